"""vkengine on Ray Serve (server/ray_app.py, issue 35): a local Ray instance in
this process, two replicas of the tiny synthetic model behind the ingress,
started as `vkengine serve --replicas 2` starts them (its flags, parsed by the
serve parser). Clients speak HTTP to the ingress (httpx, the openai client);
the replicas' own counters (VkReplica.stats, asked of one replica at a time)
say where requests ran, what their prefix caches reused and what was
cancelled; the kill test takes a replica down mid-request and waits for Ray to
replace it."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from vkengine.engine import Engine, EngineConfig
from vkengine.serving.generate import generate
from vkengine.serving.sampling import SamplingParams

from .serving import CTX, free_port, sse_events, tiny_gguf, tiny_model  # noqa: F401  (fixtures)

ray = pytest.importorskip("ray", reason="ray[serve] is a test dependency (pyproject's test extra)")
serve = pytest.importorskip("ray.serve")


@pytest.fixture(scope="module")
def cluster(tiny_gguf):
    """(ingress URL, replica handle) of `vkengine serve --replicas 2` on the tiny model."""
    from server.ray_app import APP_NAME, parse_args, start_replicas
    port = free_port()
    args = parse_args(["--model", str(tiny_gguf), "--ctx", str(CTX), "--parallel", "2", "--max-tokens", "100000",
                         "--port", str(port), "--replicas", "2", "--gpus-per-replica", "0", "--embeddings"])
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    start_replicas(args, {"num_cpus": 4, "log_to_driver": False})
    try:
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("VkReplica", app_name=APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()


def replica_stats(handle, timeout: float = 60.0) -> dict[str, dict]:
    """Every replica's own counters, by replica id: unpinned calls (the router's
    power of two choices) until both replicas answered (a handle learns of a
    replacement replica a moment after Serve reports it running), then one
    pinned call each."""
    ids: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(ids) < 2:
        assert time.monotonic() < deadline, f"only {ids} answered"
        ids.add(handle.stats.remote().result()["replica"])
    return {r: handle.stats.remote(replica=r).result() for r in ids}


@pytest.fixture(scope="module")
def ref(device, tiny_model):
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=64, max_out=1))

    def alone(prompt: str, n: int) -> list[int]:
        ids = tiny_model.tokenizer.encode(prompt)
        return [s.token for s in generate(eng, ids, n, SamplingParams(temperature=0.0), ignore_eos=True)]
    return alone


def test_every_route_through_the_ingress(cluster, ref):
    """The ingress serves `vkengine serve`'s routes with its semantics: greedy
    tokens equal to the engine's own, streams of one event a token, the
    OpenAI routes through the official client, and a bad field a 400 naming it."""
    from openai import OpenAI
    url, _ = cluster
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"]
    assert httpx.get(url + "/props").json()["total_slots"] == 2
    ids = httpx.post(url + "/tokenize", json={"content": "Once upon a time"}).json()["tokens"]
    assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["content"] == "Once upon a time"
    assert "prompt" in httpx.post(url + "/apply-template",
                                  json={"messages": [{"role": "user", "content": "hi"}]}).json()
    want = ref("Once upon a time", 12)
    j = httpx.post(url + "/completion", json={"prompt": "Once upon a time", "n_predict": 12, "return_tokens": True,
                                             "ignore_eos": True, "temperature": 0}, timeout=120).json()
    assert j["tokens"] == want and j["timings"]["predicted_n"] == 12 and j["stop_type"] == "limit"
    with httpx.stream("POST", url + "/completion", json={"prompt": "Once upon a time", "n_predict": 12,
                                                         "return_tokens": True, "ignore_eos": True,
                                                         "temperature": 0, "stream": True}, timeout=120) as r:
        evs = sse_events(r)
    assert [t for e in evs for t in e["tokens"]] == want
    assert len(evs) == 13 and evs[-1]["stop"] is True      # a token an event, then the last object
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    c = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hi"}], max_tokens=8,
                                       temperature=0)
    assert c.choices[0].message.content and c.usage.completion_tokens <= 8
    chunks = list(client.completions.create(model="x", prompt="Once upon a time", max_tokens=6, temperature=0,
                                            stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == j["content"][:len("".join(
        ch.choices[0].text for ch in chunks))]
    # bound to loopback, as `vkengine serve`: a foreign Host header is refused (DNS rebinding)
    assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 403
    bad = httpx.post(url + "/completion", json={"prompt": "x", "n_predict": "many"})
    assert bad.status_code == 400 and "n_predict" in bad.json()["error"]["message"]
    e = client.embeddings.create(model="x", input=["one text", "another text"])
    assert len(e.data) == 2 and len(e.data[0].embedding) == len(e.data[1].embedding) > 0
    # every replica's slots and engine metrics through the ingress (replicas report each second)
    deadline = time.monotonic() + 30
    while True:
        slots = httpx.get(url + "/slots").json()
        m = httpx.get(url + "/metrics").text
        owners = {s["replica"] for s in slots}
        if len(slots) == 4 and len(owners) == 2 and all(f'vkengine_slots_total{{replica="{r}"}} 2.0' in m
                                                        for r in owners):
            break
        assert time.monotonic() < deadline, (slots, m[:2000])
        time.sleep(0.5)
    assert 'vkengine_http_requests_total{route="/completion",status="200"}' in m     # the ingress's own
    assert m.count("# TYPE vkengine_slots_total gauge") == 1 and "vllm:num_requests_running{replica=" in m


def test_shared_prefixes_land_on_one_replica(cluster):
    """Requests whose prompts share a prefix of several routing blocks go to the
    replica that served it first, whose prefix cache then reuses it: asserted
    through the replicas' own counters (requests served, prompt tokens cached)."""
    url, handle = cluster
    before = replica_stats(handle)
    system = " ".join(f"rule {i}: be brief and exact." for i in range(24))   # ~170 tokens: five 32-token blocks
    for i in range(8):
        r = httpx.post(url + "/completion", json={"prompt": f"{system}\nQuestion {i}: what is {i} + {i}?",
                                                  "n_predict": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
    after = replica_stats(handle)
    served = {r: after[r]["served"] - before[r]["served"] for r in after}
    cached = {r: after[r]["cached_tokens"] - before[r]["cached_tokens"] for r in after}
    assert sorted(served.values()) == [0, 8], served
    top = max(served, key=lambda r: served[r])
    assert cached[top] >= 7 * 128, cached      # the 7 requests after the first reused the shared prompt


def test_client_disconnect_cancels_on_the_replica(cluster):
    url, handle = cluster
    before = replica_stats(handle)
    with httpx.stream("POST", url + "/completion", json={"prompt": "Count forever:", "n_predict": 100000,
                                                         "ignore_eos": True, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
    deadline = time.monotonic() + 60
    while True:
        now = replica_stats(handle)
        cancelled = sum(now[r]["finished"].get("cancelled", 0) - before[r]["finished"].get("cancelled", 0)
                        for r in now)
        if cancelled == 1 and all(s["active"] == 0 for s in now.values()):
            break
        assert time.monotonic() < deadline, f"the replica kept the request: {now}"
        time.sleep(0.5)


def test_a_replica_killed_mid_request(cluster):
    """A replica that dies mid-request: its client's stream ends with an error
    object (not a hang, not a cut connection), Ray starts a replacement, and
    the ingress serves again through both replicas."""
    url, handle = cluster
    with httpx.stream("POST", url + "/completion", json={"prompt": "Count forever:", "n_predict": 100000,
                                                         "ignore_eos": True, "stream": True}, timeout=120) as r:
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
                if len(events) == 3:
                    busy = [s for s in replica_stats(handle).values() if s["active"] > 0]
                    assert len(busy) == 1
                    ray.kill(ray.get_actor(busy[0]["actor"], namespace="serve"), no_restart=True)
        # the stream's last object is the error, then the connection closes
    assert "error" in events[-1] and "replica" in events[-1]["error"]["message"], events[-1]
    assert all("error" not in e for e in events[:-1])
    deadline = time.monotonic() + 120
    while True:
        st = serve.status().applications["vkengine"]
        running = sum(n for state, n in st.deployments["VkReplica"].replica_states.items()
                      if str(getattr(state, "value", state)) == "RUNNING")
        if str(getattr(st.status, "value", st.status)) == "RUNNING" and running == 2:
            break
        assert time.monotonic() < deadline, f"no replacement replica: {st}"
        time.sleep(1)
    r2 = httpx.post(url + "/completion", json={"prompt": "Hello", "n_predict": 4}, timeout=120)
    assert r2.status_code == 200 and r2.json()["tokens_predicted"] == 4
    assert len(replica_stats(handle)) == 2


def test_the_documented_config_builds(tiny_gguf):
    """docs/ray-serve.yaml's application (the builder `serve run` imports) builds
    from its args, with the model path replaced; a bad flag is refused before
    any replica starts."""
    from pathlib import Path

    import yaml

    from server.ray_app import app_builder
    from vkengine.errors import VkEngineError
    doc = yaml.safe_load((Path(__file__).parent.parent / "docs" / "ray-serve.yaml").read_text())
    app = doc["applications"][0]
    assert app["import_path"] == "server.ray_app:app_builder"
    cfg = dict(app["args"])
    cfg["argv"] = [str(tiny_gguf) if a == "/models/model.gguf" else a for a in cfg["argv"]]
    built = app_builder(cfg)
    assert type(built).__name__ == "Application"
    with pytest.raises(VkEngineError, match="step-tokens"):
        app_builder({**cfg, "argv": [*cfg["argv"], "--step-tokens", "1"]})


def test_ingress_health_follows_the_replicas():
    """The ingress's /health (RemoteWorker.fault) is ok while replicas report to
    the hub, and names the cause once none has for longer than a report lasts."""
    from server.ray_app import HUB_MAX_AGE, STARTUP_GRACE, RemoteWorker
    w = RemoteWorker(handle=None, cfg=None, max_requests=4)
    assert w.fault is None                                   # starting: replicas may still be loading
    w._t_start -= STARTUP_GRACE + 1
    assert "no replica has reported" in w.fault
    w.saw({"r1": ("text", [])})
    assert w.fault is None
    w.saw({})                                                # (an empty collection does not refresh it)
    w._last_seen -= HUB_MAX_AGE + 1
    assert "no replica is running" in w.fault


def test_replica_refusals_and_failures_reach_the_client_as_error_objects():
    """RemoteWorker over a stand-in handle: a replica's refusal (its queue full,
    or its engine failed: server.worker's QueueFull / Unavailable) ends the
    reply with a 503-shaped error (finish "cancelled"), any other failure of the
    call (a replica that died) with a 500-shaped one naming the replica; the
    ingress's own admission limit raises QueueFull at submit, as vkengine serve."""
    import asyncio

    from server.formats import Reply
    from server.ray_app import RemoteWorker
    from server.worker import QueueFull
    from vkengine.errors import VkEngineError
    from vkengine.serving.runner import Event, GenRequest

    class Failing:
        def __init__(self, exc):
            self.exc = exc

        def __aiter__(self):
            return self

        async def __anext__(self):
            raise self.exc

        def cancel(self):
            pass

    class Handle:
        def __init__(self, exc):
            self.exc = exc

        def options(self, **kw):
            return self

        @property
        def generate(self):
            return self

        def remote(self, req):
            return Failing(self.exc)

    async def reply_for(exc) -> dict:
        w = RemoteWorker(Handle(exc), cfg=None, max_requests=1)
        got: list[Event] = []
        job = w.submit(GenRequest([1, 2, 3], 4), got.append)
        with pytest.raises(QueueFull):
            w.submit(GenRequest([1], 1), got.append)           # over the ingress's admission limit
        await job.task
        assert w.active == 0 and len(got) == 1
        r = Reply("m", "p", 3)
        r.add(got[0])
        return r.error_body()["error"]
    refused = asyncio.run(reply_for(QueueFull("full")))
    assert refused["code"] == 503 and "refused" in refused["message"]
    died = asyncio.run(reply_for(VkEngineError("actor died")))
    assert died["code"] == 500 and "replica serving this request failed" in died["message"]


def test_the_ingress_reply_carries_the_replicas_drafts():
    """A replica's --mtp drafts reach the ingress's reply (llama-server's timings
    draft_n / draft_n_accepted) through the job's facts; a reply that did not
    speculate has none."""
    from server.formats import Reply
    from server.ray_app import JobFacts, RemoteJob
    from vkengine.serving.runner import GenRequest
    for spec, want in ((True, {"draft_n": 12, "draft_n_accepted": 9}), (False, {})):
        job = RemoteJob(GenRequest([1, 2, 3], 8))
        job.settle(JobFacts(cache_hit=1, prompt_s=0.1, decode_s=0.2, spec=spec, drafted=12, accepted=9))
        t = Reply("m", "x", 3, tokens=list(range(8)), job=job).timings()   # type: ignore[arg-type]
        assert {k: t[k] for k in ("draft_n", "draft_n_accepted") if k in t} == want
        assert t["cache_n"] == 1 and t["predicted_n"] == 8
