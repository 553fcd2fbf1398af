"""numpy reference forward pass of gpt-oss (tests only), written from
llama.cpp's src/models/openai-moe.cpp and transformers' modeling_gpt_oss.py,
independently of the engine's graph code: q/k/v/o biases, NEOX RoPE with YaRN
(tests/reference.py yarn_table: ggml's formula), attention with a sink logit per
head over every position or the last `window`, the router's top k by biased
logit weighted by the softmax of those k, experts with biases and the clamped
SwiGLU. K and V rounded as the engine's f16 cache stores them."""
from __future__ import annotations

import numpy as np

from vkengine.gguf_file import ModelFile

from . import reference as ref


class RefGptOss:
    def __init__(self, mf: ModelFile, args):
        self.a, self.mf = args, mf
        self.w: dict[str, np.ndarray] = {}

    def W(self, name: str) -> np.ndarray:
        if name not in self.w:
            self.w[name] = self.mf.tensor(name).as_f32().astype(np.float32)
        return self.w[name]

    def logits(self, tokens: list[int]) -> np.ndarray:
        a = self.a
        n, hd, H, Hkv = len(tokens), a.head_dim, a.n_head, a.n_head_kv
        k = a.n_expert_used
        x = self.W("token_embd.weight")[np.asarray(tokens)].astype(np.float64)
        pos = np.arange(n)
        yarn = (a.yarn.factor, a.yarn.orig_ctx, a.yarn.beta_fast, a.yarn.beta_slow, a.yarn.truncate) \
            if a.yarn is not None else None
        for i in range(a.n_layer):
            p = f"blk.{i}."
            h = ref.rms_norm(x, self.W(p + "attn_norm.weight"), a.rms_eps).astype(np.float64)
            q = (h @ self.W(p + "attn_q.weight").T + self.W(p + "attn_q.bias")).reshape(n, H, hd)
            kk = (h @ self.W(p + "attn_k.weight").T + self.W(p + "attn_k.bias")).reshape(n, Hkv, hd)
            v = (h @ self.W(p + "attn_v.weight").T + self.W(p + "attn_v.bias")).reshape(n, Hkv, hd)
            q = ref.rope(q, pos, a.n_rot, a.rope_base, True, yarn=yarn)
            kk = ref.rope(kk, pos, a.n_rot, a.rope_base, True, yarn=yarn)
            k16, v16 = ref.kv_round(kk, "f16"), ref.kv_round(v.astype(np.float32), "f16")
            sinks = self.W(p + "attn_sinks.weight")
            att = []
            for t in range(n):
                lo = max(0, t + 1 - a.window) if a.swa[i] else 0
                att.append(ref.attention(q[t], k16[lo:t + 1], v16[lo:t + 1], 1.0 / np.sqrt(hd), sinks=sinks))
            o = np.stack(att).reshape(n, H * hd).astype(np.float64) @ self.W(p + "attn_output.weight").T
            x = x + o + self.W(p + "attn_output.bias")
            h = ref.rms_norm(x, self.W(p + "post_attention_norm.weight"), a.rms_eps).astype(np.float64)
            lg = h @ self.W(p + "ffn_gate_inp.weight").T + self.W(p + "ffn_gate_inp.bias")
            gate, up, down = (self.W(p + f"ffn_{t}_exps.weight") for t in ("gate", "up", "down"))
            gb, ub, db = (self.W(p + f"ffn_{t}_exps.bias") for t in ("gate", "up", "down"))
            moe = np.zeros_like(x)
            for r in range(n):
                ids = np.argsort(-lg[r], kind="stable")[:k]
                wt = np.exp(lg[r, ids] - lg[r, ids].max())
                wt /= wt.sum()
                for e, w in zip(ids, wt):
                    g = np.minimum(h[r] @ gate[e].T + gb[e], 7.0)
                    u = np.clip(h[r] @ up[e].T + ub[e], -7.0, 7.0)
                    f = g / (1.0 + np.exp(-1.702 * g)) * (u + 1.0)
                    moe[r] += w * (f.astype(np.float32).astype(np.float64) @ down[e].T + db[e])
            x = x + moe
        hN = ref.rms_norm(x, self.W("output_norm.weight"), a.rms_eps).astype(np.float64)
        return (hN @ self.W("output.weight").T.astype(np.float64)).astype(np.float32)
