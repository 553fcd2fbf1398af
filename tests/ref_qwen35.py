"""numpy reference forward pass of Qwen3.5 dense / MoE GGUF models (tests only).

Written independently of the engine's graph, from the layer definitions of
Hugging Face's modeling_qwen3_5(_moe).py and llama.cpp's qwen35(moe).cpp: whole
sequences from position 0, weights dequantized with the `gguf` package, float64
math, linear attention by the token recurrence, full attention over the whole
prefix. K and V are rounded as the engine's KV cache stores them (f16, or
q8_0 blocks: `kv`).
GGUF conventions: value heads tiled over key heads, norms with +1 folded in
(except ssm_norm), ssm_a = -exp(A_log).
"""
from __future__ import annotations

import numpy as np

from vkengine.gguf_file import ModelFile
from vkengine.rope import rope_table

from . import reference as ref
from . import reference_hybrid as rh


class RefQwen35:
    def __init__(self, mf: ModelFile, args, kv: tuple[str, str] = ("f16", "f16")):
        self.a = args
        self.kv = kv   # the KV cache's K and V types
        self.mf = mf
        self.w: dict[str, np.ndarray] = {}
        self.table = rope_table(4096, args.n_rot, args.rope_base)
        self.expert_choices: list[np.ndarray] = []     # (rows, k) ids per MoE layer of the last forward

    def W(self, name: str) -> np.ndarray:
        if name not in self.w:
            self.w[name] = self.mf.tensor(name).as_f32().astype(np.float64)
        return self.w[name]

    def _full_attn(self, p: str, h: np.ndarray, pos: np.ndarray) -> np.ndarray:
        a = self.a
        n, H, Hkv, hd = len(h), a.n_head, a.n_head_kv, a.head_dim
        qg = (h @ self.W(p + "attn_q.weight").T).reshape(n, H, 2, hd)
        q, gate = qg[:, :, 0], qg[:, :, 1]
        k = (h @ self.W(p + "attn_k.weight").T).reshape(n, Hkv, hd)
        v = (h @ self.W(p + "attn_v.weight").T).reshape(n, Hkv, hd)
        q = rh.rope_neox(rh.rms_norm(q, self.W(p + "attn_q_norm.weight"), a.rms_eps), pos[:, None], a.n_rot,
                         self.table)
        k = rh.rope_neox(rh.rms_norm(k, self.W(p + "attn_k_norm.weight"), a.rms_eps), pos[:, None], a.n_rot,
                         self.table)
        k16 = ref.kv_round(k.astype(np.float32), self.kv[0]).astype(np.float64)
        v16 = ref.kv_round(v.astype(np.float32), self.kv[1]).astype(np.float64)
        att = np.stack([ref.attention(q[t], k16[: t + 1], v16[: t + 1], 1.0 / np.sqrt(hd)) for t in range(n)])
        att = att.astype(np.float64) * rh.sigmoid(gate)
        return att.reshape(n, H * hd) @ self.W(p + "attn_output.weight").T

    def _linear_attn(self, p: str, h: np.ndarray) -> np.ndarray:
        a = self.a
        n, nk, nv, dk, dv = len(h), a.nk, a.nv, a.dk, a.dv
        qkv = h @ self.W(p + "attn_qkv.weight").T
        z = (h @ self.W(p + "attn_gate.weight").T).reshape(n, nv, dv)
        beta_raw = h @ self.W(p + "ssm_beta.weight").T
        alpha = h @ self.W(p + "ssm_alpha.weight").T
        conv_w = self.W(p + "ssm_conv1d.weight").reshape(a.conv_dim, a.conv_kernel)
        y, _ = rh.conv1d(qkv, conv_w, np.zeros((a.conv_kernel - 1, a.conv_dim)))
        q = rh.l2_norm(y[:, : nk * dk].reshape(n, nk, dk))
        k = rh.l2_norm(y[:, nk * dk: 2 * nk * dk].reshape(n, nk, dk))
        v = y[:, 2 * nk * dk:].reshape(n, nv, dv)
        hm = rh.head_map(nv, nk, a.v_heads_tiled)
        g, beta = rh.gdn_gates(alpha, beta_raw, self.W(p + "ssm_a"), self.W(p + "ssm_dt.bias"))
        o, _, _ = rh.delta_rule_recurrent(q[:, hm], k[:, hm], v, g, beta, np.zeros((nv, dk, dv)), dk ** -0.5)
        o = rh.gated_rms_norm(o, z, self.W(p + "ssm_norm.weight"), a.rms_eps)
        return o.reshape(n, nv * dv) @ self.W(p + "ssm_out.weight").T

    def _swiglu(self, h, gate, up, down):
        return (rh.silu(h @ gate.T) * (h @ up.T)) @ down.T

    def _ffn(self, p: str, h: np.ndarray) -> np.ndarray:
        a = self.a
        if not a.moe:
            return self._swiglu(h, self.W(p + "ffn_gate.weight"), self.W(p + "ffn_up.weight"),
                                self.W(p + "ffn_down.weight"))
        logits = h @ self.W(p + "ffn_gate_inp.weight").T
        ids, wts = rh.route(logits, a.n_expert_used, a.expert_weights_scale)
        self.expert_choices.append(ids)
        G, U, Dn = self.W(p + "ffn_gate_exps.weight"), self.W(p + "ffn_up_exps.weight"), \
            self.W(p + "ffn_down_exps.weight")
        out = np.zeros_like(h)
        for r in range(len(h)):
            for e, wt in zip(ids[r], wts[r]):
                out[r] += wt * self._swiglu(h[r:r + 1], G[e], U[e], Dn[e])[0]
        sh = self._swiglu(h, self.W(p + "ffn_gate_shexp.weight"), self.W(p + "ffn_up_shexp.weight"),
                          self.W(p + "ffn_down_shexp.weight"))
        return out + rh.sigmoid(h @ self.W(p + "ffn_gate_inp_shexp.weight").reshape(-1, 1)) * sh

    def _block(self, p: str, kind: str, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        a = self.a
        h = rh.rms_norm(x, self.W(p + "attn_norm.weight"), a.rms_eps)
        x = x + (self._linear_attn(p, h) if kind == "linear" else self._full_attn(p, h, pos))
        h = rh.rms_norm(x, self.W(p + "post_attention_norm.weight"), a.rms_eps)
        return x + self._ffn(p, h)

    def forward(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(logits (n, V), final-normed hidden states (n, D)) of a sequence from position 0."""
        a = self.a
        self.expert_choices = []
        emb = self.W("token_embd.weight")
        x = emb[np.asarray(tokens)]
        pos = np.arange(len(tokens))
        for i, kind in enumerate(a.layer_types):
            x = self._block(f"blk.{i}.", kind, x, pos)
        hn = rh.rms_norm(x, self.W("output_norm.weight"), a.rms_eps)
        out = self.W("output.weight") if self.mf.has("output.weight") else emb
        return hn @ out.T, hn

    def logits(self, tokens: list[int]) -> np.ndarray:
        return self.forward(tokens)[0].astype(np.float32)

    def mtp_logits(self, tokens: list[int], hidden: np.ndarray) -> np.ndarray:
        """The MTP block at every position p of a sequence: token p with the main
        model's hidden state at p-1 (zeros at 0) -> logits for token p+1's successor
        (llama.cpp qwen35.cpp graph_mtp; common/speculative.cpp pairs the rows)."""
        a = self.a
        p = f"blk.{a.n_layer}."
        emb = self.W("token_embd.weight")
        e = rh.rms_norm(emb[np.asarray(tokens)], self.W(p + "nextn.enorm.weight"), a.rms_eps)
        prev = np.concatenate([np.zeros((1, a.n_embd)), hidden[:-1]])
        hh = rh.rms_norm(prev, self.W(p + "nextn.hnorm.weight"), a.rms_eps)
        x = np.concatenate([e, hh], 1) @ self.W(p + "nextn.eh_proj.weight").T
        x = self._block(p, "full", x, np.arange(len(tokens)))
        hn_name = p + "nextn.shared_head_norm.weight"
        hn = rh.rms_norm(x, self.W(hn_name if self.mf.has(hn_name) else "output_norm.weight"), a.rms_eps)
        out = self.W("output.weight") if self.mf.has("output.weight") else emb
        return (hn @ out.T).astype(np.float32)
