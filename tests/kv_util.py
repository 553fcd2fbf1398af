"""The KV cache's layouts (vkengine/state.py, shaders/kv.glsl) written out
again for the kernel tests, which place caches in a workspace: a side (K or V)
of n_slots slots of `cap` positions, f16 pairs or q8_0 quants then scales."""
from __future__ import annotations

import numpy as np

from vkengine.kernels import KVTypes

from . import reference as ref


def capacity(ctx: int, kv: KVTypes) -> int:
    """Positions a slot holds: with a q8_0 side, ctx rounded up to a multiple of 4."""
    return -(-ctx // 4) * 4 if kv.quantized else ctx


def slot_words(kv_type: str, cap: int, n_kv: int, hd: int) -> int:
    return cap * n_kv * (hd // 4 + hd // 64) if kv_type == "q8_0" else cap * n_kv * hd // 2


def pack_q8(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    """q int8 (n_slots, cap, n_kv, hd) and d float16 (n_slots, cap, n_kv, hd / 32) -> the side's words"""
    n = q.shape[0]
    return np.concatenate([np.ascontiguousarray(q).reshape(n, -1).view(np.uint32),
                           np.ascontiguousarray(d).reshape(n, -1).view(np.uint32)], axis=1).reshape(-1)


def unpack_q8(words: np.ndarray, n_slots: int, cap: int, n_kv: int, hd: int) -> tuple[np.ndarray, np.ndarray]:
    """a q8_0 side's words -> (q int8 (n_slots, cap, n_kv, hd), d float16 (n_slots, cap, n_kv, hd / 32))"""
    w = np.asarray(words, np.uint32).reshape(n_slots, -1)
    nq = cap * n_kv * hd // 4
    q = np.ascontiguousarray(w[:, :nq]).view(np.int8).reshape(n_slots, cap, n_kv, hd)
    d = np.ascontiguousarray(w[:, nq:]).view(np.float16).reshape(n_slots, cap, n_kv, hd // 32)
    return q, d


def random_side(rng, kv_type: str, shape: tuple[int, ...], grow: np.ndarray | None = None):
    """(words, float32 values) of a side of random contents: f16 normals, or
    random int8 with random f16 scales; grow: a factor per position (axis 1)."""
    g = np.ones(shape[1], np.float32) if grow is None else grow.astype(np.float32)
    if kv_type == "q8_0":
        q = rng.integers(-127, 128, shape).astype(np.int8)
        d = (rng.uniform(0.005, 0.03, (*shape[:-1], shape[-1] // 32)) * g[None, :, None, None]).astype(np.float16)
        return pack_q8(q, d), ref.dequantize_kv_q8_0(q, d)
    x = (rng.standard_normal(shape) * g[None, :, None, None]).astype(np.float16)
    return x.reshape(-1).view(np.uint32), x.astype(np.float32)


def assert_q8_matches(q: np.ndarray, d: np.ndarray, x: np.ndarray) -> None:
    """Blocks the device wrote (q, d) against the reference quantizer of x, the
    floats it quantized (up to the last bits where they came from other
    arithmetic: the RoPE's): scales within one f16 step, quants equal except at
    rounding ties of the reference (|frac(x / d)| within 1e-3 of 1/2, d the
    float32 scale it rounds with), and there within one."""
    qr, dr = ref.quantize_kv_q8_0(x)
    assert np.abs(d.view(np.int16).astype(np.int32) - dr.view(np.int16).astype(np.int32)).max() <= 1
    # ties of the values the quantizer rounds: x times 1 / d in float32 with d = max|x| / 127 before it
    # is stored as f16 (measuring them with the stored f16 d, up to 5e-4 apart, missed some: ~1 run in 30)
    b = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32)
    d32 = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)[..., None]
    y = np.abs(b * np.where(d32 != 0, np.float32(1) / np.where(d32 != 0, d32, 1), 0)).reshape(x.shape)
    tie = np.abs(y - np.floor(y) - 0.5) < 1e-3
    diff = np.abs(q.astype(np.int32) - qr.astype(np.int32))
    assert diff.max() <= 1 and (diff[~tie] == 0).all(), f"{int((diff[~tie] != 0).sum())} quants off"


def check_written(words: np.ndarray, kv_type: str, x: np.ndarray, slots, pos, n_slots: int, cap: int, n_kv: int,
                  hd: int, tol: float = 0.0) -> None:
    """A cache side (its words, poisoned before) after rows x (rows, n_kv, hd)
    were written at (slots, pos): each row as the side's type holds it (f16:
    x rounded to halves, within tol; q8_0: assert_q8_matches), and every word
    of the other positions still poison."""
    from .conftest import POISON
    written = np.zeros((n_slots, cap), bool)
    written[slots, pos] = True
    w = np.asarray(words, np.uint32).reshape(n_slots, -1)
    if kv_type == "q8_0":
        q, d = unpack_q8(w, n_slots, cap, n_kv, hd)
        assert_q8_matches(q[slots, pos], d[slots, pos], np.asarray(x, np.float32))
        nq = cap * n_kv * hd // 4
        parts = [w[:, :nq], w[:, nq:]]
    else:
        got = w.view(np.float16).astype(np.float32).reshape(n_slots, cap, n_kv, hd)[slots, pos]
        np.testing.assert_allclose(got, np.asarray(x).astype(np.float16).astype(np.float32), rtol=tol, atol=tol)
        parts = [w]
    for part in parts:
        assert (part.reshape(n_slots, cap, -1)[~written] == POISON).all()
