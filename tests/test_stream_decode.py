"""StreamDecoder (incremental detokenization over a window of ids) against
decoding the whole reply at once, and token by token against the algorithm it
replaced (the whole reply decoded again for every token), on llama.cpp's test
vocabularies: SentencePiece with byte fallback (llama-spm, phi-3) and
byte-level BPE (llama-bpe, qwen2, qwen35), over their test texts (many scripts,
emoji, whitespace runs), random ids (partial UTF-8 sequences, byte tokens) and
special tokens, with and without skipping them."""
from __future__ import annotations

import numpy as np
import pytest

from vkengine.gguf_file import GGUFFile
from vkengine.tokenizer import StreamDecoder, Tokenizer, from_gguf

from .test_tokenizer_spm import vocab_dir  # noqa: F401 (the fixture)

VOCABS = ["llama-spm", "phi-3", "llama-bpe", "qwen2", "qwen35"]


class WholeReply:
    """The decoder StreamDecoder replaced: the whole reply decoded for every token."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self.tok, self.ids, self.emitted, self.skip = tok, [], 0, skip_special

    def feed(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids, self.skip)
        if text.endswith("\ufffd"):
            return ""
        out = text[self.emitted:]
        self.emitted = len(text)
        return out

    def flush(self) -> str:
        text = self.tok.decode(self.ids, self.skip)
        out = text[self.emitted:]
        self.emitted = len(text)
        return out


def _pieces(dec, ids) -> list[str]:
    return [dec.feed(t) for t in ids] + [dec.flush()]


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request, vocab_dir):  # noqa: F811
    path = vocab_dir / f"ggml-vocab-{request.param}.gguf"
    tok = from_gguf(GGUFFile(path).meta)
    texts = path.with_suffix(".gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    return tok, [t for t in texts if t]


def test_texts_token_by_token(vocab):
    """Each test text's ids (and all of them as one reply): the same text
    piece for every token as the whole-reply decoder, and the whole text."""
    tok, texts = vocab
    replies = [tok.encode(t, add_special=False) for t in texts]
    replies.append([i for r in replies for i in r])
    for ids in replies:
        assert _pieces(StreamDecoder(tok), ids) == _pieces(WholeReply(tok), ids), tok.decode(ids)
        assert "".join(_pieces(StreamDecoder(tok), ids)) == tok.decode(ids)


@pytest.mark.parametrize("skip_special", [False, True])
def test_random_ids_and_special_tokens(vocab, skip_special):
    """Random ids over the whole vocabulary (byte tokens, pieces of multi-byte
    characters, special tokens among them): the whole reply's text, and the
    same pieces as the whole-reply decoder."""
    tok, _ = vocab
    rng = np.random.default_rng(7)
    specials = sorted(tok.special_ids) or [0]
    for n in (1, 2, 17, 300):
        ids = [int(x) for x in rng.integers(0, tok.vocab_size, n)]
        for i in rng.integers(0, n, max(1, n // 20)):   # special tokens here and there
            ids[int(i)] = int(rng.choice(specials))
        got = _pieces(StreamDecoder(tok, skip_special), ids)
        assert got == _pieces(WholeReply(tok, skip_special), ids)
        assert "".join(got) == tok.decode(ids, skip_special)
