"""The server through real HTTP: `vkengine serve` runs in a subprocess on the
tiny synthetic model (and once on the embedded default model); clients are
httpx. References come from `vkengine.generate.generate` in this process."""
from __future__ import annotations

import json
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vkengine.engine import Engine, EngineConfig
from vkengine.serving.generate import generate
from vkengine.serving.sampling import SamplingParams

from .httpcheck import soak
from .serving import CTX, serve, sse_events, tiny_gguf, tiny_model  # noqa: F401  (fixtures)

wait_idle = soak.wait_idle

PROMPTS = ["The history of the city begins", "Once upon a time", "Write a list of fruits:\n1.", "Q: 2+2=? A:"]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.9, seed=7),
            dict(temperature=1.2, top_k=0, top_p=0.9, min_p=0.0, seed=8),
            dict(temperature=0.7, repeat_penalty=1.3, seed=9)]


@pytest.fixture(scope="module")
def batch_server(serve):
    return serve("--parallel", "4", "--mode", "batch", "--step-tokens", "32", "--max-tokens", "256",
                 "--max-queue", "8")


@pytest.fixture(scope="module")
def slices_server(serve):
    return serve("--parallel", "4", "--mode", "slices", "--quantum", "2", "--step-tokens", "32",
                 "--max-tokens", "256")


@pytest.fixture(scope="module")
def small_server(serve):
    """One sequence at a time, one waiting: for the queue and disconnect tests."""
    return serve("--parallel", "1", "--max-queue", "1", "--max-tokens", "100000", "--max-body", "4096")


@pytest.fixture(scope="module")
def ref(device, tiny_model):
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=64, max_out=1))

    def alone(prompt: str, n: int, **sampling) -> tuple[list[int], str]:
        ids = tiny_model.tokenizer.encode(prompt)
        steps = list(generate(eng, ids, n, SamplingParams(**sampling), ignore_eos=True))
        return [s.token for s in steps], "".join(s.text for s in steps)
    return alone


def complete(url: str, stream: bool, **body):
    """/completion with return_tokens: (tokens, text, final object)."""
    body = {"return_tokens": True, "stream": stream, **body}
    if not stream:
        r = httpx.post(url + "/completion", json=body, timeout=120)
        assert r.status_code == 200, r.text
        j = r.json()
        return j["tokens"], j["content"], j
    with httpx.stream("POST", url + "/completion", json=body, timeout=120) as r:
        assert r.status_code == 200
        evs = sse_events(r)
    assert evs[-1]["stop"] is True and all(e["stop"] is False for e in evs[:-1])
    return [t for e in evs for t in e["tokens"]], "".join(e["content"] for e in evs), evs[-1]


