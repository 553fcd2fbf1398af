"""MTP speculative decoding on tiny random qwen35 / qwen35moe models (lavapipe):
the MTP block's logits against the numpy reference, and generated output
identical to plain greedy decoding whatever the drafts (the model's own,
forced-right, forced-wrong), across chunked prefills and context limits."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.serving.generate import generate
from vkengine.serving.mtp import MtpRunner, MtpStats, generate_mtp

from .ref_qwen35 import RefQwen35
from .test_models_qwen35 import ARCHES, PROMPT, qwen35_loaded, qwen35_models  # noqa: F401 (shared fixtures)


def _engine(device, model, **kw):
    """An engine whose state keeps 4 snapshot rows (drafts of up to 3 tokens)."""
    model = dataclasses.replace(model, args=dataclasses.replace(model.args, mtp_snap_rows=4))
    return Engine(model, device, EngineConfig(**{"n_slots": 2, "n_ctx": 128, "max_batch": 32, "max_out": 32, **kw}))


def _greedy(eng, ids, n, slot=0):
    return [(s.token, s.text, s.finish) for s in generate(eng, ids, n, slot=slot, ignore_eos=True)]


@pytest.mark.parametrize("arch", ARCHES)
def test_mtp_head_matches_reference(device, qwen35_loaded, arch):
    m = qwen35_loaded(arch)
    eng = _engine(device, m)
    run = MtpRunner(eng)
    ids = m.tokenizer.encode(PROMPT)
    n = len(ids)
    run.main(ids, 0, 0, [])
    hmap = [0] + list(range(n - 1))                        # position p reads h_{p-1}; zeros at 0
    got = run.mtp(ids, 0, 0, "hn", hmap, list(range(n)), zero_first=True, readback=Readback.LOGITS)
    ref = RefQwen35(m.file, m.args)
    _, hidden = ref.forward(ids)
    want = ref.mtp_logits(ids, hidden)
    err = float(np.abs(got - want).max())
    assert err <= 3e-3 * float(np.abs(want).max()), err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("arch,n_draft", [("qwen35", 1), ("qwen35moe", 3)])
def test_mtp_output_equals_greedy(device, qwen35_loaded, arch, n_draft):
    m = qwen35_loaded(arch)
    eng = _engine(device, m)
    ids = m.tokenizer.encode(PROMPT)
    want = _greedy(eng, ids, 16)
    st = MtpStats()
    got = [(s.token, s.text, s.finish) for s in generate_mtp(MtpRunner(eng), ids, 16, n_draft=n_draft, slot=1,
                                                             ignore_eos=True, stats=st)]
    assert got == want
    assert st.drafted >= 8 and st.verify_steps <= 16


def test_mtp_forced_drafts_keep_greedy_output(device, qwen35_loaded):
    """Drafts that are all right (every round accepts all), all wrong (every
    round rolls back to its first row) and half right give the same output."""
    m = qwen35_loaded("qwen35")
    eng = _engine(device, m, max_batch=6)                  # a chunked prefill, too
    ids = m.tokenizer.encode(PROMPT)
    want = _greedy(eng, ids, 14)
    truth = ids + [t for t, _, _ in want]

    def right(history, drafts):
        return truth[len(history):len(history) + len(drafts)]

    def wrong(history, drafts):
        return [(t + 1) % m.args.n_vocab for t in right(history, drafts)]

    def half(history, drafts):
        r = right(history, drafts)
        return r[:1] + [(t + 1) % m.args.n_vocab for t in r[1:]]

    run = MtpRunner(eng)
    for drafter, acc in ((right, 1.0), (wrong, 0.0), (half, None)):
        st = MtpStats()
        got = [(s.token, s.text, s.finish) for s in generate_mtp(run, ids, 14, n_draft=3, ignore_eos=True,
                                                                 stats=st, drafter=drafter)]
        assert got == want, drafter.__name__
        if acc is not None:
            assert st.acceptance == acc, (drafter.__name__, st.accepted, st.drafted)
    assert st.verify_steps < 14


def test_mtp_needs_snapshot_rows(device, qwen35_loaded):
    from vkengine.errors import VkEngineError
    eng = Engine(qwen35_loaded("qwen35"), device, EngineConfig(n_slots=1, n_ctx=64, max_batch=16, max_out=16))
    with pytest.raises(VkEngineError, match="mtp_snap_rows"):
        MtpRunner(eng)


def test_mtp_stops_at_the_context_length(device, qwen35_loaded):
    m = qwen35_loaded("qwen35moe")
    eng = _engine(device, m, n_ctx=40)
    ids = m.tokenizer.encode(PROMPT)
    want = _greedy(eng, ids, 100)
    got = [(s.token, s.text, s.finish) for s in generate_mtp(MtpRunner(eng), ids, 100, n_draft=3, ignore_eos=True)]
    assert got == want and got[-1][2] == "length"
