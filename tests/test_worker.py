"""The engine thread's loop on the real engine (tiny model, lavapipe), without
HTTP: four sequences arrive one after another and run interleaved (slices at
quantum 1, 4 and 8; batched; batched with more sequences than slots, so that
some are parked and resumed); every token and every byte of text must equal
what `vkengine.generate.generate` gives for the sequence alone."""
from __future__ import annotations

import dataclasses

import pytest

from server.worker import Event, GenRequest, Worker
from vkengine.engine import MAIN, Engine, EngineConfig, Readback
from vkengine.errors import VkEngineError
from vkengine.kernels import Caps
from vkengine.serving.generate import generate
from vkengine.serving.sampling import SamplingParams
from vkengine.serving.scheduler import SchedulerConfig

from .serving import CTX, tiny_gguf, tiny_model  # noqa: F401  (fixtures)
from .test_models_qwen35 import qwen35_loaded, qwen35_models  # noqa: F401  (fixtures)

# every engine here takes steps of up to 64 rows (the schedulers' steps are smaller): on GPUs an
# engine of fewer rows than the tiled threshold keeps prompt rows on the matvecs
# (Engine.tiled_prompts), and a sequence's tokens equal the reference's only where both pad alike
ENGINE_ROWS = 64
N_TOKENS = (24, 9, 17, 30)
TEXTS = ("The history of the city begins", "Once upon a time",
         "Write a list of ten fruits, one per line:\n1.", "Q: 2+2=? A:")
SYSTEM = "You are a careful assistant. Answer briefly and cite sources where you can. " * 2

CONFIGS = {
    "slices-q1": SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=1, newcomer_first=True,
                                 host_cache=2),
    "slices-q4": SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=4, newcomer_first=True,
                                 host_cache=2),
    "slices-q8": SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=8, newcomer_first=True,
                                 host_cache=2),
    "batch": SchedulerConfig(n_slots=4, max_live=4, step_tokens=16, quantum=8),
    "batch-preempt": SchedulerConfig(n_slots=2, max_live=4, step_tokens=16, quantum=3),
}

SAMPLING = {
    "greedy": [SamplingParams()] * 4,
    "sampled": [SamplingParams(temperature=0.9, seed=11), SamplingParams(),
                SamplingParams(temperature=1.3, top_k=0, top_p=0.9, min_p=0.0, seed=12),
                SamplingParams(temperature=0.7, repeat_penalty=1.3, seed=13)],
    # every token drawn on the device (Readback.SAMPLE): steps chain as greedy ones do
    "on-device": [SamplingParams(temperature=0.9, seed=21), SamplingParams(temperature=0.6, top_k=10, seed=22),
                  SamplingParams(temperature=1.2, top_p=0.8, min_p=0.0, seed=23),
                  SamplingParams(temperature=0.8, top_k=64, min_p=0.1, seed=24)],
}


@pytest.fixture(scope="module")
def ref_engine(device, tiny_model):
    return Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1,
                                                   device_sampling=True))


def alone(eng, prompt, n, sp):
    steps = list(generate(eng, prompt, n, sp, ignore_eos=True))
    return [s.token for s in steps], "".join(s.text for s in steps)


def _caps(device, **changes) -> Caps:
    return dataclasses.replace(Caps.detect(device), **changes)


# the GPUs' decode paths, on whatever device runs the tests
GPU_XQ8 = {"split_k": True, "multi_column_from": 2, "xq8": True}      # the XQ8 matvecs
GPU_XQ8_IN = {"split_k": True, "multi_column_from": 2, "norm_in": True, "xq8_in": True}   # the split norm's blocks


def run_interleaved(device, model, cfg, reqs, gap=3, setup=None, in_flight=3, caps: dict | None = None):
    """Submit one request every `gap` steps; returns (tokens, text, job) per request.
    caps: the engine's kernels' capabilities to set; setup(engine) adjusts the
    engine first. in_flight: the engine's max_in_flight (the server's 3 by default)."""
    eng = Engine(model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=ENGINE_ROWS,
                                             max_out=cfg.n_slots, max_in_flight=in_flight,
                                             device_sampling=True),   # as on GPUs (lavapipe: off by default)
                 caps=_caps(device, **(caps or {})))
    if setup is not None:
        setup(eng)
    w = Worker(eng, cfg)
    events: list[list[Event]] = [[] for _ in reqs]
    jobs = []
    for i, r in enumerate(reqs):
        jobs.append(w.submit(r, events[i].append))
        for _ in range(gap):
            w.run_once()
    w.run_until_idle()
    out = []
    for evs, job in zip(events, jobs):
        assert evs[-1].finish is not None and all(e.finish is None for e in evs[:-1])
        out.append(([e.token for e in evs if e.token is not None], "".join(e.text for e in evs), job))
    return out, w


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", list(CONFIGS))
def test_interleaved_equals_alone(device, tiny_model, ref_engine, mode, sampling):
    tok = tiny_model.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    sps = SAMPLING[sampling]
    reqs = [GenRequest(p, n, sp, ignore_eos=True) for p, n, sp in zip(prompts, N_TOKENS, sps)]
    got, w = run_interleaved(device, tiny_model, CONFIGS[mode], reqs)
    for r, (toks, text, job) in zip(reqs, got):
        want_toks, want_text = alone(ref_engine, r.prompt, r.max_tokens, r.sampling)
        assert toks == want_toks
        assert text == want_text
        assert job.finish == "length" and job.n_generated == r.max_tokens
    if mode == "batch-preempt" or mode.startswith("slices"):
        assert w.sched.stats["preemptions"] > 0
    if sampling != "sampled":    # decode steps ran chained (submitted before the previous one was read)
        assert w.runner.chained_steps > 0
    print(f"{mode}/{sampling}: {w.runner.chained_steps} chained steps")


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_two_in_flight_equals_alone(device, tiny_model, ref_engine, sampling):
    """The engine's default of two steps in flight (one chained step queued
    behind the running one) gives the same tokens as three."""
    tok = tiny_model.tokenizer
    reqs = [GenRequest(tok.encode(t), n, sp, ignore_eos=True) for t, n, sp in zip(TEXTS, N_TOKENS, SAMPLING[sampling])]
    got, w = run_interleaved(device, tiny_model, CONFIGS["batch"], reqs, in_flight=2)
    assert w.runner.depth == 2
    for r, (toks, text, job) in zip(reqs, got):
        assert (toks, text) == alone(ref_engine, r.prompt, r.max_tokens, r.sampling)


