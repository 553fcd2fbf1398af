"""Concurrent streaming clients against the server, over real HTTP (httpx).

For each configuration it starts a server (ours, or llama-server on the same
GGUF), warms it up (`warm_up`: a first request, then the same C clients with
shorter replies for at least `--warmup-s` seconds; ours then until it has recorded
the steps its start left for idle time, `settle`), then runs C clients at once
(`--repeat` times; the run of median tok/s is reported); each sends `--requests`
streaming /completion requests one after another (distinct prompts, greedy,
`--n-predict` tokens, EOS ignored). Reported per configuration: time to first
token (p50, p99), inter-token latency (p50, p99, gaps between consecutive token
chunks of one stream), and aggregate generated tokens per second over the wall
time of the run.

    .venv/bin/python bench/serve.py --model /tmp/x/llama-tiny-q8_0.gguf --clients 4
    .venv/bin/python bench/serve.py --clients 4 --llama-server ~/.cache/vkengine/llama.cpp-*/bin/llama-server

Configurations: serial (--parallel 1, the same C clients queue), slices and batch
(--parallel C), and llama-server --parallel C when a binary (--llama-server) or
a running server's URL (--llama-url) is given.

Long prompts: `--prompt-ids N` sends prompts of N random token ids instead of
words (as `vkengine bench` and llama-bench do), e.g. one client, 16k tokens:

    .venv/bin/python bench/serve.py --model M --clients 1 --requests 1 --prompt-ids 16384 -n 16 --ctx 17000

`--newcomers K --newcomer-ids N`: while the C clients stream (short prompts,
--n-predict tokens), K more clients arrive together, once every stream has
its first token, each with a prompt of N random token ids and
--newcomer-predict tokens (the warm-up adds one prompt of N ids, so that
pipelines built on first use are not timed): reported are the newcomers' TTFT (p50, p99), the
streams' inter-token gaps while newcomers are in (p99), and the aggregate
tok/s over the run.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("river stone light garden paper window city music winter forest engine story market silver "
         "harbor mountain letter evening bridge candle").split()


@dataclass
class Stream:
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float = 600,
               interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); log:\n{log.read_text() if log else ''}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)
    raise SystemExit(f"{url} did not become ready")


def prompt(rng: random.Random, n_words: int) -> str:
    return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + "."


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of sorted seconds, in ms (nan when there are none)."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def report(args, rows: list[dict], title: str, header: str, cells) -> int:
    """Print the rows as a table (cells(row) -> its cells after the config),
    write them to --json, and the exit code: 1 when any row had errors."""
    print(f"\n{title}\n")
    print(f"| config | {header} | errors |")
    print("| --- |" + " ---: |" * (header.count("|") + 2))
    for r in rows:
        print(f"| {r['config']} | {cells(r)} | {r['errors']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    return 1 if any(r["errors"] for r in rows) else 0


def prompt_ids(rng: random.Random, n: int) -> list[int]:
    """n random token ids (below 10,000: inside any vocabulary the benches use)."""
    return [rng.randrange(100, 10_000) for _ in range(n)]


def one_stream(client: httpx.Client, url: str, text: str | list[int], n_predict: int, temperature: float = 0.0,
               seed: int = 0, times: list[float] | None = None, cache_prompt: bool = False) -> Stream:
    s = Stream()
    body = {"prompt": text, "n_predict": n_predict, "stream": True, "ignore_eos": True,
            "temperature": temperature, "cache_prompt": cache_prompt}
    if temperature > 0:   # sampled (the servers' top-k 40, top-p 0.95, min-p 0.05), reproducibly
        body["seed"] = seed
    t0 = last = time.perf_counter()
    try:
        with client.stream("POST", url + "/completion", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}: {r.read()[:200]!r}"
                return s
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("stop"):
                    break
                now = time.perf_counter()
                if s.ttft is None:
                    s.ttft = now - t0
                else:
                    s.gaps.append(now - last)
                if times is not None:
                    times.append(now)
                last = now
                s.tokens += 1
    except httpx.HTTPError as e:
        s.error = repr(e)
    return s


def run_load(url: str, clients: int, requests: int, n_predict: int, prompt_words: int, seed: int,
             temperature: float = 0.0, n_ids: int = 0, prompts: list[list] | None = None,
             cache_prompt: bool = False) -> dict:
    """C clients, each sending `requests` streams one after another: random
    prompts of prompt_words words (or n_ids token ids), or the given prompts
    (a list a client, bench/ray_scale.py's shared prefixes, with cache_prompt)."""
    if prompts is None:
        rng = random.Random(seed)
        prompts = [[prompt_ids(rng, n_ids) if n_ids else prompt(rng, prompt_words) for _ in range(requests)]
                   for _ in range(clients)]
    results: list[list[Stream]] = [[] for _ in range(clients)]

    # the clients exist before the clock starts: making an httpx.Client loads
    # its TLS context (30-60 ms of CPU each here, serialized by the GIL), which
    # is the load generator's cost, not the server's
    conns = [httpx.Client(timeout=600) for _ in range(clients)]

    def client(i):
        for j, p in enumerate(prompts[i]):
            results[i].append(one_stream(conns[i], url, p, n_predict, temperature, seed * 1000 + i * requests + j,
                                         cache_prompt=cache_prompt))
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    streams = [s for r in results for s in r]
    errors = [s.error for s in streams if s.error]
    ttft = sorted(s.ttft for s in streams if s.ttft is not None)
    gaps = sorted(g for s in streams for g in s.gaps)
    tokens = sum(s.tokens for s in streams)

    return {"clients": clients, "requests": len(streams), "errors": len(errors), "first_error": errors[:1],
            "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
            "itl_p50_ms": pct(gaps, 0.5), "itl_p99_ms": pct(gaps, 0.99),
            "itl_mean_ms": statistics.fmean(gaps) * 1e3 if gaps else float("nan")}


def run_mixed(url: str, streams: int, n_stream: int, prompt_words: int, newcomers: int, n_ids: int,
              n_new: int, seed: int) -> dict:
    """`streams` clients stream n_stream tokens each; once all have their first
    token, `newcomers` clients arrive at once with n_ids-token prompts."""
    rng = random.Random(seed)
    long_prompts = [prompt_ids(rng, n_ids) for _ in range(newcomers)]
    conns = [httpx.Client(timeout=1200) for _ in range(streams + newcomers)]
    started = threading.Barrier(streams + 1)
    s_res: list[Stream] = [Stream() for _ in range(streams)]
    n_res: list[Stream] = [Stream() for _ in range(newcomers)]
    stamps: list[list[float]] = [[] for _ in range(streams)]

    def stream(i):
        class _First(list):   # the token times; the first one releases the newcomers
            def append(self, t):
                super().append(t)
                if len(self) == 1:
                    started.wait()
        times = _First()
        s_res[i] = one_stream(conns[i], url, prompt(rng, prompt_words), n_stream, times=times)
        if not times:
            started.abort()
        stamps[i] = list(times)

    def newcomer(j):
        n_res[j] = one_stream(conns[streams + j], url, long_prompts[j], n_new)
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    started.wait()
    t_in = time.perf_counter()
    late = [threading.Thread(target=newcomer, args=(j,)) for j in range(newcomers)]
    for t in late:
        t.start()
    for t in late:
        t.join()
    t_out = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for c in conns:
        c.close()
    # the streams' gaps while newcomers were in
    gaps = sorted(b - a for st in stamps for a, b in zip(st, st[1:]) if t_in <= b <= t_out)
    ttft = sorted(s.ttft for s in n_res if s.ttft is not None)
    errors = [s.error for s in s_res + n_res if s.error]
    tokens = sum(s.tokens for s in s_res + n_res)

    return {"streams": streams, "newcomers": newcomers, "newcomer_prompt": n_ids, "errors": len(errors),
            "first_error": errors[:1], "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "new_ttft_p50_ms": pct(ttft, 0.5), "new_ttft_p99_ms": pct(ttft, 0.99),
            "stream_itl_p50_ms": pct(gaps, 0.5), "stream_itl_p99_ms": pct(gaps, 0.99),
            "newcomers_in_s": t_out - t_in}


class Server:
    def __init__(self, cmd: list[str], url: str, cwd=None, keep: str | None = None, name: str = "server"):
        """keep: a folder that gets the server's log when it stops (as <name>-<n>.log)."""
        self.log = Path(tempfile.mkstemp(prefix="bench-serve-", suffix=".log")[1])
        self.keep, self.name = keep, name
        self._fh = open(self.log, "wb")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._fh, stderr=subprocess.STDOUT)
        self.url = url
        wait_ready(url, self.proc, self.log)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._fh.close()
        if self.keep:
            folder = Path(self.keep)
            folder.mkdir(parents=True, exist_ok=True)
            n = sum(1 for _ in folder.glob(f"{self.name}-*.log"))
            shutil.copyfile(self.log, folder / f"{self.name}-{n}.log")


