"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (per-head q/k
norms, RoPE on split halves) and in every layer a mixture of routed experts
without a shared one: top-k of a softmax over the router's logits,
renormalized (norm_topk_prob; llama.cpp's src/models/qwen3moe.cpp,
build_moe_ffn with norm_w). llama.py holds the graph; this module names it."""
from __future__ import annotations

from .llama import HF_MOE_NAMES, Llama
from .qwen3 import Qwen3


class Qwen3Moe(Llama):
    names = ("qwen3moe",)
    hf_architectures = ("Qwen3MoeForCausalLM",)
    hf_names = {**Qwen3.hf_names, **HF_MOE_NAMES}


ARCHITECTURE = Qwen3Moe()