# -- llama-server routes -------------------------------------------------------
def test_health_props_models_slots(batch_server):
    u = batch_server.url
    assert httpx.get(u + "/health").json() == {"status": "ok"}
    props = httpx.get(u + "/props").json()
    assert props["total_slots"] == 4 and props["default_generation_settings"]["n_ctx"] == CTX
    assert "<|im_start|>" in props["chat_template"]
    models = httpx.get(u + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"].endswith(".gguf")
    slots = httpx.get(u + "/slots").json()
    assert len(slots) == 4 and all({"id", "is_processing", "n_ctx"} <= set(s) for s in slots)


def test_tokenize_detokenize(batch_server, tiny_model):
    u = batch_server.url
    text = "Hello world, ünïcödé! <|im_start|>"
    ids = httpx.post(u + "/tokenize", json={"content": text}).json()["tokens"]
    assert ids == tiny_model.tokenizer.encode(text, add_special=False)
    assert httpx.post(u + "/detokenize", json={"tokens": ids}).json()["content"] == text
    pieces = httpx.post(u + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids


@pytest.mark.parametrize("sampling", [SAMPLING[0], SAMPLING[1], SAMPLING[3]])
def test_completion_stream_equals_non_stream_equals_alone(batch_server, ref, sampling):
    want_toks, want_text = ref(PROMPTS[0], 20, **sampling)
    for stream in (False, True):
        toks, text, final = complete(batch_server.url, stream, prompt=PROMPTS[0], n_predict=20, ignore_eos=True,
                                     **sampling)
        assert toks == want_toks and text == want_text
        assert final["stop_type"] == "limit" and final["tokens_predicted"] == 20


def test_prompt_as_token_ids(batch_server, ref, tiny_model):
    ids = tiny_model.tokenizer.encode(PROMPTS[1])
    toks, text, _ = complete(batch_server.url, False, prompt=ids, n_predict=8, temperature=0, ignore_eos=True)
    assert (toks, text) == ref(PROMPTS[1], 8)


def test_same_seed_same_text(batch_server):
    body = dict(prompt=PROMPTS[2], n_predict=16, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, ignore_eos=True)
    a = complete(batch_server.url, False, seed=123, **body)[0]
    b = complete(batch_server.url, True, seed=123, **body)[0]
    c = complete(batch_server.url, False, seed=124, **body)[0]
    assert a == b and a != c


def test_n_probs(batch_server):
    _, _, j = complete(batch_server.url, False, prompt=PROMPTS[0], n_predict=3, temperature=0, n_probs=3,
                       ignore_eos=True)
    probs = j["completion_probabilities"]
    assert len(probs) == 3
    for p, t in zip(probs, j["tokens"]):
        assert p["id"] == t and len(p["top_logprobs"]) == 3 and p["top_logprobs"][0]["id"] == t


def test_stop_string(batch_server, ref):
    _, full = ref(PROMPTS[0], 24)
    stop = full[8:12]
    toks, text, final = complete(batch_server.url, False, prompt=PROMPTS[0], n_predict=24, temperature=0,
                                 stop=[stop])
    assert text == full[:full.index(stop)]
    assert final["stop_type"] == "word" and final["stopping_word"] == stop


# -- OpenAI routes -----------------------------------------------------------------
def test_v1_completions_stream_equals_non_stream(batch_server, ref):
    u = batch_server.url
    body = dict(model="x", prompt=PROMPTS[3], max_tokens=12, temperature=0.9, seed=5, ignore_eos=True)
    j = httpx.post(u + "/v1/completions", json=body, timeout=60).json()
    assert j["object"] == "text_completion" and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"]["completion_tokens"] == 12
    with httpx.stream("POST", u + "/v1/completions", json={**body, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as r:
        evs = sse_events(r)
    assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == 12
    text = "".join(c["text"] for e in evs[:-2] for c in e["choices"])
    assert text == j["choices"][0]["text"] == ref(PROMPTS[3], 12, temperature=0.9, seed=5)[1]
    assert evs[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_completions_stream_equals_non_stream(batch_server, tiny_model, device):
    u = batch_server.url
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    body = dict(messages=msgs, max_tokens=10, temperature=0, ignore_eos=True)
    j = httpx.post(u + "/v1/chat/completions", json=body, timeout=60).json()
    msg = j["choices"][0]["message"]
    assert j["object"] == "chat.completion" and msg["role"] == "assistant"
    with httpx.stream("POST", u + "/v1/chat/completions", json={**body, "stream": True}) as r:
        evs = sse_events(r)
    assert evs[-1] == "[DONE]" and evs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in evs[:-1])
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in evs[:-1]) == msg["content"]
    # the prompt is the model's chat template
    tok = tiny_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True))
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=64, max_out=1))
    want = "".join(s.text for s in generate(eng, ids, 10, ignore_eos=True))
    assert msg["content"] == want and j["usage"]["prompt_tokens"] == len(ids)


