"""Response bodies: llama-server's /completion and OpenAI's completions and chat
completions, whole and as stream chunks, built from the worker's events.

A `Format` turns one request's events into JSON objects: `start()` (objects
before the first token), `event(ev)` (objects for one token; none when it adds
no text and the format has nothing else to say), `final()` (the closing objects,
whole-response form when not streaming)."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .tools import BLOCK, OPEN, extract
from .worker import Event, Job


@dataclass
class Reply:
    """What a request got so far."""
    model: str
    prompt_text: str
    n_prompt: int
    truncated: bool = False
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[Event] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    job: Job | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def add(self, ev: Event) -> None:
        self.text += ev.text
        if ev.token is not None:
            self.tokens.append(ev.token)
            if ev.top is not None:
                self.logprobs.append(ev)
        if ev.finish is not None:
            self.finish, self.error = ev.finish, ev.error

    def timings(self) -> dict:
        j = self.job
        n_cached = j.seq.cache_hit if j else 0
        out: dict[str, Any] = {"cache_n": n_cached, "prompt_n": self.n_prompt - n_cached,
                               "predicted_n": len(self.tokens)}
        if j and j.spec:   # (llama-server's names, where it drafts)
            out.update(draft_n=j.drafted, draft_n_accepted=j.accepted)
        if j and j.t_first is not None and j.t_last is not None:
            pm = (j.t_first - j.t_submit) * 1e3
            dm = (j.t_last - j.t_first) * 1e3
            out.update(prompt_ms=pm, prompt_per_second=out["prompt_n"] / pm * 1e3 if pm > 0 else 0.0,
                       predicted_ms=dm,
                       predicted_per_second=(len(self.tokens) - 1) / dm * 1e3 if dm > 0 else 0.0)
        return out

    def usage(self) -> dict:
        return {"prompt_tokens": self.n_prompt, "completion_tokens": len(self.tokens),
                "total_tokens": self.n_prompt + len(self.tokens)}

    def error_body(self) -> dict:
        return {"error": {"code": 500 if self.finish == "error" else 503, "message": self.error or self.finish,
                          "type": "server_error" if self.finish == "error" else "unavailable_error"}}

    @property
    def failed(self) -> bool:
        return self.finish in ("error", "cancelled")


class Format:
    def __init__(self, reply: Reply, piece, stream: bool, return_tokens: bool = False, include_usage: bool = False,
                 index: int = 0):
        self.r, self.piece, self.stream = reply, piece, stream
        self.return_tokens, self.include_usage = return_tokens, include_usage
        self.index = index          # the choice's index (a request with n > 1 has several)

    def start(self) -> list[dict]:
        return []

    def event(self, ev: Event) -> list[dict]:
        raise NotImplementedError

    def final(self) -> list[dict]:
        raise NotImplementedError

    def _probs(self, ev: Event) -> dict:
        """llama-server's per-token probability entry."""
        def one(t, lp):
            p = self.piece(t)
            return {"id": t, "token": p, "logprob": lp, "bytes": list(p.encode())}
        return {**one(ev.token, ev.logprob), "top_logprobs": [one(t, lp) for t, lp in ev.top or ()]}


def finish_reason(finish: str | None) -> str | None:
    return finish   # ours are OpenAI's: stop, length (and cancelled, error)


class LlamaCompletion(Format):
    def event(self, ev: Event) -> list[dict]:
        if ev.token is None or ev.finish is not None and not (ev.text or ev.top or self.return_tokens):
            return []
        out = {"index": 0, "content": ev.text, "tokens": [ev.token] if self.return_tokens else [], "stop": False,
               "id_slot": -1, "tokens_predicted": len(self.r.tokens), "tokens_evaluated": self.r.n_prompt}
        if ev.top is not None:
            out["completion_probabilities"] = [self._probs(ev)]
        return [out]

    def final(self) -> list[dict]:
        r, j = self.r, self.r.job
        out = {"index": 0, "content": "" if self.stream else r.text,
               "tokens": r.tokens if self.return_tokens and not self.stream else [],
               "id_slot": -1, "stop": True, "model": r.model, "tokens_predicted": len(r.tokens),
               "tokens_evaluated": r.n_prompt, "prompt": r.prompt_text, "has_new_line": "\n" in r.text,
               "truncated": r.truncated, "stop_type": j.stop_type if j else "none",
               "stopping_word": (j.out.stop_word or "") if j else "",
               "tokens_cached": r.n_prompt + len(r.tokens), "timings": r.timings()}
        if r.logprobs and not self.stream:
            out["completion_probabilities"] = [self._probs(e) for e in r.logprobs]
        return [out]


class OpenAICompletion(Format):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.id = f"cmpl-{uuid.uuid4().hex[:24]}"

    def _obj(self, text: str, finish, logprobs=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.r.created, "model": self.r.model,
                "choices": [{"text": text, "index": self.index, "logprobs": logprobs, "finish_reason": finish}]}

    def _logprobs(self, evs: list[Event]) -> dict | None:
        if not evs:
            return None
        return {"tokens": [self.piece(e.token) for e in evs], "token_logprobs": [e.logprob for e in evs],
                "top_logprobs": [{self.piece(t): lp for t, lp in e.top or ()} for e in evs]}

    def event(self, ev: Event) -> list[dict]:
        if ev.finish is not None:
            return [self._obj(ev.text, finish_reason(ev.finish), self._logprobs([ev] if ev.top else []))]
        if not ev.text and ev.top is None:
            return []
        return [self._obj(ev.text, None, self._logprobs([ev] if ev.top else []))]

    def final(self) -> list[dict]:
        r = self.r
        if self.stream:
            return [{**self._obj("", None), "choices": [], "usage": r.usage()}] if self.include_usage else []
        return [{**self._obj(r.text, finish_reason(r.finish), self._logprobs(r.logprobs)), "usage": r.usage(),
                 "timings": r.timings()}]