TILED16 = {"tiled_from": 16}   # a GPU's prompt path on lavapipe: tiled matmuls (mul_mt) from 16 rows


def _tiled_prompts(eng) -> None:
    """... and prompt steps padded to them (Engine.tiled_prompts; GPUs: 64 rows)."""
    eng._tiled_prompts = True
    assert eng.tiled_prompts


def test_prompt_rows_do_not_depend_on_the_chunking(device, tiny_model):
    """With prompt steps padded to the tiled matmuls (Engine.tiled_prompts: on
    GPUs by default, on lavapipe from 16 rows here), a prompt's last logits
    row is bit-equal whether the prompt ran at once or in chunks of 1, 5, 16
    or 23 rows (each chunk's pad rows overwritten by the next)."""
    import numpy as np
    eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1))
    if not eng.tiled_prompts:
        eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1),
                     caps=_caps(device, **TILED16))
        _tiled_prompts(eng)
    prompt = tiny_model.tokenizer.encode(SYSTEM + TEXTS[0])
    assert 23 < len(prompt) < ENGINE_ROWS
    want = eng.prefill(prompt, 0, readback=Readback.LOGITS)
    for chunk in (1, 5, 16, 23):
        out = None
        for c in range(0, len(prompt), chunk):
            part = prompt[c:c + chunk]
            last = c + len(part) == len(prompt)
            out = eng.step(part, range(c, c + len(part)), [1] * len(part), [len(part) - 1] if last else (),
                           Readback.LOGITS if last else Readback.NONE, prompt=True)
        assert np.array_equal(out[0], want), chunk


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_prompt_rows_apart_equal_alone(device, tiny_model, sampling):
    """Where the engine pads prompt steps to its tiled matmuls, the worker runs
    a step's decode rows and prompt rows as two engine steps: decode rows on
    the matvecs as alone, prompt rows (chunked 16 at a time here, the whole
    prompt at once alone) on the tiled kernels, padded. Every token as alone,
    with greedy replies, replies drawn on the device, and replies sampled on
    the host (their logits steps run alone: the other part is collected first)."""
    tok = tiny_model.tokenizer
    ref = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1,
                                                  device_sampling=True), caps=_caps(device, **TILED16))
    _tiled_prompts(ref)
    prompts = [tok.encode((SYSTEM if i % 2 == 0 else "") + TEXTS[i]) for i in range(4)]
    assert max(map(len, prompts)) > 16
    reqs = [GenRequest(p, n, sp, ignore_eos=True) for p, n, sp in zip(prompts, N_TOKENS, SAMPLING[sampling])]
    steps: list[tuple[int, bool]] = []

    def setup(eng):
        _tiled_prompts(eng)
        submit = eng.submit

        def recording_submit(tokens, *a, prompt=False, **k):
            steps.append((len(tokens), prompt))
            return submit(tokens, *a, prompt=prompt, **k)
        eng.submit = recording_submit
    got, w = run_interleaved(device, tiny_model, CONFIGS["batch"], reqs, gap=2, setup=setup, caps=TILED16)
    assert w.runner.prompt_apart and w.sched.cfg.prompt_apart
    for r, (toks, text, job) in zip(reqs, got):
        want_toks, want_text = alone(ref, r.prompt, r.max_tokens, r.sampling)
        assert toks == want_toks
        assert text == want_text
    # prompt steps and decode steps alternate while newcomers arrive; none mixes them
    assert any(p for _, p in steps) and any(not p for _, p in steps)
    assert all(n <= CONFIGS["batch"].n_slots for n, p in steps if not p), steps
    # (the third prompt reuses the first one's rows of SYSTEM: prefix cache)
    assert sum(n for n, p in steps if p) == sum(map(len, prompts)) - sum(job.seq.cache_hit for _, _, job in got)
    assert got[2][2].seq.cache_hit > 0


def test_prompt_row_cost_counts_the_rows_a_step_ran(device, tiny_model, monkeypatch):
    """The scheduler's cost of a prompt row (what --prompt-ms divides) is a
    prompt step's time over the rows its matmuls ran: where prompt steps are
    padded to the tiled matmuls, a step of 5 prompt rows costs what one of a
    whole tile of tokens does (counting 5 made rows look dearer than they are,
    and newcomers' chunks beside streams started small and grew over many
    steps); and the scheduler sizes chunks in those tiles (prompt_granule)."""
    from vkengine.serving.scheduler import Scheduler
    seen: list[int] = []
    real = Scheduler.observe_prompt

    def observe(self, rows, seconds):
        seen.append(rows)
        return real(self, rows, seconds)
    monkeypatch.setattr(Scheduler, "observe_prompt", observe)
    tok = tiny_model.tokenizer
    prompts = [tok.encode(TEXTS[i]) for i in range(4)]
    reqs = [GenRequest(p, n, SamplingParams(), ignore_eos=True) for p, n in zip(prompts, N_TOKENS)]
    steps: list[int] = []
    engines = []

    def setup(eng):
        _tiled_prompts(eng)
        engines.append(eng)
        submit = eng.submit

        def recording_submit(tokens, *a, prompt=False, **k):
            if prompt:
                steps.append(len(tokens))
            return submit(tokens, *a, prompt=prompt, **k)
        eng.submit = recording_submit
    _, w = run_interleaved(device, tiny_model, CONFIGS["batch"], reqs, gap=2, setup=setup, caps=TILED16)
    eng = engines[0]
    assert any(n < 16 for n in steps)                      # steps of fewer rows than the engine runs
    assert eng.prompt_granule == eng.kernels.prompt_granule > 1
    assert seen == [eng.prompt_cost_rows(n) for n in steps]
    assert all(r >= eng.step_rows(n, prompt=True) and r % eng.prompt_granule == 0 for r, n in zip(seen, steps))
    assert w.runner.cfg.prompt_granule == eng.prompt_granule


