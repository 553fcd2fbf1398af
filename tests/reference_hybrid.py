"""numpy references of the hybrid models' operations (float64 math), used by the
kernel tests and by the model reference (tests/ref_qwen35.py).

Written from the formulas of Hugging Face's modeling_qwen3_5.py /
modeling_qwen3_5_moe.py and llama.cpp's delta-net-base.cpp, not from the
shaders. The gated delta rule comes in two independent forms, the token
recurrence and the chunked (WY / UT-transform) form, checked against each other.
"""
from __future__ import annotations

import numpy as np


def silu(x):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-x))


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


def softplus(x):
    x = np.asarray(x, np.float64)
    return np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))


def rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def l2_norm(x, eps=1e-6):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def conv1d(x, w, state):
    """Causal depthwise conv + SiLU of one sequence: x (T, C), w (C, K), state
    (K-1, C) previous inputs (oldest first). Returns (y (T, C), new state)."""
    K = w.shape[1]
    full = np.concatenate([state.astype(np.float64), x.astype(np.float64)], 0)   # (K-1+T, C)
    T = x.shape[0]
    y = np.zeros((T, x.shape[1]))
    for t in range(T):
        y[t] = (full[t:t + K] * w.T).sum(0)
    return silu(y), full[T:T + K - 1].copy() if K > 1 else np.zeros((0, x.shape[1]))


def gdn_gates(alpha, beta_raw, A, dt_bias):
    """(decay exponent g, beta) per (row, value head): g = A * softplus(alpha + dt)."""
    return A * softplus(alpha + dt_bias), sigmoid(beta_raw)


def head_map(nv, nk, tiled):
    """Key head of each value head: tiled (GGUF) or grouped (Hugging Face)."""
    return np.arange(nv) % nk if tiled else np.arange(nv) // (nv // nk)


def delta_rule_recurrent(q, k, v, g, beta, S0, scale):
    """One sequence: q, k (T, H, dk) (L2-normalized, already expanded to the value
    heads), v (T, H, dv), g, beta (T, H), S0 (H, dk, dv).
    Returns (o (T, H, dv), S (H, dk, dv), states after each row (T, H, dk, dv))."""
    S = S0.astype(np.float64).copy()
    T, H, dv = v.shape
    o = np.zeros((T, H, dv))
    states = np.zeros((T,) + S.shape)
    for t in range(T):
        S = S * np.exp(g[t])[:, None, None]
        kv = np.einsum("hi,hij->hj", k[t], S)
        delta = (v[t] - kv) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        o[t] = np.einsum("hi,hij->hj", q[t], S) * scale
        states[t] = S
    return o, S, states


def delta_rule_chunked(q, k, v, g, beta, S0, scale, chunk=4):
    """The same recurrence in chunks (the UT-transform form of
    torch_chunk_gated_delta_rule), one head at a time; returns (o, S)."""
    T, H, dk = k.shape
    dv = v.shape[2]
    o = np.zeros((T, H, dv))
    S_out = np.zeros((H, dk, dv))
    for h in range(H):
        S = S0[h].astype(np.float64).copy()
        for c0 in range(0, T, chunk):
            sl = slice(c0, min(T, c0 + chunk))
            qc, kc, vc = q[sl, h] * scale, k[sl, h], v[sl, h]
            gc, bc = g[sl, h], beta[sl, h]
            n = len(gc)
            cum = np.cumsum(gc)                                      # log decay from chunk start
            L = np.tril(np.exp(cum[:, None] - cum[None, :]))         # decay from j to i (i >= j)
            kb = kc * bc[:, None]
            A = np.tril((kb @ kc.T) * L, -1)                          # strictly lower
            Tm = np.linalg.inv(np.eye(n) + A)                        # (I + A)^-1
            u = Tm @ (vc * bc[:, None])                              # new values, before the state read
            w = Tm @ (kb * np.exp(cum)[:, None])                     # decayed keys that read the state
            v_new = u - w @ S
            att = np.tril((qc @ kc.T) * L)
            o[sl, h] = (qc * np.exp(cum)[:, None]) @ S + att @ v_new
            S = S * np.exp(cum[-1]) + (kc * np.exp(cum[-1] - cum)[:, None]).T @ v_new
        S_out[h] = S
    return o, S_out


def gated_rms_norm(x, z, w, eps):
    return rms_norm(x, w, eps) * silu(z)


def rope_neox(x, pos, n_rot, table):
    """x (..., hd) at positions pos (broadcast over leading dims); table from
    vkengine.rope.rope_table: [pos][n_rot/2][(cos, sin)]."""
    x = np.asarray(x, np.float64)
    c = table[pos, :, 0].astype(np.float64)
    s = table[pos, :, 1].astype(np.float64)
    while c.ndim < x.ndim:
        c, s = c[..., None, :], s[..., None, :]
    h = n_rot // 2
    out = x.copy()
    a, b = x[..., :h], x[..., h:n_rot]
    out[..., :h] = a * c - b * s
    out[..., h:n_rot] = b * c + a * s
    return out


def router_logits_serial(h, w):
    """float32 logits summed in index order without fused multiply-add, as
    moe_router.comp's fixed mode: h (rows, D), w (E, D) -> (rows, E)."""
    h = np.asarray(h, np.float32)
    w = np.asarray(w, np.float32)
    acc = np.zeros((h.shape[0], w.shape[0]), np.float32)
    for d in range(h.shape[1]):
        acc = acc + (h[:, d:d + 1] * w[None, :, d]).astype(np.float32)
    return acc


def route(logits, k, w_scale=1.0):
    """Top-k by logit (ties to the lowest index), softmax over the selected.
    Returns (ids (rows, k), weights (rows, k))."""
    logits = np.asarray(logits)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    top = np.take_along_axis(logits, ids, 1).astype(np.float64)
    e = np.exp(top - top[:, :1])
    return ids, e / e.sum(1, keepdims=True) * w_scale
