"""Deterministic random-weight llama models with the shapes of real ones, written as a
GGUF file (that llama.cpp loads) and as a Hugging Face folder (config.json +
safetensors + tokenizer.json) holding exactly the same function.

Text stays real: the tokenizer (vocab, merges, chat template) is SmolLM2's,
copied from the embedded model. Weights are scaled so that logits are peaked
(top-2 margins of a nat or more are common) and greedy choices are not coin
flips. Tied real shapes (qwen2.5-0.5b, qwen3-0.6b, the Gemma ones) draw the
final norm's weights with random signs and the embeddings smaller: with random
weights the residual otherwise stays near the last token's embedding, which a
tied output scores highest by hundreds of nats, and the model repeats that
token forever (no evidence for parity). Every tensor is drawn from a generator seeded by (seed, tensor name), so
the result does not depend on the order or the number of worker processes.

GGUF stores llama Q/K rows permuted for adjacent-pair RoPE (llama.cpp's
convert_hf_to_gguf.py LlamaModel.permute); the Hugging Face copy keeps the
original row order and NEOX RoPE, and its weights are the dequantized GGUF
weights, so both files compute the same logits.

--arch qwen2 and qwen3 write the dense Qwen variants of the same graph
(vkengine/models/qwen2.py, qwen3.py): unpermuted rows (NEOX RoPE in both
files), q/k/v biases (qwen2) or per-head q/k norm weights (qwen3), and the
head size in the file (qwen3's 128 is not n_embd / n_head).

--arch gpt-oss writes gpt-oss's (vkengine/models/gpt_oss.py: biases, sinks,
experts with biases, the sliding window, YaRN when yarn_factor is set), GGUF only.

--arch gemma2 and gemma3 write Gemma's graph (vkengine/models/gemma3.py):
norms after attention and the FFN as well as before, tied embeddings, the
sliding window (SynthConfig.window), q/k norms (gemma3), soft-caps (gemma2).
GGUF norm weights hold 1 + w (llama.cpp's converter adds Gemma's 1), the
Hugging Face copy w.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

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

SHAPES = {
    # name: (n_embd, n_layer, n_head, n_head_kv, n_ff)
    "tiny": (64, 2, 4, 2, 128),
    "small": (128, 4, 4, 2, 352),
    "smollm2-135m": (576, 30, 9, 3, 1536),
    "1b": (2048, 16, 32, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}
# real shapes with more than SHAPES' fields (used with their --arch)
SHAPES_EXTRA: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(n_embd=896, n_layer=24, n_head=14, n_head_kv=2, n_ff=4864, tied=True, rope_base=1e6,
                         rms_eps=1e-6, signed_out_norm=True, embd_std=0.25),
    "qwen3-0.6b": dict(n_embd=1024, n_layer=28, n_head=16, n_head_kv=8, n_ff=3072, head_size=128, tied=True,
                       rope_base=1e6, rms_eps=1e-6, signed_out_norm=True, embd_std=0.25),
    # experts: the tiny MoE shape (qwen3moe; llama: Mixtral-style) and Qwen3-30B-A3B's
    "tiny-moe": dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=128, n_expert=8, n_expert_used=2,
                     n_ff_exp=32),
    "phi3-mini": dict(n_embd=3072, n_layer=32, n_head=32, n_head_kv=32, n_ff=8192, rope_base=10000.0),
    "gemma3-270m": dict(n_embd=640, n_layer=18, n_head=4, n_head_kv=1, n_ff=2048, head_size=256, tied=True,
                        rope_base=1e6, rms_eps=1e-6, window=512, signed_out_norm=True,
                        embd_std=0.0625),
    "gemma3-4b": dict(n_embd=2560, n_layer=34, n_head=8, n_head_kv=4, n_ff=10240, head_size=256, tied=True,
                      rope_base=1e6, rms_eps=1e-6, window=1024, rope_linear=8.0, signed_out_norm=True,
                      embd_std=0.0625),
    "gemma2-2b": dict(n_embd=2304, n_layer=26, n_head=8, n_head_kv=4, n_ff=9216, head_size=256, tied=True,
                      rope_base=10000.0, rms_eps=1e-6, window=4096, signed_out_norm=True,
                      embd_std=0.0625),
    # gpt-oss: a tiny shape (window 8, YaRN from 64 positions) and gpt-oss-20b's (its experts MXFP4 in the
    # released files: --quant mxfp4; the HF folder then holds them as openai/gpt-oss-20b does)
    "gpt-oss-tiny": dict(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=64, head_size=32, n_expert=8,
                         n_expert_used=2, n_ff_exp=32, rope_base=150000.0, window=8, yarn_factor=4.0,
                         yarn_orig_ctx=64),
    "gpt-oss-20b": dict(n_embd=2880, n_layer=24, n_head=64, n_head_kv=8, n_ff=2880, head_size=64, n_expert=32,
                        n_expert_used=4, n_ff_exp=2880, rope_base=150000.0, rms_eps=1e-5, window=128,
                        yarn_factor=32.0, yarn_orig_ctx=4096),
    "qwen3-30b-a3b": dict(n_embd=2048, n_layer=48, n_head=32, n_head_kv=4, n_ff=6144, head_size=128,
                          n_expert=128, n_expert_used=8, n_ff_exp=768, rope_base=1e6, rms_eps=1e-6),
}
ARCHES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3", "gpt-oss")
GEMMA = ("gemma2", "gemma3")


@dataclass(frozen=True)
class SynthConfig:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int = 8192
    rope_base: float = 100000.0
    rms_eps: float = 1e-5
    logit_scale: float = 8.0       # std of the output logits
    tied: bool = False
    arch: str = "llama"            # llama, qwen2 (q/k/v biases), qwen3 (q/k norms), qwen3moe (+ experts)
    head_size: int = 0             # 0: n_embd // n_head
    n_expert: int = 0              # > 0: every layer's FFN routed experts (llama: Mixtral-style)
    n_expert_used: int = 0
    n_ff_exp: int = 0
    rope_orig_ctx: int = 0         # phi3: > 0 adds LongRoPE (long factors past this context)
    window: int = 0                # gemma: the sliding window (0: the architecture's default, 512 / 4096)
    attn_softcap: float = 50.0     # gemma2's soft-caps
    final_softcap: float = 30.0
    rope_linear: float = 0.0       # gemma3: linear RoPE scaling of the global layers (4b and up: 8)
    yarn_factor: float = 0.0       # > 0: YaRN scaling (rope.scaling.type yarn) from yarn_orig_ctx positions
    yarn_orig_ctx: int = 0
    # tied real shapes: with random weights the residual stays near the last token's embedding, which a tied
    # output then scores highest by hundreds of nats (the model repeats it forever); see _tensor_plan
    signed_out_norm: bool = False
    embd_std: float = 1.0

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head


def config_for(shape: str | None, config: str | None = None, arch: str = "llama") -> SynthConfig:
    """The config of a named shape, or of --config's JSON fields, for arch."""
    if arch not in ARCHES:
        raise VkEngineError(f"unknown llama-family architecture {arch!r} ({', '.join(ARCHES)})")
    if config:
        try:
            return SynthConfig(**{"arch": arch, **config_json(config)})
        except TypeError as e:
            raise VkEngineError(f"--config: {e}") from e
    if shape in SHAPES_EXTRA:
        return SynthConfig(**SHAPES_EXTRA[shape], arch=arch)
    if shape not in SHAPES:
        raise VkEngineError(f"unknown shape {shape!r} (shapes: {', '.join([*SHAPES, *SHAPES_EXTRA])})")
    n_embd, n_layer, n_head, n_head_kv, n_ff = SHAPES[shape]
    return SynthConfig(n_embd, n_layer, n_head, n_head_kv, n_ff, arch=arch)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rows -> GGUF rows (llama.cpp convert_hf_to_gguf.py LlamaModel.permute)."""
    r, c = w.shape
    return w.reshape(n_head, 2, r // n_head // 2, c).swapaxes(1, 2).reshape(r, c)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    r, c = w.shape
    return w.reshape(n_head, r // n_head // 2, 2, c).swapaxes(1, 2).reshape(r, c)


def _tensor_plan(c: SynthConfig, n_vocab: int) -> list[tuple[str, tuple[int, ...], float]]:
    """(GGUF name, numpy shape, std) of every tensor; std 0 marks a norm weight,
    a negative std an f32 bias of std -std."""
    D, F, hd = c.n_embd, c.n_ff, c.head_dim
    # Residual contributions of each block sized to keep activations O(1).
    # signed_out_norm: the final norm's weights of random sign (an f32 "bias" of std logit_scale / sqrt(D)),
    # so that a tied model's logits keep their scale but a token's own embedding no longer scores itself highest
    # (embd_std: below 1 lets the layers' branches, not the token's embedding, dominate the residual)
    out_norm = -c.logit_scale / (c.embd_std * np.sqrt(D)) if c.signed_out_norm else 0.0
    plan = [("token_embd.weight", (n_vocab, D), c.embd_std), ("output_norm.weight", (D,), out_norm)]
    if c.arch in GEMMA:
        return plan + [t for i in range(c.n_layer) for t in _gemma_layer(c, f"blk.{i}.")]
    if c.arch == "gpt-oss":
        return plan + [("output.weight", (n_vocab, D), c.logit_scale / np.sqrt(D))] + \
            [t for i in range(c.n_layer) for t in _gptoss_layer(c, f"blk.{i}.")]
    if c.rope_orig_ctx:   # LongRoPE divisors (f32; made by _make_tensor, not drawn)
        plan += [("rope_factors_long.weight", (hd // 2,), -1.0), ("rope_factors_short.weight", (hd // 2,), -1.0)]
    if not c.tied:
        plan.append(("output.weight", (n_vocab, D), c.logit_scale / np.sqrt(D)))
    for i in range(c.n_layer):
        p = f"blk.{i}."
        qkv = ([(p + "attn_qkv.weight", ((c.n_head + 2 * c.n_head_kv) * hd, D), 1.5 / np.sqrt(D))]
               if c.arch == "phi3" else
               [(p + "attn_q.weight", (c.n_head * hd, D), 2.0 / np.sqrt(D)),
                (p + "attn_k.weight", (c.n_head_kv * hd, D), 2.0 / np.sqrt(D)),
                (p + "attn_v.weight", (c.n_head_kv * hd, D), 1.0 / np.sqrt(D))])
        plan += [
            (p + "attn_norm.weight", (D,), 0.0),
            *qkv,
            *([(p + "attn_q.bias", (c.n_head * hd,), -0.5), (p + "attn_k.bias", (c.n_head_kv * hd,), -0.5),
               (p + "attn_v.bias", (c.n_head_kv * hd,), -0.2)] if c.arch == "qwen2" else []),
            *([(p + "attn_q_norm.weight", (hd,), 0.0), (p + "attn_k_norm.weight", (hd,), 0.0)]
              if c.arch in ("qwen3", "qwen3moe") else []),
            (p + "attn_output.weight", (D, c.n_head * hd), 0.5 / np.sqrt(c.n_head * hd * c.n_layer)),
            (p + "ffn_norm.weight", (D,), 0.0),
        ]
        if c.n_expert:
            E, Fe = c.n_expert, c.n_ff_exp
            plan += [(p + "ffn_gate_inp.weight", (E, D), 4.0 / np.sqrt(D)),    # routing margins of O(1)
                     (p + "ffn_gate_exps.weight", (E, Fe, D), 1.0 / np.sqrt(D)),
                     (p + "ffn_up_exps.weight", (E, Fe, D), 1.0 / np.sqrt(D)),
                     (p + "ffn_down_exps.weight", (E, D, Fe), 1.0 / np.sqrt(Fe * c.n_layer))]
        elif c.arch == "phi3":    # [gate | up] in one matrix
            plan += [(p + "ffn_up.weight", (2 * F, D), 1.0 / np.sqrt(D)),
                     (p + "ffn_down.weight", (D, F), 1.0 / np.sqrt(F * c.n_layer))]
        else:
            plan += [(p + "ffn_gate.weight", (F, D), 1.0 / np.sqrt(D)),
                     (p + "ffn_up.weight", (F, D), 1.0 / np.sqrt(D)),
                     (p + "ffn_down.weight", (D, F), 1.0 / np.sqrt(F * c.n_layer))]
    return plan


def _gemma_layer(c: SynthConfig, p: str) -> list[tuple[str, tuple[int, ...], float]]:
    """Gemma: embeddings times sqrt(D) and every branch RMS-normed before its
    residual add, so the projections' scales only set the branches' shapes."""
    D, F, hd = c.n_embd, c.n_ff, c.head_dim
    return [(p + "attn_norm.weight", (D,), 0.0),
            (p + "attn_q.weight", (c.n_head * hd, D), 2.0 / np.sqrt(D)),
            (p + "attn_k.weight", (c.n_head_kv * hd, D), 2.0 / np.sqrt(D)),
            (p + "attn_v.weight", (c.n_head_kv * hd, D), 1.0 / np.sqrt(D)),
            *([(p + "attn_q_norm.weight", (hd,), 0.0), (p + "attn_k_norm.weight", (hd,), 0.0)]
              if c.arch == "gemma3" else []),
            (p + "attn_output.weight", (D, c.n_head * hd), 1.0 / np.sqrt(c.n_head * hd)),
            (p + "post_attention_norm.weight", (D,), 0.0),
            (p + "ffn_norm.weight", (D,), 0.0),
            (p + "ffn_gate.weight", (F, D), 1.0 / np.sqrt(D)),
            (p + "ffn_up.weight", (F, D), 1.0 / np.sqrt(D)),
            (p + "ffn_down.weight", (D, F), 1.0 / np.sqrt(F)),
            (p + "post_ffw_norm.weight", (D,), 0.0)]


def _gptoss_layer(c: SynthConfig, p: str) -> list[tuple[str, tuple[int, ...], float]]:
    """gpt-oss: biases on q, k, v, o, the router and every expert's products (f32),
    a sink logit per query head (f32, as a bias), routed experts only."""
    D, hd, E, Fe = c.n_embd, c.head_dim, c.n_expert, c.n_ff_exp
    return [(p + "attn_norm.weight", (D,), 0.0),
            (p + "attn_q.weight", (c.n_head * hd, D), 2.0 / np.sqrt(D)), (p + "attn_q.bias", (c.n_head * hd,), -0.3),
            (p + "attn_k.weight", (c.n_head_kv * hd, D), 2.0 / np.sqrt(D)),
            (p + "attn_k.bias", (c.n_head_kv * hd,), -0.3),
            (p + "attn_v.weight", (c.n_head_kv * hd, D), 1.0 / np.sqrt(D)),
            (p + "attn_v.bias", (c.n_head_kv * hd,), -0.2),
            (p + "attn_output.weight", (D, c.n_head * hd), 0.5 / np.sqrt(c.n_head * hd * c.n_layer)),
            (p + "attn_output.bias", (D,), -0.1),
            (p + "attn_sinks.weight", (c.n_head,), -2.0),
            (p + "post_attention_norm.weight", (D,), 0.0),
            (p + "ffn_gate_inp.weight", (E, D), 4.0 / np.sqrt(D)), (p + "ffn_gate_inp.bias", (E,), -0.5),
            (p + "ffn_gate_exps.weight", (E, Fe, D), 2.0 / np.sqrt(D)), (p + "ffn_gate_exps.bias", (E, Fe), -0.5),
            (p + "ffn_up_exps.weight", (E, Fe, D), 2.0 / np.sqrt(D)), (p + "ffn_up_exps.bias", (E, Fe), -0.5),
            (p + "ffn_down_exps.weight", (E, D, Fe), 1.0 / np.sqrt(Fe * c.n_layer)),
            (p + "ffn_down_exps.bias", (E, D), -0.1)]


def tensor_quant(name: str, quant: str) -> str:
    """The type a weight gets in a file of `quant`: a MoE router (ffn_gate_inp)
    stays F32, as llama.cpp's llama-quantize leaves it in the files users have."""
    return "f32" if name.endswith("ffn_gate_inp.weight") else quant


