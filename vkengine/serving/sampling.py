"""Token sampling on the host from one logits row (numpy), in llama.cpp's
default order: repetition penalty, top-k, top-p, min-p, temperature, draw.
Greedy decoding (temperature <= 0, no penalty) never reaches here: the argmax
runs on the device and one word is read back."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import VkEngineError


def _top_exact(x: np.ndarray, k: int) -> np.ndarray:
    """top_order by argpartition of the whole of x (0 < k < len(x))."""
    part = np.argpartition(-x, k - 1)[:k]
    thr = x[part].min()
    if np.isnan(thr):                     # fewer than k non-NaN values: the sort's order
        return np.argsort(-x, kind="stable")[:k]
    above = np.flatnonzero(x > thr)        # index order
    ties = np.flatnonzero(x == thr)[: k - above.size]
    cand = np.union1d(above, ties)        # sorted by index
    return cand[np.argsort(-x[cand], kind="stable")]


def top_order(x: np.ndarray, k: int) -> np.ndarray:
    """The indices of x's k largest values, largest first, ties in index order:
    exactly np.argsort(-x, kind="stable")[:k] (k <= 0: every index), without
    sorting x. A long row is first cut to the values at or above a threshold
    lo, the k-th largest of every 16th value (about 16k values pass): when at
    least k values are >= lo, x's k-th largest is too, so the cut keeps the
    top k and every tie of the k-th, in index order, and selecting among them
    gives the same order. (A NaN lo passes nothing: the exact path runs.) A
    49,152-token vocabulary, k = 40: 5.8 ms (the full sort) -> ~0.1 ms a row
    on this project's 2-core machine; the engine thread pays it for every
    sampled row of every step."""
    n = x.shape[0]
    if k <= 0 or k >= n:
        return np.argsort(-x, kind="stable")[: (k if k > 0 else n)]
    if n >= 64 * k:
        smp = x[::16]
        lo = np.partition(smp, smp.size - k)[smp.size - k]
        cand = np.flatnonzero(x >= lo)    # index order; NaN never passes
        if cand.size > k:
            return cand[_top_exact(x[cand], k)]
        if cand.size == k:
            return cand[np.argsort(-x[cand], kind="stable")]
    return _top_exact(x, k)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def validate(self) -> SamplingParams:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise VkEngineError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise VkEngineError("top_k must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise VkEngineError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise VkEngineError("min_p must be in [0, 1]")
        if not (self.repeat_penalty > 0 and np.isfinite(self.repeat_penalty)):
            raise VkEngineError("repeat_penalty must be > 0")
        if self.repeat_last_n < 0:
            raise VkEngineError("repeat_last_n must be >= 0")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_logits(self) -> bool:
        return not self.greedy or self.repeat_penalty != 1.0

    def drawn_on_device(self, top_k_max: int) -> bool:
        """Whether a device's sampler (Engine readback "sample", top_k up to
        top_k_max) can draw these tokens: sampled, top-k on, no repetition
        penalty. It draws what Sampler draws, with the same uniform (one a
        token), in float32 instead of float64."""
        return not self.greedy and self.repeat_penalty == 1.0 and 1 <= self.top_k <= top_k_max

    def device_row(self, u: float) -> tuple[float, int, float, float, float]:
        """Engine.submit's sampling row with the uniform u."""
        return (self.temperature, self.top_k, self.top_p, self.min_p, u)


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def uniform(self) -> float:
        """The next uniform in [0, 1) of this sampler's generator: the one its
        next draw would take (a draw on the device takes it instead)."""
        return float(self.rng.random())

    def penalize(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """llama.cpp's repetition penalty: positive logits divided, negative multiplied."""
        if self.p.repeat_penalty == 1.0 or not history or self.p.repeat_last_n == 0:
            return logits
        logits = logits.copy()
        ids = np.unique(np.asarray(history[-self.p.repeat_last_n:], np.int64))
        v = logits[ids]
        with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
            v = np.where(v > 0, v / self.p.repeat_penalty, v * self.p.repeat_penalty)
        # a penalty beyond float32's range makes inf (then inf - inf) or 0 * inf: NaN in the draw
        big = np.finfo(np.float32).max
        logits[ids] = np.clip(np.where(np.isnan(v), 0.0, v), -big, big)
        return logits

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        logits = self.penalize(np.asarray(logits, np.float32), history)
        if self.p.greedy:
            return int(np.argmax(logits))
        idx = top_order(logits, self.p.top_k)
        lg = logits[idx].astype(np.float64)
        probs = np.exp(lg - lg[0])
        probs /= probs.sum()
        if self.p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), self.p.top_p) + 1)
            idx, lg, probs = idx[:keep], lg[:keep], probs[:keep]
        if self.p.min_p > 0.0:
            keep = probs >= self.p.min_p * probs[0]
            idx, lg = idx[keep], lg[keep]
        with np.errstate(over="ignore"):
            scaled = lg / self.p.temperature
        if not np.isfinite(scaled[0]):          # a temperature so small that it overflows: scale the gaps
            with np.errstate(over="ignore"):
                scaled = (lg - lg[0]) / self.p.temperature
        probs = np.exp(scaled - scaled.max())
        probs /= probs.sum()
        return int(idx[self.rng.choice(len(idx), p=probs)])