def test_rows_past_a_stop_leave_the_cached_prefix_right(device, tiny_model, ref_engine):
    """With three steps in flight, a stream that a stop string ends had two
    chained rows past its last token on the device; the second one's input is
    a token the stream never gets. The slot keeps only the stream's tokens, so
    the next request, whose prompt is that whole stream and more, reuses all
    of it and still gets the tokens of its own run alone."""
    tok = tiny_model.tokenizer
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1,
                                                  max_in_flight=3))
    w = Worker(eng, CONFIGS["batch"].__class__(n_slots=1, max_live=1, step_tokens=16))
    assert w.runner.depth == 3
    deepest, submit = [0], eng.submit

    def counting_submit(*a, **k):
        submit(*a, **k)
        deepest[0] = max(deepest[0], eng.in_flight)
    eng.submit = counting_submit
    p = tok.encode(TEXTS[0])
    _, full_text = alone(ref_engine, p, 30, SamplingParams())
    stop = full_text[12:15]
    events: list[Event] = []
    job = w.submit(GenRequest(p, 30, stop=(stop,)), events.append)
    w.run_until_idle()
    assert job.finish == "stop" and deepest[0] == 3
    first = list(job.seq.tokens)
    assert len(first) - len(p) < 29                  # it ended early, with rows still chained
    p2 = first + tok.encode(" and then")
    events2: list[Event] = []
    job2 = w.submit(GenRequest(p2, 8, ignore_eos=True), events2.append)
    w.run_until_idle()
    assert job2.seq.cache_hit >= len(first) - 1      # the whole first stream, from the slot
    assert [e.token for e in events2 if e.token is not None] == alone(ref_engine, p2, 8, SamplingParams())[0]


def test_program_cache_counts_what_it_drops(device, tiny_model):
    """EngineConfig.program_cache bounds the recorded steps (LRU); each one it
    drops counts in programs_evicted (/metrics' vkengine_programs_evicted), and
    a dropped shape run again is recorded again, with the same logits."""
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=8, max_out=8, program_cache=2))
    ids = tiny_model.tokenizer.encode(TEXTS[0])[:8]
    first = eng.step(ids[:1], [0], [0], [0], Readback.LOGITS)
    for n in (2, 3):
        eng.step(ids[:n], range(n), [0] * n, [n - 1], Readback.LOGITS)
    assert eng.n_programs == 2 and eng.programs_evicted == 1
    again = eng.step(ids[:1], [0], [0], [0], Readback.LOGITS)   # (the one-row step's program was dropped)
    assert eng.programs_evicted == 2
    assert (again == first).all()


def test_xq8_interleaved_equals_alone(device, tiny_model):
    """With the XQ8 matvecs (decode steps read the 8-bit blocks that the fused
    RMSNorm writes beside h; steps of more rows quantize h with quantize_q8),
    four sequences interleaved give the tokens each gives alone on the same
    kernels: both ways of rounding h give the same blocks."""
    tok = tiny_model.tokenizer
    ref = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1),
                 caps=_caps(device, **GPU_XQ8))
    reqs = [GenRequest(tok.encode(t), n, ignore_eos=True) for t, n in zip(TEXTS, N_TOKENS)]
    got, w = run_interleaved(device, tiny_model, CONFIGS["batch"], reqs, caps=GPU_XQ8)
    for r, (toks, text, job) in zip(reqs, got):
        assert toks == alone(ref, r.prompt, r.max_tokens, r.sampling)[0]
    if not w.runner.prompt_apart:   # (GPUs: prompt rows run apart on the tiled matmuls, decode steps split the norm)
        labels = [op.label for prog in w.eng._programs.values() for op in prog.ops]
        assert "quantize_q8" in labels and any(lb.endswith("+rms_norm") for lb in labels)


def test_xq8_in_interleaved_equals_alone(device, tiny_model):
    """With gate|up on the producer's 8-bit blocks of h' (Caps.xq8_in), four
    sequences interleaved, greedy and sampled, give the tokens each gives
    alone on the same kernels."""
    tok = tiny_model.tokenizer
    ref = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1),
                 caps=_caps(device, **GPU_XQ8_IN))
    for sampling in ("greedy", "sampled"):
        reqs = [GenRequest(tok.encode(t), n, sp, ignore_eos=True)
                for t, n, sp in zip(TEXTS, N_TOKENS, SAMPLING[sampling])]
        got, w = run_interleaved(device, tiny_model, CONFIGS["batch"], reqs, caps=GPU_XQ8_IN)
        for r, (toks, text, job) in zip(reqs, got):
            assert toks == alone(ref, r.prompt, r.max_tokens, r.sampling)[0], sampling
        labels = [op.label for prog in w.eng._programs.values() for op in prog.ops]
        assert any(lb.endswith("+rms_norm+q8") for lb in labels)


@pytest.mark.parametrize("mode", ["slices-q4", "batch"])
def test_prefix_cache_on_the_real_engine(device, tiny_model, ref_engine, mode):
    """A shared system prompt is reused (copied between slots, restored from the
    host, or taken in place) and the tokens are still those of each alone."""
    tok = tiny_model.tokenizer
    prompts = [tok.encode(SYSTEM + t) for t in TEXTS]
    reqs = [GenRequest(p, 8, SamplingParams(temperature=0.8, seed=i), ignore_eos=True)
            for i, p in enumerate(prompts)]
    got, w = run_interleaved(device, tiny_model, CONFIGS[mode], reqs, gap=12)
    n_sys = len(tok.encode(SYSTEM)) - 1
    for r, (toks, text, job) in zip(reqs, got):
        assert toks == alone(ref_engine, r.prompt, 8, r.sampling)[0]
    assert sum(job.seq.cache_hit >= n_sys for _, _, job in got[1:]) == 3