def ours(args, parallel: int, mode: str, extra: tuple[str, ...] = ()) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--parallel", str(parallel),
           "--mode", mode, "--ctx", str(args.ctx), "--quantum", str(args.quantum),
           "--step-tokens", str(args.step_tokens), "--max-queue", str(max(64, args.clients))]
    cmd += args.server_args.split() + list(extra)
    if args.model:
        cmd += ["--model", args.model]
    return Server(cmd, f"http://127.0.0.1:{port}", cwd=ROOT, keep=args.keep_logs,
                  name=f"ours-{mode}{'-mtp' if extra else ''}")


def llama(args, parallel: int) -> Server:
    port = free_port()
    model = args.model or _default_model()
    parallel += args.newcomers
    cmd = [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(parallel),
           "-c", str(args.ctx * parallel), "-t", str(args.llama_threads or os.cpu_count() or 1)]
    cmd += args.llama_args.split()
    return Server(cmd, f"http://127.0.0.1:{port}", keep=args.keep_logs, name="llama-server")


def _drafts(url: str) -> tuple[float, float]:
    """Our server's drafts verified and accepted so far (--mtp)."""
    from soak import scrape, total
    m = scrape(url)
    return total(m, "vkengine_spec_draft_tokens_total"), total(m, "vkengine_spec_accepted_tokens_total")