def test_chat_logprobs(batch_server):
    body = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0, logprobs=True,
                top_logprobs=2, ignore_eos=True)
    j = httpx.post(batch_server.url + "/v1/chat/completions", json=body, timeout=60).json()
    content = j["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)


# -- concurrency -------------------------------------------------------------------
def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@pytest.mark.parametrize("which", ["batch_server", "slices_server"])
def test_concurrent_clients_get_their_alone_tokens(request, ref, which):
    srv = request.getfixturevalue(which)
    n = [30, 12, 24, 18]
    steps0 = _metric(srv.url, "vkengine_engine_steps_total")

    def client(i):
        return complete(srv.url, True, prompt=PROMPTS[i], n_predict=n[i], ignore_eos=True, **SAMPLING[i])
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(client, range(4)))
    for i, (toks, text, _) in enumerate(got):
        assert (toks, text) == ref(PROMPTS[i], n[i], **SAMPLING[i])
    steps = _metric(srv.url, "vkengine_engine_steps_total") - steps0
    if which == "batch_server":
        assert steps < sum(n)          # they shared steps: batched decode


def test_prefix_cache_over_http(batch_server, ref, tiny_model):
    from vkengine.serving.scheduler import common_prefix
    system = "You are a helpful assistant who answers questions about geography. " * 3
    prompts = [system + "Where is Paris?", system + "Where is Lima?"]
    shared = common_prefix(*[tiny_model.tokenizer.encode(p) for p in prompts])
    hits = []
    for p in prompts:
        toks, text, final = complete(batch_server.url, False, prompt=p, n_predict=6, temperature=0,
                                     ignore_eos=True)
        assert (toks, text) == ref(p, 6)
        hits.append(final["timings"]["cache_n"])
    assert shared > 30 and hits[1] >= shared
    assert _metric(batch_server.url, "vkengine_prompt_tokens_cached_total") >= shared


