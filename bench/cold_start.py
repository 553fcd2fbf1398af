"""Cold start, measured (issue 35 item 6): what a new replica pays before its
first token, ours against llama-server on the same GGUF.

Each run starts a server process and times, from the spawn: /health answering
200 ("ready") and the first streamed token of one short request ("first
token"). Ours also reports where its startup went (the phases of
`vkengine_startup_seconds`, read from /metrics), and runs on until the
pipelines it builds in the background (`vkengine_pipelines_compiling`) are
built and saved ("all pipelines"), as a server that lives on would. The runs,
in order:

  fresh      no compiled pipeline anywhere: the NVIDIA driver's shader disk cache
             off (__GL_SHADER_DISK_CACHE=0) and an empty vkengine pipeline cache
             folder (VKENGINE_PIPELINE_CACHE), with --threads pipeline threads
             each (1 = one pipeline after another, as before)
  shipped    the driver's disk cache still off, vkengine's pipeline cache file
             from the fresh runs: a new machine given the cache file (a shared
             volume, the image) by whoever deploys it
  warm       the driver's disk cache on and warm (one run to fill it first, not
             reported), vkengine's cache too: a replica restarted on a machine
             that ran one before
llama-server (--llama-server): fresh (its driver disk cache off) and warm. It
builds pipelines when a request first needs them, so its first token carries
them.

    python3 bench/cold_start.py --model M.gguf --llama-server /tmp/llb/bin/llama-server --json $OUT/cold.json
    .venv/bin/python bench/cold_start.py --model M.gguf --threads 1,2 --runs fresh,shipped
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from serve import free_port, one_stream, wait_ready  # noqa: E402 (same dir)


def phases(url: str) -> tuple[dict[str, float], float]:
    """Our server's startup phases (seconds) and the pipelines it is still building, from its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    compiling = 0.0
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "vkengine_startup_seconds":
                out[s.labels["phase"]] = round(s.value, 3)
            elif s.name == "vkengine_pipelines_compiling":
                compiling = s.value
    return out, compiling


def one_run(name: str, cmd: list[str], env: dict[str, str], url: str, ours: bool, timeout: float) -> dict:
    """Spawn, time /health and the first token, stop. The log goes to a temp file (its tail on failure)."""
    log = Path(tempfile.mkstemp(prefix="cold-", suffix=".log")[1])
    row: dict = {"config": name}
    with open(log, "wb") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            deadline = t0 + timeout
            try:   # (polled every 20 ms: the ready time is what is measured)
                wait_ready(url, proc, log, timeout, interval=0.02)
            except SystemExit as e:   # exited, or not ready in time
                row["error"] = str(e)[-2000:]
                return row
            row["ready_s"] = round(time.perf_counter() - t0, 3)
            with httpx.Client(timeout=timeout) as client:
                st = one_stream(client, url, "Tell me a story about a lighthouse keeper.", 8)
            if st.error or st.ttft is None:
                row["error"] = st.error or "no token"
                return row
            row["first_token_s"] = round(time.perf_counter() - t0, 3)
            row["request_ttft_s"] = round(st.ttft, 3)
            if ours:   # then until the pipelines it builds in the background are done (and saved)
                row["phases"], compiling = phases(url)
                row["compiling_at_first_token"] = int(compiling)
                while compiling and time.perf_counter() < deadline:
                    time.sleep(0.25)
                    compiling = phases(url)[1]
                row["all_pipelines_s"] = round(time.perf_counter() - t0, 3)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if ours:   # the startup line: pipelines, the slowest of them, those still compiling, the phases
                row["startup_log"] = [ln for ln in log.read_text(errors="replace").splitlines()
                                      if "decode and prompt steps ahead" in ln][-1:]
            log.unlink(missing_ok=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--runs", default="fresh,shipped,warm", help="which of fresh, shipped, warm (in that order)")
    ap.add_argument("--threads", default="1,16", help="pipeline threads of the fresh runs (VKENGINE_PIPELINE_THREADS)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each configuration")
    ap.add_argument("--server-args", default="", help="our server's extra flags")
    ap.add_argument("--llama-server", default=None)
    ap.add_argument("--llama-args", default="-ngl 99")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    bad = set(runs) - {"fresh", "shipped", "warm"}
    if bad:
        ap.error(f"--runs: unknown {sorted(bad)}")
    threads = [int(t) for t in args.threads.split(",") if t]
    work = Path(tempfile.mkdtemp(prefix="cold-start-"))
    shipped = work / "shipped"     # vkengine's pipeline cache, as the fresh runs leave it
    driver_warm = work / "driver"  # the NVIDIA driver's disk cache of the warm runs
    base = dict(os.environ)
    off = {"__GL_SHADER_DISK_CACHE": "0"}
    warm_env = {"__GL_SHADER_DISK_CACHE": "1", "__GL_SHADER_DISK_CACHE_PATH": str(driver_warm),
                "__GL_SHADER_DISK_CACHE_SKIP_CLEANUP": "1"}
    rows: list[dict] = []

    def spawn(name: str, extra, is_ours: bool, report: bool = True) -> None:
        """extra(i): the environment of repeat i."""
        for i in range(args.repeat if report else 1):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            if is_ours:
                cmd = [sys.executable, "-m", "server", "--model", args.model, "--port", str(port),
                       *args.server_args.split()]
            else:
                cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port),
                       *args.llama_args.split()]
            row = one_run(name, cmd, {**base, **extra(i)}, url, is_ours, args.timeout)
            row["run"] = i
            print(json.dumps(row), flush=True)
            if report:
                rows.append(row)

    try:
        if "fresh" in runs:
            for t in threads:   # each repeat from an empty folder of its own
                spawn(f"ours fresh, {t} pipeline threads",
                      lambda i, t=t: {**off, "VKENGINE_PIPELINE_CACHE": str(work / f"fresh-{t}-{i}"),
                                      "VKENGINE_PIPELINE_THREADS": str(t)}, True)
                if not shipped.exists() and (work / f"fresh-{t}-0").exists():
                    shutil.copytree(work / f"fresh-{t}-0", shipped)
        if "shipped" in runs:
            if not shipped.exists():
                ap.error("--runs shipped needs a fresh run first (it leaves the cache file)")
            spawn("ours, driver cache off, vkengine cache shipped",
                  lambda i: {**off, "VKENGINE_PIPELINE_CACHE": str(shipped)}, True)
        if args.llama_server and "fresh" in runs:
            spawn("llama-server fresh (driver cache off)", lambda i: off, False)
        if "warm" in runs:
            warm = {**warm_env, "VKENGINE_PIPELINE_CACHE": str(shipped)}
            spawn("ours warm (fill)", lambda i: warm, True, report=False)
            spawn("ours warm", lambda i: warm, True)
            if args.llama_server:
                spawn("llama-server warm (fill)", lambda i: warm_env, False, report=False)
                spawn("llama-server warm", lambda i: warm_env, False)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| config | ready s | first token s | all pipelines s | startup phases |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r.get("phases", {}).items())
        print(f"| {r['config']} | {r.get('ready_s', '-')} | {r.get('first_token_s', '-')} | "
              f"{r.get('all_pipelines_s', '-')} | {ph or r.get('error', '')[:80]} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
