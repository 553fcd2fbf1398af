"""Gemma 2: gemma3.py's graph with Gemma 2's differences (llama.cpp's
src/models/gemma2.cpp, transformers' Gemma2ForCausalLM): no q/k norms, every
other layer a sliding-window one (window 4096 unless the file says; layer 0
first), one RoPE base for both kinds, and scores and logits soft-capped
(cap * tanh(x / cap): 50 and 30 unless the file says)."""
from __future__ import annotations

from .gemma3 import HF_NAMES, Gemma3


class Gemma2(Gemma3):
    names = ("gemma2",)
    hf_architectures = ("Gemma2ForCausalLM",)
    hf_names = HF_NAMES
    kind = "gemma2"


ARCHITECTURE = Gemma2()