def _make_tensor(job):
    """Worker: (name, shape, std, seed, quant, n_head, n_head_kv, want_hf, permute, blocks) -> (name, GGUF
    bytes, type, HF float32); permute: Q/K rows for adjacent-pair RoPE (llama); blocks: q4_0/q8_0 matrices
    drawn as random blocks (writer.random_blocks: a bench-sized model)."""
    name, shape, std, seed, quant, n_head, n_head_kv, want_hf, permute, blocks = job
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from ...quant import BY_NAME, dequantize, quantize_mxfp4
    rng = rng_for(seed, name)
    if std == 0.0:   # norm weights stay f32, near 1
        w = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        return name, w.view(np.uint8).reshape(-1), "f32", w if want_hf else None
    if name.startswith("rope_factors_"):   # LongRoPE divisors from 1 up (long) or near 1 (short)
        top = 4.0 if "long" in name else 1.25
        w = np.linspace(1.0, top, shape[0]).astype(np.float32)
        return name, w.view(np.uint8).reshape(-1), "f32", w if want_hf else None
    if std < 0.0:    # biases: f32
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(-std)
        return name, w.view(np.uint8).reshape(-1), "f32", w if want_hf else None
    quant = tensor_quant(name, quant)
    qt = BY_NAME[quant]
    w = None
    raw = random_blocks(rng, quant, int(np.prod(shape)), std) if blocks else None
    if raw is None:   # (random blocks have rows in no order: nothing to permute)
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if permute and name.endswith("attn_q.weight"):
            w = _permute(w, n_head)
        elif permute and name.endswith("attn_k.weight"):
            w = _permute(w, n_head_kv)
        if quant == "f32":
            raw = w.view(np.uint8)
        elif quant == "f16":
            raw = w.astype(np.float16).view(np.uint8)
        else:
            raw = (quantize_mxfp4(w) if quant == "mxfp4"
                   else quants.quantize(w.reshape(-1, shape[-1]), qt).view(np.uint8))
    raw = np.ascontiguousarray(raw).reshape(-1)
    hf = None
    if want_hf:
        rows = int(np.prod(shape[:-1]))
        hf = w if w is not None and qt == T.F32 else dequantize(quant, raw, rows, shape[-1]).reshape(shape)
        if permute and name.endswith("attn_q.weight"):
            hf = _unpermute(hf, n_head)
        elif permute and name.endswith("attn_k.weight"):
            hf = _unpermute(hf, n_head_kv)
    return name, raw, quant, hf


