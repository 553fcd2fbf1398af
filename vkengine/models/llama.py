"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral-style): RMSNorm, RoPE,
grouped-query attention over the KV cache, SwiGLU, tied or separate output head.
The dense Qwen families are this graph with one addition each (qwen2.py,
qwen3.py): q/k/v biases (Qwen2, Qwen2.5; llama GGUFs may carry them too) or a
per-head RMSNorm of q and k before RoPE (Qwen3), found by the tensors present.

GGUF llama weights rotate adjacent pairs (llama.cpp's converter permutes Q and K
rows: convert_hf_to_gguf.py LlamaModel.permute); Hugging Face checkpoints, and
Qwen GGUFs (llama.cpp's LLAMA_ROPE_TYPE_NEOX for qwen2/qwen3), rotate split
halves (NEOX). All load as they are and pick the matching RoPE mode.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..arena import Arena
from ..errors import VkEngineError
from ..gguf_file import ModelFile, SafetensorsFolder
from ..graph import Graph
from ..kernels import Matrix, Region
from ..rope import Yarn, rope_table
from .base import Architecture, ModelArgs, PartLayers
from .loader import WeightPlanner, built, expert_raw, gate_up_experts, plan_ends

# Hugging Face tensor names -> GGUF names (data; applied when a folder is opened)
HF_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"blk.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight": r"blk.\1.attn_q.weight",
    r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight": r"blk.\1.attn_k.weight",
    r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight": r"blk.\1.attn_v.weight",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight": r"blk.\1.attn_output.weight",
    # biases: q/k/v's are added (LlamaArgs.qkv_bias); the others mapped so that they are refused, not dropped
    r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.bias": r"blk.\1.attn_\2.bias",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.bias": r"blk.\1.attn_output.bias",
    r"model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.bias": r"blk.\1.ffn_\2.bias",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"blk.\1.ffn_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight": r"blk.\1.ffn_gate.weight",
    r"model\.layers\.(\d+)\.mlp\.up_proj\.weight": r"blk.\1.ffn_up.weight",
    r"model\.layers\.(\d+)\.mlp\.down_proj\.weight": r"blk.\1.ffn_down.weight",
}


# tensors some converters write for these architectures that the graph has no place for
UNREAD_TENSORS = ("blk.0.attn_output.bias", "blk.0.ffn_up.bias", "blk.0.ffn_down.bias", "blk.0.ffn_gate.bias",
                  "blk.0.attn_norm.bias", "blk.0.ffn_norm.bias", "output_norm.bias", "output.bias",
                  "blk.0.attn_qkv.bias")

# GGUF architectures whose Q/K rows are stored unpermuted (RoPE on split halves)
NEOX_GGUF = ("qwen2", "qwen3", "qwen3moe", "phi3")

# experts: the router, and experts as transformers 5 keeps them (fused: gate_up_proj
# (E, 2F, D) with [gate | up] per expert, down_proj (E, D, F)) or one tensor an
# expert (checkpoints on the hubs: Qwen3-MoE's mlp.experts.N, Mixtral's w1/w3/w2),
# stacked on load
HF_MOE_NAMES = {
    r"model\.layers\.(\d+)\.mlp\.gate\.weight": r"blk.\1.ffn_gate_inp.weight",
    r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj": r"blk.\1.ffn_gate_up_exps.weight",
    r"model\.layers\.(\d+)\.mlp\.experts\.down_proj": r"blk.\1.ffn_down_exps.weight",
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight": r"blk.\1.ffn_gate_exp.\2.weight",
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight": r"blk.\1.ffn_up_exp.\2.weight",
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight": r"blk.\1.ffn_down_exp.\2.weight",
    r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight": r"blk.\1.ffn_gate_inp.weight",
    r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w1\.weight": r"blk.\1.ffn_gate_exp.\2.weight",
    r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w3\.weight": r"blk.\1.ffn_up_exp.\2.weight",
    r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.w2\.weight": r"blk.\1.ffn_down_exp.\2.weight",
}


