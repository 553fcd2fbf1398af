"""Embeddings: a prompt's final-normed hidden states (Readback.HIDDEN) pooled
into one vector, as llama.cpp pools its `t_embd` (the output norm's result,
what the output matrix reads) with --pooling mean / cls / last, then normalized
as its common_embd_normalize (llama-server's `embd_normalize`, default 2)."""
from __future__ import annotations

import numpy as np

from ..errors import VkEngineError

POOLINGS = ("mean", "cls", "last")
# GGUF's {arch}.pooling_type (llama.cpp's enum llama_pooling_type): 1 mean, 2 cls, 3 last
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def check_pooling(pooling: str) -> str:
    if pooling not in POOLINGS:
        raise VkEngineError(f"pooling {pooling!r} is not supported ({', '.join(POOLINGS)}; 'none', per-token "
                            "vectors, is not)")
    return pooling


def check_normalize(mode) -> int:
    """llama-server's embd_normalize: -1 none, 0 max-abs to an int16 range, 1 taxicab, 2 euclidean, p > 2 p-norm."""
    if isinstance(mode, bool) or not isinstance(mode, int) or mode < -1:
        raise VkEngineError("'embd_normalize' must be an integer >= -1 (-1 none, 0 max absolute, 1 taxicab, "
                            "2 euclidean, p > 2: p-norm)")
    return mode


def normalize(v: np.ndarray, mode: int = 2) -> np.ndarray:
    """common_embd_normalize (llama.cpp common/common.cpp), in float64 then float32."""
    x = np.asarray(v, np.float64)
    if mode == -1:
        s = 1.0
    elif mode == 0:
        s = float(np.abs(x).max(initial=0.0)) / 32760.0
    elif mode == 2:
        s = float(np.sqrt((x * x).sum()))
    else:
        s = float((np.abs(x) ** mode).sum() ** (1.0 / mode))
    return (x * (1.0 / s if s > 0.0 else 0.0)).astype(np.float32)


class Pool:
    """A sequence's pooled hidden state, fed its rows chunk by chunk as the
    steps that ran them are collected (a prompt may take several steps)."""

    def __init__(self, pooling: str, n_tokens: int):
        self.pooling, self.n_tokens = check_pooling(pooling), n_tokens
        self.sum: np.ndarray | None = None
        self.first: np.ndarray | None = None
        self.last: np.ndarray | None = None
        self.seen = 0

    def add(self, start: int, rows: np.ndarray) -> None:
        """rows: the hidden states of positions start .. start + len(rows) - 1."""
        if not len(rows):
            return
        if start != self.seen:
            raise RuntimeError(f"embedding rows out of order: got position {start}, expected {self.seen}")
        r = rows.astype(np.float64)
        self.sum = r.sum(0) if self.sum is None else self.sum + r.sum(0)
        if start == 0:
            self.first = r[0]
        self.last = r[-1]
        self.seen += len(rows)

    @property
    def complete(self) -> bool:
        return self.seen == self.n_tokens

    def vector(self) -> np.ndarray:
        if not self.complete or self.sum is None:
            raise RuntimeError(f"embedding pooled over {self.seen} of {self.n_tokens} positions")
        v = {"mean": self.sum / self.n_tokens, "cls": self.first, "last": self.last}[self.pooling]
        return np.asarray(v, np.float32)
