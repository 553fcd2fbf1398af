"""Generation: `generate()` is the one iterator that the CLI, the parity harness
and tests consume (the server's scheduler batches many sequences but shares
`OutputStream` and `Sampler` with it).

Prefill runs the prompt in chunks through the matmul kernels; each decode step
replays one pre-recorded command sequence and reads back one word (greedy) or
one logits row (sampling, repetition penalty).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .engine import Engine
from .errors import VkEngineError
from .kernels import Kernels
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer


@dataclass
class Step:
    token: int
    text: str                 # text that became final with this token (may be "")
    finish: str | None        # None, "stop" (EOS or stop string), "length" (max tokens or context)


@dataclass
class GenStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes from the prefill; decode steps produce the rest
        return (self.generated - 1) / self.decode_s if self.decode_s and self.generated > 1 else 0.0


class OutputStream:
    """Per-sequence output rules: incremental detokenization, end-of-turn tokens,
    stop strings (text that could still become a stop string is held back), and
    the token budget."""

    def __init__(self, tok: Tokenizer, max_tokens: int, stop: Sequence[str] = (), ignore_eos: bool = False):
        if max_tokens < 0:
            raise VkEngineError("max_tokens must be >= 0")
        self.tok = tok
        self.dec = tok.stream()
        self.max_tokens = max_tokens
        self.stop = [s for s in stop if s]
        self.ignore_eos = ignore_eos
        self.n = 0
        self.text = ""            # all final text so far
        self.sent = 0             # characters of self.text already returned
        self.finish: str | None = None
        self.stop_word: str | None = None   # the stop string that ended the output, if one did

    def push(self, token: int) -> tuple[str, str | None]:
        """Account for one generated token; returns (text to emit, finish reason)."""
        self.n += 1
        if not self.ignore_eos and token in self.tok.eot_ids:
            self.finish = "stop"
            return self._release(len(self.text)), self.finish
        self.text += self.dec.feed(token)
        for s in self.stop:
            i = self.text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0:
                self.text = self.text[:i]
                self.finish, self.stop_word = "stop", s
                return self._release(len(self.text)), self.finish
        if self.n >= self.max_tokens:
            self.text += self.dec.flush()
            self.finish = "length"
            return self._release(len(self.text)), self.finish
        hold = 0
        for s in self.stop:   # longest suffix of text that is a prefix of a stop string
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return self._release(len(self.text) - hold), None

    def may_finish(self, token: int) -> bool:
        """Whether push(token) may return a finish reason: an end-of-turn token,
        the last token of the budget, or (text-dependent) any token when there
        are stop strings. False means push(token) will not finish."""
        return (bool(self.stop) or self.n + 1 >= self.max_tokens
                or (not self.ignore_eos and token in self.tok.eot_ids))

    def _release(self, upto: int) -> str:
        out = self.text[self.sent:upto]
        self.sent = max(self.sent, upto)
        return out

    def truncated(self) -> str:
        """Finish for lack of context; returns the held-back text."""
        self.finish = "length"
        self.text += self.dec.flush()
        return self._release(len(self.text))


def generate(engine: Engine, prompt: Sequence[int], max_tokens: int = 128,
             sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (), slot: int = 0,
             ignore_eos: bool = False, stats: GenStats | None = None) -> Iterator[Step]:
    """Yield generated tokens for `prompt` (token ids) in KV slot `slot`."""
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise VkEngineError("the prompt is empty")
    if len(prompt) >= engine.n_ctx:
        raise VkEngineError(f"the prompt has {len(prompt)} tokens; the context length is {engine.n_ctx} "
                            "(use a shorter prompt or a larger --ctx)")
    sampler = Sampler(sampling)
    out = OutputStream(engine.model.tokenizer, max_tokens, stop, ignore_eos)
    st = stats if stats is not None else GenStats()
    st.prompt_tokens = len(prompt)
    if max_tokens == 0:
        return
    # sampled tokens are drawn on the device when it can (the server's rule)
    on_device = getattr(engine, "can_sample", False) and sampling.drawn_on_device(Kernels.SAMPLE_K)
    readback = "sample" if on_device else "logits" if sampling.needs_logits else "argmax"
    history = list(prompt)

    def row():
        return [sampling.device_row(sampler.uniform())] if on_device else None

    def pick(r) -> int:
        return int(r) if readback in ("argmax", "sample") else sampler(r, history)

    t0 = time.perf_counter()
    tok = pick(engine.prefill(prompt, slot, 0, readback, sampling=row()))
    st.prefill_s = time.perf_counter() - t0
    pos = len(prompt)
    t1 = time.perf_counter()
    while True:
        history.append(tok)
        st.generated += 1
        text, finish = out.push(tok)
        if finish is None and pos >= engine.n_ctx:
            text += out.truncated()
            finish = "length"
        yield Step(tok, text, finish)
        if finish is not None:
            break
        r = engine.step([tok], [pos], [slot], [0], readback, sampling=row())
        pos += 1
        tok = pick(r[0])
        st.decode_s = time.perf_counter() - t1
