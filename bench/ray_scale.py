"""vkengine on Ray Serve, measured (issue 35): 1 vs 2 vs 4 replicas under the
serve bench's clients (aggregate tok/s, TTFT p99), and the prefix cache's hit
rate with prefix-aware routing on and off for a workload of shared system
prompts.

Each configuration starts the application (server/ray_app.py, on a local Ray
instance) afresh, warms it with the same clients, then runs:
  - the scaling load: C clients, --requests each, --n-predict tokens, distinct
    short prompts (bench/serve.py's run_load);
  - the prefix load: C clients, --requests each, every prompt one of
    --system-prompts long shared prompts (about --system-words words) plus a
    question of its own, the prefix cache on; the hit rate is the prompt tokens
    the replicas reused over all prompt tokens (their own counters, through the
    ingress's /metrics).
On one GPU, several replicas share it (--gpus-per-replica 1/R): they stand in
for several GPUs only as far as the GPU has room; say so with the figures.

    .venv/bin/python bench/ray_scale.py --model M.gguf --replicas 1,2 --clients 4 -n 32
    python3 bench/ray_scale.py --model M.gguf --replicas 1,2,4 --clients 16 -n 128 --json $OUT/ray-scale.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve import WORDS, free_port, run_load  # noqa: E402 (same dir)


def prefix_load(url: str, clients: int, requests: int, n_predict: int, system: list[str], seed: int) -> dict:
    """C clients, each sending `requests` streams whose prompts are one of the
    shared system prompts plus a question of their own (the prefix cache on)."""
    rng = random.Random(seed)
    prompts = [[f"{rng.choice(system)}\nQuestion {i}.{j}: what is {rng.randrange(1000)} plus {rng.randrange(1000)}?"
                for j in range(requests)] for i in range(clients)]
    return run_load(url, clients, requests, n_predict, 0, seed, prompts=prompts, cache_prompt=True)


def prompt_counters(url: str) -> dict[str, list[float]]:
    """Each replica's [prompt tokens, prompt tokens reused from its prefix cache], from the ingress's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, list[float]] = {}
    for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for s in f.samples:
            if s.name in ("vkengine_prompt_tokens_total", "vkengine_prompt_tokens_cached_total"):
                out.setdefault(s.labels["replica"], [0.0, 0.0])[s.name.endswith("cached_total")] = s.value
    return out


def hit_rate(before: dict[str, list[float]], after: dict[str, list[float]]) -> float:
    """Prompt tokens reused over prompt tokens between two readings, replica by replica (a replica
    of the previous configuration lingers in the ingress's metrics for a few seconds: counted only
    where it is in both readings, where it ran nothing new)."""
    total = sum(a[0] - before.get(r, [0.0, 0.0])[0] for r, a in after.items())
    cached = sum(a[1] - before.get(r, [0.0, 0.0])[1] for r, a in after.items())
    return cached / total if total else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--replicas", default="1,2,4", help="replica counts to measure")
    ap.add_argument("--clients", "-c", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--n-predict", "-n", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--parallel", type=int, default=8, help="each replica's --parallel")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--gpus-per-replica", type=float, default=None,
                    help="Ray GPUs a replica takes (default: 1 / R where Ray sees a GPU, else 0)")
    ap.add_argument("--server-args", default="", help="more `vkengine serve` flags for the replicas")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import ray
    from ray import serve

    from server.ray_app import APP_NAME, build_app, parse_args
    ray.init(include_dashboard=False, log_to_driver=False)
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    rng = random.Random(1)
    system = [f"System prompt {k}: " + " ".join(rng.choice(WORDS) for _ in range(args.system_words))
              for k in range(args.system_prompts)]
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    rows = []
    for r in [int(x) for x in args.replicas.split(",")]:
        for routing in ([True, False] if r > 1 else [True]):
            sargs = parse_args(["--model", args.model, "--parallel", str(args.parallel), "--ctx", str(args.ctx),
                                *args.server_args.split()])
            gpus = args.gpus_per_replica if args.gpus_per_replica is not None else (1.0 / r if gpu else 0.0)
            t0 = time.perf_counter()
            serve.run(build_app(sargs, r, gpus, prefix_routing=routing), name=APP_NAME, route_prefix="/")
            up = time.perf_counter() - t0
            run_load(url, args.clients, 1, min(16, args.n_predict), args.prompt_words, seed=99)   # warm-up
            row: dict = {"replicas": r, "prefix_routing": routing, "gpus_per_replica": gpus, "startup_s": up}
            if routing:        # the scaling load once per replica count
                row["load"] = run_load(url, args.clients, args.requests, args.n_predict, args.prompt_words, seed=1)
            time.sleep(2.5)    # (replicas report their counters each second)
            before = prompt_counters(url)
            row["prefix"] = prefix_load(url, args.clients, args.requests, min(16, args.n_predict), system, seed=2)
            time.sleep(2.5)
            row["prefix"]["hit_rate"] = hit_rate(before, prompt_counters(url))
            rows.append(row)
            if args.json:   # after each configuration: a run cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
            serve.delete(APP_NAME)
            load = row.get("load")
            print(f"replicas {r} routing {'prefix' if routing else 'pow2'}: "
                  + (f"{load['tok_s']:.1f} tok/s, TTFT p99 {load['ttft_p99_ms']:.0f} ms; " if load else "")
                  + f"prefix hit rate {row['prefix']['hit_rate']:.2f} (TTFT p50 {row['prefix']['ttft_p50_ms']:.0f} "
                    f"ms), startup {up:.1f} s", flush=True)
    serve.shutdown()
    ray.shutdown()
    print("\n| replicas | routing | tok/s | TTFT p99 ms | prefix hit rate | prefix TTFT p50 ms | errors |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        load = row.get("load") or {}
        errs = load.get("errors", 0) + row["prefix"]["errors"]
        print(f"| {row['replicas']} | {'prefix' if row['prefix_routing'] else 'pow2'} | "
              f"{load.get('tok_s', float('nan')):.1f} | {load.get('ttft_p99_ms', float('nan')):.0f} | "
              f"{row['prefix']['hit_rate']:.2f} | {row['prefix']['ttft_p50_ms']:.0f} | {errs} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    return 1 if any((row.get("load") or {}).get("errors") or row["prefix"]["errors"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