def test_stop_strings_and_eos_behave_as_alone(device, tiny_model, ref_engine):
    tok = tiny_model.tokenizer
    p = tok.encode(TEXTS[0])
    full_toks, full_text = alone(ref_engine, p, 30, SamplingParams())
    stop = full_text[10:13]
    want_steps = list(generate(ref_engine, p, 30, SamplingParams(), stop=[stop]))
    got, _ = run_interleaved(device, tiny_model, CONFIGS["batch"], [
        GenRequest(p, 30, stop=(stop,)), GenRequest(tok.encode(TEXTS[1]), 5)])
    toks, text, job = got[0]
    assert text == "".join(s.text for s in want_steps) and stop not in text
    assert toks == [s.token for s in want_steps]
    assert job.finish == "stop" and job.stop_type == "word"


def test_n_probs_report_the_distribution(device, tiny_model):
    import math
    tok = tiny_model.tokenizer
    events = []
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1))
    w = Worker(eng, CONFIGS["batch"].__class__(n_slots=1, max_live=1, step_tokens=16))
    w.submit(GenRequest(tok.encode(TEXTS[2]), 4, n_probs=5), events.append)
    w.run_until_idle()
    toks = [e for e in events if e.token is not None]
    assert len(toks) == 4
    for e in toks:
        assert len(e.top) == 5 and e.top[0][0] == e.token          # greedy picks the most likely
        lps = [lp for _, lp in e.top]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert math.isclose(e.logprob, lps[0])


def test_chained_steps_equal_plain_steps(device, tiny_model):
    """Engine.submit(chain=...): a step whose tokens are the greedy outputs of the
    step still on the device (rows in any order) gives the tokens that plain
    steps give; two steps in flight at once, collected in order."""
    tok = tiny_model.tokenizer
    eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=2))
    prompts = [tok.encode(TEXTS[0]), tok.encode(TEXTS[1])]

    def start():
        return [int(eng.prefill(p, slot)) for slot, p in enumerate(prompts)], [len(p) for p in prompts]

    (a, b), (pa, pb) = start()
    plain = [(a, b)]
    for i in range(4):
        a, b = (int(t) for t in eng.step([a, b], [pa + i, pb + i], [0, 1], [0, 1]))
        plain.append((a, b))

    (a, b), (pa, pb) = start()
    got = [(a, b)]
    eng.submit([a, b], [pa, pb], [0, 1], [0, 1])                               # rows: slot 0, slot 1
    eng.submit([0, 0], [pb + 1, pa + 1], [1, 0], [0, 1], chain=[1, 0])        # rows: slot 1, slot 0
    assert eng.in_flight == 2
    with pytest.raises(RuntimeError):
        eng.submit([0, 0], [pa + 2, pb + 2], [0, 1], [0, 1], chain=[1, 0])
    r = eng.collect()
    got.append((int(r[0]), int(r[1])))
    eng.submit([0, 0], [pa + 2, pb + 2], [0, 1], [0, 1], chain=[1, 0])        # back to slot 0, slot 1
    r = eng.collect()
    got.append((int(r[1]), int(r[0])))
    eng.submit([0], [pa + 3], [0], [0], chain=[0])                             # slot 0 alone
    r = eng.collect()
    got.append((int(r[0]), int(r[1])))
    r = eng.collect()
    assert eng.in_flight == 0
    assert got == plain[:4] and int(r[0]) == plain[4][0]
    with pytest.raises(RuntimeError):
        eng.submit([0], [pa + 4], [0], [0], chain=[0])                         # nothing in flight to chain from


def test_bench_decode_chains_the_same_tokens(device, tiny_model):
    """vkengine bench's decode loop (chained steps) generates what plain steps do."""
    from vkengine.tools.bench import decode
    eng = Engine(tiny_model, device, EngineConfig(n_slots=3, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=3))
    start = [5, 500, 5000]
    toks, plain = list(start), []
    for pos in range(6):
        toks = [int(t) for t in eng.step(toks, [pos] * 3, [0, 1, 2], [0, 1, 2])]
        plain.append(toks)
    assert eng.can_chain
    assert decode(eng, list(start), 6) == plain
    assert eng.in_flight == 0


def test_bench_times_no_recording(device, tiny_model):
    """vkengine bench's warm-up records every program its timed repetitions
    run (both params buffers, plain and chained, odd step counts too), so no
    repetition pays for a recording."""
    from vkengine.tools import bench
    eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=2))
    counts = []
    real_decode, real_prefill = bench.decode, eng.prefill

    def counted(f):
        def g(*a, **k):
            out = f(*a, **k)
            counts.append(eng.n_programs)
            return out
        return g
    bench.decode, eng.prefill = counted(real_decode), counted(real_prefill)
    try:
        bench.run_bench(eng, 5, 5, reps=3)                # 2 warm-up + 3 timed prefills, then decodes
        assert counts[2:5] == [counts[1]] * 3 and counts[7:10] == [counts[6]] * 3
        counts.clear()
        bench.run_batched(eng, 2, 3, reps=3)
        assert counts[2:] == [counts[1]] * 3
    finally:
        bench.decode = real_decode


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_bench_depth_continues_the_filled_context(device, tiny_model, qwen35_loaded, arch):
    """vkengine bench --depth: every timed run (2 warm-up, then reps) of batched
    decode continues each slot's context of `depth` tokens (a hybrid's recurrent
    state put back from its parked copy), so each run generates what a plain
    prefill of those tokens followed by plain steps does."""
    import numpy as np

    from vkengine.tools import bench
    model = tiny_model if arch == "llama" else qwen35_loaded("qwen35")
    depth, n_seq, n_gen = 37, 2, 5
    eng = Engine(model, device, EngineConfig(n_slots=n_seq, n_ctx=64, max_batch=16, max_out=n_seq))
    runs, real = [], bench.decode

    def recorded(*a, **k):
        out = real(*a, **k)
        runs.append(out)
        return out
    bench.decode = recorded
    try:
        r = bench.run_batched(eng, n_seq, n_gen, reps=2, depth=depth)
    finally:
        bench.decode = real
    assert r["depth"] == depth and len(runs) == 4
    ctx = np.random.default_rng(1).integers(0, eng.n_vocab, depth).tolist()   # fill_depth's tokens
    toks = np.random.default_rng(0).integers(0, eng.n_vocab, n_seq).tolist()   # run_batched's first tokens
    ref = Engine(model, device, EngineConfig(n_slots=n_seq, n_ctx=64, max_batch=16, max_out=n_seq))
    for s in range(n_seq):
        ref.prefill(ctx, s, readback=Readback.NONE)
    plain = []
    for pos in range(depth, depth + n_gen):
        toks = [int(t) for t in ref.step(toks, [pos] * n_seq, list(range(n_seq)), list(range(n_seq)))]
        plain.append(toks)
    assert all(run == plain for run in runs)
    with pytest.raises(VkEngineError, match="do not fit the context length"):
        bench.run_bench(eng, 0, 30, reps=1, depth=depth)


