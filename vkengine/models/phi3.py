"""Phi-3, Phi-3.5 and Phi-4 (GGUF architecture phi3): the llama graph with q|k|v
in one matrix (attn_qkv) and gate|up in one (ffn_up: [gate | up]), RoPE on
split halves (partial where the file says: Phi-4-mini), and LongRoPE for the
128k models: per-frequency divisors (the long ones where a sequence's context
exceeds the original one, llama.cpp's rule) and cos/sin scaled by the
attention factor (llama.cpp's src/models/phi3.cpp; transformers' Phi3 and
_compute_longrope_parameters). llama.cpp turns Phi-3's sliding window off
("Phi SWA is currently disabled"), and so does this. llama.py holds the graph."""
from __future__ import annotations

from .llama import HF_NAMES, Llama


class Phi3(Llama):
    names = ("phi3",)
    hf_architectures = ("Phi3ForCausalLM",)
    hf_names = {
        **HF_NAMES,
        r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight": r"blk.\1.attn_qkv.weight",
        r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight": r"blk.\1.ffn_up.weight",
    }


ARCHITECTURE = Phi3()
