"""numpy reference forward pass of Gemma 2 and Gemma 3 (tests only), written
from llama.cpp's src/models/gemma2.cpp / gemma3.cpp and transformers'
modeling_gemma2/3.py, independently of the engine's graph code: weights
dequantized with the `gguf` package, causal attention over the whole sequence
with each sliding-window layer's keys cut to the last `window` positions.
K and V rounded as the engine's KV cache stores them; everything else float64."""
from __future__ import annotations

import math

import numpy as np

from vkengine.gguf_file import ModelFile

from . import reference as ref


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


class RefGemma:
    def __init__(self, mf: ModelFile, args):
        self.a, self.mf = args, mf
        self.w: dict[str, np.ndarray] = {}

    def W(self, name: str) -> np.ndarray:
        if name not in self.w:
            self.w[name] = self.mf.tensor(name).as_f32().astype(np.float32)
        return self.w[name]

    def logits(self, tokens: list[int], kv: tuple[str, str] = ("f16", "f16")) -> np.ndarray:
        a = self.a
        n = len(tokens)
        hd, H, Hkv = a.head_dim, a.n_head, a.n_head_kv
        emb = self.W("token_embd.weight")
        x = emb[np.asarray(tokens)].astype(np.float64) * math.sqrt(a.n_embd)
        pos = np.arange(n)
        for i in range(a.n_layer):
            p = f"blk.{i}."
            h = ref.rms_norm(x, self.W(p + "attn_norm.weight"), a.rms_eps).astype(np.float64)
            q = (h @ self.W(p + "attn_q.weight").T).reshape(n, H, hd)
            k = (h @ self.W(p + "attn_k.weight").T).reshape(n, Hkv, hd)
            v = (h @ self.W(p + "attn_v.weight").T).reshape(n, Hkv, hd)
            if self.mf.has(p + "attn_q_norm.weight"):      # gemma3
                q = ref.rms_norm(q, self.W(p + "attn_q_norm.weight"), a.rms_eps)
                k = ref.rms_norm(k, self.W(p + "attn_k_norm.weight"), a.rms_eps)
            swa = a.swa[i]
            base, fs = (a.rope_base_swa, a.rope_freq_scale_swa) if swa else (a.rope_base, a.rope_freq_scale)
            q = ref.rope(q, pos, a.n_rot, base, True, fs)
            k = ref.rope(k, pos, a.n_rot, base, True, fs)
            k16 = ref.kv_round(k.astype(np.float32), kv[0])
            v16 = ref.kv_round(v.astype(np.float32), kv[1])
            att = []
            for t in range(n):
                lo = max(0, t + 1 - a.window) if swa and a.window else 0
                att.append(ref.attention(q[t], k16[lo: t + 1], v16[lo: t + 1], a.attn_scale, a.attn_softcap))
            o = np.stack(att).reshape(n, H * hd).astype(np.float64) @ self.W(p + "attn_output.weight").T
            x = x + ref.rms_norm(o, self.W(p + "post_attention_norm.weight"), a.rms_eps)
            h = ref.rms_norm(x, self.W(p + "ffn_norm.weight"), a.rms_eps).astype(np.float64)
            f = gelu_tanh(h @ self.W(p + "ffn_gate.weight").T) * (h @ self.W(p + "ffn_up.weight").T)
            f = f @ self.W(p + "ffn_down.weight").T.astype(np.float64)
            x = x + ref.rms_norm(f, self.W(p + "post_ffw_norm.weight"), a.rms_eps)
        h = ref.rms_norm(x, self.W("output_norm.weight"), a.rms_eps).astype(np.float64)
        out = self.W("output.weight") if self.mf.has("output.weight") else emb
        lg = h @ out.T.astype(np.float64)
        if a.final_softcap:
            lg = a.final_softcap * np.tanh(lg / a.final_softcap)
        return lg.astype(np.float32)
