"""The server's own cost, against a simulated device: bench/serve.py's clients
(real HTTP, a process of their own) against the real server (app, worker,
scheduler, tokenizer, SSE) whose engine computes nothing and takes the time a
measured GPU step takes. Each step is "on the device" from when it is
submitted (or the previous step ends, if later) for step_us(rows) and returns
fixed tokens (or random logits rows, for replies sampled on the host); collect()
sleeps until its step is done. So the aggregate tok/s of serial and batch mode
can be compared with what the simulated device allows (1 / step time x rows),
and the server's losses found and fixed on a machine without the GPU.

    .venv/bin/python bench/serve_sim.py --clients 4 -n 256
    (default timings: the H200's 1B Q8_0 figures of docs/bench/notes.md run 10:
    a decode step 890 us + 170 us a row, prompt rows 30 us each)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def sim_engine_class():
    from vkengine.engine import Engine, Readback

    class SimEngine(Engine):
        """Engine whose steps take simulated device time and return fixed tokens."""
        step_us = (890.0, 170.0)       # a decode step: fixed + per row
        prompt_row_us = 30.0           # each row of a step with more rows than slots
        # (--wide-us) steps of more rows than slots and fewer than 64 run the
        # GPUs' 8-column matvecs once per 8 rows (grid z): wide_us[0] for the
        # first 8 rows, wide_us[1] for each further 8; None: the linear model
        wide_us: tuple[float, float] | None = None
        sample_us = 95.0               # drawing the rows' tokens on the device (--sample-us)
        trace = False                  # record every step (--trace)
        host_sampling = False          # --host-sampling

        def _sim_init(self):
            self._sim_q: deque = deque()
            self.sim_stats = {"busy_s": 0.0, "idle_s": 0.0, "steps": 0, "chained": 0, "rows": {}, "trace": []}
            self._sim_busy = 0.0
            self._sim_tok = int(self.model.tokenizer.encode(" the")[-1])
            # logits rows for sampled steps: random, so that the host's sampling
            # costs what it costs on real rows (a sort of equal values is cheaper)
            self._sim_logits = (np.random.default_rng(0).standard_normal((8, self.n_vocab)) * 3).astype(np.float32)
            self.can_sample = not self.host_sampling   # sampled tokens drawn "on the device", as on GPUs

        def submit(self, tokens, positions, slots, out_rows=(), readback=Readback.ARGMAX, chain=None,
                   sampling=None, prompt=False, masked=False, masks=None, pass_=None):
            # (prompt, pass_: the step's time model does not change; masks: its fixed tokens ignore them)
            if len(self._sim_q) >= self.max_in_flight:
                raise RuntimeError(f"{self.max_in_flight} steps are already in flight")
            n = len(tokens)
            if self.wide_us is not None and self.n_slots < n < 64:
                us = self.wide_us[0] + self.wide_us[1] * (-(-n // 8) - 1)
            else:
                us = (self.step_us[0] + self.step_us[1] * min(n, self.n_slots)
                      + self.prompt_row_us * max(0, n - self.n_slots))
            if readback & Readback.SAMPLE and out_rows:
                us += self.sample_us
            now = time.perf_counter()
            start = max(now, self._sim_busy)
            st = self.sim_stats
            if self._sim_busy and now > self._sim_busy:
                st["idle_s"] += now - self._sim_busy      # the device waited for this submit
            st["busy_s"] += us * 1e-6
            st["steps"] += 1
            st["rows"][n] = st["rows"].get(n, 0) + 1
            st["chained"] += chain is not None
            if self.trace:   # (submitted, device start, device end) in s, rows, chained
                st["trace"].append((round(now, 6), round(start, 6), round(start + us * 1e-6, 6), n,
                                    chain is not None))
            self._sim_busy = start + us * 1e-6
            res = None
            toks = np.full(len(out_rows), self._sim_tok, np.int64)
            lg = self._sim_logits[(np.arange(len(out_rows)) + st["steps"]) % len(self._sim_logits)]
            if readback & Readback.LOGITS:
                res = (toks, lg) if readback.tokens else lg
            elif readback.tokens:
                res = toks
            self._sim_q.append((self._sim_busy, res))
            if masked and masks is not None:
                self.submit_masks(masks)

        def submit_masks(self, masks) -> None:
            """A masked step's masks: its rows' fixed tokens become the first
            token each mask allows where it forbids them (the grammar's host
            work is real; the device's choice is simulated)."""
            ready, res = self._sim_q[-1]
            bits = np.unpackbits(np.asarray(masks, np.uint32).view(np.uint8), axis=-1, bitorder="little")
            toks = np.asarray(res).copy()
            for j, row in enumerate(bits[:len(toks)]):
                if not row[toks[j]]:
                    toks[j] = int(np.flatnonzero(row)[0])
            self._sim_q[-1] = (ready, toks)

        def collect(self):
            ready, res = self._sim_q.popleft()
            wait = ready - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return res

        @property
        def in_flight(self) -> int:
            return len(self._sim_q)

        @property
        def can_chain(self) -> bool:
            return True

    return SimEngine


def serve(args) -> int:
    """The server process: a tiny real model (its tokenizer and KV cache) on the
    default device, with simulated steps."""
    import uvicorn

    from server.app import ServerState, create_app
    from server.main import scheduler_config
    from server.metrics import Metrics
    from server.worker import Worker
    from vkengine.device import Device
    from vkengine.engine import EngineConfig
    from vkengine.model import load_model
    cfg, n_slots = scheduler_config(args)
    model = load_model(args.model)
    SimEngine = sim_engine_class()
    SimEngine.step_us = tuple(float(x) for x in args.step_us.split(","))
    SimEngine.prompt_row_us = args.prompt_row_us
    SimEngine.wide_us = tuple(float(x) for x in args.wide_us.split(",")) if args.wide_us else None
    SimEngine.host_sampling = args.host_sampling
    SimEngine.sample_us = args.sample_us
    SimEngine.trace = bool(args.trace)
    eng = SimEngine(model, Device(0), EngineConfig(n_slots=n_slots, n_ctx=args.ctx, max_batch=cfg.step_tokens,
                                                   max_out=n_slots, max_in_flight=args.in_flight))
    eng._sim_init()
    metrics = Metrics(n_slots, cfg.max_live, eng.n_ctx)
    worker = Worker(eng, cfg, metrics)
    st = ServerState(worker=worker, model=model, n_ctx=eng.n_ctx, metrics=metrics, max_tokens=4096,
                     max_body=1 << 20, parallel=args.parallel, mode=args.mode)
    app = create_app(st)   # its lifespan starts and stops the worker
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    st = eng.sim_stats
    print("SIMSTATS " + json.dumps({**st, "rows": {str(k): v for k, v in sorted(st["rows"].items())}}), flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", "-c", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("-n", type=int, default=256, help="tokens per reply")
    ap.add_argument("--prompt-words", type=int, default=8)
    ap.add_argument("--step-us", default="890,170", help="simulated decode step: fixed us, us per row")
    ap.add_argument("--prompt-row-us", type=float, default=30.0)
    ap.add_argument("--wide-us", default=None,
                    help="steps of more rows than slots and fewer than 64: us for the first 8 rows, us for each "
                         "further 8 (the 8-column matvecs run once per 8 rows; H200 1B Q8_0: 1970,1080)")
    ap.add_argument("--configs", default="serial,batch")
    ap.add_argument("--model", default=None, help="GGUF for the tokenizer and KV cache (default: a tiny synth)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: sampled replies (tokens drawn on the device, sample_us more a step, chained; "
                         "--host-sampling: logits read back and drawn on the host, steps not chained)")
    ap.add_argument("--host-sampling", action="store_true", help="sampled replies drawn on the host")
    ap.add_argument("--sample-us", type=float, default=95.0,
                    help="device time of drawing a step's tokens (H200, 1B: 104 against the argmax's 14)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--trace", default=None,
                    help="write every simulated step (submitted, device start and end in s, rows, chained) of "
                         "each configuration to TRACE-<config>.json")
    # the server process
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--parallel", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="batch", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, default=1024, help=argparse.SUPPRESS)
    ap.add_argument("--in-flight", type=int, default=3, help="steps the engine may have in flight (the server's 3)")
    ap.add_argument("--quantum", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--step-tokens", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--max-queue", type=int, default=64, help=argparse.SUPPRESS)
    ap.add_argument("--slots", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--host-cache", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--min-prefix", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args)

    from serve import Server, free_port, run_load
    model = args.model
    if model is None:
        from vkengine.tools.synth.llama import config_for, synth_llama
        d = Path(tempfile.mkdtemp(prefix="serve-sim-"))
        model = str(synth_llama(config_for("tiny", None), "q8_0", 0, d, "tiny", formats=("gguf",))["gguf"])
    a, b = (float(x) for x in args.step_us.split(","))
    out = []
    for cfgname in args.configs.split(","):
        par = 1 if cfgname == "serial" else args.clients
        port = free_port()
        cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--parallel", str(par), "--mode",
               "batch" if cfgname == "serial" else cfgname, "--model", model, "--step-us", args.step_us,
               "--prompt-row-us", str(args.prompt_row_us), "--max-queue", str(max(64, args.clients)),
               *(["--wide-us", args.wide_us] if args.wide_us else []),
               "--in-flight", str(args.in_flight)]
        if args.trace:
            cmd.append("--trace=1")
        if args.host_sampling:
            cmd.append("--host-sampling")
        cmd += ["--sample-us", str(args.sample_us)]
        srv = Server(cmd, f"http://127.0.0.1:{port}", cwd=ROOT)
        try:
            run_load(srv.url, 1, 1, 8, args.prompt_words, 99)     # warm-up
            r = run_load(srv.url, args.clients, args.requests, args.n, args.prompt_words, 0, args.temperature)
        finally:
            srv.stop()
        for line in srv.log.read_text().splitlines():
            if line.startswith("SIMSTATS "):
                r["device"] = json.loads(line[9:])
                d = r["device"]
                trace = d.pop("trace")
                if args.trace:
                    Path(f"{args.trace}-{cfgname}.json").write_text(json.dumps(trace))
                print(f"  device: {d['steps']} steps ({d['chained']} chained), busy {d['busy_s']:.3f} s, waited "
                      f"for the host {d['idle_s']:.3f} s (between steps while it had work), rows {d['rows']}")
        rows = min(par, args.clients)
        drawn = args.sample_us if args.temperature > 0 and not args.host_sampling else 0.0
        r["config"], r["device_tok_s"] = cfgname, rows / ((a + b * rows + drawn) * 1e-6)
        r["of_device"] = r["tok_s"] / r["device_tok_s"]
        out.append(r)
        print(f"{cfgname:7s} C={args.clients}: {r['tok_s']:8.1f} tok/s ({r['of_device']:.0%} of the simulated "
              f"device's {r['device_tok_s']:.0f}), TTFT p50 {r['ttft_p50_ms']:.1f} ms, ITL p50 "
              f"{r['itl_p50_ms']:.2f} mean {r['itl_mean_ms']:.2f} p99 {r['itl_p99_ms']:.2f} ms, errors {r['errors']}",
              flush=True)
    if len(out) >= 2:
        print(f"batch / serial: {out[-1]['tok_s'] / out[0]['tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