@dataclass(frozen=True, kw_only=True)
class LlamaArgs(ModelArgs):
    n_ff: int
    rope_freq_scale: float
    rope_neox: bool           # True for Hugging Face layout and the NEOX_GGUF architectures
    qkv_bias: bool = False    # q, k and v biases (blk.N.attn_{q,k,v}.bias)
    qk_norm: bool = False     # a per-head RMSNorm of q and k before RoPE (blk.N.attn_{q,k}_norm.weight)
    n_expert_used: int = 0    # (n_expert > 0: every layer's FFN a mixture of experts) experts a token takes
    n_ff_exp: int = 0         # an expert's FFN width
    # LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini): frequencies divided by the long factors where a
    # sequence's context exceeds rope_orig_ctx, else by the short ones; cos and sin times rope_attn_factor
    rope_long: tuple[float, ...] = ()
    rope_short: tuple[float, ...] = ()
    rope_orig_ctx: int = 0
    rope_attn_factor: float = 1.0
    yarn: Yarn | None = None  # YaRN context extension (rope_scaling yarn; GGUF rope.scaling.type yarn)

    def rope_factors(self, n_ctx: int):
        """The frequency divisors of a context of n_ctx positions (llama.cpp:
        the long ones where n_ctx exceeds the original context), or None."""
        if not self.rope_long:
            return None
        return np.asarray(self.rope_long if n_ctx > self.rope_orig_ctx else self.rope_short, np.float32)

    def check_experts(self, what: str) -> None:
        if self.n_expert and not 0 < self.n_expert_used <= min(self.n_expert, 16):
            raise VkEngineError(f"{what}: {self.n_expert_used} of {self.n_expert} experts per token (1 to "
                                f"min(experts, 16) supported)")
        if self.n_expert and self.n_ff_exp <= 0:
            raise VkEngineError(f"{what}: invalid model metadata: expert FFN width {self.n_ff_exp}")

    @classmethod
    def from_file(cls, mf: ModelFile) -> LlamaArgs:
        if isinstance(mf, SafetensorsFolder):
            c = mf.config
            n_head = int(c["num_attention_heads"])
            hd = int(c.get("head_dim") or c["hidden_size"] // n_head)
            if c.get("use_sliding_window"):
                raise VkEngineError("sliding-window attention (use_sliding_window) is not supported for this "
                                    "architecture")
            rs = c.get("rope_scaling") or {}
            scale = 1.0
            longrope: dict[str, Any] = {}
            rtype = rs.get("rope_type", rs.get("type")) if rs else None
            if rtype == "longrope":
                # transformers' _compute_longrope_parameters
                orig = int(c.get("original_max_position_embeddings") or rs["original_max_position_embeddings"])
                factor = float(c["max_position_embeddings"]) / orig
                attn = float(rs["attention_factor"]) if rs.get("attention_factor") is not None else (
                    math.sqrt(1 + math.log(factor) / math.log(orig)) if factor > 1 else 1.0)
                longrope = dict(rope_long=tuple(float(x) for x in rs["long_factor"]),
                                rope_short=tuple(float(x) for x in rs["short_factor"]), rope_orig_ctx=orig,
                                rope_attn_factor=attn)
            elif rtype == "yarn":
                hf_yarn = Yarn.from_hf(rs, c)
                longrope = dict(yarn=hf_yarn)
                scale = 1.0 / hf_yarn.factor
            elif rs:
                if rtype != "linear":
                    raise VkEngineError(f"rope_scaling {rs} is not supported (linear, longrope, yarn)")
                scale = 1.0 / float(rs["factor"])
            n_rot = int(hd * float(c.get("partial_rotary_factor", 1.0)))
            n_exp = int(c.get("num_experts") or c.get("num_local_experts") or 0)
            if n_exp:
                if c.get("norm_topk_prob") is False:
                    raise VkEngineError("norm_topk_prob false (top-k expert weights not renormalized) is not "
                                        "supported")
                if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
                    raise VkEngineError("dense FFN layers among the expert layers (mlp_only_layers, "
                                        "decoder_sparse_step) are not supported")
            return cls(
                n_vocab=int(c["vocab_size"]), n_embd=int(c["hidden_size"]), n_layer=int(c["num_hidden_layers"]),
                n_ff=int(c["intermediate_size"]), n_head=n_head,
                n_head_kv=int(c.get("num_key_value_heads") or n_head), head_dim=hd, n_rot=n_rot, **longrope,
                rope_base=float(c.get("rope_theta", 10000.0)), rope_freq_scale=scale,
                rms_eps=float(c.get("rms_norm_eps", 1e-6)),
                n_ctx_train=int(c.get("max_position_embeddings", 4096)), rope_neox=True,
                qkv_bias=mf.has("blk.0.attn_q.bias"), qk_norm=mf.has("blk.0.attn_q_norm.weight"),
                n_expert=n_exp, n_expert_used=int(c.get("num_experts_per_tok", 0) or 0) if n_exp else 0,
                n_ff_exp=int(c.get("moe_intermediate_size") or c["intermediate_size"]) if n_exp else 0)
        a = mf.arch
        m = mf.meta
        n_embd = int(m(f"{a}.embedding_length"))
        n_head = int(m(f"{a}.attention.head_count"))
        hd = int(m(f"{a}.attention.key_length", n_embd // n_head))
        scale = 1.0
        st = m(f"{a}.rope.scaling.type", None)
        if st not in (None, "none", "linear", "yarn"):
            raise VkEngineError(f"RoPE scaling type {st!r} is not supported (linear, yarn)")
        yarn: dict[str, Any] = {}
        if st == "linear":
            scale = 1.0 / float(m(f"{a}.rope.scaling.factor"))
        elif st == "yarn":
            # llama.cpp's llama/qwen2/qwen3: its default betas (32, 1), the original context from the file,
            # cos and sin times (0.1 ln factor + 1) and the file's rope.scaling.attn_factor
            if float(m(f"{a}.rope.scaling.yarn_log_multiplier", 0.0) or 0.0):
                raise VkEngineError("YaRN with rope.scaling.yarn_log_multiplier is not supported")
            factor = float(m(f"{a}.rope.scaling.factor"))
            scale = 1.0 / factor
            yarn = dict(yarn=Yarn(factor, int(m(f"{a}.rope.scaling.original_context_length",
                                                 m(f"{a}.context_length", 4096)))),
                        rope_attn_factor=float(m(f"{a}.rope.scaling.attn_factor", 1.0)))
        n_vocab = m(f"{a}.vocab_size", None)
        if n_vocab is None:
            n_vocab = mf.tensor_info("token_embd.weight")[1][0]
        n_exp = int(m(f"{a}.expert_count", 0))
        n_ff = int(m(f"{a}.feed_forward_length", 0) if n_exp else m(f"{a}.feed_forward_length"))
        longrope = {}
        if mf.has("rope_factors_long.weight"):      # LongRoPE (llama.cpp: phi3's rope_long / rope_short)
            longrope = dict(
                rope_long=tuple(float(x) for x in mf.tensor("rope_factors_long.weight").as_f32().reshape(-1)),
                rope_short=tuple(float(x) for x in mf.tensor("rope_factors_short.weight").as_f32().reshape(-1)),
                rope_orig_ctx=int(m(f"{a}.rope.scaling.original_context_length")),
                rope_attn_factor=float(m(f"{a}.rope.scaling.attn_factor", 1.0)))
        return cls(
            n_vocab=int(n_vocab), n_embd=n_embd, n_layer=int(m(f"{a}.block_count")),
            n_ff=n_ff, n_head=n_head,
            n_head_kv=int(m(f"{a}.attention.head_count_kv", n_head)), head_dim=hd,
            n_rot=int(m(f"{a}.rope.dimension_count", hd)), rope_base=float(m(f"{a}.rope.freq_base", 10000.0)),
            rope_freq_scale=scale, rms_eps=float(m(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=int(m(f"{a}.context_length", 4096)), rope_neox=a in NEOX_GGUF, **longrope, **yarn,
            qkv_bias=mf.has("blk.0.attn_q.bias"), qk_norm=mf.has("blk.0.attn_q_norm.weight"),
            n_expert=n_exp, n_expert_used=int(m(f"{a}.expert_used_count", 0)) if n_exp else 0,
            n_ff_exp=int(m(f"{a}.expert_feed_forward_length", n_ff)) if n_exp else 0)

    @property
    def qkv_width(self) -> int:
        return (self.n_head + 2 * self.n_head_kv) * self.head_dim


@dataclass
class Experts:
    """A layer's mixture of experts (LlamaArgs.n_expert): routed only, top-k of
    a softmax, renormalized (Mixtral, Qwen3-MoE)."""
    router: Matrix          # E x D
    gate_up: Matrix         # E*(2*n_ff_exp) x D, per expert [gate | up]
    down: Matrix            # E*D x n_ff_exp


@dataclass
class Layer:
    attn_norm: Region
    qkv: list[tuple[Matrix, int]]        # (matrix, first output column): fused or q, k, v
    wo: Matrix
    ffn_norm: Region
    gate_up: list[tuple[Matrix, int]]    # (dense FFN; empty with experts)
    down: Matrix | None
    experts: Experts | None = None
    qkv_bias: Region | None = None       # q|k|v biases, one vector (LlamaArgs.qkv_bias)
    q_norm: Region | None = None         # per-head q and k norm weights (LlamaArgs.qk_norm), in the
    k_norm: Region | None = None         # RoPE table's buffer (norm_rope_kv binds them together)


@dataclass
class LlamaWeights(PartLayers[Layer]):
    tok_embd: Matrix | None     # (None: parts of a split model other than the first and, unless the
    out_norm: Region | None     # head reuses the embedding, the last; the head on the last part only)
    output: Matrix | None
    layers: list[Layer | None]  # (None: a layer another part holds)
    rope: Region
    arena: Arena
    # a split model's part before the last: the next part's first layer's norm and its readers (whose kernels
    # decide, as in the whole model, whether that norm is split with them: _forward)
    next_norm: Region | None = None
    next_qkv: list[tuple[Matrix, int]] | None = None


def _scratch_widths(a: LlamaArgs) -> dict[str, int]:
    return {"x": a.n_embd, "h": a.n_embd, "qkv": a.qkv_width, "q": a.n_head * a.head_dim,
            "att": a.n_head * a.head_dim, "gu": 2 * a.n_ff, "ff": a.n_ff,
            "out_h": a.n_embd, "out_logits": a.n_vocab,
            "norm_slots": -(-a.n_embd // 4),   # sums of squares per 4 values (Graph.residual_norm)
            # h' as 8-bit blocks for an XQ8 gate|up (Graph._q8_out) and its producer's zeroed counters
            "norm_q8": a.n_embd // 2 + a.n_embd // 16, "norm_q8_sync": -(-a.n_embd // 32),
            **(_moe_widths(a) if a.n_expert else {})}


def _moe_widths(a: LlamaArgs) -> dict[str, int]:
    """The expert FFN's arrays: router logits, (ids, weights), each routed
    expert's [gate | up], SwiGLU and output, moe_sort's lists, counts and work list."""
    k, E = a.n_expert_used, a.n_expert
    return {"rl": E, "route": 2 * k, "gu_e": k * 2 * a.n_ff_exp, "ff_e": k * a.n_ff_exp, "dn_e": k * a.n_embd,
            "elist": E, "ecnt": E, "eblk": 2 * k + 1, "rt_sync": 1}


def _experts(g: Graph, a: LlamaArgs, X: Experts, next_norm: Region | None) -> bool:
    """x[r] += the routed experts' SwiGLU FFNs of h[r], weighted (Graph.routed_experts, as qwen35moe's).
    next_norm: the next layer's attention norm, into h, which the experts' down
    projection takes where it runs fused (mul_mv_id's COMBINE: decode rows on
    GPUs); returns whether it did."""
    g.router(X.router, "h", "rl", "route", a.n_expert, a.n_expert_used)
    return g.routed_experts(X.gate_up, X.down, a.n_expert, a.n_expert_used, a.n_ff_exp,
                            norm=(next_norm, "h") if next_norm is not None else None)


def _forward(g: Graph, a: LlamaArgs, w: LlamaWeights) -> None:
    """One step: g.n token rows through every layer; logits for the g.n_out
    requested rows into out_logits. A part of a split model (a.part) runs its
    own layers: the first embeds the tokens; the others start from what the
    part before handed over (x, and the norm of their first layer in h:
    _next); the last runs the head."""
    run = a.part_layers
    # The RMSNorms after the residual adds: split between the add's matvec and
    # the matvecs that read them where they can (Graph.residual_norm: decode
    # steps on GPUs; att_in/ffn_in the sums of squares those take), else fused
    # into the add, else dispatches of their own
    if a.first_part:
        assert w.tok_embd is not None
        g.embed(w.tok_embd, "x")
        g.rms_norm("x", w.layer(run.start).attn_norm, "h")
        att_in = None
    else:
        att_in = g.handed_norm_in()
    for i in run:
        L = w.layer(i)
        if L.q_norm is not None or L.qkv_bias is not None:
            # q|k|v into qkv, then (biases added) RoPE and the cache write: the
            # matvecs' fused RoPE epilogue has neither a bias nor a norm
            if L.qkv_bias is not None:   # (in the matvecs where they can: Graph.matmuls_bias)
                g.matmuls_bias(L.qkv, "h", "qkv", L.qkv_bias, a.qkv_width, norm_in=att_in)
            else:
                for m, col in L.qkv:
                    g.matmul(m, "h", "qkv", col=col, norm_in=att_in)
            if L.q_norm is not None and L.k_norm is not None:
                if not a.rope_neox:
                    raise VkEngineError("q/k norms with adjacent-pair RoPE are not supported")
                g.norm_rope_kv(i, "qkv", "q", w.rope, L.q_norm, L.k_norm, a.n_head, a.n_head_kv, a.head_dim,
                               a.n_rot, gated=False)
            else:
                g.rope_kv(i, "qkv", "q", a.n_head, a.n_head_kv, a.head_dim, a.n_rot, a.rope_neox)
        else:
            g.qkv_rope(i, L.qkv, "h", "qkv", "q", a.n_head, a.n_head_kv, a.head_dim, a.n_rot, a.rope_neox,
                       norm_in=att_in)
        g.attention(i, "q", "att", a.n_head, a.n_head_kv, a.head_dim, 1.0 / math.sqrt(a.head_dim))
        nxt = _next(w, i, run)
        if L.experts is not None:
            # the router and the expert products take the normalized h
            g.matmul_norm(L.wo, "att", "x", L.ffn_norm, "h")
            att_in = None
            if not _experts(g, a, L.experts, nxt[0] if nxt is not None else None) and nxt is not None:
                g.rms_norm("x", nxt[0], "h")
            continue
        assert L.down is not None
        ffn_in = g.residual_norm(L.wo, "att", "x", L.ffn_norm, "h", [L.gate_up], glu_reader=True)
        # (a prompt step's SwiGLU may reach the down projection as halves only: ff_h)
        ff_h = g.gate_up_swiglu(L.gate_up, "h", "gu", "ff", norm_in=ffn_in, down=L.down)
        if nxt is not None:
            att_in = g.residual_norm(L.down, "ff", "x", nxt[0], "h", [nxt[1]], x_halves=ff_h)
        else:
            g.matmul(L.down, "ff", "x", accumulate=True, x_halves=ff_h)
    if g.n_out:
        assert w.out_norm is not None and w.output is not None
        g.rms_norm("x", w.out_norm, "out_h", gather=True)
        g.matmul(w.output, "out_h", "out_logits", no_epilogues=True)


def _next(w: LlamaWeights, i: int, run: range) -> tuple[Region, list[tuple[Matrix, int]]] | None:
    """The norm and q|k|v of the layer after layer i: the part's own, the next
    part's first (a part before the last computes that layer's norm as the
    whole model does, and hands it over), or None after the model's last."""
    if i + 1 < run.stop:
        nxt = w.layer(i + 1)
        return nxt.attn_norm, nxt.qkv
    if w.next_norm is not None and w.next_qkv is not None:
        return w.next_norm, w.next_qkv
    return None


def _hands_norm(g: Graph, a: LlamaArgs, w: LlamaWeights) -> bool:
    """Whether _forward's last layer of this part splits the next layer's norm (Architecture.hands_norm)."""
    L = w.layer(a.part_layers.stop - 1)
    if L.experts is not None or L.down is None or w.next_norm is None or w.next_qkv is None:
        return False
    return g.splits_norm(L.down, "ff", "x", w.next_norm, "h", [w.next_qkv])


# -- loading ----------------------------------------------------------------------

def _concat(parts: list[Callable[[], np.ndarray]]) -> Callable[[], np.ndarray]:
    """The values of several tensors, one after another (produced at build time)."""
    return lambda: np.concatenate([f() for f in parts])


def _down_experts(p: WeightPlanner, pre: str, a: LlamaArgs) -> int:
    """E*D x n_ff_exp: every expert's down projection, stacked."""
    t, produce = expert_raw(p, pre, "down", a.n_expert, a.n_embd, a.n_ff_exp)
    return p.matrix_raw(t, a.n_expert * a.n_embd, a.n_ff_exp, produce, pre + "ffn_down_exps", unit=a.n_embd)


def _plan_qkv(p: WeightPlanner, mf: ModelFile, pre: str, a: LlamaArgs) -> list[tuple[int, int]]:
    hd = a.head_dim
    if mf.has(pre + "attn_qkv.weight"):
        return [(p.matrix([pre + "attn_qkv.weight"], [a.qkv_width], a.n_embd), 0)]
    return p.fused([pre + "attn_q.weight", pre + "attn_k.weight", pre + "attn_v.weight"],
                   [a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd], a.n_embd)


def _load_weights(mf: ModelFile, a: LlamaArgs, device, n_ctx: int) -> LlamaWeights:
    """Plan, allocate and upload every weight (kept quantized)."""
    D, F, hd = a.n_embd, a.n_ff, a.head_dim
    p = WeightPlanner(mf, device)
    i_embd, i_onorm, i_out = plan_ends(p, mf, a)
    freq_factors = mf.tensor("rope_freqs.weight").as_f32() if mf.has("rope_freqs.weight") else None
    if a.rope_long:
        freq_factors = a.rope_factors(n_ctx)
        if freq_factors.size != a.n_rot // 2:
            raise VkEngineError(f"{mf.path.name}: {freq_factors.size} LongRoPE factors for {a.n_rot} rotated dims")
    table = rope_table(n_ctx, a.n_rot, a.rope_base, a.rope_freq_scale, freq_factors, yarn=a.yarn)
    table = (table * np.float32(a.rope_attn_factor)).astype(np.float32)
    # the RoPE table and every q/k norm weight in one buffer (norm_rope_kv binds them together)
    entries = [("rope table", lambda: table, table.size)]
    if a.qk_norm:
        for i in range(a.n_layer):   # (every layer's: small, and the table's indices stay the layer's)
            for t in ("attn_q_norm", "attn_k_norm"):
                name = f"blk.{i}.{t}.weight"
                entries.append((name, p.value(name, hd), hd))
    i_table = p.vectors(entries)
    i_rope = i_table[0]
    layers: list[dict[str, Any] | None] = []
    for i in range(a.n_layer):
        if not a.owns(i):
            layers.append(None)
            continue
        pre = f"blk.{i}."
        bias = None
        if a.qkv_bias:
            parts = [p.value(pre + f"attn_{t}.bias", n) for t, n in
                     (("q", a.n_head * hd), ("k", a.n_head_kv * hd), ("v", a.n_head_kv * hd))]
            bias = p.vectors([(pre + "attn_qkv.bias", _concat(parts), a.qkv_width)])[0]
        layers.append(dict(
            qkv_bias=bias, q_norm=i_table[1 + 2 * i] if a.qk_norm else None,
            k_norm=i_table[2 + 2 * i] if a.qk_norm else None,
            attn_norm=p.vector(pre + "attn_norm.weight", D),
            qkv=_plan_qkv(p, mf, pre, a),
            wo=p.matrix([pre + "attn_output.weight"], [D], a.n_head * hd),
            ffn_norm=p.vector(pre + "ffn_norm.weight", D),
            **(dict(router=p.matrix([pre + "ffn_gate_inp.weight"], [a.n_expert], D),
                    gate_up_exps=gate_up_experts(p, pre, a.n_expert, a.n_ff_exp, D),
                    down_exps=_down_experts(p, pre, a)) if a.n_expert else
               dict(gate_up=p.fused([pre + "ffn_gate.weight", pre + "ffn_up.weight"], [F, F], D)
                    if mf.has(pre + "ffn_gate.weight") else     # phi3: [gate | up] in one ffn_up
                    [(p.matrix([pre + "ffn_up.weight"], [2 * F], D), 0)],
                    down=p.matrix([pre + "ffn_down.weight"], [D], F)))))
    nxt = None
    if a.part is not None and not a.part.last:   # (a copy of one layer's q|k|v: the boundary's choice, _forward)
        pre = f"blk.{a.part.stop}."
        nxt = (p.vector(pre + "attn_norm.weight", D), _plan_qkv(p, mf, pre, a))
    b, arena = p.build(device)
    return LlamaWeights(
        next_norm=b[nxt[0]] if nxt else None, next_qkv=[(b[h], c) for h, c in nxt[1]] if nxt else None,
        tok_embd=built(b, i_embd), out_norm=built(b, i_onorm), output=built(b, i_out), rope=b[i_rope], arena=arena,
        layers=[Layer(attn_norm=b[L["attn_norm"]], qkv=[(b[h], c) for h, c in L["qkv"]], wo=b[L["wo"]],
                      ffn_norm=b[L["ffn_norm"]], gate_up=[(b[h], c) for h, c in L.get("gate_up", [])],
                      down=b[L["down"]] if "down" in L else None,
                      experts=Experts(b[L["router"]], b[L["gate_up_exps"]], b[L["down_exps"]])
                      if "router" in L else None,
                      qkv_bias=b[L["qkv_bias"]] if L["qkv_bias"] is not None else None,
                      q_norm=b[L["q_norm"]] if L["q_norm"] is not None else None,
                      k_norm=b[L["k_norm"]] if L["k_norm"] is not None else None)
                if L is not None else None for L in layers])


class Llama(Architecture):
    names: ClassVar[tuple[str, ...]] = ("llama",)
    hf_architectures: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")
    hf_names = {**HF_NAMES, **HF_MOE_NAMES}
    splittable = True
    handoff = ("x", "h", "norm_slots")   # (h: the next layer's norm, or h' with its sums of squares)

    def args(self, mf: ModelFile) -> LlamaArgs:
        a = LlamaArgs.from_file(mf)
        a.check_experts(mf.path.name)
        # tensors this graph would not read: refused rather than silently left out
        unread = [n for n in UNREAD_TENSORS if mf.has(n)]
        if unread:
            raise VkEngineError(f"{mf.path.name}: {', '.join(unread)} (biases or norms this architecture's graph "
                                "does not apply) are not supported")
        return a

    def scratch_widths(self, a: LlamaArgs) -> dict[str, int]:
        if a.fixed_experts:
            raise VkEngineError("--fixed-experts and --experts-log are for the qwen35moe models; this "
                                "architecture's router runs as the model's matmul")
        return _scratch_widths(a)

    def load_weights(self, mf: ModelFile, a: LlamaArgs, device, n_ctx: int) -> LlamaWeights:
        return _load_weights(mf, a, device, n_ctx)

    def forward(self, g: Graph, a: LlamaArgs, w: LlamaWeights, hidden_rows: bool = False) -> None:
        if hidden_rows:
            raise VkEngineError("llama models have no MTP block to feed hidden states to")
        _forward(g, a, w)

    def hands_norm(self, g: Graph, a: LlamaArgs, w: LlamaWeights) -> bool:
        return _hands_norm(g, a, w)

    def holds_tensor(self, a: ModelArgs, name: str) -> bool:
        # (a part before the last: also the next part's first layer's norm and q|k|v, _load_weights)
        if super().holds_tensor(a, name):
            return True
        if a.part is None or a.part.last:
            return False
        pre = f"blk.{a.part.stop}."
        return name in [pre + t + ".weight" for t in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv")]


ARCHITECTURE = Llama()