def test_bench_depth_cli_errors():
    from vkengine.tools.bench import bench_ctx, parse_depths
    # the context grows to fit depth or a long prompt unless --ctx is given (-p 16384 failed at 4096)
    assert bench_ctx(None, [0], 512, 128) is None
    assert bench_ctx(None, [0], 16384, 0) == 16384
    assert bench_ctx(None, [0, 4096], 512, 128) == 4608
    assert bench_ctx(2048, [0, 4096], 512, 128) == 2048
    assert parse_depths("0, 4096,16384") == [0, 4096, 16384]
    # -ub: prompt steps of at most that many rows (the sequences and the depth's fill steps still fit)
    from vkengine.tools.bench import DEPTH_FILL_ROWS, bench_rows
    assert bench_rows(32768, 1, [0]) == 32768 and bench_rows(32768, 1, [0], ubatch=512) == 512
    assert bench_rows(100, 1, [0], ubatch=512) == 100 and bench_rows(64, 1, [4096], ubatch=32) == DEPTH_FILL_ROWS
    assert bench_rows(64, 300, [0], ubatch=32) == 300
    with pytest.raises(VkEngineError, match="--ubatch"):
        bench_rows(64, 1, [0], ubatch=-1)
    for bad in ("", "4k", "-1"):
        with pytest.raises(VkEngineError, match="--depth"):
            parse_depths(bad)


def test_bench_ablate_leaves_out_the_matching_ops(device, tiny_model):
    """bench --ablate: the steps recorded while Device.omit is set lack every
    dispatch its pattern finds (their count reported, the other ops kept);
    afterwards the engine records whole steps again and decodes what it did
    before (the ablated steps' wrong results leave nothing behind)."""
    from vkengine.tools import bench

    def dispatches(progs):
        return {k: [op.label for op in p.ops if op.kind == "dispatch"] for k, p in progs.items()}
    eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=2))
    before = bench.decode(eng, [7, 70], 4)
    whole = dispatches(eng._programs)
    # (a pattern that finds nothing is reported as such, not an error that loses the others)
    pats = bench.parse_ablate("^attention;x<-ff; nothing-has-this-label ")
    assert [p.pattern for p in pats] == ["^attention", "x<-ff", "nothing-has-this-label"]
    seen, real = [], eng.drop_programs

    def dropped():   # the programs each ablation recorded, looked at before they go
        seen.append((dispatches(eng._programs), {k: p.n_omitted for k, p in eng._programs.items()}))
        real()
    eng.drop_programs = dropped
    res = bench.run_ablation(eng, pats, n_gen=3, parallel=[2], reps=1, depth=5)
    assert [r["pattern"] for r in res] == [None, *(p.pattern for p in pats)]
    assert all(set(r["step_ms"]) == {1, 2} and all(ms > 0 for ms in r["step_ms"].values()) for r in res)
    expect = [max(sum(bool(p.search(lb)) for lb in labels) for labels in whole.values()) for p in pats]
    assert expect[0] > 0 and expect[1] > 0 and expect[2] == 0
    assert [r["omitted"] for r in res] == [0, *expect]
    for pat, (progs, omitted) in zip(pats, seen[2:]):   # (seen[0]: before the whole steps, [1]: after them)
        common = set(progs) & set(whole)
        assert common, pat
        for k in common:
            assert progs[k] == [lb for lb in whole[k] if not pat.search(lb)]
            assert omitted[k] == len(whole[k]) - len(progs[k])
    assert eng.device.omit is None
    assert bench.decode(eng, [7, 70], 4) == before
    with pytest.raises(VkEngineError, match="not a regular expression"):
        bench.parse_ablate("ok;(")
    assert bench.parse_ablate(" ; ") == []


def test_bench_ablate_cli(tiny_gguf, capsys):
    """`vkengine bench --ablate` prints the whole steps and, per pattern, the
    ops it left out and the steps' times without them; a pattern that finds
    nothing is said so; a bad pattern is a clear error; -n 0 cannot ablate."""
    import json

    from vkengine.cli import main
    base = ["bench", "-m", str(tiny_gguf), "-p", "0", "-n", "4", "-r", "1", "--parallel", "2", "--ctx", "64"]
    assert main([*base, "--ablate", "^attention;zz-no-such-op"]) == 0
    out = capsys.readouterr().out
    assert "decode steps whole: 1 row " in out and ", 2 rows " in out
    assert "without /^attention/ (" in out and "/zz-no-such-op/ finds no op" in out
    assert main([*base, "--json", "--ablate", "x<-ff"]) == 0
    res = json.loads(capsys.readouterr().out)["ablate"]
    assert [r["pattern"] for r in res] == [None, "x<-ff"] and res[1]["omitted"] > 0
    assert set(res[1]["step_ms"]) == {"1", "2"}
    assert main([*base, "--ablate", "("]) == 2
    assert "not a regular expression" in capsys.readouterr().err
    assert main([*base[:6], "0", *base[7:], "--ablate", "x"]) == 2
    assert "give -n > 0" in capsys.readouterr().err


