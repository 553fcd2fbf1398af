"""Tool calling on /v1/chat/completions (issue 33), over real HTTP with the
official openai client, on the tiny synthetic model (random weights, SmolLM2's
vocabulary and chat template, which knows no tools: the documented fallback),
and with a Hermes-style template (Qwen2.5's tool syntax) given by
--chat-template-file.

- A named tool_choice, and `required`, always yield calls whose arguments
  validate (jsonschema) against the function's parameters: the reply is held to
  the call's form by constrained decoding.
- Streamed calls reassemble with the client's own accumulator.
- The history's calls and tool replies render through the template (Hermes
  syntax), /apply-template shows it; replies are parsed from Hermes blocks
  and from Llama 3's JSON form.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from .serving import serve, tiny_gguf  # noqa: F401  (fixtures)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"], "additionalProperties": False}}}
FLIGHTS = {"type": "function", "function": {
    "name": "find_flights", "parameters": {"type": "object", "properties": {
        "from": {"type": "string", "maxLength": 4}, "to": {"type": "string", "maxLength": 4},
        "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
        "dates": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
        "required": ["from", "to", "passengers"], "additionalProperties": False}}}
TOOLS = [WEATHER, FLIGHTS]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# a Hermes-style template, as Qwen2.5's writes tools, calls and tool replies
HERMES = """{%- if reasoning_effort is defined or enable_thinking is defined %}<|im_start|>system
Reasoning: {{ reasoning_effort | default('medium') }}, thinking: {{ enable_thinking | default(true) }}<|im_end|>
{% endif %}{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}{%- for message in messages %}{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{%- for tc in message.tool_calls %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def plain(serve):
    return serve("--parallel", "4", "--max-tokens", "256")


@pytest.fixture(scope="module")
def hermes(serve):
    return serve("--parallel", "4", "--max-tokens", "256", template=HERMES)


def _client(srv):
    import openai
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


MSGS = [{"role": "user", "content": "Weather in Paris, and flights from CDG to JFK for two?"}]


@pytest.mark.parametrize("which", ["plain", "hermes"])
def test_named_and_required_choices_validate(request, which):
    client = _client(request.getfixturevalue(which))
    for seed in range(3):
        for choice in ({"type": "function", "function": {"name": "find_flights"}}, "required"):
            r = client.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, tool_choice=choice,
                                               max_tokens=200, temperature=0.9, seed=seed,
                                               parallel_tool_calls=choice == "required")
            ch = r.choices[0]
            assert ch.finish_reason == "tool_calls", ch
            assert ch.message.tool_calls
            for c in ch.message.tool_calls:
                if isinstance(choice, dict):
                    assert c.function.name == "find_flights"
                jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])
                assert c.id.startswith("call_") and c.type == "function"


def test_streamed_calls_reassemble_with_the_clients_accumulator(plain):
    client = _client(plain)
    with client.chat.completions.stream(model="x", messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}}) as s:
        final = s.get_final_completion()
    want = client.chat.completions.create(model="x", messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}})
    got_calls, want_calls = final.choices[0].message.tool_calls, want.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in got_calls] == \
        [(c.function.name, c.function.arguments) for c in want_calls]


def test_history_round_trip_through_the_hermes_template(hermes):
    """A call and its tool reply in the history render as the template writes them, and the next turn
    (a named choice) parses into a call again."""
    import httpx
    hist = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}]
    p = httpx.post(hermes.url + "/apply-template", json={"messages": hist, "tools": TOOLS}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in p
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in p and '"name": "find_flights"' in p
    r = _client(hermes).chat.completions.create(model="x", messages=hist, tools=TOOLS, max_tokens=200,
                                                tool_choice="required", temperature=0)
    assert r.choices[0].message.tool_calls


def test_fallback_renders_tools_for_a_template_without_them(plain):
    import httpx
    p = httpx.post(plain.url + "/apply-template", json={"messages": MSGS, "tools": TOOLS}).json()["prompt"]
    assert "<tools>" in p and '"name": "get_weather"' in p and "<tool_call>" in p
    q = httpx.post(plain.url + "/apply-template", json={"messages": MSGS, "tools": TOOLS,
                                                        "tool_choice": "none"}).json()["prompt"]
    assert "<tools>" not in q


def test_parsing_forms():
    from server.tools import Tools, extract
    t = Tools(tuple(TOOLS), "auto", True)
    content, calls = extract('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                             '\n</tool_call>', t)
    assert content == "Let me check." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    content, calls = extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', t)
    assert content is None and calls[0]["function"]["name"] == "get_weather"
    content, calls = extract('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>', t)
    assert calls == [] and "unknown" in content


@pytest.mark.parametrize("body,field", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
])
def test_bad_tools_are_400(plain, body, field):
    import httpx
    r = httpx.post(plain.url + "/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.slow
def test_embedded_smollm2_named_call_and_schema(serve):
    """The embedded SmolLM2-135M-Instruct (real weights): a named tool_choice gives a call whose arguments
    validate, and a json_schema reply validates."""
    srv = serve("--parallel", "2", "--max-tokens", "96", model=None)
    client = _client(srv)
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "What is the weather "
                                                             "like in Paris?"}], tools=TOOLS, max_tokens=60,
                                       temperature=0, tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}})
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA["get_weather"])
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "minimum": 0,
                                                                       "maximum": 100}},
              "required": ["capital", "population_millions"], "additionalProperties": False}
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "The capital of France, as JSON."}], max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_template_variables(hermes, plain):
    """chat_template_kwargs (llama-server's: Qwen3's enable_thinking) and OpenAI's
    reasoning_effort (gpt-oss's template reads it) reach a template that reads
    them; one that does not read them is a 400 naming the field, not a variable
    dropped unsaid."""
    msgs = [{"role": "user", "content": "hi"}]
    r = httpx.post(hermes.url + "/apply-template", json={"messages": msgs, "reasoning_effort": "low",
                                                          "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert "Reasoning: low, thinking: False" in r.json()["prompt"]
    r = httpx.post(hermes.url + "/apply-template", json={"messages": msgs})
    assert "Reasoning:" not in r.json()["prompt"]
    out = _client(hermes).chat.completions.create(model="x", messages=msgs, max_tokens=4, reasoning_effort="high")
    assert out.choices[0].message.content is not None
    for srv, body, field in ((plain, {"reasoning_effort": "high"}, "reasoning_effort"),       # not read there
                             (plain, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
                             (hermes, {"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
                             (hermes, {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                             (hermes, {"reasoning_effort": "extreme"}, "reasoning_effort")):
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 2, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field
