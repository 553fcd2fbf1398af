"""Structured outputs (issue 33): llama-server's `json_schema` and `grammar`
(GBNF) and OpenAI's `response_format` (json_object, json_schema), through
llguidance's token masks (vkengine/serving/constrain.py), over real HTTP on the
tiny synthetic model (random weights: only the constraint makes its output JSON).

- 50 generated schemas (nested objects, arrays, enums, bounded numbers,
  required and optional properties, anyOf), greedy and sampled, four requests
  at a time: every output parses and validates (jsonschema) and ends by itself.
- Unconstrained requests batched beside constrained ones give the tokens they
  give alone.
- A schema or grammar that does not compile is a 400 naming its field.
"""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import numpy as np
import pytest

from .serving import serve, tiny_gguf  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def srv(serve):
    return serve("--parallel", "4", "--mode", "batch", "--step-tokens", "32", "--max-tokens", "256")


def _leaf(rng) -> dict:
    k = rng.integers(6)
    if k == 0:
        return {"type": "string", "maxLength": int(rng.integers(1, 9))}
    if k == 1:
        lo = int(rng.integers(-50, 50))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 200))}
    if k == 2:
        lo = float(rng.integers(-10, 10))
        # (multipleOf bounds the digits: a random model left free writes fractions without end)
        return {"type": "number", "minimum": lo, "maximum": lo + 5.0, "multipleOf": 0.25}
    if k == 3:
        return {"type": "boolean"}
    if k == 4:
        return {"enum": [f"v{i}" for i in range(int(rng.integers(1, 5)))]}
    return {"anyOf": [_leaf(rng), _leaf(rng)]}


def _schema(rng, depth: int = 0) -> dict:
    props = {}
    for i in range(int(rng.integers(1, 5))):
        k = rng.integers(4)
        if k == 0 and depth < 2:
            props[f"p{i}"] = _schema(rng, depth + 1)
        elif k == 1:
            props[f"p{i}"] = {"type": "array", "items": _leaf(rng) if depth >= 1 or rng.integers(2) else
                              _schema(rng, depth + 1), "minItems": int(rng.integers(0, 2)),
                              "maxItems": int(rng.integers(2, 4))}
        else:
            props[f"p{i}"] = _leaf(rng)
    names = list(props)
    required = [n for n in names if rng.integers(2)] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = [_schema(np.random.default_rng(1000 + i)) for i in range(50)]


def _ask(url: str, body: dict) -> dict:
    r = httpx.post(url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_generated_schemas_parse_and_validate(srv):
    def one(i: int) -> tuple[int, dict]:
        sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": i}
        return i, _ask(srv.url, {"prompt": f"Record {i}:", "json_schema": SCHEMAS[i], "n_predict": 256,
                                 **sampling})
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for i, r in pool.map(one, range(len(SCHEMAS))):
            assert r["stop_type"] == "eos", (i, r["stop_type"], r["content"])
            jsonschema.validate(json.loads(r["content"]), SCHEMAS[i])


def test_unconstrained_neighbours_keep_their_tokens(srv):
    """Constrained rows (host-masked logits) batched beside unconstrained ones
    (device sampling) leave the unconstrained rows' tokens as they are alone."""
    plain = [{"prompt": p, "n_predict": 24, "return_tokens": True, **s} for p, s in (
        ("Once upon a time", {"temperature": 0.0}), ("The city of", {"temperature": 0.8, "seed": 5}))]
    alone = [_ask(srv.url, b)["tokens"] for b in plain]
    bodies = plain + [{"prompt": "Data:", "json_schema": SCHEMAS[k], "n_predict": 64} for k in (3, 4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda b: _ask(srv.url, b), bodies))
    assert [g["tokens"] for g in got[:2]] == alone
    for k, g in zip((3, 4), got[2:]):
        jsonschema.validate(json.loads(g["content"]), SCHEMAS[k])


def test_gbnf_grammar(srv):
    for seed in range(4):
        r = _ask(srv.url, {"prompt": "Answer:", "grammar": 'root ::= "yes" | "no" | "maybe later"',
                           "n_predict": 16, "temperature": 1.0, "seed": seed})
        assert r["content"] in ("yes", "no", "maybe later") and r["stop_type"] == "eos", r


def test_openai_response_format(srv):
    import openai
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    schema = SCHEMAS[7]
    r = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Give a record"}], max_tokens=200, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "rec", "schema": schema, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # streamed, with n = 2: every choice's text validates
    chunks = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "Give a record"}], max_tokens=200, temperature=0.9,
        seed=4, n=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "rec", "schema": schema}})
    texts = ["", ""]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
    for t in texts:
        jsonschema.validate(json.loads(t), schema)


@pytest.mark.parametrize("path,body,field", [
    ("/completion", {"prompt": "x", "grammar": "root ::= ("}, "grammar"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "object", "properties": {"a": {"type": "foo"}}}},
     "json_schema"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "n", "strict": True}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "n", "schema": {"type": "nope"}}}}, "response_format.json_schema.schema"),
])
def test_bad_constraints_are_400_naming_the_field(srv, path, body, field):
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


def test_slices_mode(serve):
    """The scheduler's other mode (one sequence on the device at a time, parked between quanta)."""
    s = serve("--parallel", "2", "--mode", "slices", "--quantum", "4", "--max-tokens", "128")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda k: _ask(s.url, {"prompt": "Data:", "json_schema": SCHEMAS[k], "n_predict": 128}),
                            (5, 6)))
    for k, g in zip((5, 6), got):
        jsonschema.validate(json.loads(g["content"]), SCHEMAS[k])