def test_bench_profiles_a_long_prompt_in_steps(device, tiny_model):
    """Engine.profile refuses a step of more rows than the activations hold (it
    wrote past them: `bench --profile -p 16384` on the 8B, whose engine caps a
    step's rows to fit one buffer, profiled one 16k-row step where prefill
    runs four of 4k); bench profiles such a prompt step by step, summed by op."""
    from vkengine.cli import _merge_profiles
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=16))
    with pytest.raises(VkEngineError, match="a step takes 1..16 rows, got 17"):
        eng.profile(17)
    a, b = eng.profile(16, runs=1), eng.profile(8, runs=1, start_pos=16)
    merged = _merge_profiles([a, b])
    ua, ub = {k: (us, c) for k, us, c in a}, {k: (us, c) for k, us, c in b}
    assert {k for k, _, _ in merged} == set(ua) | set(ub)
    for k, us, c in merged:
        assert us == pytest.approx(ua.get(k, (0, 0))[0] + ub.get(k, (0, 0))[0])
        assert c == ua.get(k, (0, 0))[1] + ub.get(k, (0, 0))[1]
    assert [us for _, us, _ in merged] == sorted((us for _, us, _ in merged), reverse=True)


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("mode", ["slices-q4", "batch", "batch-preempt"])
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_hybrid_interleaved_equals_alone(device, qwen35_loaded, arch, mode, sampling):
    """The hybrid models' per-sequence state (KV rows of the attention layers,
    conv and recurrent state of the linear ones) is batched, parked, restored
    and prefix-cached like a KV cache: four interleaved sequences (greedy and
    sampled, some sharing a system prompt) get the tokens of each alone."""
    model = qwen35_loaded(arch)
    tok = model.tokenizer
    ref = Engine(model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1,
                                             device_sampling=True))
    texts = [TEXTS[0], SYSTEM + TEXTS[1], SYSTEM + TEXTS[2], TEXTS[3]]
    reqs = [GenRequest(tok.encode(t), n, sp, ignore_eos=True)
            for t, n, sp in zip(texts, (12, 7, 10, 9), SAMPLING[sampling])]
    got, w = run_interleaved(device, model, CONFIGS[mode], reqs + [reqs[2]], gap=4)
    for r, (toks, text, job) in zip(reqs + [reqs[2]], got):
        want_toks, want_text = alone(ref, r.prompt, r.max_tokens, r.sampling)
        assert toks == want_toks
        assert text == want_text
    if mode != "batch":
        assert w.sched.stats["preemptions"] > 0
    if sampling != "sampled":    # decode steps ran chained, the recurrent state too
        assert w.runner.chained_steps > 0


@pytest.mark.parametrize("mode", ["slices-q4", "batch"])
def test_hybrid_next_turn_reuses_the_state(device, qwen35_loaded, mode):
    """A hybrid's recurrent state cannot be cut shorter, so a prefix is reused
    only at the length the state covers: the next turn of a conversation (the
    last prompt, its reply, new text) continues from the finished sequence's
    state instead of prefilling again, with the tokens it gets alone."""
    model = qwen35_loaded("qwen35")
    tok = model.tokenizer
    ref = Engine(model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=1))
    cfg = CONFIGS[mode]
    eng = Engine(model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=cfg.step_tokens,
                                             max_out=cfg.n_slots))
    w = Worker(eng, cfg)
    first = GenRequest(tok.encode(SYSTEM + TEXTS[1]), 6, ignore_eos=True)
    evs: list[Event] = []
    w.submit(first, evs.append)
    w.run_until_idle()
    reply = [e.token for e in evs if e.token is not None]
    second = GenRequest(first.prompt + reply + tok.encode(" Tell me more."), 6, ignore_eos=True)
    evs2: list[Event] = []
    job = w.submit(second, evs2.append)
    w.run_until_idle()
    assert [e.token for e in evs2 if e.token is not None] == alone(ref, second.prompt, 6, SamplingParams())[0]
    assert job.seq.cache_hit == len(first.prompt) + len(reply) - 1     # all but the reply's last token
    # the same prompt again: the finished state covers more than the common prefix, so nothing is reused
    evs3: list[Event] = []
    job = w.submit(first, evs3.append)
    w.run_until_idle()
    assert [e.token for e in evs3 if e.token is not None] == reply and job.seq.cache_hit == 0
    # a stop string ends a reply while the next (chained) decode step is on the device: that step's row
    # took the reply's last token, so the slot records it and the next turn reuses the whole reply
    stop = tok.decode(reply[3:4])
    assert stop.strip() and stop not in tok.decode(reply[:3])
    evs4: list[Event] = []
    w.submit(GenRequest(first.prompt, 20, stop=(stop,), ignore_eos=True), evs4.append)
    w.run_until_idle()
    assert evs4[-1].finish == "stop"
    gen = [e.token for e in evs4 if e.token is not None]
    assert gen == reply[:4]
    nxt = GenRequest(first.prompt + gen + tok.encode(" Go on."), 4, ignore_eos=True)
    evs5: list[Event] = []
    job = w.submit(nxt, evs5.append)
    w.run_until_idle()
    assert [e.token for e in evs5 if e.token is not None] == alone(ref, nxt.prompt, 4, SamplingParams())[0]
    assert job.seq.cache_hit == len(first.prompt) + len(gen)


def test_staggered_streams_share_one_step(device, tiny_model, ref_engine):
    """Greedy streams that arrive while a step is on the device end up in the
    same decode steps as the running ones: no step is composed beside one in
    flight, so the live sequences never split into groups that take turns in
    steps of fewer rows (each costing nearly a whole step; bench/serve_sim.py).
    The last two requests arrive during the device wait of the first two's
    third step, as HTTP requests do. Tokens as alone."""
    tok = tiny_model.tokenizer
    eng = Engine(tiny_model, device, EngineConfig(n_slots=4, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=4))
    w = Worker(eng, CONFIGS["batch"])
    reqs = [GenRequest(tok.encode(TEXTS[i]), 16, ignore_eos=True) for i in (0, 2, 1, 3)]   # short ones last
    events: list[list[Event]] = [[] for _ in reqs]
    rows: list[int] = []
    submit, collect, n_collect = eng.submit, eng.collect, [0]

    def counting_submit(tokens, *a, **k):
        rows.append(len(tokens))
        return submit(tokens, *a, **k)

    def arriving_collect():
        n_collect[0] += 1
        if n_collect[0] == 3:
            for i in (2, 3):
                w.submit(reqs[i], events[i].append)
        return collect()
    eng.submit, eng.collect = counting_submit, arriving_collect
    for i in (0, 1):
        w.submit(reqs[i], events[i].append)
    w.run_until_idle()
    for r, evs in zip(reqs, events):
        assert [e.token for e in evs if e.token is not None] == alone(ref_engine, r.prompt, r.max_tokens, r.sampling)[0]
    # 2-row steps only before the others' prefill and after the first two end;
    # split into pairs, nearly every decode step had 2 rows
    assert rows.count(4) >= 10, str(rows)


