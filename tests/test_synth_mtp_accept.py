"""`vkengine synth --mtp-accept` (tiny qwen35 / qwen35moe on lavapipe): a model
whose MTP block drafts the main model's own greedy tokens, so that MTP
speculative decoding accepts nearly every draft while its output stays the
plain greedy output; the model of the same seed without the flag accepts few
(random weights). The construction is checked on the numpy reference too, and
on the Hugging Face copy."""
from __future__ import annotations

import json

import numpy as np
import pytest

from vkengine.cli import main
from vkengine.gguf_file import GGUFFile
from vkengine.model import load_model
from vkengine.serving.generate import GenStats
from vkengine.tools.synth.qwen35 import SHAPES, synth_qwen35
from vkengine.tools.synth.writer import tokenizer_meta

from .ref_qwen35 import RefQwen35
from .test_models_qwen35 import ARCHES, PROMPT, qwen35_loaded, qwen35_models  # noqa: F401 (shared fixtures)
from .test_mtp_qwen35 import _engine, _greedy


@pytest.fixture(scope="module")
def accept_models(tmp_path_factory, tokenizer_source):
    """The tiny models of test_models_qwen35's seed, written with mtp_accept."""
    out = tmp_path_factory.mktemp("synth-mtp-accept")
    tmeta = tokenizer_meta(tokenizer_source)
    return {arch: synth_qwen35(SHAPES[(arch, "tiny")], "q8_0", seed=11, out_dir=out, name=f"{arch}-tiny-accept",
                               workers=1, tmeta=tmeta, mtp_accept=True) for arch in ARCHES}


def _mtp_run(device, model, n=24):
    """(greedy output, MTP output, stats) of n tokens after PROMPT, 3 drafts a step."""
    eng = _engine(device, model)
    ids = model.tokenizer.encode(PROMPT)
    want = _greedy(eng, ids, n)
    st = GenStats()
    got = _greedy(eng, ids, n, mtp_draft=3, stats=st)
    return want, got, st


@pytest.mark.parametrize("arch", ARCHES)
def test_reference_mtp_predicts_the_greedy_token(accept_models, arch):
    """In the numpy reference: every position's logits are those of its token
    alone (the blocks add nothing), and the MTP block at p (token p, hidden
    state p-1) picks the same token as the main model at p."""
    m = load_model(accept_models[arch]["gguf"])
    ids = m.tokenizer.encode(PROMPT)
    ref = RefQwen35(m.file, m.args)
    logits, hidden = ref.forward(ids)
    alone = np.stack([ref.forward([t])[0][0] for t in ids])
    np.testing.assert_allclose(logits, alone, rtol=0, atol=1e-9 * float(np.abs(alone).max()))
    mtp = ref.mtp_logits(ids, hidden)
    assert (mtp.argmax(-1) == logits.argmax(-1)).all()
    assert m.file.meta("vkengine.synth.mtp_accept") is True


@pytest.mark.parametrize("arch", ARCHES)
def test_mtp_accepts_drafts(device, accept_models, qwen35_loaded, arch):
    """The flag's model accepts nearly every draft, its output the greedy one; the
    model of the same seed without the flag accepts few."""
    want, got, st = _mtp_run(device, load_model(accept_models[arch]["gguf"]))
    assert got == want
    assert st.acceptance >= 0.9, (st.accepted, st.drafted)
    assert st.verify_steps <= 24 // 3
    want, got, plain = _mtp_run(device, qwen35_loaded(arch))
    assert got == want
    assert plain.acceptance < 0.1, (plain.accepted, plain.drafted)


def test_hf_copy_accepts_drafts(device, accept_models):
    """The Hugging Face copy (dequantized [I | 0], fused experts) drafts as well."""
    want, got, st = _mtp_run(device, load_model(accept_models["qwen35moe"]["hf"]))
    assert got == want
    assert st.acceptance >= 0.9, (st.accepted, st.drafted)


def test_cli_mtp_accept(tmp_path, tokenizer_source, capsys):
    """`synth --mtp-accept` names its file apart from the plain model and marks it;
    a config without an MTP block, or an architecture without one, is an error."""
    tok = ["--tokenizer-from", str(tokenizer_source)] if tokenizer_source else []
    assert main(["synth", "--arch", "qwen35", "--shape", "tiny", "--mtp-accept", "--formats", "gguf",
                 "--workers", "1", "--out", str(tmp_path), *tok]) == 0
    path = tmp_path / "qwen35-tiny-mtp-accept-q8_0.gguf"
    assert GGUFFile(path).meta("vkengine.synth.mtp_accept") is True
    capsys.readouterr()

    no_mtp = dict(n_embd=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=32, nk=2, nv=4, dk=16, dv=16, n_ff=128,
                  sections=[2, 1, 1], mtp=False)
    assert main(["synth", "--arch", "qwen35", "--config", json.dumps(no_mtp), "--mtp-accept", "--formats", "gguf",
                 "--out", str(tmp_path)]) == 2
    assert "needs a model with an MTP block" in capsys.readouterr().err
    assert main(["synth", "--arch", "llama", "--shape", "tiny", "--mtp-accept", "--out", str(tmp_path)]) == 2
    assert "llama has no MTP block" in capsys.readouterr().err
