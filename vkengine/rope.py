"""Rotary position embedding tables, computed on the host in float64 so that
every device (and the numpy reference) rotates by the same angles."""
from __future__ import annotations

import numpy as np


def rope_angles(n_ctx: int, n_rot: int, base: float, freq_scale: float = 1.0,
                freq_factors: np.ndarray | None = None) -> np.ndarray:
    """theta[pos, i] = pos * freq_scale * base^(-2i / n_rot) / factor_i, float64 (n_ctx, n_rot/2)."""
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if freq_factors is not None:
        inv = inv / np.asarray(freq_factors, np.float64)[: n_rot // 2]
    return np.arange(n_ctx, dtype=np.float64)[:, None] * freq_scale * inv[None, :]


def rope_table(n_ctx: int, n_rot: int, base: float, freq_scale: float = 1.0,
               freq_factors: np.ndarray | None = None) -> np.ndarray:
    """float32 (n_ctx, n_rot/2, 2) of (cos, sin), the layout rope_kv.comp reads."""
    th = rope_angles(n_ctx, n_rot, base, freq_scale, freq_factors)
    return np.stack([np.cos(th), np.sin(th)], axis=-1).astype(np.float32)