HF_NAME_OF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",          # experts as transformers 5 keeps them (fused)
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


PHI3_HF_NAME_OF = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Gemma: post_attention_layernorm is the attention output's norm; the FFN's input norm is pre_feedforward
GEMMA_HF_NAME_OF = {"post_attention_norm.weight": "post_attention_layernorm.weight",
                    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                    "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}


def _longrope_attn(c: SynthConfig) -> float:
    """LongRoPE's attention factor (convert_hf_to_gguf.py Phi3MiniModel, transformers)."""
    scale = c.n_ctx / c.rope_orig_ctx
    return float(np.sqrt(1 + np.log(scale) / np.log(c.rope_orig_ctx))) if scale > 1 else 1.0


def _window(c: SynthConfig) -> int:
    return c.window or (4096 if c.arch == "gemma2" else 512)


def _gemma_hf_config(c: SynthConfig) -> dict[str, Any]:
    """transformers' Gemma2Config / Gemma3TextConfig fields beyond the llama ones."""
    period = 2 if c.arch == "gemma2" else 6
    return {
        "hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": c.head_dim, "sliding_window": _window(c),
        "layer_types": ["sliding_attention" if i % period < period - 1 else "full_attention"
                        for i in range(c.n_layer)],
        "attn_logit_softcapping": c.attn_softcap if c.arch == "gemma2" else None,
        "final_logit_softcapping": c.final_softcap if c.arch == "gemma2" else None,
        "attention_bias": False, "attention_dropout": 0.0, "pad_token_id": 0,
        **({"rope_local_base_freq": 10000.0, "sliding_window_pattern": period,
            "rope_scaling": {"rope_type": "linear", "factor": c.rope_linear} if c.rope_linear else None}
           if c.arch == "gemma3" else {"cache_implementation": "hybrid"}),
    }


GPTOSS_HF_NAME_OF = {
    "attn_norm.weight": "input_layernorm.weight", "attn_sinks.weight": "self_attn.sinks",
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"attn_{t}.{k}": f"self_attn.{t}_proj.{k}" for t in "qkv" for k in ("weight", "bias")},
}


