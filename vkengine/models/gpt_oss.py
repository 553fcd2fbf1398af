"""gpt-oss (OpenAI's gpt-oss-20b / 120b, GGUF arch "gpt-oss"): llama.cpp's
src/models/openai-moe.cpp, transformers' GptOssForCausalLM.

Per layer: RMSNorm; q, k, v with biases; NEOX RoPE with YaRN (the file's
factor and original context, llama.cpp's betas 32 / 1, cos and sin times
0.1 ln factor + 1); attention scaled by 1/sqrt(head size) with a learned sink
logit per query head (attn_sinks: one more term in the softmax's denominator,
with no value), over the last `window` positions (128) on every other layer
(layer 0 first, llama.cpp's pattern 2) and over all positions on the others;
the output projection's bias; the residual; RMSNorm (post_attention_norm);
a router with a bias choosing the top k experts by logit, weighted by the
softmax of those k logits; each expert's gate and up products with biases, the
clamped SwiGLU (gate <= 7, up in [-7, 7], gate * sigmoid(1.702 gate) * (up +
1)), its down product with a bias; their weighted sum into the residual. No
embedding scale; an untied output.

Experts are MXFP4 in released files (any weight type loads). The
sliding-window layers keep their KV rows in rings (KVCache rings, as Gemma's).
Hugging Face folders (MXFP4 blocks in their own layout) are not loaded yet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..arena import Arena
from ..errors import VkEngineError
from ..gguf_file import ModelFile, SafetensorsFolder
from ..graph import Graph
from ..kernels import Matrix, Region
from ..rope import Yarn, rope_table
from .base import Architecture, SlidingWindowArgs
from .gemma3 import swa_pattern
from .loader import WeightPlanner, expert_raw, gate_up_experts

SWIGLU_OAI = (1.702, 7.0)   # (alpha, limit): llama.cpp's openai-moe.cpp constants


@dataclass(frozen=True, kw_only=True)
class GptOssArgs(SlidingWindowArgs):
    n_expert_used: int
    n_ff_exp: int
    yarn: Yarn | None
    rope_attn_factor: float = 1.0

    @classmethod
    def from_file(cls, mf: ModelFile) -> GptOssArgs:
        if isinstance(mf, SafetensorsFolder):
            raise VkEngineError(f"{mf.path}: gpt-oss Hugging Face folders are not supported yet (its MXFP4 "
                                "experts' layout); use its GGUF")
        a, m = mf.arch, mf.meta
        n_embd = int(m(f"{a}.embedding_length"))
        n_head = int(m(f"{a}.attention.head_count"))
        n_layer = int(m(f"{a}.block_count"))
        hd = int(m(f"{a}.attention.key_length", n_embd // n_head))
        st = m(f"{a}.rope.scaling.type", None)
        if st not in (None, "none", "yarn"):
            raise VkEngineError(f"RoPE scaling type {st!r} is not supported for gpt-oss (yarn)")
        if float(m(f"{a}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0):
            raise VkEngineError("YaRN with rope.scaling.yarn_log_multiplier is not supported")
        yarn = Yarn(float(m(f"{a}.rope.scaling.factor")),
                    int(m(f"{a}.rope.scaling.original_context_length", m(f"{a}.context_length", 4096)))) \
            if st == "yarn" else None
        pat = m(f"{a}.attention.sliding_window_pattern", None)
        if pat is not None and not isinstance(pat, (int, float)):
            swa = tuple(bool(x) for x in pat)
            if len(swa) != n_layer:
                raise VkEngineError(f"{mf.path.name}: sliding_window_pattern lists {len(swa)} layers for {n_layer}")
        else:
            swa = swa_pattern(n_layer, int(pat) if pat is not None else 2)
        n_exp = int(m(f"{a}.expert_count"))
        k = int(m(f"{a}.expert_used_count"))
        if not 0 < k <= min(n_exp, 16):
            raise VkEngineError(f"{mf.path.name}: {k} of {n_exp} experts per token (1 to min(experts, 16) supported)")
        n_vocab = m(f"{a}.vocab_size", None) or mf.tensor_info("token_embd.weight")[1][0]
        return cls(
            n_vocab=int(n_vocab), n_embd=n_embd, n_layer=n_layer, n_head=n_head,
            n_head_kv=int(m(f"{a}.attention.head_count_kv", n_head)), head_dim=hd,
            n_rot=int(m(f"{a}.rope.dimension_count", hd)), rope_base=float(m(f"{a}.rope.freq_base", 10000.0)),
            rms_eps=float(m(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=int(m(f"{a}.context_length", 4096)), n_expert=n_exp, n_expert_used=k,
            n_ff_exp=int(m(f"{a}.expert_feed_forward_length", m(f"{a}.feed_forward_length", 0))),
            window=int(m(f"{a}.attention.sliding_window")), swa=swa, yarn=yarn,
            rope_attn_factor=float(m(f"{a}.rope.scaling.attn_factor", 1.0)))

    @property
    def qkv_width(self) -> int:
        return (self.n_head + 2 * self.n_head_kv) * self.head_dim


@dataclass
class Layer:
    attn_norm: Region
    qkv: list[tuple[Matrix, int]]
    qkv_bias: Region
    wo: Matrix
    wo_bias: Region
    sinks: Region
    post_norm: Region
    router: Matrix
    router_bias: Region
    gate_up: Matrix             # E*(2F) x D, per expert [gate | up]
    down: Matrix                # E*D x F
    gate_up_bias: Region        # E x 2F, per expert [gate | up]
    down_bias: Region           # E x D


@dataclass
class GptOssWeights:
    tok_embd: Matrix
    out_norm: Region
    output: Matrix
    layers: list[Layer]
    rope: Region
    arena: Arena


def _forward(g: Graph, a: GptOssArgs, w: GptOssWeights) -> None:
    g.embed(w.tok_embd, "x")
    scale = 1.0 / math.sqrt(a.head_dim)
    for i, L in enumerate(w.layers):
        g.rms_norm("x", L.attn_norm, "h")
        for m, col in L.qkv:
            g.matmul(m, "h", "qkv", col=col)
        g.add_bias("qkv", L.qkv_bias, a.qkv_width)
        g.rope_kv(i, "qkv", "q", a.n_head, a.n_head_kv, a.head_dim, a.n_rot, True)
        g.attention(i, "q", "att", a.n_head, a.n_head_kv, a.head_dim, scale, window=a.window if a.swa[i] else 0,
                    sinks=L.sinks)
        g.matmul(L.wo, "att", "t")
        g.add_bias("t", L.wo_bias, a.n_embd)
        g.add("x", "t", "x")
        g.rms_norm("x", L.post_norm, "h")
        g.matmul(L.router, "h", "rl")
        g.add_bias("rl", L.router_bias, a.n_expert)
        g.moe_route("rl", "route", a.n_expert, a.n_expert_used)
        g.routed_experts(L.gate_up, L.down, a.n_expert, a.n_expert_used, a.n_ff_exp,
                         biases=(L.gate_up_bias, L.down_bias), oai=SWIGLU_OAI)
    if g.n_out:
        g.rms_norm("x", w.out_norm, "out_h", gather=True)
        g.matmul(w.output, "out_h", "out_logits", no_epilogues=True)


def _stacked(parts, E: int) -> Any:
    """Per expert, the rows of each part side by side: [gate_e | up_e] for e < E
    (E = 1: the parts one after another)."""
    return lambda: np.concatenate([f().reshape(E, -1) for f in parts], axis=1).reshape(-1)


def _load_weights(mf: ModelFile, a: GptOssArgs, device, n_ctx: int) -> GptOssWeights:
    D, hd, E, F = a.n_embd, a.head_dim, a.n_expert, a.n_ff_exp
    p = WeightPlanner(mf, device)
    i_embd = p.matrix(["token_embd.weight"], [a.n_vocab], D)
    i_onorm = p.vector("output_norm.weight", D)
    i_out = p.matrix(["output.weight"], [a.n_vocab], D) if mf.has("output.weight") else i_embd
    table = rope_table(n_ctx, a.n_rot, a.rope_base, yarn=a.yarn)
    table = (table * np.float32(a.rope_attn_factor)).astype(np.float32)
    i_rope = p.vectors([("rope table", lambda: table, table.size)])[0]
    layers: list[dict[str, Any]] = []
    for i in range(a.n_layer):
        pre = f"blk.{i}."
        qkv_b = [p.value(pre + f"attn_{t}.bias", n) for t, n in
                 (("q", a.n_head * hd), ("k", a.n_head_kv * hd), ("v", a.n_head_kv * hd))]
        t_down, produce_down = expert_raw(p, pre, "down", E, D, F)
        layers.append(dict(
            attn_norm=p.vector(pre + "attn_norm.weight", D),
            qkv=p.fused([pre + "attn_q.weight", pre + "attn_k.weight", pre + "attn_v.weight"],
                        [a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], D),
            qkv_bias=p.vectors([(pre + "attn_qkv.bias", _stacked(qkv_b, 1), a.qkv_width)])[0],
            wo=p.matrix([pre + "attn_output.weight"], [D], a.n_head * hd),
            wo_bias=p.vector(pre + "attn_output.bias", D),
            sinks=p.vector(pre + "attn_sinks.weight", a.n_head),
            post_norm=p.vector(pre + "post_attention_norm.weight", D),
            router=p.matrix([pre + "ffn_gate_inp.weight"], [E], D),
            router_bias=p.vector(pre + "ffn_gate_inp.bias", E),
            gate_up=gate_up_experts(p, pre, E, F, D),
            down=p.matrix_raw(t_down, E * D, F, produce_down, pre + "ffn_down_exps", unit=D),
            gate_up_bias=p.vectors([(pre + "ffn_gate_up_exps.bias",
                                     _stacked([p.value(pre + "ffn_gate_exps.bias", E * F),
                                               p.value(pre + "ffn_up_exps.bias", E * F)], E), E * 2 * F)])[0],
            down_bias=p.vector(pre + "ffn_down_exps.bias", E * D)))
    b, arena = p.build(device)
    return GptOssWeights(
        tok_embd=b[i_embd], out_norm=b[i_onorm], output=b[i_out], rope=b[i_rope], arena=arena,
        layers=[Layer(**{k: ([(b[h], c) for h, c in v] if k == "qkv" else b[v])   # type: ignore[arg-type]
                         for k, v in L.items()}) for L in layers])


class GptOss(Architecture):
    names: ClassVar[tuple[str, ...]] = ("gpt-oss",)
    hf_architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    hf_names: ClassVar[dict[str, str]] = {}

    def args(self, mf: ModelFile) -> GptOssArgs:
        return GptOssArgs.from_file(mf)

    def scratch_widths(self, a: GptOssArgs) -> dict[str, Any]:
        if a.fixed_experts:
            raise VkEngineError("--fixed-experts and --experts-log are for the qwen35moe models")
        q = a.n_head * a.head_dim
        k, E = a.n_expert_used, a.n_expert
        return {"x": a.n_embd, "h": a.n_embd, "t": a.n_embd, "qkv": a.qkv_width, "q": q, "att": q,
                "rl": E, "route": 2 * k, "gu_e": k * 2 * a.n_ff_exp, "ff_e": k * a.n_ff_exp, "dn_e": k * a.n_embd,
                "elist": E, "ecnt": E, "out_h": a.n_embd, "out_logits": a.n_vocab}

    def load_weights(self, mf: ModelFile, a: GptOssArgs, device, n_ctx: int) -> GptOssWeights:
        return _load_weights(mf, a, device, n_ctx)

    def forward(self, g: Graph, a: GptOssArgs, w: GptOssWeights, hidden_rows: bool = False) -> None:
        if hidden_rows:
            raise VkEngineError("gpt-oss has no MTP block to feed hidden states to")
        _forward(g, a, w)


ARCHITECTURE = GptOss()
