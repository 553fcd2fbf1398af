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

Hugging Face folders (openai/gpt-oss-20b, -120b): the experts' MXFP4 blocks
and exponents (`*_blocks`, `*_scales`, transformers' Mxfp4GptOssExperts
layout) are repacked into GGUF's MXFP4 blocks on load, bit for bit (nibble
pairs to halves, quant.mxfp4_from_hf); dequantized checkpoints (bf16
`gate_up_proj` (E, D, 2F), `down_proj` (E, F, D), x @ W) load as they are.
gate_up's rows (columns when dequantized) alternate gate and up (HF's
gate_up[..., ::2] and [..., 1::2]), biases likewise. YaRN's correction range
is taken unrounded where the config says `truncate: false` (as the released
config does; llama.cpp's GGUFs round it).
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
from ..quant import mxfp4_from_hf
from ..rope import Yarn, rope_table
from .base import Architecture, PartLayers, SlidingWindowArgs
from .gemma3 import hf_layer_kinds, swa_pattern
from .loader import WeightPlanner, built, expert_raw, gate_up_experts, plan_ends

SWIGLU_OAI = (1.702, 7.0)   # (alpha, limit): llama.cpp's openai-moe.cpp constants

# Hugging Face tensor names -> GGUF names; the experts' tensors keep HF's layout
# under names of their own (.blocks/.scales: MXFP4; .weight: dequantized, x @ W)
HF_NAMES = {
    r"model\.embed_tokens\.weight": "token_embd.weight",
    r"model\.norm\.weight": "output_norm.weight",
    r"lm_head\.weight": "output.weight",
    r"model\.layers\.(\d+)\.input_layernorm\.weight": r"blk.\1.attn_norm.weight",
    r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)": r"blk.\1.attn_\2.\3",
    r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)": r"blk.\1.attn_output.\2",
    r"model\.layers\.(\d+)\.self_attn\.sinks": r"blk.\1.attn_sinks.weight",
    r"model\.layers\.(\d+)\.post_attention_layernorm\.weight": r"blk.\1.post_attention_norm.weight",
    r"model\.layers\.(\d+)\.mlp\.router\.(weight|bias)": r"blk.\1.ffn_gate_inp.\2",
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj_(blocks|scales|bias)": r"blk.\1.ffn_\2_exps.\3",
    r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj": r"blk.\1.ffn_\2_exps.weight",
}


@dataclass(frozen=True, kw_only=True)
class GptOssArgs(SlidingWindowArgs):
    n_expert_used: int
    n_ff_exp: int
    yarn: Yarn | None
    rope_attn_factor: float = 1.0

    @classmethod
    def from_file(cls, mf: ModelFile) -> GptOssArgs:
        if isinstance(mf, SafetensorsFolder):
            return _hf_args(mf)
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


