"""A chat reply's reasoning apart from its answer, as llama-server's
--reasoning-format auto gives it (`reasoning_content` beside `content`):

- think: `<think>...</think>` before the answer (Qwen3, QwQ, the DeepSeek-R1
  distills; their templates may open the block in the prompt itself, so the
  reply may start inside it);
- harmony (gpt-oss): messages `<|channel|>analysis<|message|>...<|end|>` (the
  reasoning), `<|channel|>final<|message|>...` (the answer), and commentary
  addressed `to=functions.NAME` (a tool call, its arguments the message),
  separated by `<|start|>assistant`.

Split works on the reply's whole text so far and only ever grows both parts
(a tail that may be the start of a marker is held back until it is not), so a
stream can send each part's new characters as they come.
"""
from __future__ import annotations

import json
import re

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MODES = ("auto", "deepseek", "none")      # llama-server's reasoning_format values we take (deepseek: auto)


def mode_for(template: str | None) -> str | None:
    """The reply format a chat template's model writes: harmony, think or None."""
    if not template:
        return None
    if "<|channel|>" in template and "<|message|>" in template:
        return "harmony"
    if THINK_CLOSE in template:
        return "think"
    return None


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of text that may be the start of a marker."""
    for k in range(min(max(len(m) for m in markers) - 1, len(text)), 0, -1):
        tail = text[len(text) - k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class ReasoningSplit:
    def __init__(self, mode: str, prompt_text: str):
        self.mode = mode
        # a think block the prompt opened (DeepSeek-R1's template ends with "<think>\n")
        self.open_at_start = mode == "think" and prompt_text.rstrip().endswith(THINK_OPEN)

    def split(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        """(reasoning, answer, harmony tool calls) of the reply so far."""
        if self.mode == "harmony":
            return self._harmony(text, final)
        return (*self._think(text, final), [])

    def _think(self, text: str, final: bool) -> tuple[str, str]:
        start = 0
        if not self.open_at_start:
            s = text.lstrip()
            if s.startswith(THINK_OPEN):
                start = len(text) - len(s) + len(THINK_OPEN)
            elif not final and THINK_OPEN.startswith(s):
                return "", ""                     # may become "<think>": nothing is decided yet
            else:
                return "", text
        i = text.find(THINK_CLOSE, start)
        if i >= 0:
            return text[start:i].lstrip(), text[i + len(THINK_CLOSE):].lstrip()
        end = len(text) if final else len(text) - _held(text, (THINK_CLOSE,))
        return text[start:end].lstrip(), ""

    _HEAD = re.compile(r"<\|channel\|>(\w+)([^<]*?)(?:<\|constrain\|>[^<]*)?<\|message\|>")
    _ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")

    def _harmony(self, text: str, final: bool) -> tuple[str, str, list[dict]]:
        reasoning: list[str] = []
        answer: list[str] = []
        calls: list[dict] = []
        pos = 0
        while True:
            m = self._HEAD.search(text, pos)
            if m is None:
                if not reasoning and not answer and not calls and "<|channel|>" not in text and final:
                    answer.append(text)              # not harmony after all: the text as it is
                break
            channel, header = m.group(1), m.group(2)
            body_start = m.end()
            ends = [j for j in (text.find(e, body_start) for e in self._ENDS) if j >= 0]
            done = bool(ends)
            body_end = min(ends) if done else (len(text) if final else len(text) - _held(text, self._ENDS))
            body = text[body_start:body_end]
            # the recipient: in the header, or before <|channel|> ("<|start|>assistant to=functions.f<|channel|>")
            to = re.search(r"to=functions\.([\w.-]+)", text[pos:m.start()] + header)
            if to:
                if done or final:
                    try:
                        args = json.loads(body) if body.strip() else {}
                    except json.JSONDecodeError:
                        args = None
                    calls.append({"name": to.group(1), "arguments": body if args is None else json.dumps(args)})
            elif channel == "analysis":
                reasoning.append(body)
            else:                                       # final, or commentary to the user
                answer.append(body)
            if not done:
                break
            pos = body_end
        return "".join(reasoning), "".join(answer), calls
