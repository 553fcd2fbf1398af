"""Constrained decoding: a request's tokens held to a grammar (a JSON schema,
a GBNF grammar, JSON), through llguidance, the constrained-decoding library
behind llama.cpp's and vLLM's guidance backends.

Why llguidance (over xgrammar, the other maintained library): it builds its
token masks from the `tokenizers` JSON that our GGUF vocabularies already are
(byte-level BPE and SentencePiece with byte fallback alike), ships abi3 wheels
with no torch dependency (xgrammar needs torch, which the engine does not
use), is MIT-licensed, reads llama.cpp's GBNF as well as JSON schemas, and
computes a mask in tens of microseconds on a 49k vocabulary (28 us measured
on SmolLM2's, 12 us on Phi-3's 32k, this machine's CPU, 2026-12-03; its
masks are lazy over the grammar's lexer, so the cost follows what the grammar
allows rather than the vocabulary's size). On Qwen's 151,936-token vocabulary
a JSON string's interior (nearly every token allowed, the dearest mask) took
198.5 us median, 550 us p99 on the H200 machine's CPU (docs/bench/notes.md run 33).

The mask applies where the row's token is chosen: on the device (the step's
masked pick, Engine.submit(masked=True): a bitmask a row, computed while the
GPU runs the step's forward) for greedy and device-drawn rows, on the host for
rows whose logits come back anyway (logprobs, logit_bias, a host sampler).
Rows that asked for none keep their own sampling and chaining. Each request's matcher advances with every
token it takes; when the grammar allows nothing more the request ends
("stop").
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import VkEngineError

_LOCK = threading.Lock()
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llg():
    try:
        import llguidance
    except ImportError as e:          # pragma: no cover (a dependency)
        raise VkEngineError("constrained decoding needs the llguidance package (pip install llguidance)") from e
    return llguidance


def ll_tokenizer(tok) -> Any:
    """llguidance's view of a Tokenizer (built once, ~0.3 s, kept on it)."""
    with _LOCK:
        llt = getattr(tok, "_llg", None)
        if llt is None:
            eos = sorted(tok.eot_ids)
            try:
                llt = _llg().LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=eos or None)
            except TypeError:
                # older llguidance (1.6) takes one end-of-turn id, not a list: the first (a constrained
                # reply still ends where its grammar is complete)
                llt = _llg().LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size, eos_token=eos[0] if eos else None)
            object.__setattr__(tok, "_llg", llt)
        return llt


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (llguidance's form) and where it came from."""
    text: str          # llguidance grammar text
    source: str        # the request field it came from, for messages


def compile_grammar(tok, kind: str, spec: Any, source: str) -> Grammar:
    """kind: "json_schema" (spec a schema object), "json" (any JSON object),
    "gbnf" (spec llama.cpp GBNF text) or "lark" (llguidance's Lark). A grammar that does not compile against
    the model's vocabulary raises VkEngineError naming `source`."""
    llg = _llg()
    try:
        if kind in ("json_schema", "json"):
            schema = dict(spec) if kind == "json_schema" else {"type": "object"}
            # JSON as json.dumps writes it (", " and ": ", no other whitespace): llguidance's default lets
            # whitespace run on between tokens, which a model may then do without end
            schema.setdefault("x-guidance", JSON_OPTIONS)
            text = llg.grammar_from("json_schema", json.dumps(schema))
        elif kind == "gbnf":
            text = llg.grammar_from("gbnf", spec)
        elif kind == "lark":
            text = llg.grammar_from("lark", spec)
        else:
            raise VkEngineError(f"internal: grammar kind {kind!r}")
        m = llg.LLMatcher(ll_tokenizer(tok), text)
    except VkEngineError:
        raise
    except Exception as e:            # (what the library says of input it cannot take, whatever its type)
        raise VkEngineError(f"'{source}' does not compile: {e}") from None
    if m.get_error():
        raise VkEngineError(f"'{source}' does not compile: {m.get_error()}")
    if not _mask(m, _words(ll_tokenizer(tok))).any():
        raise VkEngineError(f"'{source}' admits no output at all")
    return Grammar(text, source)


def _words(llt) -> np.ndarray:
    """A token bitmask's words (bit t of word t // 32: token t allowed)."""
    return np.zeros((llt.vocab_size + 31) // 32, np.int32)


def _mask(m, words: np.ndarray) -> np.ndarray:
    """The matcher's mask for its next token, into words."""
    m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    return words


class Constraint:
    """One request's matcher: masks its logits rows, takes its tokens."""

    def __init__(self, tok, grammar: Grammar):
        llg = _llg()
        self.llt = ll_tokenizer(tok)
        self.m = llg.LLMatcher(self.llt, grammar.text)
        self.source = grammar.source
        self.words = _words(self.llt)

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """A copy of the logits row with every token the grammar forbids at -inf
        (all of them at a dead end)."""
        words = _mask(self.m, self.words)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: logits.shape[-1]].astype(bool)
        if allowed.size < logits.shape[-1]:          # (rows past the tokenizer's vocabulary: never allowed)
            allowed = np.concatenate([allowed, np.zeros(logits.shape[-1] - allowed.size, bool)])
        return np.where(allowed, logits, np.float32(-np.inf)).astype(logits.dtype, copy=False)

    def mask_into(self, out: np.ndarray) -> bool:
        """The mask of the next token into out (uint32 words, a bit a token, as
        Engine.submit's masks; tokens past the tokenizer's vocabulary never
        allowed); False when nothing is allowed (a dead end)."""
        words = _mask(self.m, self.words).view(np.uint32)
        k = min(len(words), len(out))
        out[:k] = words[:k]
        out[k:] = 0
        return bool(out.any())

    def take(self, token: int) -> bool:
        """Advance by the chosen token (False: the grammar refused it)."""
        return bool(self.m.consume_token(int(token)))

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows no further token."""
        return bool(self.m.is_stopped())