class OpenAIChat(Format):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.tools: Any = None      # server/tools.py Tools: the reply's tool calls are parsed out of its text
        self.reasoning: Any = None  # server/reasoning.py ReasoningSplit: reasoning apart from the answer
        self._sent = 0              # (tools) characters of the answer streamed as content
        self._calling = False       # (tools) a tool call has begun: no more content is streamed
        self._sent_r = 0            # (reasoning) characters of it streamed as reasoning_content
        self._sent_c = 0            # (reasoning, no tools) characters of the answer streamed

    def _parts(self, final: bool) -> tuple[str, str, list[dict]]:
        """(reasoning, answer, harmony's tool calls) of the reply so far."""
        if self.reasoning is None:
            return "", self.r.text, []
        return self.reasoning.split(self.r.text, final)

    def _calls(self, answer: str, harmony: list[dict]) -> tuple[str | None, list[dict]]:
        """The answer's text and the reply's tool calls (harmony's, then those in the answer)."""
        content, calls = extract(answer, self.tools)
        hc = [c for c in (self.tools.call(h["name"], h["arguments"]) for h in harmony) if c is not None]
        return (content or None) if hc + calls else content, hc + calls

    def _streamable(self) -> str:
        """(tools) The answer's text that may be streamed now: everything before a
        tool call, less a tail that may be the start of one."""
        full = self._parts(False)[1]
        if self._calling:
            return ""
        head = full.lstrip()
        if head.startswith(("{", "<|python_tag|>")) and self._sent == 0:
            return ""                                    # (may be Llama 3's bare JSON call: held to the end)
        i = full.find(OPEN, self._sent)
        if i >= 0:
            self._calling = True
            end = i
        else:
            end = len(full)
            for k in range(min(len(OPEN) - 1, len(full)), 0, -1):
                if OPEN.startswith(full[len(full) - k:]):
                    end = len(full) - k
                    break
        out, self._sent = full[self._sent:end], max(self._sent, end)
        return out

    def _reasoning_delta(self, final: bool) -> list[dict]:
        if self.reasoning is None:
            return []
        r = self._parts(final)[0]
        new, self._sent_r = r[self._sent_r:], max(self._sent_r, len(r))
        return [self._chunk({"reasoning_content": new}, None)] if new else []

    def _tool_event(self, ev: Event) -> list[dict]:
        lp = self._logprobs([ev] if ev.top else [])
        out = self._reasoning_delta(ev.finish is not None)
        text = self._streamable()
        if text or lp:
            out.append(self._chunk({"content": text}, None, lp))
        if ev.finish is None:
            return out
        _, answer, harmony = self._parts(True)
        content, calls = self._calls(answer, harmony)
        rest = answer[self._sent:]
        if calls:
            rest = BLOCK.sub("", rest).strip()
            rest = "" if rest.startswith(("{", "<|python_tag|>")) else rest
        if rest:
            out.append(self._chunk({"content": rest}, None))
        if calls:
            out.append(self._chunk({"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, None))
        out.append(self._chunk({}, "tool_calls" if calls else finish_reason(ev.finish)))
        return out

    def _chunk(self, delta: dict, finish, logprobs=None) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.r.created, "model": self.r.model,
                "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    def _logprobs(self, evs: list[Event]) -> dict | None:
        if not evs:
            return None

        def one(t, lp):
            p = self.piece(t)
            return {"token": p, "logprob": lp, "bytes": list(p.encode())}
        return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top or ()]}
                            for e in evs]}

    def start(self) -> list[dict]:
        return [self._chunk({"role": "assistant", "content": ""}, None)]

    def event(self, ev: Event) -> list[dict]:
        if self.tools is not None:
            return self._tool_event(ev)
        lp = self._logprobs([ev] if ev.top else [])
        out = []
        if self.reasoning is not None:
            out += self._reasoning_delta(ev.finish is not None)
            c = self._parts(ev.finish is not None)[1]
            text, self._sent_c = c[self._sent_c:], max(self._sent_c, len(c))
        else:
            text = ev.text
        if text or lp:
            out.append(self._chunk({"content": text}, None, lp))
        if ev.finish is not None:
            out.append(self._chunk({}, finish_reason(ev.finish)))
        return out

    def final(self) -> list[dict]:
        r = self.r
        if self.stream:
            if not self.include_usage:
                return []
            return [{**self._chunk({}, None), "choices": [], "usage": r.usage()}]
        reasoning, answer, harmony = self._parts(True)
        message: dict[str, Any] = {"role": "assistant", "content": answer}
        finish = finish_reason(r.finish)
        if self.tools is not None:
            content, calls = self._calls(answer, harmony)
            if calls:
                message, finish = {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        if reasoning.strip():
            message["reasoning_content"] = reasoning.strip()
        return [{"id": self.id, "object": "chat.completion", "created": r.created, "model": r.model,
                 "choices": [{"index": self.index, "message": message,
                              "logprobs": self._logprobs(r.logprobs), "finish_reason": finish}],
                 "usage": r.usage(), "timings": r.timings()}]
