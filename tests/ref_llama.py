"""numpy reference forward pass of the llama graph (tests only), with the
dense Qwen additions where the file has their tensors: q/k/v biases (qwen2),
per-head q/k RMSNorms before RoPE (qwen3), routed experts in place of the
FFN (qwen3moe, Mixtral-style llama), and phi3's fused q|k|v and gate|up
matrices and LongRoPE.

Written independently of the engine's graph code: weights dequantized with the
`gguf` package, full causal attention over the whole sequence. K and V are
rounded as the engine's KV cache stores them (f16, or q8_0 blocks), so logits can be compared
tightly; everything else is float32/float64 on the host.
"""
from __future__ import annotations

import numpy as np

from vkengine.gguf_file import ModelFile

from . import reference as ref


class RefLlama:
    def __init__(self, mf: ModelFile, args, n_ctx: int = 256):
        """n_ctx: the engine's context (LongRoPE's factors follow it)."""
        self.a = args
        self.mf = mf
        self.n_ctx = n_ctx
        self.w: dict[str, np.ndarray] = {}

    def W(self, name: str) -> np.ndarray:
        if name not in self.w:
            self.w[name] = self.mf.tensor(name).as_f32().astype(np.float32)
        return self.w[name]

    def logits(self, tokens: list[int], act_q8: bool = False, ffn_q8_parts: bool = False,
               kv: tuple[str, str] = ("f16", "f16")) -> np.ndarray:
        """(len(tokens), n_vocab) logits of a sequence starting at position 0.
        act_q8: the inputs of the products that the XQ8 matvecs take (gate|up
        and the output head: the matrices that never fuse a norm or RoPE)
        rounded to 8-bit blocks first, as those kernels take them
        (ref.dequantize_q8). ffn_q8_parts: gate|up's input as the XQ8_IN path
        takes it (Kernels.xq8_in): h' = x * ffn_norm's weight as two planes of
        8-bit blocks, then times the norm's scale 1 / rms(x). kv: the KV cache's
        K and V types (f16, q8_0: ref.kv_round)."""
        a = self.a
        qa = ref.dequantize_q8 if act_q8 else (lambda t: t)
        n = len(tokens)
        hd, H, Hkv = a.head_dim, a.n_head, a.n_head_kv
        emb = self.W("token_embd.weight")
        x = emb[np.asarray(tokens)].astype(np.float64)
        pos = np.arange(n)
        for i in range(a.n_layer):
            p = f"blk.{i}."
            h = ref.rms_norm(x, self.W(p + "attn_norm.weight"), a.rms_eps).astype(np.float32)
            if self.mf.has(p + "attn_qkv.weight"):        # phi3: one matrix
                qkv = h @ self.W(p + "attn_qkv.weight").T
                q, k, v = np.split(qkv, [H * hd, (H + Hkv) * hd], axis=1)
            else:
                q = h @ self.W(p + "attn_q.weight").T
                k = h @ self.W(p + "attn_k.weight").T
                v = h @ self.W(p + "attn_v.weight").T
            if self.mf.has(p + "attn_q.bias"):          # qwen2
                q, k, v = (t + self.W(p + f"attn_{s}.bias") for t, s in ((q, "q"), (k, "k"), (v, "v")))
            q, k, v = q.reshape(n, H, hd), k.reshape(n, Hkv, hd), v.reshape(n, Hkv, hd)
            if self.mf.has(p + "attn_q_norm.weight"):   # qwen3: each head's q and k RMS-normed
                q = ref.rms_norm(q, self.W(p + "attn_q_norm.weight"), a.rms_eps)
                k = ref.rms_norm(k, self.W(p + "attn_k_norm.weight"), a.rms_eps)
            ff, ms = a.rope_factors(self.n_ctx), a.rope_attn_factor
            yarn = (a.yarn.factor, a.yarn.orig_ctx, a.yarn.beta_fast, a.yarn.beta_slow, a.yarn.truncate) \
                if a.yarn is not None else None
            q = ref.rope(q, pos, a.n_rot, a.rope_base, a.rope_neox, a.rope_freq_scale, ff, ms, yarn)
            k = ref.rope(k, pos, a.n_rot, a.rope_base, a.rope_neox, a.rope_freq_scale, ff, ms, yarn)
            k16 = ref.kv_round(k.astype(np.float32), kv[0])
            v16 = ref.kv_round(v.astype(np.float32), kv[1])
            att = np.stack([ref.attention(q[t], k16[: t + 1], v16[: t + 1], 1.0 / np.sqrt(hd)) for t in range(n)])
            wo = self.W(p + "attn_output.weight").T.astype(np.float64)
            x = x + att.reshape(n, H * hd).astype(np.float32).astype(np.float64) @ wo
            if ffn_q8_parts:
                x32 = x.astype(np.float32)
                scale = 1.0 / np.sqrt((x32.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + a.rms_eps)
                h = ref.dequantize_q8x2(x32 * self.W(p + "ffn_norm.weight")).astype(np.float64) * scale
            else:
                h = qa(ref.rms_norm(x, self.W(p + "ffn_norm.weight"), a.rms_eps).astype(np.float32))
            if self.mf.has(p + "ffn_gate_inp.weight"):   # routed experts (qwen3moe, Mixtral)
                x = x + self.experts(p, h.astype(np.float32))
                continue
            if self.mf.has(p + "ffn_gate.weight"):
                g = h @ self.W(p + "ffn_gate.weight").T
                u = h @ self.W(p + "ffn_up.weight").T
            else:                                          # phi3: [gate | up] in ffn_up
                g, u = np.split(h @ self.W(p + "ffn_up.weight").T, 2, axis=1)
            f = (ref.silu(g) * u).astype(np.float32)
            x = x + f.astype(np.float64) @ self.W(p + "ffn_down.weight").T.astype(np.float64)
        h = ref.rms_norm(x, self.W("output_norm.weight"), a.rms_eps)
        self.last_hidden = h      # the final-normed hidden states (what embeddings pool)
        if act_q8:
            h = qa(h.astype(np.float32)).astype(np.float64)
        out = self.W("output.weight") if self.mf.has("output.weight") else emb
        return (h @ out.T.astype(np.float64)).astype(np.float32)

    def hidden(self, tokens: list[int], kv: tuple[str, str] = ("f16", "f16")) -> np.ndarray:
        """(len(tokens), n_embd) final-normed hidden states of a sequence from position 0."""
        self.logits(tokens, kv=kv)
        return self.last_hidden

    def experts(self, p: str, h: np.ndarray) -> np.ndarray:
        """Each row through its top-k experts by router logit (ties to the lower
        index), weighted by the softmax of the chosen logits."""
        k = self.a.n_expert_used
        logits = h.astype(np.float64) @ self.W(p + "ffn_gate_inp.weight").T.astype(np.float64)
        gate, up = self.W(p + "ffn_gate_exps.weight"), self.W(p + "ffn_up_exps.weight")
        down = self.W(p + "ffn_down_exps.weight")
        out = np.zeros((len(h), down.shape[1]))
        for r in range(len(h)):
            ids = np.argsort(-logits[r], kind="stable")[:k]
            wts = np.exp(logits[r, ids] - logits[r, ids].max())
            wts /= wts.sum()
            for e, wt in zip(ids, wts):
                f = ref.silu(h[r] @ gate[e].T) * (h[r] @ up[e].T)
                out[r] += wt * (f.astype(np.float32).astype(np.float64) @ down[e].T.astype(np.float64))
        return out
