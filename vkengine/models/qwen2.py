"""Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills built on them): the llama graph
with q, k and v biases and RoPE on split halves (llama.cpp's
src/models/qwen2.cpp; transformers' Qwen2Attention, whose q/k/v projections
always carry a bias). llama.py holds the graph; this module names it."""
from __future__ import annotations

from .llama import HF_NAMES, Llama


class Qwen2(Llama):
    names = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
    hf_names = {
        **HF_NAMES,
        r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias": r"blk.\1.attn_q.bias",
        r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias": r"blk.\1.attn_k.bias",
        r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias": r"blk.\1.attn_v.bias",
    }


ARCHITECTURE = Qwen2()
