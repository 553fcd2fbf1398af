"""Tokenizer from GGUF metadata (BPE vocab, merges, pre-tokenizer type, special
tokens) built with the `tokenizers` library, so that it splits text exactly as
llama.cpp does on the same file; the chat template rendered with jinja2;
a streaming detokenizer that never emits half a UTF-8 character."""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import VkEngineError

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` (src/llama-vocab.cpp).
# Each entry is a list of regexes applied in turn (isolating matches), then the
# GPT-2 byte-level mapping.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5 keeps combining marks with letters (llama.cpp llama-vocab.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35)
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# gpt-oss's o200k (llama.cpp LLAMA_VOCAB_PRE_TYPE_GPT4O; the tokenizer.json form, which the tokenizers
# library's regex engine runs as it is)
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS: dict[str, list[str]] = {
    "gpt-4o": [_GPT4O],
    "default": [_GPT2],
    "gpt2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
}

IGNORE_MERGES = ("llama3", "llama-v3", "llama-bpe")

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@dataclass
class Tokenizer:
    hf: Any                          # tokenizers.Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    eot_ids: frozenset[int] = frozenset()   # tokens that end a turn (EOS, <|im_end|>, ...)
    chat_template: str | None = None
    special_ids: frozenset[int] = frozenset()
    space_prefix: bool = False       # (SentencePiece) the tokenizer put a space before the text

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """The text of ids, every piece as it is (a SentencePiece vocabulary's
        first token keeps the space its tokenizer put before the text, as
        llama-server's /detokenize and streamed pieces keep it)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def token_text(self, i: int) -> str:
        return self.hf.id_to_token(i) or ""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat template rendered (extra: more template variables, e.g. tools), in
        the environment Hugging Face's apply_chat_template gives templates (their
        released files are written for it): raise_exception, strftime_now (gpt-oss's
        template dates its system message), the loop controls, and a tojson that
        keeps non-ASCII text and quotes as they are. A template that refuses a
        system message (Gemma 2's raises "System role not supported") gets it at the
        head of the first user message, and one that refuses the tool role (Gemma's
        alternate user and model only) or drops it unsaid (Phi-3.5's) the tool replies
        as user turns, as llama.cpp's chat templates do."""
        if not self.chat_template:
            raise VkEngineError("this model has no chat template (tokenizer.chat_template); use a raw prompt")
        first: VkEngineError | None = None
        try:
            text = self._render(messages, add_generation_prompt, extra)
            if _replies_kept(messages, text):
                return text
        except VkEngineError as e:
            first = e
        # llama.cpp's polyfills for what a template refuses: the system message in the first user turn,
        # tool replies as user turns (Gemma's templates only alternate user and model), tool-call ids of
        # 9 letters and digits (Mistral's templates refuse others)
        sys_merged = _system_into_first_user(messages)
        tools_user = _tool_as_user(messages)
        both = _tool_as_user(sys_merged) if sys_merged is not None else None
        for conv in (sys_merged, tools_user, both, _short_call_ids(messages)):
            if conv is not None:
                try:
                    text = self._render(conv, add_generation_prompt, extra)
                    if _replies_kept(conv, text):
                        return text
                except VkEngineError:
                    pass
        if first is not None:
            raise first
        raise VkEngineError("the chat template drops the tool replies of the conversation (role 'tool'), "
                            "and again when they are given as user turns")

    def _render(self, messages: list[dict], add_generation_prompt: bool, extra: dict) -> str:
        from jinja2 import TemplateError
        assert self.chat_template is not None
        try:
            tmpl = _compiled_template(self.chat_template)
            return tmpl.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.token_text(self.bos_id) if self.bos_id is not None else "",
                eos_token=self.token_text(self.eos_id) if self.eos_id is not None else "", **extra)
        except TemplateError as e:
            raise VkEngineError(f"chat template failed to render: {e}") from e

    def stream(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Incremental detokenization: feed ids, get the text that became final
    (a multi-byte character split across tokens is held back until complete).

    Each token decodes a window of the last few ids, not the whole reply (the
    offsets of vLLM's and TGI's incremental detokenizers): the text a token
    adds is decode(ids[prefix:]) past decode(ids[prefix:read]), where read is
    where the last text came out and prefix where the text before it did, so
    a first token's leading space (SentencePiece) and bytes that complete a
    character across tokens come out as decode(ids) has them. Decoding the
    whole reply again for every token cost O(n) a token: 0.64 ms a token at
    4,000 tokens of a reply, 1.4 ms at 8,000 (notes.md run 47)."""

    def __init__(self, tok: Tokenizer, skip_special: bool = False):
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0           # the window's first id
        self.read = 0             # ids before this one have come out as text
        self.skip_special = skip_special

    def _step(self, final: bool) -> str:
        ids, skip = self.ids, self.skip_special
        before = self.tok.decode(ids[self.prefix:self.read], skip) if self.read > self.prefix else ""
        text = self.tok.decode(ids[self.prefix:], skip)
        if not final and (text.endswith("\ufffd") or len(text) <= len(before)):
            return ""             # incomplete UTF-8 sequence (or nothing new): wait for more ids
        self.prefix, self.read = self.read, len(ids)
        return text[len(before):]

    def feed(self, token: int) -> str:
        self.ids.append(token)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)


def from_gguf(meta) -> Tokenizer:
    """`meta(key, default)` reads GGUF metadata."""
    from tokenizers import Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = meta("tokenizer.ggml.model", None)
    if kind == "llama":
        return _spm_from_gguf(meta)
    if kind != "gpt2":
        raise VkEngineError(f"tokenizer model {kind!r} is not supported (supported: gpt2 byte-level BPE, "
                            "llama SentencePiece BPE)")
    tokens = list(meta("tokenizer.ggml.tokens"))
    merges_raw = list(meta("tokenizer.ggml.merges"))
    types = list(meta("tokenizer.ggml.token_type", [1] * len(tokens)))
    pre = meta("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise VkEngineError(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    # Llama 3's pre-tokenizer types take a word that is a token as it is, without its merges
    # (llama-vocab.cpp: ignore_merges for LLAMA_VOCAB_PRE_TYPE_LLAMA3; tokenizer.json's ignore_merges)
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in IGNORE_MERGES)
    hf = HFTokenizer(bpe)
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZERS[pre]]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    _add_tokens(hf, tokens, types)
    return _finish(hf, meta, vocab, types, add_bos_default=False)


def _add_tokens(hf, tokens: list[str], types: list[int], rstrip: bool = False) -> None:
    """The vocabulary's control tokens as special tokens, its user-defined ones as added tokens.
    rstrip: each of them (but <unk>, <s>, <|endoftext|>) takes the whitespace after it (llama.cpp's
    llama-vocab.cpp does so for models whose general.name says phi-3 or phi3, as Phi-3's HF tokenizer's
    added tokens have rstrip)."""
    from tokenizers import AddedToken

    def strip(i: int) -> bool:
        return rstrip and tokens[i] not in ("<unk>", "<s>", "<|endoftext|>")
    specials = [AddedToken(tokens[i], special=True, normalized=False, rstrip=strip(i))
                for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL]
    user = [AddedToken(tokens[i], special=False, normalized=False, rstrip=strip(i))
            for i, t in enumerate(types) if t == TOKEN_TYPE_USER_DEFINED]
    if specials:
        hf.add_special_tokens(specials)
    if user:
        hf.add_tokens(user)


def _finish(hf, meta, vocab: dict[str, int], types: list[int], add_bos_default: bool,
            space_prefix: bool = False) -> Tokenizer:
    """The Tokenizer of a GGUF vocabulary built into hf: its special ids and chat template."""
    bos = meta("tokenizer.ggml.bos_token_id", None)
    eos = meta("tokenizer.ggml.eos_token_id", None)
    eot = meta("tokenizer.ggml.eot_token_id", None)
    eot_ids = {int(x) for x in (eos, eot) if x is not None}
    for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<end_of_turn>", "<|return|>", "<|call|>"):
        if name in vocab and types[vocab[name]] == TOKEN_TYPE_CONTROL:
            eot_ids.add(vocab[name])
    if "<|return|>" in vocab and "<|call|>" in vocab and "<|end|>" in vocab:
        # gpt-oss's harmony format: <|end|> closes a message (the analysis channel's, before the final
        # answer), <|return|> and <|call|> end the turn (llama.cpp's llama-vocab.cpp drops <|end|> so too)
        eot_ids.discard(vocab["<|end|>"])
    return Tokenizer(
        hf=hf, bos_id=None if bos is None else int(bos), eos_id=None if eos is None else int(eos),
        add_bos=bool(meta("tokenizer.ggml.add_bos_token", add_bos_default)), eot_ids=frozenset(eot_ids),
        chat_template=meta("tokenizer.chat_template", None),
        special_ids=frozenset(i for i, t in enumerate(types) if t == TOKEN_TYPE_CONTROL),
        space_prefix=space_prefix)


def _spm_from_gguf(meta) -> Tokenizer:
    """A SentencePiece BPE vocabulary (tokenizer.ggml.model "llama": Llama 2,
    Mistral, Mixtral, Phi-3, Gemma 1-3) as llama.cpp's llm_tokenizer_spm
    tokenizes it: spaces as U+2581, a space put before the text (and after each
    special token) where tokenizer.ggml.add_space_prefix says so (default yes),
    then pairs merged by the score of the piece they make, characters outside
    the vocabulary as <0xXX> byte tokens. Built as the `tokenizers` library's BPE
    with merges ranked by those scores (transformers' SentencePieceExtractor
    does the same), which the library then runs in Rust."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    tokens = list(meta("tokenizer.ggml.tokens"))
    scores = list(meta("tokenizer.ggml.scores", [0.0] * len(tokens)))
    types = list(meta("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(scores) != len(tokens) or len(types) != len(tokens):
        raise VkEngineError("invalid tokenizer metadata: tokens, scores and token types differ in length")
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t: i for i, t in enumerate(tokens) if types[i] in (TOKEN_TYPE_NORMAL, TOKEN_TYPE_USER_DEFINED)}
    merges = []
    for piece, i in mergeable.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], i, mergeable[left], mergeable[right], left, right))
    merges.sort()
    unk = meta("tokenizer.ggml.unknown_token_id", None)
    bpe = models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], byte_fallback=True, fuse_unk=True,
                     unk_token=tokens[int(unk)] if unk is not None else None)
    hf = HFTokenizer(bpe)
    space_prefix = bool(meta("tokenizer.ggml.add_space_prefix", True))
    norm = [normalizers.Replace(" ", "\u2581")]
    hf.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if space_prefix else []) + norm)
    hf.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    name = str(meta("general.name", "") or "").lower()
    _add_tokens(hf, tokens, types, rstrip="phi-3" in name or "phi3" in name)
    return _finish(hf, meta, vocab, types, add_bos_default=True, space_prefix=space_prefix)


def from_hf_folder(folder: Path) -> Tokenizer:
    """tokenizer.json (+ tokenizer_config.json for BOS/EOS and the chat template)."""
    from tokenizers import Tokenizer as HFTokenizer
    tj = folder / "tokenizer.json"
    if not tj.is_file():
        raise VkEngineError(f"{folder} has no tokenizer.json")
    hf = HFTokenizer.from_file(str(tj))
    cfg = {}
    if (folder / "tokenizer_config.json").is_file():
        cfg = json.loads((folder / "tokenizer_config.json").read_text())

    def tid(key):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return hf.token_to_id(v) if v else None

    bos, eos = tid("bos_token"), tid("eos_token")
    eot = {x for x in (eos,) if x is not None}
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        i = hf.token_to_id(name)
        if i is not None:
            eot.add(i)
    specials = frozenset(i for t, i in hf.get_vocab(with_added_tokens=True).items()
                         if t in {a.content for a in hf.get_added_tokens_decoder().values() if a.special})
    return Tokenizer(hf=hf, bos_id=bos, eos_id=eos, add_bos=bool(cfg.get("add_bos_token", False)),
                     eot_ids=frozenset(eot), chat_template=cfg.get("chat_template"), special_ids=specials)


@functools.lru_cache(maxsize=8)
def _compiled_template(source: str):
    """A chat template compiled once (a request with polyfills renders it up to five
    times) in the environment Hugging Face's apply_chat_template gives templates."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise VkEngineError(f"chat template: {msg}")

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = tojson
    return env.from_string(source)


def _system_into_first_user(messages: list[dict]) -> list[dict] | None:
    """The conversation with its leading system message(s) put at the head of the
    first user message (None: no system message to move)."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    if not n:
        return None
    system = "\n\n".join(str(m.get("content") or "") for m in messages[:n])
    rest = [dict(m) for m in messages[n:]]
    for m in rest:
        if m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):   # content parts: the system text as a part before them
                m["content"] = [{"type": "text", "text": system + "\n\n"}, *content]
            else:
                m["content"] = f"{system}\n\n{content or ''}"
            return rest
    return [{"role": "user", "content": system}, *rest]


def _tool_as_user(messages: list[dict] | None) -> list[dict] | None:
    """The conversation with its tool replies as user turns, consecutive turns of
    one role joined (None: no tool reply)."""
    if messages is None or not any(m.get("role") == "tool" for m in messages):
        return None
    out: list[dict] = []
    for m in messages:
        m = {**m, "role": "user"} if m.get("role") == "tool" else dict(m)
        if out and out[-1].get("role") == m["role"] and isinstance(out[-1].get("content"), str) \
                and isinstance(m.get("content"), str) and not out[-1].get("tool_calls") and not m.get("tool_calls"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def _replies_kept(messages: list[dict], text: str) -> bool:
    """Whether every tool reply's text is in the rendered conversation (some
    templates skip the roles they do not know)."""
    def kept(c: str) -> bool:   # as it is, or as a JSON string (Llama 3.1's template writes it so)
        return c in text or json.dumps(c) in text or json.dumps(c, ensure_ascii=False) in text
    return all(kept(m["content"]) for m in messages
               if m.get("role") == "tool" and isinstance(m.get("content"), str) and m["content"])


def _short_call_ids(messages: list[dict]) -> list[dict] | None:
    """The conversation with its tool-call ids (and the replies' tool_call_id) as 9
    letters and digits, the same id for the same original (None: no ids)."""
    def short(i: object) -> str:
        return hashlib.sha256(str(i).encode()).hexdigest()[:9]
    if not any(m.get("tool_calls") or m.get("tool_call_id") for m in messages):
        return None
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": short(c.get("id"))} if c.get("id") is not None else c
                               for c in m["tool_calls"]]
        if m.get("tool_call_id") is not None:
            m["tool_call_id"] = short(m["tool_call_id"])
        out.append(m)
    return out