def _gptoss_hf_tensor(c: SynthConfig, n: str, results, quant: str) -> dict[str, np.ndarray]:
    """gpt-oss's Hugging Face tensors of GGUF tensor n, as openai/gpt-oss-20b holds
    them: experts with gate and up alternating (rows; biases), MXFP4 as `_blocks`
    and `_scales` (transformers' nibble pairs) for --quant mxfp4, else
    dequantized (E, in, out) for x @ W."""
    from ...quant import mxfp4_to_hf
    blk, i, rest = n.split(".", 2) if n.startswith("blk.") else ("", "", n)
    if not blk:
        return {HF_NAME_OF[n]: np.ascontiguousarray(results[n][3], np.float32)}
    pre = f"model.layers.{i}."
    if rest in GPTOSS_HF_NAME_OF:
        return {pre + GPTOSS_HF_NAME_OF[rest]: np.ascontiguousarray(results[n][3], np.float32)}
    E, F, D = c.n_expert, c.n_ff_exp, c.n_embd
    if rest.startswith("ffn_up_exps"):
        return {}                                   # (written with the gate's)
    up = n.replace("gate_exps", "up_exps")

    def alternate(g: np.ndarray, u: np.ndarray) -> np.ndarray:     # along axis 1
        out = np.empty((g.shape[0], 2 * g.shape[1], *g.shape[2:]), g.dtype)
        out[:, 0::2], out[:, 1::2] = g, u
        return out
    if rest.endswith(".bias"):
        b = results[n][3]
        if rest.startswith("ffn_gate_exps"):
            return {pre + "mlp.experts.gate_up_proj_bias": alternate(b, results[up][3]).astype(np.float32)}
        return {pre + "mlp.experts.down_proj_bias": np.ascontiguousarray(b, np.float32)}
    which, rows, cols = ("gate_up", F, D) if rest.startswith("ffn_gate_exps") else ("down", D, F)
    if quant == "mxfp4":
        def hf(name: str) -> tuple[np.ndarray, np.ndarray]:
            b, s = mxfp4_to_hf(results[name][1], E * rows, cols)
            return b.reshape(E, rows, cols // 32, 16), s.reshape(E, rows, cols // 32)
        b, s = hf(n)
        if which == "gate_up":
            bu, su = hf(up)
            b, s = alternate(b, bu), alternate(s, su)
        return {pre + f"mlp.experts.{which}_proj_blocks": b, pre + f"mlp.experts.{which}_proj_scales": s}
    w = results[n][3]
    if which == "gate_up":
        w = alternate(w, results[up][3])
    return {pre + f"mlp.experts.{which}_proj": np.ascontiguousarray(w.transpose(0, 2, 1), np.float32)}


def _gptoss_hf_config(c: SynthConfig, base: dict[str, Any], quant: str) -> dict[str, Any]:
    """transformers' GptOssConfig as openai/gpt-oss-20b's config.json has it."""
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings",
            "eos_token_id", "bos_token_id", "torch_dtype")
    cfg = {k: base[k] for k in keep}
    window = c.window or 128
    cfg.update({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "attention_dropout": 0.0, "hidden_act": "silu", "intermediate_size": c.n_ff_exp,
        "num_local_experts": c.n_expert, "num_experts_per_tok": c.n_expert_used,
        "experts_per_token": c.n_expert_used, "router_aux_loss_coef": 0.0, "output_router_logits": False,
        "sliding_window": window, "swiglu_limit": 7.0, "initial_context_length": c.yarn_orig_ctx or 4096,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(c.n_layer)],
        "rope_scaling": ({"rope_type": "yarn", "factor": c.yarn_factor, "beta_fast": 32.0, "beta_slow": 1.0,
                          "original_max_position_embeddings": c.yarn_orig_ctx, "truncate": False}
                         if c.yarn_factor else None),
    })
    if quant == "mxfp4":
        cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return cfg


