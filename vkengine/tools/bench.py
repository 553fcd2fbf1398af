"""`vkengine bench`: prefill (pp) and decode (tg) speed, measured like
llama-bench: pp = one prompt of n tokens from an empty context, tg = n tokens
generated one at a time from an empty context; median of `reps` runs.
Batched decode (`--parallel B`): B sequences in B slots decode n tokens
together, one step of B rows per token, as the server's batch mode does;
reported as aggregate tok/s (B * n / time). Decode steps are chained as the
server chains greedy decode (`decode`): the next step is on the device before
the host reads the last one's tokens."""
from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from ..engine import Engine
from ..errors import VkEngineError


def warm_up(eng: Engine, run) -> None:
    """Run what the timed repetitions run, twice, so that they record no
    program: a step's program is kept per params buffer (and chained or not),
    the buffers alternate step by step, and a run of an odd number of steps
    leaves the next one starting on the other buffer. (A warm-up of one
    prefill or two decode steps left the other buffer's prefill and chained
    decode programs to the first timed repetition: with -r 2 the median,
    their mean, then included half a recording.)"""
    for _ in range(2):
        run()


def run_bench(eng: Engine, n_prompt: int, n_gen: int, reps: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    V = eng.n_vocab
    out: dict[str, Any] = {"model": eng.model.name, "device": eng.device.info.name, "n_prompt": n_prompt,
                           "n_gen": n_gen}
    if n_prompt:
        toks = rng.integers(0, V, n_prompt).tolist()
        warm_up(eng, lambda: eng.prefill(toks, 0))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            eng.prefill(toks, 0)
            times.append(time.perf_counter() - t)
        out["pp_s"] = statistics.median(times)
        out["pp_tps"] = n_prompt / out["pp_s"]
    if n_gen:
        tok = int(rng.integers(0, V))
        warm_up(eng, lambda: decode(eng, [tok], n_gen))
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            decode(eng, [tok], n_gen)
            times.append(time.perf_counter() - t)
        out["tg_s"] = statistics.median(times)
        out["tg_tps"] = n_gen / out["tg_s"]
    return out


def decode(eng: Engine, toks: list[int], n_gen: int) -> list[list[int]]:
    """Greedy decode of len(toks) sequences in slots 0.. from position 0, one
    step of all rows per token, each step's tokens the previous step's greedy
    outputs: as the server runs greedy decode, each step is submitted chained
    to the one before it (Engine.submit(chain=...)) before that one is read
    back, where the engine allows it. Returns each step's tokens."""
    n = len(toks)
    slots = rows = list(range(n))
    out = []
    if not eng.can_chain:
        for pos in range(n_gen):
            toks = eng.step(toks, [pos] * n, slots, rows).tolist()
            out.append(toks)
        return out
    eng.submit(toks, [0] * n, slots, rows)
    for pos in range(1, n_gen):
        eng.submit(toks, [pos] * n, slots, rows, chain=rows)
        out.append(eng.collect().tolist())
    out.append(eng.collect().tolist())
    return out


def run_batched(eng: Engine, n_seq: int, n_gen: int, reps: int = 3, seed: int = 0) -> dict:
    """Aggregate decode speed of n_seq sequences stepping together from an empty context."""
    if n_seq > eng.n_slots:
        raise ValueError(f"{n_seq} sequences need {n_seq} slots, the engine has {eng.n_slots}")
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, eng.n_vocab, n_seq).tolist()
    warm_up(eng, lambda: decode(eng, toks, n_gen))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        decode(eng, toks, n_gen)
        times.append(time.perf_counter() - t)
    s = statistics.median(times)
    return {"n_seq": n_seq, "n_gen": n_gen, "step_ms": 1000 * s / n_gen, "tps": n_seq * n_gen / s}


def parse_parallel(text: str) -> list[int]:
    """`--parallel 4,16` -> [4, 16]: the sequence counts of batched decode."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VkEngineError(f"--parallel takes comma-separated sequence counts such as 1,4,16, got {text!r}") from None
    if any(v < 1 or v > 256 for v in vals):
        raise VkEngineError(f"--parallel counts must be 1..256, got {text!r}")
    return vals
