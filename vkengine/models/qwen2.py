"""Qwen2 / Qwen2.5 (and the DeepSeek-R1 distills built on them): the llama graph
with q, k and v biases and RoPE on split halves (llama.cpp's
src/models/qwen2.cpp; transformers' Qwen2Attention, whose q/k/v projections
always carry a bias). llama.py holds the graph; this module names it."""
from __future__ import annotations

from .llama import HF_NAMES, Llama


class Qwen2(Llama):
    names = ("qwen2",)
    hf_architectures = ("Qwen2ForCausalLM",)
    hf_names = HF_NAMES     # (its q/k/v biases are in llama's names)


ARCHITECTURE = Qwen2()