@pytest.mark.parametrize("sampling", ["greedy", "on-device"])
def test_prepared_steps_cover_a_servers_prompt_steps(device, tiny_model, ref_engine, sampling):
    """After prepare_decode(slots, step_tokens), as the server calls it, four
    prompts of different lengths arriving together run their steps of more than
    8 rows (prompt chunks beside decode rows) as prepared buckets: nothing of
    that size is recorded while the streams wait (greedy replies, or replies
    sampled on the device). Tokens as alone."""
    tok = tiny_model.tokenizer
    cfg = CONFIGS["batch"]
    eng = Engine(tiny_model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=ENGINE_ROWS,
                                                  max_out=cfg.n_slots, device_sampling=True))
    eng.pad_steps = True   # (GPUs only by default: lavapipe keeps exact steps)
    assert eng.prepare_decode(cfg.n_slots, cfg.step_tokens) > 0
    w = Worker(eng, cfg)
    reqs = [GenRequest(tok.encode(SYSTEM[:40 + 23 * i] + TEXTS[i]), 12, SAMPLING[sampling][i], ignore_eos=True)
            for i in range(4)]
    recorded: list[int] = []
    rows: list[int] = []
    record, submit = eng._record, eng.submit

    def counting_record(n, *a, **k):
        recorded.append(n)
        return record(n, *a, **k)

    def counting_submit(tokens, *a, **k):
        rows.append(len(tokens))
        return submit(tokens, *a, **k)
    eng._record, eng.submit = counting_record, counting_submit
    events: list[list[Event]] = [[] for _ in reqs]
    for i, r in enumerate(reqs):
        w.submit(r, events[i].append)
    w.run_until_idle()
    for r, evs in zip(reqs, events):
        assert [e.token for e in evs if e.token is not None] == alone(ref_engine, r.prompt, r.max_tokens, r.sampling)[0]
    assert sum(n > Engine.STEP_EXACT for n in rows) >= 3, str(rows)
    assert all(n <= Engine.STEP_EXACT for n in recorded), f"recorded during the load: {recorded} (steps {rows})"


def test_a_servers_start_leaves_steps_for_the_idle_engine_thread(device, tiny_model, ref_engine):
    """prepare_decode(defer=True), as the server's start calls it, records only
    the steps of at most one output row (a first request's); the engine thread
    records the others while it has nothing to run (Engine.record_deferred), so
    that four streams arriving afterwards run steps of several rows without a
    recording. Tokens as alone. /metrics' programs_deferred follows the list
    down to 0 (bench/serve.py waits for it before timing)."""
    import time

    from server.metrics import Metrics
    tok = tiny_model.tokenizer
    cfg = CONFIGS["batch"]
    eng = Engine(tiny_model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=ENGINE_ROWS,
                                                  max_out=cfg.n_slots))
    eng.pad_steps = True   # (GPUs only by default: lavapipe keeps exact steps)
    n_now = eng.prepare_decode(cfg.n_slots, cfg.step_tokens, defer=True)
    left = list(eng.deferred)
    assert n_now > 0 and left and all(k[1] > 1 for k in left)
    assert all((*k, MAIN) not in eng._programs for k in left)
    metrics = Metrics(cfg.n_slots, cfg.max_live, CTX)
    w = Worker(eng, cfg, metrics)

    def gauge(name: str) -> float | None:
        return metrics.registry.get_sample_value(f"vkengine_{name}")
    assert gauge("programs_deferred") == len(left) and gauge("programs_evicted_total") == 0
    w.start()
    try:
        t0 = time.monotonic()
        while (eng.deferred or gauge("programs_deferred")) and time.monotonic() - t0 < 60:
            time.sleep(0.02)
        assert not eng.deferred, f"{len(eng.deferred)} steps still deferred"
        assert gauge("programs_deferred") == 0 and gauge("recorded_programs") == eng.n_programs
        recorded: list[int] = []
        record = eng._record

        def counting_record(n, *a, **k):
            recorded.append(n)
            return record(n, *a, **k)
        eng._record = counting_record
        reqs = [GenRequest(tok.encode(TEXTS[i]), 10, ignore_eos=True) for i in range(4)]
        events: list[list[Event]] = [[] for _ in reqs]
        done = [0]

        def emit(i):
            def f(ev):
                events[i].append(ev)
                done[0] += ev.finish is not None
            return f
        for i, r in enumerate(reqs):
            w.submit(r, emit(i))
        t0 = time.monotonic()
        while done[0] < len(reqs) and time.monotonic() - t0 < 120:
            time.sleep(0.02)
    finally:
        w.stop()
    for r, evs in zip(reqs, events):
        assert [e.token for e in evs if e.token is not None] == alone(ref_engine, r.prompt, r.max_tokens, r.sampling)[0]
    assert all(n <= Engine.STEP_EXACT for n in recorded), f"recorded during the load: {recorded}"


def test_logits_step_waits_for_the_chained_one(device, tiny_model, ref_engine):
    """Two greedy streams run chained while a request that needs logits
    (sampling) waits for a place; when one stream ends, the newcomer's step
    (logits, which runs alone) is composed only once the chained step on the
    device is collected (no step is composed beside one in flight): every
    stream keeps its tokens, in order, once each."""
    from vkengine.serving.scheduler import SchedulerConfig
    tok = tiny_model.tokenizer
    cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=16, quantum=64)
    eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=2))
    w = Worker(eng, cfg)
    reqs = [GenRequest(tok.encode(TEXTS[0]), 20, ignore_eos=True),
            GenRequest(tok.encode(TEXTS[3]), 6, ignore_eos=True),
            GenRequest(tok.encode(TEXTS[1]), 8, SamplingParams(temperature=0.9, seed=5), ignore_eos=True)]
    events: list[list[Event]] = [[], [], []]
    for r, evs in zip(reqs, events):
        w.submit(r, evs.append)
    w.run_until_idle()
    assert w.runner.chained_steps > 0
    for r, evs in zip(reqs, events):
        assert [e.token for e in evs if e.token is not None] == alone(ref_engine, r.prompt, r.max_tokens, r.sampling)[0]