def _metric(url: str, name: str) -> float | None:
    """One of our server's /metrics values (None: a server without it, llama-server)."""
    from soak import scrape
    try:
        return scrape(url).get(name)
    except httpx.HTTPError:
        return None


def settle(url: str, timeout: float) -> float | None:
    """Wait until our server has recorded the steps its start left for idle
    time (/metrics' vkengine_programs_deferred at 0), so that the measured runs
    record none in their requests' time (on the H100 a 35B-A3B server with
    --mtp --draft 5 leaves ~180 turn shapes, each ~10-50 ms to record, and a
    warm-up of 2 s keeps it busy; its first tokens came 17-29 ms later than
    with 3 drafts, likely for that: notes.md run 51). The seconds waited; None
    for a server without the gauge."""
    t0 = time.perf_counter()
    while True:
        left = _metric(url, "vkengine_programs_deferred")
        if left is None or left == 0:
            return None if left is None else time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            print(f"warning: {left:.0f} steps still to record after {timeout:.0f} s; measuring anyway",
                  file=sys.stderr)
            return time.perf_counter() - t0
        time.sleep(0.1)


def _default_model() -> str:
    sys.path.insert(0, str(ROOT))
    from vkengine.model import default_model_path
    return str(default_model_path())


def warm_up(url: str, args) -> int:
    """Bring a server to the state its measured runs should see: a first
    request (pipelines, recorded steps), then the measured load's C clients with
    replies of at most 64 tokens until `args.warmup_s` seconds have passed (at
    least once). A GPU that idled while the server started runs at low clocks
    for a while: on the H200 a batch server's first ~30 decode steps under load
    took 5.2 ms against 1.3 ms later (VKENGINE_STEP_LOG, docs/bench/notes.md run
    24), which a single 8-token warm-up request did not cover, so whichever
    configuration met the GPU cold lost ~13% of its rate. Returns the number of
    warm-up loads run."""
    run_load(url, 1, 1, 8, 4, seed=999)
    t, n = time.perf_counter(), 0
    while True:
        run_load(url, args.clients, 1, min(args.n_predict, 64), args.prompt_words, seed=998 - n,
                 temperature=args.temperature)
        n += 1
        if time.perf_counter() - t >= args.warmup_s:
            return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the embedded SmolLM2-135M)")
    ap.add_argument("--clients", "-c", type=int, default=4, help="concurrent streaming clients (C)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--n-predict", "-n", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence")
    ap.add_argument("--quantum", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=64)
    ap.add_argument("--configs", default="serial,slices,batch",
                    help="comma separated: serial, slices, batch, and serial-mtp, batch-mtp (the same with --mtp "
                         "--draft D: greedy replies drafted by the model's MTP block)")
    ap.add_argument("--draft", type=int, default=2, help="the -mtp configurations' --draft")
    ap.add_argument("--llama-server", default=None, help="llama-server binary: adds 'llama-server -np C'")
    ap.add_argument("--llama-url", default=None, help="a running llama-server to measure instead of starting one")
    ap.add_argument("--llama-threads", type=int, default=None)
    ap.add_argument("--llama-args", default="", help="extra llama-server arguments (e.g. '-ngl 99' on a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled replies (each request its own seed) instead of greedy ones")
    ap.add_argument("--warmup-s", type=float, default=2.0,
                    help="warm-up: the C clients with short replies for at least this long before measuring")
    ap.add_argument("--settle-s", type=float, default=120.0,
                    help="then wait up to this long for our server to record the steps its start left for idle "
                         "time (vkengine_programs_deferred)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="measured runs per configuration (same server); the run of median tok/s is reported")
    ap.add_argument("--prompt-ids", type=int, default=0,
                    help="prompts of this many random token ids instead of --prompt-words words")
    ap.add_argument("--newcomers", type=int, default=0,
                    help="mixed scenario: this many clients arrive with long prompts while the C clients stream")
    ap.add_argument("--newcomer-ids", type=int, default=8192, help="mixed scenario: the newcomers' prompt length")
    ap.add_argument("--newcomer-predict", type=int, default=16, help="mixed scenario: the newcomers' reply length")
    ap.add_argument("--server-args", default="", help="extra arguments of our server (e.g. '--prompt-ms 25')")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--keep-logs", default=None, metavar="DIR",
                    help="copy each server's log here when it stops (llama-server's prompt and batch timings)")
    args = ap.parse_args(argv)
    if args.repeat < 1 or args.warmup_s < 0 or args.settle_s < 0:
        raise SystemExit("--repeat must be >= 1, --warmup-s and --settle-s >= 0")

    rows = []
    if args.newcomers:
        return mixed_main(args)
    plan = [c.strip() for c in args.configs.split(",") if c.strip()]
    if args.llama_server or args.llama_url:
        plan.append("llama-server")
    for name in plan:
        srv = None
        mtp = ("--mtp", "--draft", str(args.draft)) if name.endswith("-mtp") else ()
        if name in ("serial", "serial-mtp"):
            srv = ours(args, 1, "batch", mtp)
        elif name in ("slices", "batch", "batch-mtp"):
            srv = ours(args, args.clients, name.removesuffix("-mtp"), mtp)
        elif name == "llama-server":
            srv = None if args.llama_url else llama(args, args.clients)
        else:
            raise SystemExit(f"unknown config {name!r}")
        url = args.llama_url if srv is None else srv.url
        try:
            n_warm = warm_up(url, args)
            settled = settle(url, args.settle_s)
            drafts0 = _drafts(url) if mtp else (0.0, 0.0)
            ev0 = _metric(url, "vkengine_programs_evicted_total")
            runs = [run_load(url, args.clients, args.requests, args.n_predict, args.prompt_words, args.seed + i,
                             args.temperature, args.prompt_ids) for i in range(args.repeat)]
            ev1 = _metric(url, "vkengine_programs_evicted_total")
            if mtp:   # the drafts of the timed runs (the server's counters)
                drafted, accepted = (b - a for a, b in zip(drafts0, _drafts(url)))
                print(f"{name}: {drafted:.0f} drafts, {accepted:.0f} accepted", file=sys.stderr)
        finally:
            if srv is not None:
                srv.stop()
        r = sorted(runs, key=lambda x: x["tok_s"])[(len(runs) - 1) // 2]
        r["tok_s_runs"] = [x["tok_s"] for x in runs]
        r["warmup_loads"] = n_warm
        r["settle_s"] = settled
        if ev0 is not None and ev1 is not None:   # (recorded steps dropped and recorded again while measured)
            r["programs_evicted"] = ev1 - ev0
            if ev1 > ev0:
                print(f"{name}: the program cache dropped {ev1 - ev0:.0f} recorded steps during the timed runs",
                      file=sys.stderr)
        base = name.removesuffix("-mtp")
        r["config"] = (base if base != "serial" else "serial (--parallel 1)") + (f" --mtp --draft {args.draft}"
                                                                               if mtp else "")
        if mtp:
            r["drafted"], r["accepted"] = drafted, accepted
        rows.append(r)
        runs = ", ".join(f"{x:.0f}" for x in r["tok_s_runs"])
        print(f"{r['config']}: {r['tok_s']:.1f} tok/s (runs: {runs}), TTFT p50 {r['ttft_p50_ms']:.0f} ms, "
              f"ITL p50 {r['itl_p50_ms']:.1f} ms, errors {r['errors']}", file=sys.stderr)

    return report(args, rows,
                  f"C = {args.clients} clients x {args.requests} requests, {args.n_predict} tokens each"
                  f"{f', sampled at temperature {args.temperature}' if args.temperature > 0 else ''}, "
                  f"model {Path(args.model).name if args.model else 'SmolLM2-135M-Instruct Q4_1 (default)'}",
                  "TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | tok/s",
                  lambda r: f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.1f} | "
                            f"{r['itl_p99_ms']:.1f} | {r['tok_s']:.1f}")


def mixed_main(args) -> int:
    """The mixed scenario for ours (batch, --parallel C + K) and llama-server (-np C + K)."""
    rows = []
    plan = ["batch"] + (["llama-server"] if args.llama_server or args.llama_url else [])
    for name in plan:
        if name == "batch":
            srv: Server | None = ours(args, args.clients + args.newcomers, "batch")
        else:
            srv = None if args.llama_url else llama(args, args.clients)
        url = args.llama_url if srv is None else srv.url
        try:
            warm_up(url, args)
            settle(url, args.settle_s)
            # and one newcomer-sized prompt: pipelines of long prompts' shapes are built on first use (on a
            # fresh H200, llama-server's first 8k-token prompt took 15.1 s against 1.0-2.2 s for the next
            # ones, and its newcomers' TTFT p99 read 18.4 s against 4.8 s warm: notes.md run 37)
            run_load(url, 1, 1, 2, args.prompt_words, seed=997, n_ids=args.newcomer_ids)
            r = run_mixed(url, args.clients, args.n_predict, args.prompt_words, args.newcomers, args.newcomer_ids,
                          args.newcomer_predict, args.seed)
        finally:
            if srv is not None:
                srv.stop()
        r["config"] = name
        rows.append(r)
    return report(args, rows,
                  f"{args.clients} streams of {args.n_predict} tokens; {args.newcomers} newcomers with "
                  f"{args.newcomer_ids}-token prompts and {args.newcomer_predict}-token replies",
                  "newcomers' TTFT p50 ms | p99 ms | streams' ITL p50 ms | p99 ms | tok/s",
                  lambda r: f"{r['new_ttft_p50_ms']:.0f} | {r['new_ttft_p99_ms']:.0f} | "
                            f"{r['stream_itl_p50_ms']:.1f} | {r['stream_itl_p99_ms']:.1f} | {r['tok_s']:.1f}")


if __name__ == "__main__":
    sys.exit(main())
