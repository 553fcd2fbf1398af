"""Deterministic random-weight Qwen3.5 models (dense `qwen35`, MoE `qwen35moe`),
written as a GGUF file in llama.cpp's layout (the keys and tensor names of
llama.cpp 11434's src/models/qwen35*.cpp loaders, as its converter writes them)
and as a Hugging Face folder (Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM:
config.json + safetensors + SmolLM2's tokenizer) holding the same function.

Every tensor is drawn from a generator seeded by (seed, GGUF name) in Hugging
Face order and conventions, then put in GGUF's: value heads of the linear
attention reordered to the tiled order (convert_hf_to_gguf
_LinearAttentionVReorderBase), A_log stored as -exp(A_log), the +1 of the
zero-centred RMSNorms folded in. The GGUF tensor is quantized; the HF copy is
its dequantized values brought back to HF order and conventions, so both files
compute the same logits (up to float rounding of the conventions).

mtp_accept rewrites a few tensors so that the MTP block drafts what the main
model will say (_mtp_accept_plan): speculative decoding's mechanics measured
with random weights, whose own drafts are never accepted.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ...errors import VkEngineError
from .writer import (
    FILE_TYPES,
    add_meta,
    check_quant,
    config_json,
    draws_blocks,
    iter_tensors,
    make_tensors,
    random_blocks,
    rng_for,
    tokenizer_meta,
    write_gguf_tensors,
    write_hf_tokenizer,
)


@dataclass(frozen=True)
class Qwen35SynthConfig:
    arch: str                      # qwen35 | qwen35moe
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    nk: int                        # linear attention key heads
    nv: int                        # value heads
    dk: int
    dv: int
    n_ff: int = 0
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    rot_frac: float = 0.25         # partial_rotary_factor
    sections: tuple[int, ...] = (11, 11, 10)
    full_attention_interval: int = 4
    conv_kernel: int = 4
    mtp: bool = True
    n_ctx: int = 8192
    rope_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    logit_scale: float = 8.0
    tied: bool = False

    @property
    def n_rot(self) -> int:
        return int(self.head_dim * self.rot_frac)

    @property
    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                for i in range(self.n_layer)]

    @property
    def conv_dim(self) -> int:
        return 2 * self.nk * self.dk + self.nv * self.dv


SHAPES = {
    # Real models' shapes (Qwen/Qwen3.5-0.8B, -4B, -35B-A3B config.json) with SmolLM2's vocabulary.
    ("qwen35", "tiny"): Qwen35SynthConfig("qwen35", 64, 4, 4, 2, 32, 2, 4, 16, 16, n_ff=128, sections=(2, 1, 1),
                                          n_ctx=512),
    ("qwen35moe", "tiny"): Qwen35SynthConfig("qwen35moe", 64, 4, 4, 2, 32, 2, 4, 16, 16, n_expert=8,
                                             n_expert_used=3, n_ff_exp=32, n_ff_shexp=64, sections=(2, 1, 1),
                                             n_ctx=512),
    ("qwen35", "0.8B"): Qwen35SynthConfig("qwen35", 1024, 24, 8, 2, 256, 16, 16, 128, 128, n_ff=3584, tied=True),
    ("qwen35", "4B"): Qwen35SynthConfig("qwen35", 2560, 32, 16, 4, 256, 16, 32, 128, 128, n_ff=9216, tied=True),
    ("qwen35moe", "35B-A3B"): Qwen35SynthConfig("qwen35moe", 2048, 40, 16, 2, 256, 16, 32, 128, 128, n_expert=256,
                                                n_expert_used=8, n_ff_exp=512, n_ff_shexp=512),
}

# GGUF norm weights that hold the +1 of Qwen3.5's x * (1 + w) (subtracted for HF)
_PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "output_norm.weight", "attn_q_norm.weight",
             "attn_k_norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")
_HF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight", "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight", "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight", "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log", "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
_HF_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
             "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight"}


def hf_name(c: Qwen35SynthConfig, gguf_name: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    _, i, rest = gguf_name.split(".", 2)
    if int(i) == c.n_layer:            # the MTP block
        return _HF_NEXTN.get(rest) or f"mtp.layers.0.{_HF_LAYER[rest]}"
    return f"model.layers.{i}.{_HF_LAYER[rest]}"


def _tensor_plan(c: Qwen35SynthConfig, n_vocab: int) -> list[tuple]:
    """(GGUF name, numpy shape, init, quantized, v-head reorder) of every tensor.
    init: ("normal", std) | ("norm"[, gain]) (GGUF value gain * (1 + small)) | ("ssm_a",) | ("dt",)
    (and, from _mtp_accept_plan: ("const", value) | ("eye",) | ("copy", GGUF name, its init));
    reorder: (axis, first index, head size) of the value-head block, or None."""
    D, hd, L = c.n_embd, c.head_dim, c.n_layer
    vw = c.nv * c.dv
    # Tied models read logits off the embeddings. Embeddings of std 1 would dominate
    # the residual stream and every step would repeat its input token: they are
    # small instead (as trained models' are), and the final norm's gain sets the
    # logits' scale.
    emb_std = 0.05 if c.tied else 1.0
    gain = c.logit_scale / (np.sqrt(D) * emb_std) if c.tied else 1.0
    plan: list[tuple] = [("token_embd.weight", (n_vocab, D), ("normal", emb_std), True, None),
                         ("output_norm.weight", (D,), ("norm", gain), False, None)]
    if not c.tied:
        plan.append(("output.weight", (n_vocab, D), ("normal", c.logit_scale / np.sqrt(D)), True, None))

    def ffn(p):
        if c.n_expert:
            E, F, Fs = c.n_expert, c.n_ff_exp, c.n_ff_shexp
            return [(p + "ffn_gate_inp.weight", (E, D), ("normal", 3.0 / np.sqrt(D)), False, None),
                    (p + "ffn_gate_exps.weight", (E, F, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                    (p + "ffn_up_exps.weight", (E, F, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                    (p + "ffn_down_exps.weight", (E, D, F), ("normal", 1.0 / np.sqrt(F * L)), True, None),
                    (p + "ffn_gate_inp_shexp.weight", (D,), ("normal", 1.0 / np.sqrt(D)), False, None),
                    (p + "ffn_gate_shexp.weight", (Fs, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                    (p + "ffn_up_shexp.weight", (Fs, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                    (p + "ffn_down_shexp.weight", (D, Fs), ("normal", 1.0 / np.sqrt(Fs * L)), True, None)]
        return [(p + "ffn_gate.weight", (c.n_ff, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                (p + "ffn_up.weight", (c.n_ff, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                (p + "ffn_down.weight", (D, c.n_ff), ("normal", 1.0 / np.sqrt(c.n_ff * L)), True, None)]

    def full(p):
        return [(p + "attn_q.weight", (2 * c.n_head * hd, D), ("normal", 2.0 / np.sqrt(D)), True, None),
                (p + "attn_k.weight", (c.n_head_kv * hd, D), ("normal", 2.0 / np.sqrt(D)), True, None),
                (p + "attn_v.weight", (c.n_head_kv * hd, D), ("normal", 1.0 / np.sqrt(D)), True, None),
                (p + "attn_output.weight", (D, c.n_head * hd), ("normal", 0.5 / np.sqrt(c.n_head * hd * L)), True,
                 None),
                (p + "attn_q_norm.weight", (hd,), ("norm",), False, None),
                (p + "attn_k_norm.weight", (hd,), ("norm",), False, None)]

    for i, t in enumerate(c.layer_types):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", (D,), ("norm",), False, None),
                 (p + "post_attention_norm.weight", (D,), ("norm",), False, None)]
        if t == "full_attention":
            plan += full(p)
        else:
            qk = 2 * c.nk * c.dk
            plan += [(p + "attn_qkv.weight", (c.conv_dim, D), ("normal", 1.0 / np.sqrt(D)), True, (0, qk, c.dv)),
                     (p + "attn_gate.weight", (vw, D), ("normal", 1.0 / np.sqrt(D)), True, (0, 0, c.dv)),
                     (p + "ssm_beta.weight", (c.nv, D), ("normal", 1.0 / np.sqrt(D)), True, (0, 0, 1)),
                     (p + "ssm_alpha.weight", (c.nv, D), ("normal", 1.0 / np.sqrt(D)), True, (0, 0, 1)),
                     (p + "ssm_conv1d.weight", (c.conv_dim, c.conv_kernel), ("normal", 0.5), False, (0, qk, c.dv)),
                     (p + "ssm_dt.bias", (c.nv,), ("dt",), False, (0, 0, 1)),
                     (p + "ssm_a", (c.nv,), ("ssm_a",), False, (0, 0, 1)),
                     (p + "ssm_norm.weight", (c.dv,), ("norm",), False, None),
                     (p + "ssm_out.weight", (D, vw), ("normal", 0.5 / np.sqrt(vw * L)), True, (1, 0, c.dv))]
        plan += ffn(p)
    if c.mtp:
        p = f"blk.{L}."
        plan += [(p + "attn_norm.weight", (D,), ("norm",), False, None),
                 (p + "post_attention_norm.weight", (D,), ("norm",), False, None),
                 (p + "nextn.eh_proj.weight", (D, 2 * D), ("normal", 1.0 / np.sqrt(2 * D)), True, None),
                 (p + "nextn.enorm.weight", (D,), ("norm",), False, None),
                 (p + "nextn.hnorm.weight", (D,), ("norm",), False, None),
                 (p + "nextn.shared_head_norm.weight", (D,), ("norm",), False, None)]
        plan += full(p) + ffn(p)
    return plan


# Matrices whose product is a block's addition to the residual stream
# (attention, linear attention, dense FFN, routed and shared experts)
_RESIDUAL_OUT = ("attn_output.weight", "ssm_out.weight", "ffn_down.weight", "ffn_down_exps.weight",
                 "ffn_down_shexp.weight")


def _mtp_accept_plan(plan: list[tuple]) -> list[tuple]:
    """The plan of a model whose MTP block's drafts are the main model's own
    greedy tokens, so speculative decoding accepts (almost) all of them.

    Every block, the MTP block's layer too, adds zero to the residual stream
    (its output matrices are zeros), so the main model's final hidden state is
    its token's embedding e and its next greedy token a function of that token
    alone: f(t) = argmax(head . output_norm(e_t)). The MTP block computes
    eh_proj . [enorm(e_t) | hnorm(h)]; with eh_proj = [I | 0] and enorm's
    weight all ones that is rmsnorm(e_t), its layer adds zero, and its head
    norm (output_norm's weight) and head (the main one: the file has no MTP
    embedding or head) give head . output_norm(rmsnorm(e_t)), which is the
    main logits up to the eps of a second RMSNorm. So the draft after t_p is
    f(t_p), the greedy token at p, and a chained draft f(d) is the greedy token
    after d. Quantizing keeps this: each 32-block of [I | 0] holds one 1.0 or
    none, so every row dequantizes to the same multiple of the identity (1 in
    the float types, q4_0, q5_0 and mxfp4; within 3e-4 of 1 in the others),
    which the head's RMSNorm removes (tiny models on lavapipe accepted every
    draft, in q8_0, q4_0, q4_1, q5_1, mxfp4, f16 and bf16, tied or not).

    Every matmul still runs on full-size weights and the routers still choose
    experts by their random weights (outputs of zero, but the experts of each
    row's token read), so a step moves the bytes a real one does. With tied
    embeddings (the dense 0.8B and 4B shapes) f(t) is mostly t itself, as
    e_t . e_t dominates the logits: the output soon repeats one token."""
    out = []
    for name, shape, init, quantized, reorder in plan:
        if name.endswith(_RESIDUAL_OUT):
            init = ("const", 0.0)
        elif name.endswith("nextn.eh_proj.weight"):
            init = ("eye",)
        elif name.endswith("nextn.enorm.weight"):
            init = ("const", 1.0)
        elif name.endswith("nextn.shared_head_norm.weight"):
            init = ("copy", "output_norm.weight", next(p[2] for p in plan if p[0] == "output_norm.weight"))
        out.append((name, shape, init, quantized, reorder))
    return out


def _v_reorder(x: np.ndarray, spec, nk: int, nv: int, inverse: bool = False) -> np.ndarray:
    """Value heads grouped by key head (HF) <-> tiled (GGUF), on one axis from an index."""
    if spec is None or nk == nv:
        return x
    axis, first, hd = spec
    x = np.moveaxis(x, axis, 0)
    head, tail = x[:first], x[first:]
    r = nv // nk
    shape = (r, nk) if inverse else (nk, r)
    t = tail.reshape(*shape, hd, *tail.shape[1:]).swapaxes(0, 1).reshape(tail.shape)
    return np.moveaxis(np.concatenate([head, t]), 0, axis)


def _make_tensor(job):
    """Worker: -> (GGUF name, GGUF bytes, type, GGUF-convention float32 values in HF head order)."""
    name, shape, init, quantized, reorder, seed, quant, nk, nv, want_hf, blocks = job
    from gguf import quants

    from ...quant import BY_NAME, dequantize
    source = name
    if init[0] == "copy":       # another tensor's values: its init, from its generator
        _, source, init = init
    rng = rng_for(seed, source)
    kind = init[0]
    t = quant if quantized else "f32"
    raw = None
    if kind == "const":
        w = np.full(shape, init[1], np.float32)
    elif kind == "eye":        # [I | 0]
        w = np.eye(*shape, dtype=np.float32)
    elif kind == "norm":      # GGUF value (the +1 folded in), times an optional gain
        w = (init[1] if len(init) > 1 else 1.0) * (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32))
    elif kind == "ssm_a":      # A = -exp(A_log), A_log = log(U(0.05, 2)): decays from fast to slow
        w = -rng.uniform(0.05, 2.0, shape).astype(np.float32)
    elif kind == "dt":
        w = 0.5 * rng.standard_normal(shape, dtype=np.float32)
    else:   # (a bench-sized model's q4_0/q8_0 matrices: random blocks, rows in no order, nothing to reorder)
        raw = random_blocks(rng, t, int(np.prod(shape)), init[1]) if blocks else None
        if raw is None:
            w = rng.standard_normal(shape, dtype=np.float32) * np.float32(init[1])
    if raw is None:
        w = np.ascontiguousarray(_v_reorder(w.astype(np.float32), reorder, nk, nv))
        if t == "f32":
            raw = w.view(np.uint8).reshape(-1)
        elif t == "f16":
            raw = w.astype(np.float16).view(np.uint8).reshape(-1)
        else:
            raw = np.ascontiguousarray(quants.quantize(w.reshape(-1, shape[-1]), BY_NAME[t])).view(np.uint8).reshape(-1)
    hf = None
    if want_hf:
        deq = w if t == "f32" else dequantize(t, raw, int(np.prod(shape[:-1])), shape[-1]).reshape(shape)
        hf = np.ascontiguousarray(_v_reorder(deq, reorder, nk, nv, inverse=True), np.float32)
    return name, raw, t, hf


def _hf_tensors(c: Qwen35SynthConfig, plan, results) -> dict[str, np.ndarray]:
    """HF names and conventions of the generated tensors (experts fused as
    transformers keeps them: gate_up_proj (E, 2F, D), down_proj (E, D, F))."""
    out = {}
    for name, shape, *_ in plan:
        v = results[name][3]
        if name.endswith("ffn_up_exps.weight"):
            continue
        if name.endswith("ffn_gate_exps.weight"):
            up = results[name.replace("gate_exps", "up_exps")][3]
            p = hf_name(c, name.replace("ffn_gate_exps", "ffn_down_exps")).replace("down_proj", "gate_up_proj")
            out[p] = np.concatenate([v, up], axis=1)
            continue
        if name.endswith(_PLUS_ONE):
            v = v - np.float32(1.0)
        elif name.endswith(".ssm_a"):
            v = np.log(-v.astype(np.float64)).astype(np.float32)
        elif name.endswith("ssm_conv1d.weight"):
            v = v.reshape(shape[0], 1, shape[1])
        elif name.endswith("ffn_gate_inp_shexp.weight"):
            v = v.reshape(1, -1)
        out[hf_name(c, name)] = np.ascontiguousarray(v, np.float32)
    return out


def _hf_config(c: Qwen35SynthConfig, n_vocab: int, tmeta: dict) -> dict:
    moe = c.arch == "qwen35moe"
    cfg = {
        "architectures": ["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        "vocab_size": n_vocab, "hidden_size": c.n_embd, "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
        "hidden_act": "silu", "max_position_embeddings": c.n_ctx, "rms_norm_eps": c.rms_eps,
        "tie_word_embeddings": c.tied, "attention_bias": False, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_base, "partial_rotary_factor": c.rot_frac,
                            "mrope_section": list(c.sections), "mrope_interleaved": True},
        "layer_types": c.layer_types, "full_attention_interval": c.full_attention_interval,
        "linear_conv_kernel_dim": c.conv_kernel, "linear_key_head_dim": c.dk, "linear_value_head_dim": c.dv,
        "linear_num_key_heads": c.nk, "linear_num_value_heads": c.nv,
        "mtp_num_hidden_layers": int(c.mtp), "torch_dtype": "float32",
        "bos_token_id": tmeta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": tmeta.get("tokenizer.ggml.eos_token_id"),
    }
    if moe:
        cfg.update(num_experts=c.n_expert, num_experts_per_tok=c.n_expert_used, moe_intermediate_size=c.n_ff_exp,
                   shared_expert_intermediate_size=c.n_ff_shexp)
    else:
        cfg["intermediate_size"] = c.n_ff
    return cfg


def _write_gguf(path: Path, c: Qwen35SynthConfig, quant: str, seed: int, name: str, n_vocab: int, tmeta: dict,
                plan, results, mtp_accept: bool) -> None:
    """results: (name, raw bytes, type, ...) of every plan entry, in plan order."""
    import gguf

    a = c.arch
    w = gguf.GGUFWriter(str(path), a)
    n_all = c.n_layer + int(c.mtp)
    w.add_name(name)
    w.add_context_length(c.n_ctx)
    w.add_embedding_length(c.n_embd)
    w.add_block_count(n_all)
    if c.n_ff:
        w.add_feed_forward_length(c.n_ff)
    w.add_head_count(c.n_head)
    w.add_head_count_kv(c.n_head_kv)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(c.rope_base)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.n_rot)
    w.add_rope_dimension_sections(list(c.sections) + [0] * (4 - len(c.sections)))
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.dk)
    w.add_ssm_group_count(c.nk)
    w.add_ssm_time_step_rank(c.nv)
    w.add_ssm_inner_size(c.nv * c.dv)
    w.add_array(f"{a}.attention.recurrent_layers",
                [t == "linear_attention" for t in c.layer_types] + [False] * int(c.mtp))
    w.add_full_attention_interval(c.full_attention_interval)
    if c.mtp:
        w.add_nextn_predict_layers(1)
    if c.n_expert:
        w.add_expert_count(c.n_expert)
        w.add_expert_used_count(c.n_expert_used)
        w.add_expert_feed_forward_length(c.n_ff_exp)
        w.add_expert_shared_feed_forward_length(c.n_ff_shexp)
    w.add_vocab_size(n_vocab)
    w.add_file_type(FILE_TYPES[quant])
    w.add_string("vkengine.synth.seed", str(seed))
    w.add_string("vkengine.synth.config", json.dumps(asdict(c)))
    if mtp_accept:      # tells the file apart from the plain model of the same seed
        w.add_bool("vkengine.synth.mtp_accept", True)
    add_meta(w, tmeta)
    write_gguf_tensors(w, [(n, s, quant if quantized else "f32") for n, s, _, quantized, _ in plan], results)


def synth_qwen35(c: Qwen35SynthConfig, quant: str, seed: int, out_dir: Path, name: str = "synth",
                 formats=("gguf", "hf"), workers: int | None = None,
                 tokenizer_from: Path | None = None, tmeta: dict | None = None,
                 mtp_accept: bool = False) -> dict[str, Path]:
    """Write the model; returns {"gguf": file, "hf": folder} for what was written.
    tmeta: tokenizer fields already read (writer.tokenizer_meta) to reuse.
    mtp_accept: blocks that add nothing and an MTP block that drafts the main
    model's greedy tokens (_mtp_accept_plan), for measuring speculative decoding."""
    check_quant(quant)
    if c.nv % c.nk or c.n_embd % 32 or (c.nv * c.dv) % 32 or (c.n_ff or c.n_ff_exp) % 32:
        raise VkEngineError("shapes must divide value heads among key heads and keep matrix columns "
                            "multiples of 32")
    if mtp_accept and not c.mtp:
        raise VkEngineError("--mtp-accept needs a model with an MTP block: this config has mtp = false")
    tmeta = tmeta or tokenizer_meta(tokenizer_from)
    n_vocab = len(tmeta["tokenizer.ggml.tokens"])
    out_dir.mkdir(parents=True, exist_ok=True)
    want_hf = "hf" in formats
    plan = _tensor_plan(c, n_vocab)
    if mtp_accept:
        plan = _mtp_accept_plan(plan)
    blocks = draws_blocks(s for _, s, *_ in plan)
    jobs = [(n, s, init, qz, ro, seed, quant, c.nk, c.nv, want_hf, blocks) for n, s, init, qz, ro in plan]
    # the Hugging Face copy needs every tensor at once; GGUF alone streams
    # (a 35B-A3B shape is larger than this machine's memory)
    results = make_tensors(_make_tensor, jobs, workers) if want_hf else None
    written: dict[str, Path] = {}
    if "gguf" in formats:
        path = out_dir / f"{name}-{quant}.gguf"
        tmp = path.with_suffix(".gguf.tmp")
        _write_gguf(tmp, c, quant, seed, name, n_vocab, tmeta, plan,
                    (results[p[0]] for p in plan) if results is not None
                    else iter_tensors(_make_tensor, jobs, workers), mtp_accept)
        os.replace(tmp, path)
        written["gguf"] = path
    if want_hf:
        from safetensors.numpy import save_file
        folder = out_dir / f"{name}-{quant}-hf"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(_hf_tensors(c, plan, results), str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(_hf_config(c, n_vocab, tmeta), indent=1))
        write_hf_tokenizer(folder, tmeta)
        written["hf"] = folder
    return written


def config_for(arch: str, shape: str | None, config: str | None = None) -> Qwen35SynthConfig:
    """The config of a named shape of arch, or of --config's JSON fields."""
    if config:
        d = config_json(config)
        if "sections" in d:
            d["sections"] = tuple(d["sections"])
        try:
            return Qwen35SynthConfig(**{"arch": arch, **d})
        except TypeError as e:
            raise VkEngineError(f"--config: {e}") from e
    key = (arch, shape)
    if key not in SHAPES:
        names = ", ".join(s for a, s in SHAPES if a == arch)
        raise VkEngineError(f"unknown shape {shape!r} for {arch} (shapes: {names})")
    return SHAPES[key]
