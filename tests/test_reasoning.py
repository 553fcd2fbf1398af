"""Reasoning apart from the answer in chat replies (server/reasoning.py), as
llama-server's --reasoning-format auto: <think> blocks (Qwen3, QwQ, the R1
distills, whose template may open the block in the prompt) and gpt-oss's
harmony channels (analysis, final, and commentary to a function: a tool call);
split so that a stream only ever adds to both parts; through the server,
streamed and not, and off with reasoning_format none."""
from __future__ import annotations

import json

import httpx
import pytest

from server.reasoning import ReasoningSplit, mode_for

from .serving import serve, tiny_gguf  # noqa: F401  (fixtures)

HARMONY = ("<|channel|>analysis<|message|>User wants weather. Call the tool.<|end|><|start|>assistant "
           "to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>{\"city\": \"Paris\"}")
CASES = [
    ("think", "", "<think>\nFirst, plan.\n</think>\n\nThe answer.", "First, plan.", "The answer.", []),
    ("think", "<|im_start|>assistant\n<think>\n", "plan </thin k> still\n</think>Done", "plan </thin k> still",
     "Done", []),
    ("think", "", "No thinking here.", "", "No thinking here.", []),
    ("think", "", "<thi", "", "<thi", []),                 # a reply that merely starts like the tag
    ("harmony", "", "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant<|channel|>final<|message|>Hi!",
     "Hmm.", "Hi!", []),
    ("harmony", "", HARMONY, "User wants weather. Call the tool.", "",
     [{"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}]),
]


@pytest.mark.parametrize("mode,prompt,text,reasoning,answer,calls", CASES)
def test_split_grows_and_ends_right(mode, prompt, text, reasoning, answer, calls):
    sp = ReasoningSplit(mode, prompt)
    r, a, c = sp.split(text, final=True)
    assert (r.strip(), a, c) == (reasoning, answer, calls)
    prev = ("", "")
    for k in range(len(text) + 1):       # streamed a character at a time: both parts only grow
        r, a, _ = sp.split(text[:k], final=False)
        assert r.startswith(prev[0]) and a.startswith(prev[1]), (k, r, a, prev)
        prev = (r, a)
    r, a, _ = sp.split(text, final=True)
    assert r.startswith(prev[0]) and a.startswith(prev[1])


def test_mode_from_the_template():
    assert mode_for("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    assert mode_for("{% if '</think>' in content %}{% endif %}") == "think"
    assert mode_for("<|im_start|>{{ role }}") is None and mode_for(None) is None


THINKING = """{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content.split('</think>')[-1] }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


@pytest.fixture(scope="module")
def thinker(serve):
    return serve("--parallel", "2", "--max-tokens", "64", template=THINKING)


def test_server_gives_reasoning_content(thinker):
    """The template opens a think block in the prompt, so the reply (the tiny
    model's, which never closes it) is all reasoning: reasoning_content holds
    the text reasoning_format none leaves in content; streamed the same."""
    body = {"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 24, "temperature": 0}
    raw = httpx.post(thinker.url + "/v1/chat/completions", json={**body, "reasoning_format": "none"},
                     timeout=60).json()["choices"][0]["message"]
    assert "reasoning_content" not in raw and raw["content"].strip()
    msg = httpx.post(thinker.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert msg["content"] == "" and msg["reasoning_content"] == raw["content"].strip()
    parts = {"reasoning_content": "", "content": ""}
    with httpx.stream("POST", thinker.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:])["choices"]:
                    for k in parts:
                        parts[k] += ch["delta"].get(k) or ""
    assert parts["content"] == "" and parts["reasoning_content"].strip() == msg["reasoning_content"]
    r = httpx.post(thinker.url + "/v1/chat/completions", json={**body, "reasoning_format": "loud"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_format"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode,text", [
    ("think", "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n"
              "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
    ("harmony", HARMONY)])
def test_reasoning_beside_tool_calls(mode, text, stream):
    """A reply that reasons, then calls a tool (Qwen3's Hermes block after its
    think block; gpt-oss's call to a function), through the chat format a few
    characters at a time: the reasoning as reasoning_content, the call as
    tool_calls with finish_reason tool_calls, no markup left in content."""
    from server.formats import OpenAIChat, Reply
    from server.tools import parse
    from vkengine.serving.runner import Event
    tools = parse({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]})
    reply = Reply("m", "", 3)
    fmt = OpenAIChat(reply, lambda t: "", stream)
    fmt.tools, fmt.reasoning = tools, ReasoningSplit(mode, "")
    objs = fmt.start()
    for k in range(0, len(text), 5):
        ev = Event(text=text[k:k + 5], token=1, finish="stop" if k + 5 >= len(text) else None)
        reply.add(ev)
        objs += fmt.event(ev)
    objs += fmt.final()
    if stream:
        deltas = [c["delta"] for o in objs for c in o.get("choices", [])]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        content = "".join(d.get("content") or "" for d in deltas)
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        finish = [c["finish_reason"] for o in objs for c in o.get("choices", []) if c["finish_reason"]]
    else:
        msg = objs[-1]["choices"][0]["message"]
        reasoning, content, calls = msg.get("reasoning_content") or "", msg["content"] or "", msg["tool_calls"]
        finish = [objs[-1]["choices"][0]["finish_reason"]]
    assert reasoning.strip() in ("The user wants weather.", "User wants weather. Call the tool.")
    assert content.strip() == "" and finish == ["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
