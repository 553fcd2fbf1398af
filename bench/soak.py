"""Soak test: C concurrent clients for M minutes (or N requests) against
`vkengine serve`, over real HTTP on loopback, then a check that nothing leaked.

Each client sends requests one after another, drawn from a mix: streaming and
whole completions (llama-server and OpenAI routes, chat), short and long
prompts, greedy and sampled; streams that the client drops after a few tokens
(or right after the headers, while queued or prefilling) and whole requests it
abandons; prompts that run into the context limit mid-generation; requests
over the limits (prompt longer than the context, n_predict over --max-tokens,
a body over --max-body, bad JSON, wrong types, lone surrogates); tokenizing a
large text; /slots, /props and /metrics probes. Busy answers (503 when every
sequence and the queue are taken) are expected under this load; the client then
waits as Retry-After says. The default server has more sequences than device
slots, so sequences are parked on the host in turns.

Reported: requests by outcome, errors by kind, client-side time to first token
and inter-token p50/p99 (streams of /completion), the server's own counts, and
memory at start and end (host RSS; the engine's buffers by kind; free parking
buffers; parked KV copies; slots, live sequences, queue). When every client has
stopped, the server must go idle with slots, live sequences, parked states,
queue and buffers back at their starting counts (less the bounded pool of free
parking buffers and the host prefix cache); any unexpected error, a 500, a
server that dies or logs a traceback, or a leak makes the exit status 1.

    .venv/bin/python bench/soak.py --clients 8 --minutes 5
    .venv/bin/python bench/soak.py --model /tmp/rel/llama-tiny-q8_0.gguf -c 4 --requests 60
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8080 -c 8 --minutes 10
    .venv/bin/python bench/soak.py -c 32 --minutes 10 --hostile 1000     # issue 37's soak

--hostile N mixes N hostile connections into the run, spread over it: bodies
cut off mid-way, headers trickled until the server closes the connection
(--header-timeout), chunked bodies with broken framing; a probe meanwhile asks
/health every 0.2 s (its latency p99 is reported and must stay under 100 ms)
and the server log must stay bounded (under 1 MiB).
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
SERVE_ARGS = ("--parallel 4 --slots 2 --mode batch --quantum 16 --max-queue 2 --ctx 512 --max-tokens 256 "
              "--max-body 65536 --step-tokens 32")
WORDS = ("river stone light garden paper window city music winter forest engine story market silver "
         "harbor mountain letter evening bridge candle").split()
TIMEOUT = 300.0


@dataclass
class Result:
    scenario: str
    outcome: str                          # ok | rejected (expected 4xx) | busy | disconnect | error:<kind>
    accepted: bool | None = None          # a generation the server took on (None: unknown)
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    detail: str = ""


@dataclass
class Limits:
    n_ctx: int
    n_vocab: int
    max_tokens: int
    max_body: int


# -- metrics -----------------------------------------------------------------------
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", re.M)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {'name' or 'name{labels}': value}."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {m[1] + (m[2] or ""): float(m[3]) for m in _LINE.finditer(text)}


def total(m: dict[str, float], name: str, **labels) -> float:
    out = 0.0
    for k, v in m.items():
        base, _, lab = k.partition("{")
        if base == name and all(f'{a}="{b}"' in lab for a, b in labels.items()):
            out += v
    return out


def by_label(m: dict[str, float], name: str, label: str) -> dict[str, float]:
    out: Counter = Counter()
    for k, v in m.items():
        base, _, lab = k.partition("{")
        hit = re.search(rf'{label}="([^"]*)"', lab)
        if base == name and hit:
            out[hit[1]] += v
    return dict(out)


MEMORY = [("host RSS (MiB)", "process_resident_memory_bytes", {}, 2 ** 20),
          ("device buffers (MiB)", "vkengine_buffer_bytes", {"kind": "device"}, 2 ** 20),
          ("host buffers (MiB)", "vkengine_buffer_bytes", {"kind": "host"}, 2 ** 20),
          ("buffers", "vkengine_buffers", {}, 1),
          ("free parking buffers", "vkengine_kv_pool_buffers", {}, 1),
          ("parked KV copies", "vkengine_kv_parked", {}, 1),
          ("host prefix cache", "vkengine_host_cache_entries", {}, 1),
          ("recorded step programs", "vkengine_recorded_programs", {}, 1),
          ("slots used", "vkengine_slots_used", {}, 1),
          ("slots total", "vkengine_slots_total", {}, 1),
          ("live sequences", "vkengine_sequences_live", {}, 1),
          ("parked sequences", "vkengine_sequences_parked", {}, 1),
          ("queue", "vkengine_queue_depth", {}, 1),
          ("active requests", "vkengine_requests_active", {}, 1)]


def leak_checks(a: dict[str, float], b: dict[str, float]) -> list[tuple[str, bool, str]]:
    """(what, passed, values) comparing the idle state at start (a) and end (b)."""
    def g(m, name, **lab):
        return total(m, name, **lab)

    def held(m, what):          # what the engine holds beyond the pool and the parked copies
        if what == "bytes":
            return g(m, "vkengine_buffer_bytes", kind="host") - g(m, "vkengine_kv_pool_bytes") - \
                g(m, "vkengine_kv_parked_bytes")
        return g(m, "vkengine_buffers") - g(m, "vkengine_kv_pool_buffers") - g(m, "vkengine_kv_parked")
    out = []
    for name in ("vkengine_slots_used", "vkengine_sequences_live", "vkengine_sequences_parked",
                 "vkengine_queue_depth", "vkengine_requests_active"):
        out.append((f"{name} back to {g(a, name):g}", g(b, name) == g(a, name), f"{g(b, name):g}"))
    out.append(("parked KV copies are only the host prefix cache",
                g(b, "vkengine_kv_parked") == g(b, "vkengine_host_cache_entries"),
                f"{g(b, 'vkengine_kv_parked'):g} vs {g(b, 'vkengine_host_cache_entries'):g}"))
    dev_a, dev_b = g(a, "vkengine_buffer_bytes", kind="device"), g(b, "vkengine_buffer_bytes", kind="device")
    out.append(("device-local buffer bytes unchanged", dev_a == dev_b, f"{dev_a:.0f} -> {dev_b:.0f}"))
    out.append(("host buffer bytes unchanged (less pool and parked)", held(a, "bytes") == held(b, "bytes"),
                f"{held(a, 'bytes'):.0f} -> {held(b, 'bytes'):.0f}"))
    out.append(("buffer count unchanged (less pool and parked)", held(a, "n") == held(b, "n"),
                f"{held(a, 'n'):g} -> {held(b, 'n'):g}"))
    return out


# -- scenarios ---------------------------------------------------------------------
def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def sse(line: str):
    if not line.startswith("data: "):
        return None
    data = line[6:]
    return data if data == "[DONE]" else json.loads(data)


def _status(r: httpx.Response, want: int, scenario: str) -> Result | None:
    """None when r has the wanted status; else the Result that classifies it."""
    if r.status_code == want:
        return None
    if r.status_code == 503 and "retry-after" in r.headers:
        return Result(scenario, "busy", accepted=False, detail=r.headers["retry-after"])
    body = r.read()[:200]
    return Result(scenario, f"error:status {r.status_code}", accepted=False, detail=body.decode(errors="replace"))


def stream_completion(c, url, rng, lim: Limits, scenario="stream", drop_after: int | None = None) -> Result:
    long = rng.random() < 0.3
    prompt = "Tell me about " + words(rng, rng.randint(120, 220) if long else rng.randint(3, 30))
    n = rng.randint(8, 48)
    body = {"prompt": prompt, "n_predict": n, "stream": True, "ignore_eos": True, "return_tokens": True,
            "cache_prompt": rng.random() < 0.5}
    if rng.random() < 0.4:
        body.update(temperature=0.8, seed=rng.randrange(1 << 30), top_k=rng.choice([0, 40]))
    else:
        body["temperature"] = 0
    t0 = last = time.perf_counter()
    res = Result(scenario, "ok")
    got, final = 0, None
    with c.stream("POST", url + "/completion", json=body) as r:
        bad = _status(r, 200, scenario)
        if bad:
            return bad
        res.accepted = True
        if drop_after == 0:
            return Result(scenario, "disconnect", accepted=True)
        for line in r.iter_lines():
            ev = sse(line)
            if ev is None:
                continue
            if "error" in ev:
                return Result(scenario, "error:error event", True, detail=str(ev)[:200])
            now = time.perf_counter()
            if ev.get("tokens"):
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.gaps.append(now - last)
                last = now
                got += len(ev["tokens"])
            if drop_after is not None and got >= drop_after:
                res.outcome = "disconnect"
                return res                      # leaving the block closes the connection mid-stream
            if ev.get("stop"):
                final = ev
                break
    if final is None:
        return Result(scenario, "error:stream ended without a final event", True)
    if final["tokens_predicted"] != n or got != n or final["stop_type"] != "limit":
        return Result(scenario, "error:wrong token count", True,
                      detail=f"want {n}, got {got}, final {final['tokens_predicted']} {final['stop_type']}")
    return res


def whole_completion(c, url, rng, lim, scenario="complete") -> Result:
    n = rng.randint(4, 40)
    body = {"prompt": "Once upon a time " + words(rng, rng.randint(2, 200)), "n_predict": n, "ignore_eos": True,
            "temperature": rng.choice([0, 0.7]), "seed": 5}
    r = c.post(url + "/completion", json=body)
    bad = _status(r, 200, scenario)
    if bad:
        return bad
    j = r.json()
    if j["tokens_predicted"] != n or not j["stop"]:
        return Result(scenario, "error:wrong token count", True, detail=str(j)[:200])
    return Result(scenario, "ok", True)


def chat(c, url, rng, lim, scenario="chat") -> Result:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": words(rng, rng.randint(3, 40))}]
    body = {"messages": msgs, "max_tokens": rng.randint(4, 32), "temperature": rng.choice([0, 0.9])}
    if rng.random() < 0.5:
        r = c.post(url + "/v1/chat/completions", json=body)
        bad = _status(r, 200, scenario)
        if bad:
            return bad
        fin = r.json()["choices"][0]["finish_reason"]
        return Result(scenario, "ok" if fin in ("stop", "length") else f"error:finish {fin}", True)
    with c.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        bad = _status(r, 200, scenario)
        if bad:
            return bad
        evs = [e for e in map(sse, r.iter_lines()) if e is not None]
    if not evs or evs[-1] != "[DONE]" or any("error" in e for e in evs[:-1]):
        return Result(scenario, "error:bad chat stream", True, detail=str(evs[-2:])[:200])
    return Result(scenario, "ok", True)


def v1_completion(c, url, rng, lim, scenario="v1") -> Result:
    r = c.post(url + "/v1/completions", json={"prompt": words(rng, 12), "max_tokens": rng.randint(1, 24),
                                              "temperature": 0.5, "seed": 3})
    bad = _status(r, 200, scenario)
    return bad or Result(scenario, "ok", True)


def disconnect(c, url, rng, lim) -> Result:
    return stream_completion(c, url, rng, lim, "disconnect", drop_after=rng.choice([0, 0, 1, 2, 4, 8]))


def abandon(c, url, rng, lim) -> Result:
    """A whole completion whose client gives up after a short while (queued, prefilling or decoding)."""
    body = {"prompt": words(rng, rng.randint(5, 300)), "n_predict": 200, "ignore_eos": True}
    try:
        r = c.post(url + "/completion", json=body, timeout=rng.uniform(0.02, 1.0))
    except httpx.TimeoutException:
        return Result("abandon", "disconnect", None)
    bad = _status(r, 200, "abandon")
    return bad or Result("abandon", "ok", True)


def context_limit(c, url, rng, lim) -> Result:
    """Token ids up to 20 short of the context and more to generate: ends by the context limit."""
    p = lim.n_ctx - rng.randint(4, 20)
    ids = [rng.randrange(100, lim.n_vocab) for _ in range(p)]
    n = min(lim.max_tokens, 64)
    r = c.post(url + "/completion", json={"prompt": ids, "n_predict": n, "ignore_eos": True, "temperature": 0})
    bad = _status(r, 200, "context")
    if bad:
        return bad
    j = r.json()
    want = min(n, lim.n_ctx - p + 1)
    if j["tokens_predicted"] != want or j["stop_type"] != "limit":
        return Result("context", "error:context limit", True, detail=f"want {want}, got {j['tokens_predicted']}")
    return Result("context", "ok", True)


def over_limits(c, url, rng, lim) -> Result:
    kind = rng.choice(["ctx", "max_tokens", "body", "json", "type", "surrogate", "route", "negative"])
    want = 400
    if kind == "ctx":
        body = {"prompt": [rng.randrange(100, lim.n_vocab) for _ in range(lim.n_ctx + 5)]}
    elif kind == "max_tokens":
        body = {"prompt": "hi", "n_predict": lim.max_tokens + 1}
    elif kind == "negative":
        body = {"prompt": "hi", "max_tokens": -5}
    elif kind == "type":
        body = {"prompt": "hi", "temperature": "warm", "n_predict": [1]}
    elif kind == "body":
        body, want = {"prompt": "x" * (lim.max_body + 10)}, 413
    else:
        body = None
    path = "/v1/completions" if kind == "negative" else "/completion"
    if kind == "json":
        r = c.post(url + path, content=b'{"prompt": "unterminated')
    elif kind == "surrogate":
        r = c.post(url + path, content=b'{"prompt": "\\ud800 lone"}')
    elif kind == "route":
        r, want = c.post(url + "/slots/0?action=save", json={"filename": "/etc/passwd"}), 404
    else:
        r = c.post(url + path, json=body)
    if r.status_code == want and "error" in r.json():
        return Result("over:" + kind, "rejected", False)
    return Result("over:" + kind, f"error:status {r.status_code} for over-limit {kind}", False,
                  detail=r.text[:200])


def tokenize(c, url, rng, lim) -> Result:
    text = words(rng, lim.max_body // 12)          # about a third of the body limit
    r = c.post(url + "/tokenize", json={"content": text})
    if r.status_code != 200 or not r.json()["tokens"]:
        return Result("tokenize", f"error:status {r.status_code}", detail=r.text[:200])
    return Result("tokenize", "ok")


def probe(c, url, rng, lim) -> Result:
    path = rng.choice(["/slots", "/props", "/metrics", "/health", "/v1/models"])
    r = c.get(url + path)
    return Result("probe", "ok" if r.status_code == 200 else f"error:status {r.status_code} on {path}")


SCENARIOS = [(stream_completion, 30), (whole_completion, 10), (chat, 8), (v1_completion, 5), (disconnect, 14),
             (abandon, 4), (context_limit, 4), (over_limits, 15), (tokenize, 3), (probe, 7)]


# -- the run -------------------------------------------------------------------------
def run_clients(url: str, lim: Limits, clients: int, deadline: float, max_requests: int, seed: int) -> list[Result]:
    results: list[Result] = []
    lock = threading.Lock()
    issued = [0]
    fns, weights = zip(*SCENARIOS)

    def take() -> bool:
        with lock:
            if time.monotonic() >= deadline or (max_requests and issued[0] >= max_requests):
                return False
            issued[0] += 1
            return True

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with httpx.Client(timeout=TIMEOUT) as c:
            while take():
                fn = rng.choices(fns, weights)[0]
                try:
                    res = fn(c, url, rng, lim)
                except httpx.TimeoutException as e:
                    res = Result(fn.__name__, f"error:timeout {type(e).__name__}")
                except httpx.HTTPError as e:
                    res = Result(fn.__name__, f"error:transport {type(e).__name__}", detail=str(e)[:200])
                except (ValueError, KeyError, TypeError) as e:       # a reply that is not what the API says
                    res = Result(fn.__name__, f"error:bad reply {type(e).__name__}", detail=str(e)[:200])
                with lock:
                    results.append(res)
                if res.outcome == "busy":                 # a polite client waits as told before its next request
                    time.sleep(min(float(res.detail), 5.0))
    threads = [threading.Thread(target=client, args=(i,), name=f"soak-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def sample_rss(url: str, every: float, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """(seconds, host RSS) while the clients run: growth that levels off is warm-up, steady growth a leak."""
    t0 = time.monotonic()
    while not stop.wait(every):
        try:
            out.append((time.monotonic() - t0, total(scrape(url), "process_resident_memory_bytes")))
        except httpx.HTTPError:
            pass


def hostile(url: str, n: int, until: float, stop: threading.Event, seen: Counter) -> None:
    """n hostile connections, spread evenly until `until`, each kind in turn; up
    to 64 trickling connections are held at once (each until the server closes it)."""
    import socket
    u = urlparse(url)
    addr = (u.hostname or "127.0.0.1", u.port or 80)
    held: list[tuple[socket.socket, float]] = []
    gap = max(0.001, (until - time.monotonic()) / max(1, n))
    for i in range(n):
        if stop.is_set():
            break
        kind = ("half-body", "trickle", "bad-chunks")[i % 3]
        try:
            k = socket.create_connection(addr, timeout=10)
            if kind == "half-body":
                k.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 100\r\n\r\n{\"prompt\": \"hal")
                k.close()
            elif kind == "bad-chunks":
                k.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\nZZ\r\n")
                k.settimeout(10)
                try:
                    k.recv(4096)
                except OSError:
                    pass
                k.close()
            else:
                k.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
                k.setblocking(False)
                held.append((k, time.monotonic()))
            seen[kind] += 1
        except OSError as e:
            seen[f"{kind} refused ({type(e).__name__})"] += 1
        still = []
        for k, t in held:                     # trickle a byte; a closed one is done
            try:
                k.send(b"a")
                if k.recv(1) == b"":
                    k.close()
                    seen["trickle closed by the server"] += 1
                    continue
            except BlockingIOError:
                pass
            except OSError:
                k.close()
                seen["trickle closed by the server"] += 1
                continue
            still.append((k, t))
        held = still[-64:]
        for k, _ in still[:-64]:
            k.close()
        time.sleep(gap)
    for k, _ in held:
        k.close()


# The /health probe runs in a process of its own, as a health checker would: a new TCP connection a
# probe, `Connection: close`, the time from connect to the whole answer. Run in this process it would
# time the clients' GIL as well, and httpx builds an SSL context for each new client (~30 ms of CPU on
# an idle 2-core machine): the probe measured itself (p50 55 ms in the first 10-minute soak).
PROBE_SRC = r"""
import socket, sys, time
host, port, period = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
req = ("GET /health HTTP/1.1\r\nHost: %s:%d\r\nConnection: close\r\n\r\n" % (host, port)).encode()
while True:
    t = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=10) as k:
            k.sendall(req)
            buf = b""
            while True:
                b = k.recv(65536)
                if not b:
                    break
                buf += b
        ok = buf.startswith(b"HTTP/1.1 200")
    except OSError:
        ok = False
    print("%.3f" % ((time.monotonic() - t) * 1e3) if ok else "inf", flush=True)
    time.sleep(period)