# -- bad input and limits ---------------------------------------------------------
@pytest.mark.parametrize("path,body,field", [
    ("/completion", {"prompt": "hi", "n_predict": "5"}, "n_predict"),
    ("/completion", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/completion", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/completion", {"prompt": "hi", "stream": 1}, "stream"),
    ("/completion", {"prompt": "hi", "stop": [1, 2]}, "stop"),
    ("/completion", {"prompt": "hi", "seed": 1.5}, "seed"),
    ("/completion", {"prompt": "hi", "n_predict": 100000}, "n_predict"),
    ("/completion", {"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ("/completion", {"prompt": {"text": "hi"}}, "prompt"),
    ("/completion", {}, "prompt"),
    ("/completion", {"prompt": "hi" * 2000}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    # fields that change a request's meaning and are not supported: a 400 naming them, never dropped
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": "f"}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"},
     "reasoning_effort"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
     "functions"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("/completion", {"prompt": "hi", "mirostat": 2}, "mirostat"),
    ("/completion", {"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("/completion", {"prompt": "hi", "samplers": ["top_k"]}, "samplers"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}},
     "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
    ("/completion", {"prompt": "hi", "logit_bias": [[5]]}, "logit_bias"),
    ("/tokenize", {"content": 5}, "content"),
    ("/detokenize", {"tokens": ["a"]}, "tokens"),
])
def test_bad_fields_are_400_naming_the_field(batch_server, path, body, field):
    r = httpx.post(batch_server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"'{field}'" in err["message"]


def test_noop_values_of_refused_fields_are_accepted(batch_server):
    """The refused fields at their no-op values (what clients send by default) change nothing."""
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0,
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "n": 1, "logit_bias": {},
            "presence_penalty": 0, "modalities": ["text"], "user": "u1", "metadata": {"k": "v"}}
    r = httpx.post(batch_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    plain = httpx.post(batch_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": body["messages"], "max_tokens": 4, "temperature": 0}).json()
    assert r.json()["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def test_openai_client(batch_server):
    """The official openai client: a chat completion, a stream, and the fields we do not support
    raised to it as BadRequestError naming the parameter."""
    import openai
    client = openai.OpenAI(base_url=batch_server.url + "/v1", api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=6, temperature=0)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="x", messages=msgs, max_tokens=6, temperature=0, stream=True) if c.choices)
    assert streamed == text
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    two = client.chat.completions.create(model="x", messages=msgs, max_tokens=5, temperature=0.9, seed=3, n=2)
    assert [c.index for c in two.choices] == [0, 1] and two.usage.completion_tokens == 10
    for kw, param in ((dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "other"}}),
                       "tool_choice"), (dict(n=17), "n"),
                      (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="x", messages=msgs, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body


N_PROMPT = ("A long shared question about the rivers, mountains and cities of the northern provinces, "
            "asked once and answered several ways:")


def test_n_choices_share_one_prefill(batch_server):
    """n = 4: four choices, choice i sampled with seed + i exactly as a request of its own with that seed;
    the prompt prefilled once (the other three copy its KV rows: /metrics' cached prompt tokens); the
    streamed chunks, by index, reassemble into the same four texts."""
    url = batch_server.url
    body = {"prompt": N_PROMPT, "max_tokens": 8, "temperature": 0.9, "seed": 11}
    n_ids = len(httpx.post(url + "/tokenize", json={"content": N_PROMPT}).json()["tokens"])
    cached0 = _metric(url, "vkengine_prompt_tokens_cached_total")
    r = httpx.post(url + "/v1/completions", json={**body, "n": 4}, timeout=120)
    assert r.status_code == 200, r.text
    cached = _metric(url, "vkengine_prompt_tokens_cached_total") - cached0
    j = r.json()
    assert [c["index"] for c in j["choices"]] == [0, 1, 2, 3]
    assert j["usage"]["completion_tokens"] == 32 and j["usage"]["prompt_tokens"] >= n_ids
    assert cached >= 3 * (n_ids - 1), (cached, n_ids)
    texts = [c["text"] for c in j["choices"]]
    assert len(set(texts)) > 1                      # (four seeds: not one text four times)
    for i, t in enumerate(texts):
        alone = httpx.post(url + "/v1/completions", json={**body, "seed": 11 + i}, timeout=120).json()
        assert alone["choices"][0]["text"] == t, i
    with httpx.stream("POST", url + "/v1/completions", json={**body, "n": 4, "stream": True}, timeout=120) as s:
        evs = sse_events(s)
    assert evs[-1] == "[DONE]"
    got = ["", "", "", ""]
    for e in evs[:-1]:
        for c in e["choices"]:
            got[c["index"]] += c["text"]
    assert got == texts


def test_logit_bias(batch_server):
    """A banned token (-100, or llama-server's false) never comes; a +100 one always does."""
    url = batch_server.url
    base = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "return_tokens": True}
    toks = complete(url, False, **base)[0]
    banned = complete(url, False, **base, logit_bias=[[toks[0], False], [toks[1], False]])[0]
    assert toks[0] not in banned and toks[1] not in banned
    r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.9,
                                                  "seed": 2, "logit_bias": {"1234": 100}}, timeout=60).json()
    assert r["choices"][0]["text"] == httpx.post(url + "/detokenize", json={"tokens": [1234] * 5}).json()["content"]
    r = httpx.post(url + "/completion", json={**base, "logit_bias": [[10 ** 6, 1]]}, timeout=60)
    assert r.status_code == 400 and "logit_bias" in r.json()["error"]["message"]


def test_api_doc_lists_every_refused_field():
    """docs/api.md's table names every field the server refuses."""
    from pathlib import Path

    from server.schemas import REFUSED
    doc = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    missing = sorted({f for route in REFUSED.values() for f in route if f"`{f}`" not in doc})
    assert not missing, missing


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_json_is_400(batch_server, raw):
    r = httpx.post(batch_server.url + "/completion", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_truncation_when_asked(batch_server):
    long = "word " * 1000
    j = httpx.post(batch_server.url + "/completion", json={"prompt": long, "n_predict": 4, "truncate": True,
                                                           "n_keep": 4}, timeout=60).json()
    assert j["truncated"] is True and j["tokens_evaluated"] <= CTX // 2 and j["tokens_predicted"] == 4


def test_unknown_route_and_method(batch_server):
    r = httpx.get(batch_server.url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    assert httpx.get(batch_server.url + "/completion").status_code == 405


def test_body_limit_and_queue_limit(small_server):
    u = small_server.url
    r = httpx.post(u + "/completion", json={"prompt": "x" * 5000})
    assert r.status_code == 413
    # one running, one queued: the third gets 503 with Retry-After
    body = {"prompt": "Hello", "n_predict": 400, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=120) as c1, httpx.Client(timeout=120) as c2:
        with c1.stream("POST", u + "/completion", json=body) as r1:
            lines = r1.iter_lines()              # (kept: dropping the iterator closes the connection)
            next(lines)                                            # the first is running
            with c2.stream("POST", u + "/completion", json=body) as r2:
                assert r2.status_code == 200                       # accepted: queued
                r3 = httpx.post(u + "/completion", json=body)
                assert r3.status_code == 503 and int(r3.headers["retry-after"]) >= 1
                assert "busy" in r3.json()["error"]["message"]
    # both clients went away. The engine thread frees their sequences at its next
    # step (a cancel is a message to it, not a lock on its state), so a request sent
    # in that window may still get 503; once it is idle, the next one is served.
    assert wait_idle(u, 180) is not None, "the server did not go idle after both clients left"
    toks, _, final = complete(u, False, prompt="Hello", n_predict=5, ignore_eos=True)
    assert len(toks) == 5


def test_disconnect_frees_the_slot(small_server):
    u = small_server.url
    cancelled0 = _metric(u, 'vkengine_requests_total{finish="cancelled"}')
    body = {"prompt": "Hello", "n_predict": 100000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", u + "/completion", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    # the only slot was taken by a request that would run to the end of the context;
    # this one runs only once that slot is free again
    toks, _, _ = complete(u, False, prompt="Again", n_predict=4, ignore_eos=True)
    assert len(toks) == 4
    assert _metric(u, 'vkengine_requests_total{finish="cancelled"}') == cancelled0 + 1
    slot = httpx.get(u + "/slots").json()[0]
    assert slot["is_processing"] is False and slot["n_cached"] < CTX // 2


def test_startup_phases_in_metrics(batch_server):
    """Where the server's startup went (issue 35's cold start), by phase, in
    /metrics; the imports from the process's own start (Linux /proc)."""
    got = soak.by_label(soak.scrape(batch_server.url), "vkengine_startup_seconds", "phase")
    assert set(got) == {"imports", "model file", "device", "weights and buffers", "pipelines and recording"}
    assert all(v >= 0 for v in got.values()) and got["imports"] > 0


def test_gateway_metrics(small_server):
    """The gauges the Kubernetes Gateway API Inference Extension's endpoint
    picker routes by (its model server protocol, vLLM's names): waiting and
    running requests and the KV cache's utilization (a fraction), beside ours,
    while one request streams in the only slot and another waits for it."""
    import threading
    u = small_server.url

    def gauges():   # one scrape: {name: value} (they have no labels)
        return soak.scrape(u)
    body = {"prompt": "Hello", "n_predict": 100000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", u + "/completion", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        waiter = threading.Thread(target=complete, args=(u, False),
                                  kwargs=dict(prompt="Again", n_predict=3, ignore_eos=True))
        waiter.start()
        deadline = time.monotonic() + 60
        while (g := gauges())["vllm:num_requests_waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g["vllm:num_requests_waiting"] == 1 == g["vkengine_queue_depth"]
        assert g["vllm:num_requests_running"] == 1
        slot = httpx.get(u + "/slots").json()[0]
        assert slot["is_processing"] and slot["n_cached"] >= 5
        assert 0 < g["vllm:kv_cache_usage_perc"] <= 1
        assert g["vllm:kv_cache_usage_perc"] == g["vllm:gpu_cache_usage_perc"] == g["vkengine_kv_cache_usage_ratio"]
    waiter.join(120)
    assert not waiter.is_alive()
    assert wait_idle(u, 120) is not None
    g = gauges()
    assert g["vllm:num_requests_waiting"] == g["vllm:num_requests_running"] == g["vllm:kv_cache_usage_perc"] == 0


def test_server_survives_bad_input_and_keeps_serving(batch_server, ref):
    u = batch_server.url
    for raw in (b"\x00" * 100, b'{"prompt": ' + b"[" * 5000, b'{"prompt": "a", "n_predict": 1e400}'):
        assert httpx.post(u + "/completion", content=raw).status_code == 400
    toks, text, _ = complete(u, False, prompt=PROMPTS[1], n_predict=5, temperature=0, ignore_eos=True)
    assert (toks, text) == ref(PROMPTS[1], 5)


def test_metrics(batch_server):
    complete(batch_server.url, False, prompt="Hello", n_predict=2)   # (alone, no request would have ended yet)
    text = httpx.get(batch_server.url + "/metrics").text
    for name in ("vkengine_requests_total", "vkengine_generated_tokens_total", "vkengine_queue_depth",
                 "vkengine_time_to_first_token_seconds_bucket", "vkengine_inter_token_seconds_bucket",
                 "vkengine_slots_used", "vkengine_http_requests_total", "vkengine_programs_deferred",
                 "vkengine_programs_evicted_total"):
        assert re.search(rf"^{name}", text, re.M), name
    assert _metric(batch_server.url, "vkengine_time_to_first_token_seconds_count") >= 1


def test_api_key_and_cors(serve):
    srv = serve("--api-key", "s3cret", "--cors", "http://app.example")
    u = srv.url
    body = {"prompt": "hi", "n_predict": 2}
    assert httpx.post(u + "/completion", json=body).status_code == 401
    r = httpx.post(u + "/completion", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    assert httpx.get(u + "/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.post(u + "/completion", json=body, headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert httpx.get(u + "/health").status_code == 200              # probes need no key
    pre = httpx.options(u + "/completion", headers={"Origin": "http://app.example",
                                                    "Access-Control-Request-Method": "POST"})
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(u + "/completion", headers={"Origin": "http://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"


def test_cors_off_and_loopback_by_default(batch_server):
    from vkengine.cli import build_parser
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"
    r = httpx.get(batch_server.url + "/health", headers={"Origin": "http://app.example"})
    assert "access-control-allow-origin" not in r.headers


def test_graceful_shutdown_ends_streams_cleanly(serve):
    srv = serve("--shutdown-grace", "1", "--max-tokens", "100000")
    body = {"prompt": "Hello", "max_tokens": 100000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        srv.signal(signal.SIGTERM)
        evs = [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" for x in lines if x.startswith("data: ")]
    # the request outlived the grace period: it ends with an error event and [DONE]
    assert evs[-1] == "[DONE]" and "shutting down" in evs[-2]["error"]["message"]
    assert srv.proc.wait(60) is not None
    assert "Application shutdown complete" in srv.log()


def test_serves_the_embedded_default_model(serve, device):
    """`make serve` serves SmolLM2-135M-Instruct; a short chat reply equals generate()."""
    from vkengine.model import load_model
    srv = serve("--parallel", "2", model=None, ctx=256)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    j = httpx.post(srv.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0},
                   timeout=300).json()
    m = load_model(None)
    ids = m.tokenizer.encode(m.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
    eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=256, max_batch=64, max_out=1))
    want = "".join(s.text for s in generate(eng, ids, 6))
    assert j["choices"][0]["message"]["content"] == want
    assert "Paris" in want


def test_a_text_longer_than_the_context_holds_is_refused_before_tokenizing(tiny_model):
    """ServerState.check_fits: a text of more bytes than the context's tokens can cover is a 400 naming the
    field, before it is tokenized; a text within 10 bytes a position passes without reading the vocabulary
    for that bound (which cost a server's first request ~60 ms, issue 35)."""
    from server.app import ServerState
    from server.schemas import HTTPError
    st = ServerState(worker=None, model=tiny_model, n_ctx=64, metrics=None)   # type: ignore[arg-type]
    st.check_fits("word " * 128, "prompt")
    assert "bytes_per_token" not in st.__dict__
    bound = st.bytes_per_token
    assert bound >= 10
    st.check_fits("x" * (64 * bound), "prompt")
    with pytest.raises(HTTPError) as e:
        st.check_fits("x" * (64 * bound + 1), "messages")
    assert e.value.status == 400 and e.value.param == "messages" and "64 tokens" in e.value.message
