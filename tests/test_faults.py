"""Faults over real HTTP and at startup: a client that goes away in every
phase of its request (queued, prefilling, decoding, parked on the host), a
server shut down with requests in flight, requests that run into the context
limit mid-generation, one request's failure inside the engine thread, a model
that does not fit the device, and corrupt or truncated model files. After each
HTTP fault the server must be idle with nothing leaked (tests/httpcheck.py)."""
from __future__ import annotations

import json
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from server.worker import GenRequest, Worker
from vkengine.engine import Engine, EngineConfig
from vkengine.errors import VkEngineError
from vkengine.model import load_model
from vkengine.serving.generate import generate
from vkengine.serving.sampling import SamplingParams
from vkengine.serving.scheduler import SchedulerConfig

from .httpcheck import RawRequest, assert_idle_and_no_leak, metric, scrape, slots, soak, wait_for
from .serving import serve, tiny_gguf, tiny_model  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def long_body(stream: bool, prompt="Hello there", **kw) -> dict:
    return {"prompt": prompt, "n_predict": 100000, "ignore_eos": True, "stream": stream, "cache_prompt": False, **kw}


def parse_http(raw: bytes) -> tuple[int, bytes]:
    """(status, body) of a whole HTTP/1.1 response, chunked or not."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" not in head.lower():
        return status, body
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out, body = out + rest[:n], rest[n + 2:]
    return status, out


def sse_objects(body: bytes) -> list:
    return [json.loads(x[6:]) if x != b"data: [DONE]" else "[DONE]"
            for x in body.split(b"\n") if x.startswith(b"data: ")]


def counts(url: str) -> dict[str, float]:
    m = scrape(url)
    return {"cancelled": soak.total(m, "vkengine_requests_total", finish="cancelled"),
            "generated": soak.total(m, "vkengine_generated_tokens_total")}


# -- disconnects ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def fault_server(serve):
    """Two sequences at once on one device slot (the other parked in turns of 100 steps), one queued;
    4-token steps so that a long prompt prefills over hundreds of steps."""
    srv = serve("--parallel", "2", "--slots", "1", "--quantum", "100", "--step-tokens", "4", "--max-queue", "1",
                "--max-tokens", "100000", ctx=2048)
    srv.idle0 = scrape(srv.url)
    return srv


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_while_queued(fault_server, stream):
    u = fault_server.url
    a = RawRequest(u, "/completion", long_body(True))
    b = RawRequest(u, "/completion", long_body(True))
    wait_for(lambda: metric(u, "vkengine_sequences_live") == 2, "two live sequences")
    c0 = counts(u)
    c = RawRequest(u, "/completion", long_body(stream))
    wait_for(lambda: metric(u, "vkengine_queue_depth") == 1, "a queued request")
    c.close()
    wait_for(lambda: counts(u)["cancelled"] == c0["cancelled"] + 1, "the queued request to be cancelled")
    # the gauges are published at the end of the engine's turn that cancelled it
    wait_for(lambda: metric(u, "vkengine_queue_depth") == 0, "the queue to empty")
    assert metric(u, "vkengine_sequences_live") == 2
    assert counts(u)["generated"] == c0["generated"]          # it never ran
    a.close()
    b.close()
    assert_idle_and_no_leak(u, fault_server.idle0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_while_prefilling(fault_server, stream):
    u = fault_server.url
    c0 = counts(u)
    prompt = ids(random.Random(stream), 2000)              # 500 steps of 4 rows
    r = RawRequest(u, "/completion", long_body(stream, prompt))
    wait_for(lambda: any(s["is_processing"] and 0 < s["n_cached"] < s["n_prompt"] for s in slots(u)),
             "the prompt to be prefilling", every=0.01)
    r.close()
    wait_for(lambda: counts(u)["cancelled"] == c0["cancelled"] + 1, "the request to be cancelled")
    assert counts(u)["generated"] == c0["generated"]          # cancelled before its first token
    assert_idle_and_no_leak(u, fault_server.idle0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_while_decoding(fault_server, stream):
    u = fault_server.url
    c0 = counts(u)
    r = RawRequest(u, "/completion", long_body(stream))
    wait_for(lambda: any(s["is_processing"] and s["n_decoded"] >= 3 for s in slots(u)), "decoding")
    r.close()
    wait_for(lambda: counts(u)["cancelled"] == c0["cancelled"] + 1, "the request to be cancelled")
    assert counts(u)["generated"] >= c0["generated"] + 3
    assert_idle_and_no_leak(u, fault_server.idle0)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_disconnect_while_parked(fault_server, stream):
    """A's KV rows are parked in host memory while B has the device slot; A goes away: its parked copy
    is released (back to the pool of free parking buffers) and B runs on."""
    u = fault_server.url
    c0 = counts(u)
    a = RawRequest(u, "/completion", long_body(stream, "The first one"))
    s = wait_for(lambda: next((s for s in slots(u) if s["is_processing"] and s["n_decoded"] >= 1), None), "A")
    a_id = s["id_task"]
    b = RawRequest(u, "/completion", long_body(True, "The second one"))
    wait_for(lambda: metric(u, "vkengine_sequences_parked") == 1 and slots(u)[0]["id_task"] not in (None, a_id),
             "A to be parked while B runs")
    assert metric(u, "vkengine_kv_parked") == 1
    a.close()
    wait_for(lambda: counts(u)["cancelled"] == c0["cancelled"] + 1, "A to be cancelled")
    assert metric(u, "vkengine_sequences_parked") == 0 and metric(u, "vkengine_kv_parked") == 0
    assert metric(u, "vkengine_sequences_live") == 1                      # B runs on
    b.close()
    assert_idle_and_no_leak(u, fault_server.idle0)


# -- the context limit ---------------------------------------------------------------------
CTX_SMALL = 64


@pytest.fixture(scope="module")
def ctx_server(serve):
    srv = serve("--parallel", "3", "--step-tokens", "16", "--max-tokens", "1000", ctx=CTX_SMALL)
    srv.idle0 = scrape(srv.url)
    return srv


def test_context_limit_mid_generation(ctx_server, tiny_model, device):
    """Prompts of 50 and 40 tokens, asked for more than the context holds, one streaming and one whole,
    beside a short request: both stop at the context (stop_type "limit", finish "length") with the
    tokens generate() gives alone, including the last one (computed at position ctx - 1)."""
    u = ctx_server.url
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=CTX_SMALL, max_batch=64, max_out=1))
    rng = random.Random(3)
    prompts = [ids(rng, 50), ids(rng, 40), ids(rng, 5)]
    want = [[s.token for s in generate(eng, p, 1000, ignore_eos=True)] for p in prompts[:2]]
    assert [len(w) for w in want] == [CTX_SMALL - 50 + 1, CTX_SMALL - 40 + 1]
    got: dict[int, object] = {}

    def run(i):
        body = {"prompt": prompts[i], "temperature": 0, "ignore_eos": True, "return_tokens": True}
        if i == 0:
            with httpx.stream("POST", u + "/completion", json={**body, "stream": True}, timeout=300) as r:
                evs = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
            got[i] = ([t for e in evs for t in e["tokens"]], evs[-1])
        elif i == 1:
            j = httpx.post(u + "/v1/completions", json={**body, "max_tokens": 1000}, timeout=300).json()
            got[i] = j
        else:
            got[i] = httpx.post(u + "/completion", json={**body, "n_predict": 3}, timeout=300).json()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    toks, final = got[0]
    assert toks == want[0] and final["stop"] and final["stop_type"] == "limit"
    assert final["tokens_predicted"] == len(want[0])
    j = got[1]
    assert j["choices"][0]["finish_reason"] == "length" and j["usage"]["completion_tokens"] == len(want[1])
    assert got[2]["tokens_predicted"] == 3 and got[2]["stop_type"] == "limit"
    assert_idle_and_no_leak(u, ctx_server.idle0)
    # a prompt that fills the context exactly is refused; one token less generates one token
    r = httpx.post(u + "/completion", json={"prompt": ids(rng, CTX_SMALL), "n_predict": 5}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    j = httpx.post(u + "/completion", json={"prompt": ids(rng, CTX_SMALL - 1), "n_predict": 5}, timeout=60).json()
    assert j["tokens_predicted"] == 2 and j["stop_type"] == "limit"


# -- shutdown with requests in flight ---------------------------------------------------------
def _exited_cleanly(srv) -> None:
    rc = srv.proc.wait(120)
    # uvicorn re-raises the signal once shut down: -SIGTERM, as any process ended by SIGTERM
    assert rc in (0, -signal.SIGTERM, 128 + signal.SIGTERM), rc
    log = srv.log()
    assert "Application shutdown complete" in log and "Traceback" not in log, log[-3000:]


def test_shutdown_lets_in_flight_requests_finish_within_the_grace(serve):
    srv = serve("--parallel", "1", "--max-queue", "2", "--shutdown-grace", "300", "--max-tokens", "1000")
    u = srv.url
    a = RawRequest(u, "/completion", {"prompt": "One", "n_predict": 40, "stream": True, "ignore_eos": True,
                                      "return_tokens": True})
    a.read_until(b"data: ")                                           # A is generating
    b = RawRequest(u, "/v1/completions", {"prompt": "Two", "max_tokens": 10, "ignore_eos": True})
    wait_for(lambda: metric(u, "vkengine_queue_depth") == 1, "B queued")
    srv.signal(signal.SIGTERM)
    status, body = parse_http(a.read_all())
    evs = sse_objects(body)
    assert status == 200 and evs[-1]["stop"] and evs[-1]["stop_type"] == "limit"
    assert sum(len(e["tokens"]) for e in evs) == 40
    status, body = parse_http(b.read_all())
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 10
    with pytest.raises(httpx.TransportError):                        # no longer listening
        httpx.post(u + "/completion", json={"prompt": "Three", "n_predict": 2}, timeout=30)
    _exited_cleanly(srv)


def test_shutdown_ends_what_outlives_the_grace(serve):
    """Running and queued requests, streaming and whole, end with a "shutting down" error (an error event
    in a stream, 503 for a whole reply) once the grace period is over; the process exits cleanly."""
    srv = serve("--parallel", "1", "--max-queue", "2", "--shutdown-grace", "1", "--max-tokens", "100000")
    u = srv.url
    a = RawRequest(u, "/completion", long_body(True))
    a.read_until(b"data: ")
    b = RawRequest(u, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True,
                                               "max_tokens": 100000, "ignore_eos": True})
    c = RawRequest(u, "/completion", long_body(False))
    wait_for(lambda: metric(u, "vkengine_queue_depth") == 2, "B and C queued")
    srv.signal(signal.SIGTERM)
    for r in (a, b):
        status, body = parse_http(r.read_all())
        errs = [e for e in sse_objects(body) if isinstance(e, dict) and "error" in e]
        assert status == 200 and errs and "shutting down" in errs[-1]["error"]["message"]
    status, body = parse_http(c.read_all())
    assert status == 503 and "shutting down" in json.loads(body)["error"]["message"]
    _exited_cleanly(srv)


# -- one request failing inside the engine thread ----------------------------------------------
def _good_and_bad(device, tiny_model, bad_sampling):
    """A worker with two 20-token requests submitted: (worker, good ids, good events, bad job, bad events)."""
    tok = tiny_model.tokenizer
    eng = Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=256, max_batch=16, max_out=2))
    w = Worker(eng, SchedulerConfig(n_slots=2, max_live=2, step_tokens=16))
    good_ids, bad_ids = tok.encode("A good request"), tok.encode("A bad request")
    good, bad = [], []
    w.submit(GenRequest(good_ids, 20, ignore_eos=True), good.append)
    job = w.submit(GenRequest(bad_ids, 20, bad_sampling, ignore_eos=True), bad.append)
    return w, good_ids, good, job, bad


def test_one_request_failing_does_not_end_the_others(device, tiny_model):
    """A request whose sampling raises ends alone with an error; the others run on and equal generate()."""
    w, good_ids, good, job, bad = _good_and_bad(device, tiny_model, SamplingParams(temperature=0.8, seed=1))
    calls = [0]
    real = job.sampler

    def failing(logits, history):
        calls[0] += 1
        if calls[0] == 3:
            raise ValueError("probabilities contain NaN")
        return real(logits, history)
    job.sampler = failing
    w.run_until_idle()
    ref = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=256, max_batch=16, max_out=1))
    assert [e.token for e in good if e.token is not None] == \
        [s.token for s in generate(ref, good_ids, 20, ignore_eos=True)]
    assert good[-1].finish == "length"
    assert bad[-1].finish == "error" and len([e for e in bad if e.token is not None]) == 2
    assert w.active == 0 and w.sched.idle and not w.runner.kv.held


def test_detokenizing_failure_while_the_next_step_runs(device, tiny_model):
    """The worker delivers a token's text while the next step is already on the device; a request whose
    detokenizing raises there ends alone with an error, its slot is freed only once that step is in, and
    the other request's tokens equal generate()."""
    w, good_ids, good, job, bad = _good_and_bad(device, tiny_model, SamplingParams())
    real, calls, inflight = job.out.push, [0], []

    def failing(token):
        calls[0] += 1
        if calls[0] == 4:
            inflight.append(bool(w.runner.inflight))
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(token)
    job.out.push = failing
    w.run_until_idle()
    assert inflight == [True], "the failing token was not delivered while a step was on the device"
    ref = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=256, max_batch=16, max_out=1))
    assert [e.token for e in good if e.token is not None] == \
        [s.token for s in generate(ref, good_ids, 20, ignore_eos=True)]
    assert good[-1].finish == "length"
    assert bad[-1].finish == "error" and len([e for e in bad if e.token is not None]) == 3
    assert w.active == 0 and w.sched.idle and not w.runner.kv.held and not w.runner._finish_after