def _hf_name(gguf_name: str, arch: str = "llama") -> str:
    if gguf_name.startswith("blk."):
        _, i, rest = gguf_name.split(".", 2)
        if arch == "phi3" and rest in PHI3_HF_NAME_OF:
            return f"model.layers.{i}.{PHI3_HF_NAME_OF[rest]}"
        if arch in GEMMA and rest in GEMMA_HF_NAME_OF:
            return f"model.layers.{i}.{GEMMA_HF_NAME_OF[rest]}"
        return f"model.layers.{i}.{HF_NAME_OF[rest]}"
    return HF_NAME_OF[gguf_name]


def synth_llama(c: SynthConfig, quant: str, seed: int, out_dir: Path, name: str = "synth",
                formats=("gguf", "hf"), workers: int | None = None,
                tokenizer_from: Path | None = None) -> dict[str, Path]:
    """Write the model; returns {"gguf": file, "hf": folder} for what was written."""
    import gguf

    check_quant(quant)
    if (not c.head_size and c.n_embd % c.n_head) or c.n_head % c.n_head_kv or c.head_dim % 2:
        raise VkEngineError("n_embd must divide into n_head heads of even size (or head_size be set and even), "
                            "and n_head by n_head_kv")
    if c.arch not in ARCHES:
        raise VkEngineError(f"unknown llama-family architecture {c.arch!r} ({', '.join(ARCHES)})")
    if c.arch == "qwen3moe" and not c.n_expert:
        raise VkEngineError("qwen3moe needs a shape with experts (tiny-moe, qwen3-30b-a3b)")
    if c.arch == "gpt-oss" and (not c.n_expert or c.tied):
        raise VkEngineError("gpt-oss: routed experts (a MoE shape) and an untied output")
    if c.arch in GEMMA and (c.n_expert or not c.tied):
        raise VkEngineError(f"{c.arch} is dense with tied embeddings (llama.cpp's gemma2 has no output matrix)")
    if c.arch in ("qwen2", "qwen3") and c.n_expert:
        raise VkEngineError(f"{c.arch} has no experts (qwen3moe, or llama for a Mixtral-style model)")
    if c.n_expert and not (0 < c.n_expert_used <= min(c.n_expert, 16) and c.n_ff_exp > 0):
        raise VkEngineError("experts need 1 to min(n_expert, 16) used a token and n_ff_exp > 0")
    tmeta = tokenizer_meta(tokenizer_from)
    n_vocab = len(tmeta["tokenizer.ggml.tokens"])
    if c.arch == "phi3" and "<|end|>" not in tmeta["tokenizer.ggml.tokens"]:
        raise VkEngineError("phi3 needs a Phi-3 vocabulary (llama.cpp looks up its <|end|> token): "
                            "--tokenizer-from a Phi-3 GGUF, e.g. llama.cpp's models/ggml-vocab-phi-3.gguf")
    out_dir.mkdir(parents=True, exist_ok=True)
    want_hf = "hf" in formats
    plan = _tensor_plan(c, n_vocab)
    blocks = draws_blocks(s for _, s, _ in plan)
    jobs = [(n, s, std, seed, quant, c.n_head, c.n_head_kv, want_hf, c.arch == "llama", blocks) for n, s, std in plan]
    # the Hugging Face copy needs every tensor at once; GGUF alone streams
    results = make_tensors(_make_tensor, jobs, workers) if want_hf else None

    written: dict[str, Path] = {}
    if "gguf" in formats:
        path = out_dir / f"{name}-{quant}.gguf"
        tmp = path.with_suffix(".gguf.tmp")
        w = gguf.GGUFWriter(str(tmp), c.arch)
        w.add_name(name)
        w.add_context_length(c.n_ctx)
        w.add_embedding_length(c.n_embd)
        w.add_block_count(c.n_layer)
        # (Mixtral-style llama: llama.cpp takes the experts' width from feed_forward_length)
        mixtral = c.arch == "llama" and c.n_expert > 0
        w.add_feed_forward_length(c.n_ff_exp if mixtral else c.n_ff)
        w.add_head_count(c.n_head)
        w.add_head_count_kv(c.n_head_kv)
        w.add_rope_freq_base(c.rope_base)
        w.add_layer_norm_rms_eps(c.rms_eps)
        w.add_rope_dimension_count(c.head_dim)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        if c.n_expert:
            w.add_expert_count(c.n_expert)
            w.add_expert_used_count(c.n_expert_used)
            if not mixtral:
                w.add_expert_feed_forward_length(c.n_ff_exp)
        if c.arch == "gpt-oss":
            w.add_sliding_window(c.window or 128)
        if c.arch in GEMMA:
            w.add_sliding_window(_window(c))
            if c.arch == "gemma2":
                w.add_attn_logit_softcapping(c.attn_softcap)
                w.add_final_logit_softcapping(c.final_softcap)
            if c.rope_linear:
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(c.rope_linear)
        if c.yarn_factor:
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(c.yarn_factor)
            w.add_rope_scaling_orig_ctx_len(c.yarn_orig_ctx)
        if c.rope_orig_ctx:
            w.add_uint32(f"{c.arch}.rope.scaling.original_context_length", c.rope_orig_ctx)
            w.add_float32(f"{c.arch}.rope.scaling.attn_factor", _longrope_attn(c))
        w.add_vocab_size(n_vocab)
        w.add_file_type(FILE_TYPES[quant])
        w.add_string("vkengine.synth.seed", str(seed))
        w.add_string("vkengine.synth.config", json.dumps(asdict(c)))
        add_meta(w, tmeta)
        specs = [(n, s, "f32" if std <= 0.0 else tensor_quant(n, quant)) for n, s, std in plan]
        write_gguf_tensors(w, specs, (results[n] for n, _, _ in plan) if results is not None
                           else iter_tensors(_make_tensor, jobs, workers))
        os.replace(tmp, path)
        written["gguf"] = path
    if results is not None:
        from safetensors.numpy import save_file
        folder = out_dir / f"{name}-{quant}-hf"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for n, _, _ in plan if c.arch == "gpt-oss" else ():
            tensors.update(_gptoss_hf_tensor(c, n, results, quant))
        for n, _, _ in plan if c.arch != "gpt-oss" else ():
            if n.endswith("ffn_up_exps.weight") or n.startswith("rope_factors_"):   # (factors: in config.json)
                continue
            v = results[n][3]
            if n.endswith("ffn_gate_exps.weight"):     # (E, 2F, D): [gate | up] per expert
                v = np.concatenate([v, results[n.replace("gate_exps", "up_exps")][3]], axis=1)
            if c.arch in GEMMA and n.endswith("norm.weight"):   # (Gemma's RMSNorm adds the 1 the GGUF holds)
                v = v - np.float32(1.0)
            tensors[_hf_name(n, c.arch)] = np.ascontiguousarray(v, np.float32)
        save_file(tensors, str(folder / "model.safetensors"))
        hf_arch = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                   "qwen3": ("Qwen3ForCausalLM", "qwen3"), "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
                   "phi3": ("Phi3ForCausalLM", "phi3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
                   "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
                   "gpt-oss": ("GptOssForCausalLM", "gpt_oss")}[c.arch]
        mixtral = c.arch == "llama" and c.n_expert > 0
        if mixtral:
            hf_arch = ("MixtralForCausalLM", "mixtral")     # (its intermediate_size: the experts' width)
        cfg = {
            "architectures": [hf_arch[0]], "model_type": hf_arch[1], "vocab_size": n_vocab,
            "hidden_size": c.n_embd, "intermediate_size": c.n_ff_exp if mixtral else c.n_ff,
            "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_base, "max_position_embeddings": c.n_ctx,
            "tie_word_embeddings": c.tied, "hidden_act": "silu", "torch_dtype": "float32",
            "bos_token_id": tmeta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": tmeta.get("tokenizer.ggml.eos_token_id"),
            **({"use_sliding_window": False, "attention_bias": c.arch == "qwen2"}
               if c.arch not in ("llama", "phi3") else {}),
            **({"rope_scaling": {"rope_type": "yarn", "factor": c.yarn_factor,
                                 "original_max_position_embeddings": c.yarn_orig_ctx}} if c.yarn_factor else {}),
            **({"rope_scaling": {"type": "longrope", "long_factor": results["rope_factors_long.weight"][3].tolist(),
                                 "short_factor": results["rope_factors_short.weight"][3].tolist()},
                "original_max_position_embeddings": c.rope_orig_ctx} if c.rope_orig_ctx else {}),
            **({"num_experts": c.n_expert, "num_local_experts": c.n_expert, "num_experts_per_tok": c.n_expert_used,
                "moe_intermediate_size": c.n_ff_exp, "norm_topk_prob": True, "decoder_sparse_step": 1,
                "mlp_only_layers": [], "router_aux_loss_coef": 0.0, "output_router_logits": False}
               if c.n_expert else {}),
        }
        if c.arch in GEMMA:
            cfg.update(_gemma_hf_config(c))
        if c.arch == "gpt-oss":
            cfg = _gptoss_hf_config(c, cfg, quant)
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        write_hf_tokenizer(folder, tmeta)
        written["hf"] = folder
    return written