def test_bench_decode_chains_a_hybrid(device, qwen35_loaded):
    """The chained decode loop on a hybrid model (recurrent state carried from step to step on the device)."""
    from vkengine.tools.bench import decode
    eng = Engine(qwen35_loaded("qwen35moe"), device,
                 EngineConfig(n_slots=2, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=2))
    toks, plain = [7, 700], []
    for pos in range(5):
        toks = [int(t) for t in eng.step(toks, [pos] * 2, [0, 1], [0, 1])]
        plain.append(toks)
    assert decode(eng, [7, 700], 5) == plain


@pytest.mark.parametrize("host_sampling", [False, True], ids=["device-draws", "host-draws"])
def test_serve_sim_engine_drives_the_worker(device, tiny_model, host_sampling):
    """bench/serve_sim.py's simulated engine (steps that take a set time and
    return fixed tokens or logits rows) drives the real worker through greedy
    and sampled replies: drawn "on the device" (steps chained, as on GPUs) or
    on the host from logits rows. Every reply gets its tokens."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from serve_sim import sim_engine_class
    sim = sim_engine_class()
    sim.step_us, sim.host_sampling, sim.sample_us = (10.0, 1.0), host_sampling, 5.0
    eng = sim(tiny_model, device, EngineConfig(n_slots=4, n_ctx=CTX, max_batch=ENGINE_ROWS, max_out=4, max_in_flight=3))
    eng._sim_init()
    w = Worker(eng, CONFIGS["batch"])
    tok = tiny_model.tokenizer
    sps = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.7, top_k=20, seed=2)] * 2
    if host_sampling:
        sps[1] = SamplingParams()     # greedy beside the host's draws
    events: list[list[Event]] = [[] for _ in sps]
    for i, sp in enumerate(sps):
        w.submit(GenRequest(tok.encode(TEXTS[i]), 12, sp, ignore_eos=True), events[i].append)
    w.run_until_idle()
    for evs in events:
        assert len([e for e in evs if e.token is not None]) == 12 and evs[-1].finish == "length"
    assert (w.runner.chained_steps > 0) == (not host_sampling)   # the host's draws need each step's logits first


def test_which_replies_are_drawn_on_the_device(device, tiny_model):
    """Sampled replies go to the device's sampler when it can draw them as the
    host would (top_k 1..64, no repetition penalty, no log-probabilities); the
    others read their logits back. Greedy replies take the argmax."""
    from vkengine.kernels import Kernels
    cfg = CONFIGS["batch"]
    eng = Engine(tiny_model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=ENGINE_ROWS,
                                                  max_out=cfg.n_slots,
                                                  device_sampling=True))
    w = Worker(eng, cfg)
    prompt = tiny_model.tokenizer.encode(TEXTS[0])
    cases = [(SamplingParams(temperature=0.8), 0, True),
             (SamplingParams(temperature=0.8, top_k=Kernels.SAMPLE_K), 0, True),
             (SamplingParams(temperature=0.8, top_k=Kernels.SAMPLE_K + 1), 0, False),
             (SamplingParams(temperature=0.8, top_k=0), 0, False),
             (SamplingParams(temperature=0.8, repeat_penalty=1.1), 0, False),
             (SamplingParams(temperature=0.8), 3, False),           # n_probs: the logits
             (SamplingParams(), 0, False)]                          # greedy: the argmax
    for sp, n_probs, want in cases:
        job = w.submit(GenRequest(prompt, 4, sp, n_probs=n_probs), lambda ev: None)
        assert job.on_device == want, (sp, n_probs)
        assert job.needs_logits == (not want and (sp.needs_logits or n_probs > 0))
    w.run_until_idle()
    off = Worker(Engine(tiny_model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=ENGINE_ROWS,
                                                         max_out=cfg.n_slots, device_sampling=False)), cfg)
    assert not off.submit(GenRequest(prompt, 1, SamplingParams(temperature=0.8)), lambda ev: None).on_device
    off.run_until_idle()


def test_step_log_records_every_step(device, tiny_model, tmp_path):
    """--step-log: one JSON line per collected step, whose rows, prompt
    rows, outputs and chaining are those of the steps the engine ran (counted
    at Engine.submit); times are non-negative and in submit order."""
    import json
    path = tmp_path / "steps.jsonl"
    tok = tiny_model.tokenizer
    cfg = CONFIGS["batch"]
    eng = Engine(tiny_model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=cfg.step_tokens,
                                                  max_out=cfg.n_slots, max_in_flight=3))
    w = Worker(eng, cfg, step_log=str(path))
    ran: list[tuple[int, int, bool]] = []
    submit = eng.submit

    def counting_submit(tokens, positions, slots, out_rows=(), *a, chain=None, **k):
        ran.append((len(tokens), len(out_rows), chain is not None))
        return submit(tokens, positions, slots, out_rows, *a, chain=chain, **k)
    eng.submit = counting_submit
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    for p in prompts:
        w.submit(GenRequest(p, 6, SamplingParams(), ignore_eos=True), lambda ev: None)
    w.run_until_idle()
    w._log_file.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["rows"], r["outs"], r["chained"]) for r in lines] == ran
    # the first step holds both prompts whole (16 rows fit them), the last ones single decode rows
    assert lines[0]["prompt_rows"] == lines[0]["rows"] == sum(map(len, prompts))
    assert all(r["prompt_rows"] == 0 for r in lines[1:])
    assert any(r["chained"] for r in lines)
    assert all(r["dt_ms"] >= r["wait_ms"] >= 0 for r in lines)
    assert [r["t_ms"] for r in lines] == sorted(r["t_ms"] for r in lines)