def _hf_args(mf: SafetensorsFolder) -> GptOssArgs:
    """transformers' GptOssConfig (config.json of openai/gpt-oss-20b and -120b)."""
    c = mf.config
    q = c.get("quantization_config") or {}
    if q and q.get("quant_method") != "mxfp4":
        raise VkEngineError(f"{mf.path}: quantization_config {q.get('quant_method')!r} is not supported (mxfp4, "
                            "or none)")
    for key, want in (("swiglu_limit", SWIGLU_OAI[1]), ("swiglu_alpha", SWIGLU_OAI[0])):
        if c.get(key) is not None and float(c[key]) != want:
            raise VkEngineError(f"{mf.path}: {key} {c[key]} is not supported ({want})")
    if c.get("attention_bias") is False:
        raise VkEngineError(f"{mf.path}: gpt-oss without attention biases (attention_bias false) is not supported")
    n_head, n_layer = int(c["num_attention_heads"]), int(c["num_hidden_layers"])
    rs = c.get("rope_scaling") or c.get("rope_parameters") or {}
    base = float(c.get("rope_theta") or rs.get("rope_theta") or 150000.0)
    kind = rs.get("rope_type", rs.get("type", "default")) if rs else "default"
    yarn = None
    if kind == "yarn":
        yarn = Yarn.from_hf(rs, c)
    elif kind != "default":
        raise VkEngineError(f"rope_scaling {rs} is not supported for gpt-oss (yarn)")
    window = int(c.get("sliding_window") or 0)
    swa = hf_layer_kinds(c, n_layer, 2) if window else (False,) * n_layer
    n_exp = int(c["num_local_experts"])
    k = int(c.get("num_experts_per_tok") or c.get("experts_per_token") or 0)
    if not 0 < k <= min(n_exp, 16):
        raise VkEngineError(f"{mf.path}: {k} of {n_exp} experts per token (1 to min(experts, 16) supported)")
    hd = int(c.get("head_dim") or int(c["hidden_size"]) // n_head)
    return GptOssArgs(
        n_vocab=int(c["vocab_size"]), n_embd=int(c["hidden_size"]), n_layer=n_layer, n_head=n_head,
        n_head_kv=int(c.get("num_key_value_heads") or n_head), head_dim=hd, n_rot=hd, rope_base=base,
        rms_eps=float(c.get("rms_norm_eps", 1e-5)), n_ctx_train=int(c.get("max_position_embeddings", 131072)),
        n_expert=n_exp, n_expert_used=k, n_ff_exp=int(c["intermediate_size"]), window=window, swa=swa, yarn=yarn)


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
class GptOssWeights(PartLayers[Layer]):
    tok_embd: Matrix | None     # (None where a part of a split model does not use it: see
    out_norm: Region | None     # vkengine/models/llama.py LlamaWeights)
    output: Matrix | None
    layers: list[Layer | None]  # (None: a layer another part holds)
    rope: Region
    arena: Arena


def _forward(g: Graph, a: GptOssArgs, w: GptOssWeights) -> None:
    """One step (a part of a split model: its own layers, as llama.py's _forward)."""
    if a.first_part:
        assert w.tok_embd is not None
        g.embed(w.tok_embd, "x")
    scale = 1.0 / math.sqrt(a.head_dim)
    for i in a.part_layers:
        L = w.layer(i)
        g.rms_norm("x", L.attn_norm, "h")
        # (the biases in the matvecs, and the output projection's residual add and norm, the router's
        # choice, where they can: GPUs' decode steps; the same sums as the ops apart)
        g.matmuls_bias(L.qkv, "h", "qkv", L.qkv_bias, a.qkv_width)
        g.rope_kv(i, "qkv", "q", a.n_head, a.n_head_kv, a.head_dim, a.n_rot, True)
        g.attention(i, "q", "att", a.n_head, a.n_head_kv, a.head_dim, scale, window=a.window if a.swa[i] else 0,
                    sinks=L.sinks)
        g.matmul_norm(L.wo, "att", "x", L.post_norm, "h", bias=L.wo_bias, tmp="t")
        g.router(L.router, "h", "rl", "route", a.n_expert, a.n_expert_used, bias=L.router_bias)
        g.routed_experts(L.gate_up, L.down, a.n_expert, a.n_expert_used, a.n_ff_exp,
                         biases=(L.gate_up_bias, L.down_bias), oai=SWIGLU_OAI)
    if g.n_out:
        assert w.out_norm is not None and w.output is not None
        g.rms_norm("x", w.out_norm, "out_h", gather=True)
        g.matmul(w.output, "out_h", "out_logits", no_epilogues=True)


def _stacked(parts, E: int) -> Any:
    """Per expert, the rows of each part side by side: [gate_e | up_e] for e < E
    (E = 1: the parts one after another)."""
    return lambda: np.concatenate([f().reshape(E, -1) for f in parts], axis=1).reshape(-1)


def _alternating(x: np.ndarray, axis: int) -> np.ndarray:
    """HF's alternating gate/up (gate at even indices along `axis`, up at odd)
    as [gate | up]."""
    ev = np.take(x, np.arange(0, x.shape[axis], 2), axis=axis)
    od = np.take(x, np.arange(1, x.shape[axis], 2), axis=axis)
    return np.concatenate([ev, od], axis=axis)


def _alternating_rows(produce, E: int) -> Any:
    """A producer of the per-expert [gate | up] of HF's alternating (E, 2F) values."""
    return lambda: _alternating(produce().reshape(E, -1), 1).reshape(-1)


def _hf_experts(p: WeightPlanner, pre: str, which: str, E: int, rows: int, cols: int) -> int:
    """A layer's stacked experts from a Hugging Face folder as an E*rows x cols
    matrix (gate_up: per expert [gate | up], rows = 2F): MXFP4 blocks repacked,
    or a dequantized (E, cols, rows) tensor transposed."""
    mf = p.mf
    assert isinstance(mf, SafetensorsFolder)
    name = f"{pre}ffn_{which}_exps"
    gate_up = which == "gate_up"
    if mf.has(name + ".blocks"):
        (bt, bs), (st, ss) = mf.array_info(name + ".blocks"), mf.array_info(name + ".scales")
        if bt != "U8" or st != "U8" or bs != (E, rows, cols // 32, 16) or ss != (E, rows, cols // 32):
            raise VkEngineError(f"{mf.path.name}: {name} MXFP4 blocks {bt}{list(bs)} / scales {st}{list(ss)}, "
                                f"expected U8{[E, rows, cols // 32, 16]} / U8{[E, rows, cols // 32]}")

        def produce_mx() -> np.ndarray:
            b, s = mf.array(name + ".blocks"), mf.array(name + ".scales")
            if gate_up:
                b, s = _alternating(b, 1), _alternating(s, 1)
            return mxfp4_from_hf(b, s)
        return p.matrix_raw("mxfp4", E * rows, cols, produce_mx, name, unit=rows)
    t, s = mf.tensor_info(name + ".weight")
    if s != (E, cols, rows):
        raise VkEngineError(f"{mf.path.name}: {name} has shape {list(s)}, expected {[E, cols, rows]} (or MXFP4 "
                            "_blocks and _scales)")

    def produce() -> np.ndarray:
        raw = mf.tensor(name + ".weight").raw
        v = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[raw.size // (E * cols * rows)])
        v = v.reshape(E, cols, rows).transpose(0, 2, 1)
        return np.ascontiguousarray(_alternating(v, 1) if gate_up else v).view(np.uint8).reshape(-1)
    return p.matrix_raw(t, E * rows, cols, produce, name, unit=rows)


def _load_weights(mf: ModelFile, a: GptOssArgs, device, n_ctx: int) -> GptOssWeights:
    D, hd, E, F = a.n_embd, a.head_dim, a.n_expert, a.n_ff_exp
    p = WeightPlanner(mf, device)
    i_embd, i_onorm, i_out = plan_ends(p, mf, a)
    table = rope_table(n_ctx, a.n_rot, a.rope_base, yarn=a.yarn)
    table = (table * np.float32(a.rope_attn_factor)).astype(np.float32)
    i_rope = p.vectors([("rope table", lambda: table, table.size)])[0]
    layers: list[dict[str, Any] | None] = []
    for i in range(a.n_layer):
        pre = f"blk.{i}."
        if not a.owns(i):
            layers.append(None)
            continue
        qkv_b = [p.value(pre + f"attn_{t}.bias", n) for t, n in
                 (("q", a.n_head * hd), ("k", a.n_head_kv * hd), ("v", a.n_head_kv * hd))]
        if p.hf:
            gate_up, down = _hf_experts(p, pre, "gate_up", E, 2 * F, D), _hf_experts(p, pre, "down", E, D, F)
            gu_bias = _alternating_rows(p.value(pre + "ffn_gate_up_exps.bias", E * 2 * F), E)
        else:
            t_down, produce_down = expert_raw(p, pre, "down", E, D, F)
            gate_up = gate_up_experts(p, pre, E, F, D)
            down = p.matrix_raw(t_down, E * D, F, produce_down, pre + "ffn_down_exps", unit=D)
            gu_bias = _stacked([p.value(pre + "ffn_gate_exps.bias", E * F),
                                p.value(pre + "ffn_up_exps.bias", E * F)], E)
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
            gate_up=gate_up, down=down,
            gate_up_bias=p.vectors([(pre + "ffn_gate_up_exps.bias", gu_bias, E * 2 * F)])[0],
            down_bias=p.vector(pre + "ffn_down_exps.bias", E * D)))
    b, arena = p.build(device)
    return GptOssWeights(
        tok_embd=built(b, i_embd), out_norm=built(b, i_onorm), output=built(b, i_out), rope=b[i_rope], arena=arena,
        layers=[Layer(**{k: ([(b[h], c) for h, c in v] if k == "qkv" else b[v])   # type: ignore[arg-type]
                         for k, v in L.items()}) if L is not None else None for L in layers])


class GptOss(Architecture):
    names: ClassVar[tuple[str, ...]] = ("gpt-oss",)
    hf_architectures: ClassVar[tuple[str, ...]] = ("GptOssForCausalLM",)
    hf_names: ClassVar[dict[str, str]] = HF_NAMES
    splittable = True

    def args(self, mf: ModelFile) -> GptOssArgs:
        return GptOssArgs.from_file(mf)

    def scratch_widths(self, a: GptOssArgs) -> dict[str, Any]:
        if a.fixed_experts:
            raise VkEngineError("--fixed-experts and --experts-log are for the qwen35moe models")
        q = a.n_head * a.head_dim
        k, E = a.n_expert_used, a.n_expert
        return {"x": a.n_embd, "h": a.n_embd, "t": a.n_embd, "qkv": a.qkv_width, "q": q, "att": q,
                "rl": E, "route": 2 * k, "gu_e": k * 2 * a.n_ff_exp, "ff_e": k * a.n_ff_exp, "dn_e": k * a.n_embd,
                "elist": E, "ecnt": E, "eblk": 2 * k + 1, "out_h": a.n_embd, "out_logits": a.n_vocab,
                "rt_sync": 1}   # (the router's choice in its matvec: Graph.router)

    def load_weights(self, mf: ModelFile, a: GptOssArgs, device, n_ctx: int) -> GptOssWeights:
        return _load_weights(mf, a, device, n_ctx)

    def forward(self, g: Graph, a: GptOssArgs, w: GptOssWeights, hidden_rows: bool = False) -> None:
        if hidden_rows:
            raise VkEngineError("gpt-oss has no MTP block to feed hidden states to")
        _forward(g, a, w)


ARCHITECTURE = GptOss()
