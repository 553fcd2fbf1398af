"""`vkengine bench`: prefill (pp) and decode (tg) speed, measured like
llama-bench: pp = one prompt of n tokens from an empty context, tg = n tokens
generated one at a time from an empty context; median of `reps` runs."""
from __future__ import annotations

import statistics
import time

import numpy as np

from .engine import Engine


def run_bench(eng: Engine, n_prompt: int, n_gen: int, reps: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    V = eng.n_vocab
    out = {"model": eng.model.name, "device": eng.device.info.name, "n_prompt": n_prompt, "n_gen": n_gen}
    if n_prompt:
        toks = rng.integers(0, V, n_prompt).tolist()
        eng.prefill(toks, 0)                      # warm-up: record the programs
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            eng.prefill(toks, 0)
            times.append(time.perf_counter() - t)
        out["pp_s"] = statistics.median(times)
        out["pp_tps"] = n_prompt / out["pp_s"]
    if n_gen:
        tok = int(rng.integers(0, V))
        eng.step([tok], [0], [0], [0])            # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            for pos in range(n_gen):
                tok = int(eng.step([tok], [pos], [0], [0])[0])
            times.append(time.perf_counter() - t)
        out["tg_s"] = statistics.median(times)
        out["tg_tps"] = n_gen / out["tg_s"]
    return out
