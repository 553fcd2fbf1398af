"""The MTP block on tiny random qwen35 / qwen35moe models (lavapipe): its
logits against the numpy reference, and `generate(mtp_draft=...)` (the
runner's speculative decoding, vkengine/serving/speculate.py) giving the plain
greedy output across chunked prefills and the context's end. The server's
side, with drafts forced right or right in part, is tests/test_speculate.py."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vkengine.engine import Engine, EngineConfig, Pass, Readback
from vkengine.errors import VkEngineError
from vkengine.serving.generate import GenStats, generate
from vkengine.serving.speculate import Speculator

from .ref_qwen35 import RefQwen35
from .test_models_qwen35 import ARCHES, PROMPT, qwen35_loaded, qwen35_models  # noqa: F401 (shared fixtures)


def _engine(device, model, **kw):
    """An engine whose state keeps 4 snapshot rows (drafts of up to 3 tokens)."""
    model = dataclasses.replace(model, args=dataclasses.replace(model.args, mtp_snap_rows=4))
    return Engine(model, device, EngineConfig(**{"n_slots": 2, "n_ctx": 128, "max_batch": 32, "max_out": 32, **kw}))


def _greedy(eng, ids, n, slot=0, mtp_draft=0, stats=None):
    return [(s.token, s.text, s.finish)
            for s in generate(eng, ids, n, slot=slot, ignore_eos=True, mtp_draft=mtp_draft, stats=stats)]


@pytest.mark.parametrize("arch", ARCHES)
def test_mtp_head_matches_reference(device, qwen35_loaded, arch):
    m = qwen35_loaded(arch)
    eng = _engine(device, m)
    Speculator(eng, 1)                                      # (uploads the zero hidden state of position 0)
    ids = m.tokenizer.encode(PROMPT)
    n = len(ids)
    eng.step(ids, range(n), [0] * n, [], Readback.NONE, pass_=Pass(hidden_rows=True))
    hmap = [0] + list(range(n - 1))                        # position p reads h_{p-1}; zeros at 0
    got = eng.step(ids, range(n), [0] * n, range(n), Readback.LOGITS,
                   pass_=Pass(mtp=True, hidden="hn", zero_first=True), hmap=hmap)
    ref = RefQwen35(m.file, m.args)
    _, hidden = ref.forward(ids)
    want = ref.mtp_logits(ids, hidden)
    err = float(np.abs(got - want).max())
    assert err <= 3e-3 * float(np.abs(want).max()), err
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("arch,n_draft,max_batch", [("qwen35", 1, 32), ("qwen35moe", 3, 32), ("qwen35", 2, 6),
                                                      ("qwen35moe", 5, 32)])
def test_mtp_output_equals_greedy(device, qwen35_loaded, arch, n_draft, max_batch):
    """(max_batch 6: a prefill in chunks, the MTP block following each.)"""
    m = qwen35_loaded(arch)
    eng = _engine(device, m, max_batch=max_batch)
    ids = m.tokenizer.encode(PROMPT)
    want = _greedy(eng, ids, 16)
    st = GenStats()
    assert _greedy(eng, ids, 16, slot=1, mtp_draft=n_draft, stats=st) == want
    assert st.drafted >= 8 and 0 < st.verify_steps < 16


def test_mtp_needs_snapshot_rows(device, qwen35_loaded):
    eng = Engine(qwen35_loaded("qwen35"), device, EngineConfig(n_slots=1, n_ctx=64, max_batch=16, max_out=16))
    with pytest.raises(VkEngineError, match="mtp_snap_rows"):
        list(generate(eng, [1, 2, 3], 4, mtp_draft=2))


def test_mtp_stops_at_the_context_length(device, qwen35_loaded):
    m = qwen35_loaded("qwen35moe")
    eng = _engine(device, m, n_ctx=40)
    ids = m.tokenizer.encode(PROMPT)
    want = _greedy(eng, ids, 100)
    got = _greedy(eng, ids, 100, mtp_draft=3)
    assert got == want and got[-1][2] == "length"


def test_profile_of_a_speculative_turns_steps(device, qwen35_loaded):
    """Engine.profile with an MTP pass (`bench --mtp --profile`): the verify
    step, the MTP block over its rows and a chained draft each give their GPU
    time per op, the block's and the draft's with the MTP block's own ops; an
    MTP pass without hidden-state rows, or rows for another pass, is refused."""
    from vkengine.engine import MAIN
    from vkengine.tools.bench import mtp_step_kinds
    eng = _engine(device, qwen35_loaded("qwen35moe"))
    kinds = mtp_step_kinds(3, 16)
    labels = {}
    for name, (n, outs, pass_, hmap, first) in kinds.items():
        prof = eng.profile(n, len(outs), runs=1, start_pos=first(0), pass_=pass_, hmap=hmap)
        assert prof and all(us >= 0 for _, us, _ in prof)
        labels[name] = {lb for lb, _, _ in prof}
    for name in ("mtp_block_ms", "mtp_draft_ms"):
        assert any("mtp" in lb for lb in labels[name]), labels[name]
    assert not any("mtp" in lb for lb in labels["verify_ms"]), labels["verify_ms"]
    with pytest.raises(ValueError, match="hmap"):
        eng.profile(2, 1, runs=1, pass_=kinds["mtp_block_ms"][2])
    with pytest.raises(ValueError, match="hmap"):
        eng.profile(2, 1, runs=1, pass_=MAIN, hmap=[0, 1])


def test_bench_times_a_speculative_turns_steps(device, qwen35_loaded):
    """`vkengine bench --mtp --draft K` (tools/bench.run_mtp_steps): each step of
    a turn timed alone, and the turns back to back on the device, at depth too
    (the recurrent state put back between runs), and a model without room for
    the drafts refused."""
    from vkengine.tools.bench import run_mtp_steps
    eng = _engine(device, qwen35_loaded("qwen35moe"))
    for depth in (0, 20):
        r = run_mtp_steps(eng, 3, n_steps=3, reps=1, depth=depth)
        assert r["steps"] == 3 and r["depth"] == depth
        assert all(r[k] > 0 for k in ("decode_ms", "verify_ms", "mtp_block_ms", "mtp_draft_ms"))
        assert r["turn_ms"] == pytest.approx(r["verify_ms"] + r["mtp_block_ms"] + 2 * r["mtp_draft_ms"])
        # the turns back to back on the device (their drafts read there): 4 tokens a turn
        assert r["chained_turn_ms"] > 0 and r["chained_turn_tps"] == pytest.approx(4000 / r["chained_turn_ms"])
    assert run_mtp_steps(eng, 3, n_steps=99, reps=1, depth=100)["steps"] == 5   # (what the context leaves)
    with pytest.raises(VkEngineError, match="MTP block"):
        run_mtp_steps(eng, 4, n_steps=2, reps=1)   # (4 snapshot rows: 3 drafts at most)