# -- a model that does not fit ---------------------------------------------------------------------
def _cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vkengine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _clean_error(p: subprocess.CompletedProcess, *words: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and p.stderr.startswith("error: "), p.stderr[-2000:]
    for w in words:
        assert w in p.stderr, p.stderr
    return p.stderr


def test_kv_cache_larger_than_the_device_is_refused_at_startup(tmp_path, device):
    """A synthetic model with enough layers that its KV cache (at --parallel 16 and the largest --ctx one
    layer's cache fits in a buffer) is twice the device's memory: `vkengine serve` exits with a message
    that says what to reduce, before allocating it (lavapipe would grant it lazily, and the process
    would be killed later, mid-request)."""
    from vkengine.tools.synth.llama import SynthConfig, synth_llama
    parallel, row = 16, 2 * 16 * 2                     # bytes of one position's K (2 kv heads x 16 dims, f16)
    ctx = device.max_buffer_bytes // (2 * parallel * row) // 256 * 256
    per_layer = 2 * parallel * ctx * row
    n_layer = int(2 * device.memory_bytes // per_layer) + 1
    cfg = SynthConfig(n_embd=64, n_layer=n_layer, n_head=4, n_head_kv=2, n_ff=128)
    model = synth_llama(cfg, "f16", 0, tmp_path, "deep", formats=("gguf",), workers=1)["gguf"]
    p = _cli("serve", "--model", str(model), "--parallel", str(parallel), "--ctx", str(ctx), "--port", "9")
    _clean_error(p, "GiB", "reduce the context length (--ctx)", "--parallel")
    # at a context that fits, the same model starts (generate a token to show it)
    fit = int(re.search(r"about (\d+) positions fit", p.stderr)[1])
    q = _cli("generate", "--model", str(model), "--ctx", str(min(fit, 256)), "-n", "1", "hi")
    assert q.returncode == 0, q.stderr[-2000:]
    # its startup reported apart from its speeds (issue 35's cold start): decode steps recorded before
    assert re.search(r"startup: imports [\d.]+ s, model file [\d.]+ s, device [\d.]+ s, weights and buffers "
                     r"[\d.]+ s, pipelines and recording [\d.]+ s; total [\d.]+ s", q.stderr), q.stderr[-2000:]


def test_kv_cache_layer_over_the_buffer_limit_is_refused(tiny_gguf, device):
    ctx = 2 * device.max_buffer_bytes // (2 * 16 * 64)
    p = _cli("serve", "--model", str(tiny_gguf), "--parallel", "16", "--ctx", str(ctx), "--port", "9")
    _clean_error(p, "storage-buffer limit", "reduce the context length (--ctx)")


def test_weights_larger_than_the_device_are_refused_before_allocating(tiny_model, device, monkeypatch):
    n0 = device.n_buffers
    monkeypatch.setattr(type(device), "memory_bytes", property(lambda self: 4 << 20))
    with pytest.raises(VkEngineError, match="the weights alone do not fit; use a smaller or more quantized"):
        Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=64))
    assert device.n_buffers == n0


