"""Our engine's side of a parity case: the greedy free run (through the same
`generate` iterator as the CLI) and one teacher-forced pass along llama.cpp's
tokens that yields the argmax and log-probabilities at every position.

The teacher-forced pass is a prefill with logits read back for the N positions
that matter (chunked by max_batch rows and max_out logit rows), not N decode
steps: it gives the teacher-forced top-1, the KL and the re-anchored comparison
at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from vkengine.engine import Engine, EngineConfig
from vkengine.generate import generate


@dataclass
class EngineCase:
    tokens: list[int]                     # free-run greedy tokens
    tf_top1: list[int]                    # teacher-forced argmax per position
    tf_logprobs: list[dict[int, float]]   # teacher-forced log-softmax at the kept ids


def engine_config(max_prompt: int, n_predict: int, n_ctx_train: int) -> EngineConfig:
    """One slot with room for the longest prompt plus N, rounded up to 256 so
    that prompt sets of similar size share KV sizes."""
    need = max_prompt + n_predict + 1
    n_ctx = min(n_ctx_train, -(-need // 256) * 256)
    # max_out 64: 32-token cases read all their logit rows in one step
    return EngineConfig(n_slots=1, n_ctx=n_ctx, max_batch=256, max_out=64)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    r = row.astype(np.float64)
    m = r.max()
    return r - m - np.log(np.exp(r - m).sum())


def teacher_forced(eng: Engine, tokens: Sequence[int], first: int, keep: Sequence[Iterable[int]],
                   slot: int = 0) -> tuple[list[int], list[dict[int, float]]]:
    """Run `tokens` from position 0 and return, for positions first..end, the
    argmax and the log-softmax at keep[i - first] (plus the argmax itself)."""
    top1: list[int] = []
    lps: list[dict[int, float]] = []
    pos, n = 0, len(tokens)
    while pos < n:
        end = min(pos + eng.max_batch, n)
        lo = max(first, pos)
        if end - lo > eng.max_out:        # not more logit rows than one step holds
            end = lo + eng.max_out
        out = list(range(lo - pos, end - pos)) if lo < end else []
        rows = eng.step(tokens[pos:end], range(pos, end), [slot] * (end - pos), out,
                        "logits" if out else "none")
        for j, r in enumerate(rows if out else ()):
            ls = _log_softmax(r)
            best = int(np.argmax(r))
            ids = set(keep[lo + j - first]) | {best}
            top1.append(best)
            lps.append({int(t): float(ls[t]) for t in ids})
        pos = end
    return top1, lps


def run_case(eng: Engine, prompt: Sequence[int], ref: Sequence[int],
             ref_top: Sequence[Sequence[tuple[int, float]]], slot: int = 0) -> EngineCase:
    """Free run of len(ref) greedy tokens, then teacher forcing along `ref`."""
    n = len(ref)
    free = [s.token for s in generate(eng, prompt, n, ignore_eos=True, slot=slot)]
    keep = [{t for t, _ in ref_top[i]} | {int(ref[i]), free[i]} for i in range(n)]
    seq = [int(t) for t in prompt] + [int(t) for t in ref[:n - 1]]
    top1, lps = teacher_forced(eng, seq, len(prompt) - 1, keep, slot)
    return EngineCase(free, top1, lps)
