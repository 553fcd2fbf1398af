"""Per-sequence output rules, shared by every consumer of the runner:
incremental detokenization, end-of-turn tokens, stop strings and the token
budget."""
from __future__ import annotations

from collections.abc import Sequence

from ..errors import VkEngineError
from ..tokenizer import Tokenizer


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