def test_matmul_scratch_counts_in_the_startup_memory_check(tiny_model, device, monkeypatch):
    """The tiled matmuls' own scratch (split K's partial sums, mul_mc2's halves
    of x) is part of what must fit: an engine whose weights fit but whose
    scratch does not is refused before allocating, naming the step size."""
    from vkengine.kernels import Kernels
    n0 = device.n_buffers
    monkeypatch.setattr(Kernels, "scratch_bytes_bound", lambda self, rows, cols: device.memory_bytes)
    with pytest.raises(VkEngineError, match="activations of a 64-row step do not fit; use fewer rows per step"):
        Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=64, max_batch=64))
    assert device.n_buffers == n0


def test_matmul_scratch_bound(device):
    """What scratch_bytes_bound counts: nothing where no step is tiled (lavapipe,
    or steps below the tiled threshold), split K's cap where it splits,
    mul_mc2's halves of x (rows padded to 256) where it runs, as many again
    for the GLU epilogue's halves where it runs (Caps.mc2_glu), and the XQ8
    matvecs' 8-bit x where they run."""
    from vkengine.kernels import Kernels

    from .conftest import kernels_for
    base = {"tiled_from": None, "split_k_wgs": 256, "coopmat2": False, "xq8": False, "mc2_glu": False}

    def bound(rows: int, cols: int, **caps) -> int:
        return kernels_for(device, **{**base, **caps}).scratch_bytes_bound(rows, cols)
    assert bound(512, 4096) == 0
    assert bound(32, 4096, tiled_from=64) == 0
    assert bound(512, 4096, tiled_from=64) == Kernels.SPLIT_K_SCRATCH
    assert bound(300, 14336, tiled_from=64, coopmat2=True) == Kernels.SPLIT_K_SCRATCH + 512 * 14336 * 2
    assert bound(300, 14336, tiled_from=64, coopmat2=True, split_k_wgs=0) == 512 * 14336 * 2
    assert bound(300, 14336, tiled_from=64, coopmat2=True, split_k_wgs=0, mc2_glu=True) == 2 * 512 * 14336 * 2
    # + 63 rows (the matvec steps) of 8-bit x: 9 bytes per 8 values
    assert (bound(300, 14336, tiled_from=64, coopmat2=True, split_k_wgs=0, xq8=True)
            == 512 * 14336 * 2 + 63 * 14336 * 9 // 8)


# -- corrupt and truncated model files ---------------------------------------------------------------
def _load_or_refuse(path, device) -> str:
    """Loading either works (then an engine is built) or raises VkEngineError: never another exception."""
    try:
        m = load_model(path)
        Engine(m, device, EngineConfig(n_slots=1, n_ctx=32, max_batch=8, max_out=1))
        return "loaded"
    except VkEngineError as e:
        return str(e)


def _set_meta(src: Path, dst: Path, key: str, value: int) -> Path:
    from gguf import GGUFReader
    shutil.copy(src, dst)
    r = GGUFReader(str(dst), "r+")
    f = r.fields[key]
    f.parts[f.data[0]][0] = value
    r.data.flush()
    del r
    return dst


GGUF_CUTS = [0, 3, 24, 4096, 0.5, -1]


@pytest.mark.timeout(600)
def test_truncated_and_corrupt_gguf(tiny_gguf, tmp_path, device):
    data = Path(tiny_gguf).read_bytes()
    cases: dict[str, bytes | Path] = {}
    for c in GGUF_CUTS:
        n = int(len(data) * c) if isinstance(c, float) else c if c >= 0 else len(data) + c
        cases[f"truncated at {n}"] = data[:n]
    cases["version 999"] = data[:4] + struct.pack("<I", 999) + data[8:]
    cases["2^62 tensors"] = data[:8] + struct.pack("<Q", 1 << 62) + data[16:]
    cases["2^62 metadata keys"] = data[:16] + struct.pack("<Q", 1 << 62) + data[24:]
    cases["garbage after the header"] = data[:24] + bytes(random.Random(0).randrange(256) for _ in range(4096)) + \
        data[24 + 4096:]
    for key, v in [("llama.block_count", 0), ("llama.embedding_length", 3),
                   ("tokenizer.ggml.bos_token_id", 4_000_000_000)]:
        cases[f"{key} = {v}"] = _set_meta(Path(tiny_gguf), tmp_path / f"{key}-{v}.gguf", key, v)
    results = {}
    for name, d in cases.items():
        path = d if isinstance(d, Path) else tmp_path / "x.gguf"
        if not isinstance(d, Path):
            path.write_bytes(d)
        results[name] = _load_or_refuse(path, device)
    assert [k for k, v in results.items() if v == "loaded"] == []
    for k, v in results.items():
        if k.startswith("truncated"):
            assert "truncated" in v or "not a GGUF file" in v, (k, v)
    # the CLI: one line, exit status 2, no traceback
    (tmp_path / "cut.gguf").write_bytes(data[:4096])
    _clean_error(_cli("generate", "--model", str(tmp_path / "cut.gguf"), "hi"), "cut.gguf")


def test_a_deferred_tokenizer_is_the_same_and_its_errors_come_before_serving(tiny_gguf, tmp_path):
    """load_model(defer_tokenizer=True) (the server's: its tokenizer built while the first steps' pipelines
    compile) leaves the vocabulary for first use: the same tokens as an eager load, built once however many
    threads ask; an invalid vocabulary's error comes at that use, and `vkengine serve` (before it answers
    anything) and `generate` still refuse the file with their one-line error."""
    eager = load_model(tiny_gguf)
    lazy = load_model(tiny_gguf, defer_tokenizer=True)
    assert lazy._tokenizer is None
    got = []
    threads = [threading.Thread(target=lambda: got.append(lazy.tokenizer)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(t is got[0] for t in got)
    text = "Tell me a story about a lighthouse keeper. <|im_end|>"
    assert lazy.tokenizer.encode(text) == eager.tokenizer.encode(text)
    bad = _set_meta(Path(tiny_gguf), tmp_path / "bos.gguf", "tokenizer.ggml.bos_token_id", 4_000_000_000)
    m = load_model(bad, defer_tokenizer=True)   # (the vocabulary not read yet)
    for _ in range(2):
        with pytest.raises(VkEngineError, match="BOS token id"):
            _ = m.tokenizer
    _clean_error(_cli("serve", "--model", str(bad), "--port", "9"), "BOS token id")
    _clean_error(_cli("generate", "--model", str(bad), "-n", "1", "hi"), "BOS token id")   # (generate's too)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    from vkengine.tools.synth.llama import config_for, synth_llama
    return synth_llama(config_for("tiny", None), "f16", 0, tmp_path_factory.mktemp("tinyhf"), "tiny",
                       formats=("hf",), workers=1)["hf"]


def _hf_copy(src: Path, dst: Path, weights: bytes | None = None, config=None) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors" and weights is not None:
            (dst / f.name).write_bytes(weights)
        elif f.name == "config.json" and config is not None:
            (dst / f.name).write_text(config if isinstance(config, str) else json.dumps(config))
        else:
            (dst / f.name).symlink_to(f)
    return dst


@pytest.mark.timeout(600)
def test_truncated_and_corrupt_safetensors(tiny_hf, tmp_path, device):
    src = Path(tiny_hf)
    st = next(src.glob("*.safetensors"))
    data = st.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    cfg = json.loads((src / "config.json").read_text())
    name = next(k for k in header if k != "__metadata__")

    def with_header(h):
        b = json.dumps(h).encode()
        b += b" " * (-len(b) % 8)
        return struct.pack("<Q", len(b)) + b + data[8 + n:]
    weights = {f"truncated at {c}": data[:c] for c in (0, 8, 50, 8 + n, len(data) // 2, len(data) - 1)}
    weights.update({
        "header length 2^62": struct.pack("<Q", 1 << 62) + data[8:],
        "header not JSON": data[:8] + b"x" * n + data[8 + n:],
        "offsets beyond the file": with_header({**header, name: {**header[name], "data_offsets": [0, 1 << 40]}}),
        "shape and size disagree": with_header({**header, name: {**header[name], "shape": [3, 5]}}),
        "dtype I64": with_header({**header, name: {**header[name], "dtype": "I64"}}),
    })
    configs = {"config not JSON": "{", "hidden_size missing": {k: v for k, v in cfg.items() if k != "hidden_size"},
               "num_hidden_layers a string": {**cfg, "num_hidden_layers": "two"},
               "num_attention_heads 0": {**cfg, "num_attention_heads": 0},
               "no architectures": {**cfg, "architectures": []},
               "rope_scaling without factor": {**cfg, "rope_scaling": {"type": "linear"}},
               "rope_scaling factor 0": {**cfg, "rope_scaling": {"type": "linear", "factor": 0}}}
    results = {}
    for i, (k, w) in enumerate(weights.items()):
        results[k] = _load_or_refuse(_hf_copy(src, tmp_path / f"w{i}", weights=w), device)
    for i, (k, c) in enumerate(configs.items()):
        results[k] = _load_or_refuse(_hf_copy(src, tmp_path / f"c{i}", config=c), device)
    assert [k for k, v in results.items() if v == "loaded"] == []
    assert all("safetensors" in results[k] for k in weights), results
    _clean_error(_cli("serve", "--model", str(tmp_path / "w4"), "--port", "9"), "safetensors")
    _clean_error(_cli("serve", "--model", str(tmp_path / "c2"), "--port", "9"), "invalid model metadata")