"""


def health_probe(url: str, stop: threading.Event, out: list[float]) -> None:
    """/health every 0.2 s from a child process (PROBE_SRC) until stop; latencies in seconds into out."""
    u = urlparse(url)
    p = subprocess.Popen([sys.executable, "-c", PROBE_SRC, u.hostname or "127.0.0.1", str(u.port or 80), "0.2"],
                         stdout=subprocess.PIPE, text=True)
    def read(lines: IO[str]) -> None:
        for x in lines:
            if x.strip():
                out.append(float(x) / 1e3)
    assert p.stdout is not None
    reader = threading.Thread(target=read, args=(p.stdout,), daemon=True)
    reader.start()
    stop.wait()
    p.terminate()
    p.wait()
    reader.join(5)


def wait_idle(url: str, timeout: float) -> dict[str, float] | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        m = scrape(url)
        if all(total(m, n) == 0 for n in ("vkengine_requests_active", "vkengine_queue_depth",
                                          "vkengine_sequences_live", "vkengine_slots_used")):
            return m
        time.sleep(0.5)
    return None


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


class Server:
    """`vkengine serve` in a subprocess on a free loopback port."""

    def __init__(self, model: str, serve_args: list[str]):
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix="soak-serve-", suffix=".log")[1])
        self._fh = open(self.log, "wb")
        cmd = [sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), *serve_args]
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._fh, stderr=subprocess.STDOUT)
        end = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited ({self.proc.returncode}):\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                self.stop()
                raise SystemExit(f"server did not become ready:\n{self.log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        return self.proc.returncode


def synth_tiny(out: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from vkengine.tools.synth.llama import config_for, synth_llama
    return str(synth_llama(config_for("tiny", None), "q8_0", 0, out, "tiny", formats=("gguf",), workers=1)["gguf"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=None, help="a running server on loopback (default: start one)")
    ap.add_argument("--model", default=None, help="GGUF for the server it starts (default: a tiny synthetic model)")
    ap.add_argument("--serve-args", default=SERVE_ARGS, help=f"flags of the server it starts ({SERVE_ARGS})")
    ap.add_argument("--clients", "-c", type=int, default=8, help="concurrent clients (C)")
    ap.add_argument("--minutes", "-m", type=float, default=5.0, help="stop sending after this long (M)")
    ap.add_argument("--requests", "-n", type=int, default=0, help="stop after this many requests (0: no limit)")
    ap.add_argument("--idle-timeout", type=float, default=120.0, help="seconds the server may take to go idle")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--hostile", type=int, default=0, help="hostile connections mixed in (see above)")
    args = ap.parse_args(argv)
    if args.url and urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("--url must be a loopback address: the soak is not for other people's servers")
    if args.minutes <= 0 or args.clients < 1:
        raise SystemExit("--minutes must be > 0 and --clients >= 1")

    srv = None
    tmp = tempfile.TemporaryDirectory(prefix="soak-")
    if args.url is None:
        model = args.model or synth_tiny(Path(tmp.name))
        srv = Server(model, shlex.split(args.serve_args))
    url = (args.url or srv.url).rstrip("/")
    failures: list[str] = []
    try:
        props = httpx.get(url + "/props", timeout=30).json()
        meta = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["meta"]
        lim = Limits(n_ctx=props["default_generation_settings"]["n_ctx"], n_vocab=meta["n_vocab"],
                     max_tokens=props["max_tokens"], max_body=props.get("max_body", 1 << 20))
        start = wait_idle(url, args.idle_timeout)
        if start is None:
            raise SystemExit("the server is not idle at the start")
        t0 = time.monotonic()
        rss: list[tuple[float, float]] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(url, max(5.0, args.minutes * 6), stop, rss))
        sampler.start()
        hostile_seen: Counter = Counter()
        health_s: list[float] = []
        side = [threading.Thread(target=health_probe, args=(url, stop, health_s))]
        if args.hostile:
            side.append(threading.Thread(target=hostile, args=(url, args.hostile, t0 + args.minutes * 60, stop,
                                                                hostile_seen)))
        for th in side:
            th.start()
        try:
            results = run_clients(url, lim, args.clients, t0 + args.minutes * 60, args.requests, args.seed)
        finally:
            stop.set()
            sampler.join()
            for th in side:
                th.join()
        wall = time.monotonic() - t0
        end = wait_idle(url, args.idle_timeout)
        if end is None:
            failures.append(f"the server did not go idle within {args.idle_timeout:.0f} s")
            end = scrape(url)
    finally:
        rc = srv.stop() if srv else None
    if srv is not None:
        log = srv.log.read_text(errors="replace")
        # uvicorn shuts down gracefully, then re-raises SIGINT: exit status 130 (or 0 on older versions)
        if rc not in (0, 130, -signal.SIGINT) or "Application shutdown complete" not in log:
            failures.append(f"the server did not shut down cleanly on SIGINT (exit status {rc})")
        if "Traceback" in log or " ERROR " in log:
            failures.append(f"the server log has errors ({srv.log})")
        if args.hostile and len(log) > 1 << 20:
            failures.append(f"the server log grew to {len(log)} bytes under hostile connections ({srv.log})")
    health_p99 = pct(health_s, .99)
    if args.hostile and not health_p99 < 100.0:
        failures.append(f"/health p99 {health_p99:.0f} ms (must be < 100 ms)")

    outcomes = Counter(r.outcome if not r.outcome.startswith("error:") else "error" for r in results)
    errors = Counter(r.outcome[6:] for r in results if r.outcome.startswith("error:"))
    ttft = [r.ttft for r in results if r.ttft is not None]
    gaps = [g for r in results for g in r.gaps]
    finishes = {k: v - by_label(start, "vkengine_requests_total", "finish").get(k, 0)
                for k, v in by_label(end, "vkengine_requests_total", "finish").items()}
    statuses = {k: v - by_label(start, "vkengine_http_requests_total", "status").get(k, 0)
                for k, v in by_label(end, "vkengine_http_requests_total", "status").items()}
    statuses = {k: v for k, v in statuses.items() if v}
    accepted = sum(r.accepted is True for r in results)
    unknown = sum(r.accepted is None and r.outcome == "disconnect" for r in results)
    ended = sum(finishes.values())
    if errors:
        failures.append(f"{sum(errors.values())} unexpected errors")
    if finishes.get("error"):
        failures.append(f"{finishes['error']:g} requests ended with an engine error")
    if any(k.startswith("5") and k != "503" for k in statuses):
        failures.append(f"the server answered 5xx: {statuses}")
    if not accepted <= ended <= accepted + unknown:
        failures.append(f"the server ended {ended:g} requests; the clients saw {accepted} accepted "
                        f"(+ up to {unknown} abandoned before an answer)")
    checks = leak_checks(start, end)
    failures += [f"leak: {what} (now {val})" for what, ok, val in checks if not ok]

    print(f"\nsoak: C = {args.clients} clients, {wall / 60:.1f} min, {len(results)} requests "
          f"({len(results) / wall:.1f}/s); server {' '.join(srv.cmd[3:]) if srv else url}\n")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print("by scenario: " + ", ".join(f"{k} {v}" for k, v in sorted(Counter(r.scenario for r in results).items())))
    print("errors by kind: " + (", ".join(f"{k}: {v}" for k, v in errors.most_common()) or "none"))
    for r in [r for r in results if r.outcome.startswith("error:")][:5]:
        print(f"  e.g. {r.scenario}: {r.outcome[6:]} {r.detail}")
    print(f"server: requests by finish {({k: int(v) for k, v in finishes.items() if v})}, "
          f"HTTP by status {({k: int(v) for k, v in sorted(statuses.items())})}")
    print(f"TTFT ms p50 {pct(ttft, .5):.0f} p99 {pct(ttft, .99):.0f} ({len(ttft)} streams); "
          f"inter-token ms p50 {pct(gaps, .5):.1f} p99 {pct(gaps, .99):.1f} ({len(gaps)} gaps)")
    print(f"/health ms p50 {pct(health_s, .5):.1f} p99 {health_p99:.1f} max {pct(health_s, 1.0):.1f} "
          f"({len(health_s)} probes)" + (f"; hostile connections: {dict(hostile_seen)}; server log "
                                          f"{srv.log.stat().st_size if srv else 0} bytes" if args.hostile else ""))
    if rss:
        print("host RSS under load (MiB): " + ", ".join(f"{t / 60:.1f} min {v / 2 ** 20:.0f}" for t, v in rss))
    print("\n| at idle | start | end |\n| --- | ---: | ---: |")
    for label, name, lab, unit in MEMORY:
        print(f"| {label} | {total(start, name, **lab) / unit:.1f} | {total(end, name, **lab) / unit:.1f} |")
    print()
    for what, ok, val in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what} ({val})")
    for f in failures:
        print(f"FAILED: {f}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "clients": args.clients, "wall_s": wall, "requests": len(results), "outcomes": outcomes,
            "errors": errors, "scenarios": Counter(r.scenario for r in results),
            "ttft_ms": {"p50": pct(ttft, .5), "p99": pct(ttft, .99), "n": len(ttft)},
            "itl_ms": {"p50": pct(gaps, .5), "p99": pct(gaps, .99), "n": len(gaps)},
            "server_finishes": finishes, "server_statuses": statuses, "rss_under_load": rss,
            "health_ms": {"p50": pct(health_s, .5), "p99": health_p99, "n": len(health_s)},
            "hostile": dict(hostile_seen),
            "memory": {label: [total(start, n, **lab), total(end, n, **lab)] for label, n, lab, _ in MEMORY},
            "checks": [{"what": w, "ok": ok, "value": v} for w, ok, v in checks], "failures": failures},
            indent=1))
    tmp.cleanup()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
