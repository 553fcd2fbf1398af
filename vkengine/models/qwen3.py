"""Qwen3 (dense): the llama graph with a per-head RMSNorm of q and k before
RoPE on split halves, no biases, head size from the file rather than
n_embd / n_head (llama.cpp's src/models/qwen3.cpp; transformers'
Qwen3Attention q_norm/k_norm). llama.py holds the graph; this module names it."""
from __future__ import annotations

from .llama import HF_NAMES, Llama


class Qwen3(Llama):
    names = ("qwen3",)
    hf_architectures = ("Qwen3ForCausalLM",)
    hf_names = {
        **HF_NAMES,
        r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight": r"blk.\1.attn_q_norm.weight",
        r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight": r"blk.\1.attn_k_norm.weight",
    }


ARCHITECTURE = Qwen3()
