"""Loading Qwen3.5 (dense and MoE) weights: plan an arena from the file's
header, allocate it once, upload every tensor (matrices kept quantized).

Grouping (tensors a kernel binds together share a buffer): the RoPE table with
every q/k norm weight (norm_rope_kv.comp), each linear layer's A with its
dt_bias (delta_rule.comp). Experts are stacked per layer as E x rows matrices
(gate and up interleaved per expert, so one expert matmul produces [gate | up]).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...arena import Arena
from ...gguf_file import ModelFile, SafetensorsFolder
from ...kernels import Matrix, Region
from ...rope import rope_table
from ..base import PartLayers
from ..loader import WeightPlanner, built, expert_raw, gate_up_experts, plan_ends
from .args import MTP_BLOCK, hf_value


@dataclass
class LinearAttn:
    lin_in: list[tuple[Matrix, int]]     # (matrix, first output column) of [qkv | z | beta | alpha]
    conv: Region                         # [conv_dim][K] f32
    a: Region                            # A = -exp(A_log), per value head
    dt: Region                           # dt bias (same buffer as a)
    norm: Region                         # gated norm weight (head_v_dim)
    out: Matrix


@dataclass
class FullAttn:
    qkv: list[tuple[Matrix, int]]        # [q|gate per head | k | v]
    q_norm: Region                       # (same buffer as the RoPE table)
    k_norm: Region
    wo: Matrix


@dataclass
class DenseFfn:
    gate_up: list[tuple[Matrix, int]]
    down: Matrix


@dataclass
class MoeFfn:
    router: Matrix | None                # E x D (None in the fixed-expert mode)
    router_f32: Region | None            # E x D f32 (fixed-expert mode)
    gate_up: Matrix                      # E*(2*n_ff_exp) x D, per expert [gate | up]
    down: Matrix                         # E*D x n_ff_exp
    sh_gate_up: list[tuple[Matrix, int]]
    sh_down: Matrix
    sh_gate: Matrix                      # 1 x D


@dataclass
class Layer:
    attn_norm: Region
    post_norm: Region
    mixer: LinearAttn | FullAttn
    ffn: DenseFfn | MoeFfn


@dataclass
class Mtp:
    eh_proj: Matrix                      # D x 2D, input [enorm(embedding) | hnorm(hidden)]
    enorm: Region
    hnorm: Region
    head_norm: Region
    embed: Matrix
    head: Matrix
    layer: Layer


@dataclass
class Qwen35Weights(PartLayers[Layer]):
    tok_embd: Matrix | None     # (None where a part of a split model does not use it: see
    out_norm: Region | None     # vkengine/models/llama.py LlamaWeights)
    output: Matrix | None
    layers: list[Layer | None]  # (None: a layer another part holds)
    rope: Region
    mtp: Mtp | None             # (the last part's)
    arena: Arena


def _plan_layer(p: WeightPlanner, a, prefix: str, kind: str, qk_norms: list) -> dict:
    D, hd = a.n_embd, a.head_dim
    L = dict(kind=kind, attn_norm=p.vector(prefix + "attn_norm.weight", D),
             post_norm=p.vector(prefix + "post_attention_norm.weight", D))
    if kind == "linear":
        vw = a.nv * a.dv
        names = [prefix + "attn_qkv.weight", prefix + "attn_gate.weight", prefix + "ssm_beta.weight",
                 prefix + "ssm_alpha.weight"]
        L["lin_in"] = p.fused(names, [a.conv_dim, vw, a.nv, a.nv], D)
        L["conv"] = p.vector(prefix + "ssm_conv1d.weight", a.conv_dim * a.conv_kernel)
        L["a"], L["dt"] = p.vectors([(prefix + "ssm_a", p.value(prefix + "ssm_a", a.nv), a.nv),
                                     (prefix + "ssm_dt.bias", p.value(prefix + "ssm_dt.bias", a.nv), a.nv)])
        L["norm"] = p.vector(prefix + "ssm_norm.weight", a.dv)
        L["out"] = p.matrix([prefix + "ssm_out.weight"], [D], vw)
    else:
        rows = [2 * a.n_head * hd, a.n_head_kv * hd, a.n_head_kv * hd]
        if p.mf.has(prefix + "attn_q.weight"):
            L["qkv"] = p.fused([prefix + "attn_q.weight", prefix + "attn_k.weight", prefix + "attn_v.weight"],
                               rows, D)
        else:   # the converter's optional fused layout (llama.cpp create_tensor_qkv)
            L["qkv"] = [(p.matrix([prefix + "attn_qkv.weight"], [sum(rows)], D), 0)]
        L["wo"] = p.matrix([prefix + "attn_output.weight"], [D], a.n_head * hd)
        L["qk_norm"] = len(qk_norms)
        qk_norms.append(prefix)
    if a.moe:
        E, F, Fs = a.n_expert, a.n_ff_exp, a.n_ff_shexp
        if a.fixed_experts:
            L["router_f32"] = p.vector(prefix + "ffn_gate_inp.weight", E * D)
        else:
            L["router"] = p.matrix([prefix + "ffn_gate_inp.weight"], [E], D)
        L["gate_up_exps"] = gate_up_experts(p, prefix, E, F, D)
        td, pd = expert_raw(p, prefix, "down", E, D, F)
        L["down_exps"] = p.matrix_raw(td, E * D, F, pd, prefix + "ffn_down_exps", unit=D)
        L["sh_gate_up"] = p.fused([prefix + "ffn_gate_shexp.weight", prefix + "ffn_up_shexp.weight"], [Fs, Fs], D)
        L["sh_down"] = p.matrix([prefix + "ffn_down_shexp.weight"], [D], Fs)
        L["sh_gate"] = p.vector(prefix + "ffn_gate_inp_shexp.weight", D)
    else:
        L["gate_up"] = p.fused([prefix + "ffn_gate.weight", prefix + "ffn_up.weight"], [a.n_ff, a.n_ff], D)
        L["down"] = p.matrix([prefix + "ffn_down.weight"], [D], a.n_ff)
    return L


def _build_layer(L: dict[str, Any], b: list, norms: list[tuple[Region, Region]], D: int) -> Layer:
    def pairs(x):
        return [(b[h], c) for h, c in x]
    mixer: LinearAttn | FullAttn
    ffn: MoeFfn | DenseFfn
    if L["kind"] == "linear":
        mixer = LinearAttn(pairs(L["lin_in"]), b[L["conv"]], b[L["a"]], b[L["dt"]], b[L["norm"]], b[L["out"]])
    else:
        qn, kn = norms[L["qk_norm"]]
        mixer = FullAttn(pairs(L["qkv"]), qn, kn, b[L["wo"]])
    if "gate_up_exps" in L:
        sg = b[L["sh_gate"]]
        ffn = MoeFfn(b[L["router"]] if "router" in L else None, b[L["router_f32"]] if "router_f32" in L else None,
                     b[L["gate_up_exps"]], b[L["down_exps"]], pairs(L["sh_gate_up"]), b[L["sh_down"]],
                     Matrix("f32", 1, D, sg))
    else:
        ffn = DenseFfn(pairs(L["gate_up"]), b[L["down"]])
    return Layer(b[L["attn_norm"]], b[L["post_norm"]], mixer, ffn)


def mtp_prefix(mf: ModelFile, a) -> str:
    return f"blk.{MTP_BLOCK}." if isinstance(mf, SafetensorsFolder) else f"blk.{a.n_layer}."


def load_weights(mf: ModelFile, a, device, n_ctx: int) -> Qwen35Weights:
    """Plan, allocate and upload every weight (matrices kept quantized)."""
    D = a.n_embd
    p = WeightPlanner(mf, device, hf_value)
    # (the last part keeps the token embedding too where the MTP block reuses it)
    mp = mtp_prefix(mf, a) if a.n_nextn else ""
    i_embd, i_onorm, i_out = plan_ends(p, mf, a, embed_on_last=bool(a.n_nextn)
                                       and not mf.has(mp + "nextn.embed_tokens.weight"))
    qk_norms: list[str] = []
    layers = [_plan_layer(p, a, f"blk.{i}.", t, qk_norms) if a.owns(i) else None
              for i, t in enumerate(a.layer_types)]
    mtp: dict[str, Any] | None = None
    if a.n_nextn and a.last_part:
        mtp = dict(layer=_plan_layer(p, a, mp, "full", qk_norms),
                   eh_proj=p.matrix([mp + "nextn.eh_proj.weight"], [D], 2 * D),
                   enorm=p.vector(mp + "nextn.enorm.weight", D), hnorm=p.vector(mp + "nextn.hnorm.weight", D))
        hn = mp + "nextn.shared_head_norm.weight"
        mtp["head_norm"] = p.vector(hn, D) if mf.has(hn) else i_onorm
        emb, head = mp + "nextn.embed_tokens.weight", mp + "nextn.shared_head_head.weight"
        mtp["embed"] = p.matrix([emb], [a.n_vocab], D) if mf.has(emb) else i_embd
        mtp["head"] = p.matrix([head], [a.n_vocab], D) if mf.has(head) else i_out
        assert None not in (mtp["head_norm"], mtp["embed"], mtp["head"])
    # the RoPE table and every q/k norm weight in one buffer (bound together)
    table = rope_table(n_ctx, a.n_rot, a.rope_base)
    entries = [("rope table", lambda: table, table.size)]
    for pre in qk_norms:
        entries += [(pre + "attn_q_norm.weight", p.value(pre + "attn_q_norm.weight", a.head_dim), a.head_dim),
                    (pre + "attn_k_norm.weight", p.value(pre + "attn_k_norm.weight", a.head_dim), a.head_dim)]
    i_rope = p.vectors(entries)

    b, arena = p.build(device)
    rope = b[i_rope[0]]
    norms = [(b[i_rope[1 + 2 * j]], b[i_rope[2 + 2 * j]]) for j in range(len(qk_norms))]
    built_layers = [_build_layer(L, b, norms, D) if L is not None else None for L in layers]
    m = None
    if mtp is not None:
        m = Mtp(b[mtp["eh_proj"]], b[mtp["enorm"]], b[mtp["hnorm"]], b[mtp["head_norm"]], b[mtp["embed"]],
                b[mtp["head"]], _build_layer(mtp["layer"], b, norms, D))
    return Qwen35Weights(built(b, i_embd), built(b, i_onorm), built(b, i_out), built_layers, rope, m, arena)
