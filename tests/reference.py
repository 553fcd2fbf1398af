"""numpy reference implementations of the kernels (float64 where it matters)."""
from __future__ import annotations

import math

import numpy as np

from vkengine.rope import rope_table


def rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


def yarn_table(n_ctx, n_rot, base, factor, orig_ctx, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """YaRN's (cos, sin) table as ggml's rope_yarn computes it (ggml-cpu ops.cpp,
    ggml.c ggml_rope_yarn_corr_dims; llama.cpp's attention factor for llama-family
    models: cos and sin times 0.1 ln factor + 1), written out per pair; truncate
    false: the correction range unrounded (transformers' find_correction_range,
    gpt-oss's config)."""
    def corr_dim(beta):
        return n_rot * math.log(orig_ctx / (beta * 2 * math.pi)) / (2 * math.log(base))
    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(0.0, low), min(n_rot - 1.0, high)
    mscale = 1.0 + 0.1 * math.log(factor)
    out = np.zeros((n_ctx, n_rot // 2, 2))
    for i in range(n_rot // 2):
        ramp = 1.0 - min(1.0, max(0.0, (i - low) / max(0.001, high - low)))
        for p in range(n_ctx):
            extrap = p * base ** (-2.0 * i / n_rot)
            theta = extrap / factor * (1.0 - ramp) + extrap * ramp
            out[p, i] = (math.cos(theta) * mscale, math.sin(theta) * mscale)
    return out.astype(np.float32)


def rope(x, pos, n_rot, base, neox, freq_scale=1.0, freq_factors=None, mscale=1.0, yarn=None):
    """x (rows, heads, hd) at positions pos (rows,): rotated copy (float64 math
    with the same float32 cos/sin table as the device); freq_factors divide the
    frequencies (Llama 3.1, LongRoPE), mscale scales cos and sin (LongRoPE);
    yarn: yarn_table's arguments after base ((factor, original context), then
    optionally beta_fast, beta_slow, truncate)."""
    if yarn is not None:
        tab = yarn_table(int(pos.max()) + 1, n_rot, base, *yarn).astype(np.float64)
    else:
        tab = rope_table(int(pos.max()) + 1, n_rot, base, freq_scale, freq_factors).astype(np.float64)
    tab = (tab.astype(np.float32) * np.float32(mscale)).astype(np.float64)
    c = tab[pos, :, 0][:, None, :]
    s = tab[pos, :, 1][:, None, :]
    out = x.astype(np.float64).copy()
    if neox:
        h = n_rot // 2
        a, b = x[..., :h].astype(np.float64), x[..., h:n_rot].astype(np.float64)
        out[..., :h] = a * c - b * s
        out[..., h:n_rot] = b * c + a * s
    else:
        a, b = x[..., 0:n_rot:2].astype(np.float64), x[..., 1:n_rot:2].astype(np.float64)
        out[..., 0:n_rot:2] = a * c - b * s
        out[..., 1:n_rot:2] = a * s + b * c
    return out.astype(np.float32)


def attention(q, k, v, scale, softcap=0.0, sinks=None):
    """q (hq, hd) against k, v (t, hkv, hd): grouped-query softmax attention
    (softcap > 0: scores s -> softcap * tanh(s / softcap) first, Gemma 2;
    sinks (hq,): one more logit per head in the softmax, with no value:
    transformers' GptOss eager attention)."""
    hq, hkv = q.shape[0], k.shape[1]
    g = hq // hkv
    out = np.zeros_like(q, dtype=np.float64)
    for h in range(hq):
        kk = k[:, h // g, :].astype(np.float64)
        vv = v[:, h // g, :].astype(np.float64)
        s = kk @ q[h].astype(np.float64) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        if sinks is not None:
            both = np.concatenate([s, [float(sinks[h])]])
            p = np.exp(both - both.max())
            out[h] = (p[:-1] / p.sum()) @ vv
            continue
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv
    return out.astype(np.float32)


def silu(x):
    x = x.astype(np.float64)
    return x / (1 + np.exp(-x))


def softmax(x, axis=-1):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis, keepdims=True))
    return (e / e.sum(axis, keepdims=True)).astype(np.float32)


def quantize_q8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_q8.comp in numpy, per row of 32-value blocks: (q int8 [..., K],
    d float32 [..., K / 32]) with d = max|x| / 127, q = roundEven(x / d)."""
    b = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(x.shape), d


def dequantize_q8(x: np.ndarray) -> np.ndarray:
    """x as the XQ8 matvecs see it: quantize_q8, then back to floats."""
    q, d = quantize_q8(x)
    return (q.astype(np.float32) * np.repeat(d, 32, axis=-1)).astype(np.float32)


def quantize_q8x2(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """mul_mvk.comp's PARTS_Q8 blocks: quantize_q8's (q, d) and a second plane
    q2 = roundEven((x - q d) / (d / 254)), clamped to +-127."""
    q, d = quantize_q8(x)
    b = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32)
    dd = d[..., None]
    inv = np.where(dd > 0, np.float32(1) / np.where(dd > 0, dd, 1), 0).astype(np.float32)
    r = (b - q.reshape(b.shape).astype(np.float32) * dd).astype(np.float32)
    q2 = np.clip(np.rint(r * (inv * np.float32(254))), -127, 127).astype(np.int8)
    return q, q2.reshape(x.shape), d


def dequantize_q8x2(x: np.ndarray) -> np.ndarray:
    """x as the XQ8 "nx" matvecs see it: both planes, back to floats."""
    q, q2, d = quantize_q8x2(x)
    dr = np.repeat(d, 32, axis=-1).astype(np.float64)
    return (q.astype(np.float64) * dr + q2.astype(np.float64) * (dr / 254)).astype(np.float32)


def quantize_kv_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q8_0_ref (ggml-quants.c) in float32, per 32-value
    block of the last axis: (q int8, same shape; d float16 [..., n / 32]) with
    d = max|x| / 127, id = 1 / d (0 where d = 0), q = roundf(x * id) (halves
    away from zero)."""
    b = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32)
    d = (np.abs(b).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    y = (b * inv[..., None]).astype(np.float32)
    t = np.trunc(y)
    q = t + np.where(np.abs(y - t) >= 0.5, np.sign(y), 0)
    return q.astype(np.int8).reshape(x.shape), d.astype(np.float16)


def dequantize_kv_q8_0(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    return (q.astype(np.float32) * np.repeat(d.astype(np.float32), 32, axis=-1)).astype(np.float32)


def kv_round(x: np.ndarray, kv_type: str) -> np.ndarray:
    """x (..., head_dim) as a KV cache of type kv_type holds it, as float32."""
    if kv_type == "q8_0":
        return dequantize_kv_q8_0(*quantize_kv_q8_0(x))
    return np.asarray(x).astype(np.float16).astype(np.float32)
