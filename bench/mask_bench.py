"""Constrained decoding's cost (issue 33): a grammar's token mask per token on
the host (llguidance, the model's vocabulary) and decode speed of a constrained
request against an unconstrained one in the same engine, through the server's
runner (no HTTP):

    python3 bench/mask_bench.py --model M.gguf [--tokens 256] [--out mask.json]

Scenarios (greedy, one request unless said): `free` (no grammar, ignore_eos),
`json-device` (a JSON schema whose one string field must run on: the mask on
the device, steps chained), `json-host` (the same with logprobs asked: logits
read back, the mask and the pick on the host, no chaining), and a batch of 4
(`batch-free`: four free streams; `batch-mixed`: three free and one
constrained). Decode rate: tokens after the first over the time from the first
token to the last. Mask cost: every Constraint.mask_into (device path) or
Constraint.apply (host path: the mask and its use on a logits row) call of the
constrained runs, timed where the runner makes it."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 100000}},
          "required": ["text"], "additionalProperties": False}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--probe-only", action="store_true", help="the engine probe alone (no runner scenarios)")
    ap.add_argument("--probe", action="store_true",
                    help="also the engine alone (no runner): where a masked step's time goes")
    args = ap.parse_args()

    from server.worker import GenRequest, Worker
    from vkengine.device import Device
    from vkengine.engine import Engine, EngineConfig
    from vkengine.model import load_model
    from vkengine.options import Options
    from vkengine.serving import constrain
    from vkengine.serving.sampling import SamplingParams
    from vkengine.serving.scheduler import SchedulerConfig

    m = load_model(args.model)
    dev = Device(None)
    tok = m.tokenizer
    eng = Engine(m, dev, EngineConfig(n_slots=4, n_ctx=2048, max_batch=512, max_out=4, max_in_flight=3,
                                      options=Options.from_env()))   # (VKENGINE_POLL_PICKS=1 and the rest)
    w = Worker(eng, SchedulerConfig(n_slots=4, max_live=4, step_tokens=64))
    t0 = time.perf_counter()
    g = constrain.compile_grammar(tok, "json_schema", SCHEMA, "json_schema")
    compile_s = time.perf_counter() - t0
    mask_times: list[float] = []

    def timed(real):
        def call(self, arg):
            t = time.perf_counter()
            try:
                return real(self, arg)
            finally:
                mask_times.append(time.perf_counter() - t)
        return call
    constrain.Constraint.mask_into = timed(constrain.Constraint.mask_into)   # type: ignore[method-assign]
    constrain.Constraint.apply = timed(constrain.Constraint.apply)           # type: ignore[method-assign]
    prompt = tok.encode("Write a long story about a lighthouse keeper and the sea.")
    greedy = SamplingParams()

    def req(kind: str) -> GenRequest:
        if kind == "free":
            return GenRequest(prompt, args.tokens, greedy, ignore_eos=True, use_cache=False)
        return GenRequest(prompt, args.tokens, greedy, grammar=g, n_probs=1 if kind == "host" else 0,
                          use_cache=False)

    def run(kinds: list[str]) -> list[dict]:
        stamps: list[list[float]] = [[] for _ in kinds]
        jobs = []
        for i, k in enumerate(kinds):
            jobs.append(w.submit(req(k), lambda ev, i=i: stamps[i].append(time.perf_counter())
                                 if ev.token is not None else None))
        chained0 = w.runner.chained_steps
        w.run_until_idle()
        out = []
        for k, st, j in zip(kinds, stamps, jobs):
            n = len(st)
            out.append({"kind": k, "tokens": n, "finish": j.finish,
                        "decode_tok_s": (n - 1) / (st[-1] - st[0]) if n > 1 else None})
        out[0]["chained_steps"] = w.runner.chained_steps - chained0
        return out

    scen = {"free": ["free"], "json-device": ["device"], "json-host": ["host"],
            "batch-free": ["free"] * 4, "batch-mixed": ["device", "free", "free", "free"]}
    res: dict = {"model": Path(args.model).name, "n_vocab": m.args.n_vocab, "device": dev.info.name,
                 "tokens": args.tokens, "grammar_compile_s": round(compile_s, 3), "runs": {}}
    if args.probe_only:
        scen = {}
    else:
        run(["free"])
        run(["device"])                            # warm-up: recordings of every step shape
    for rep in range(args.reps if scen else 0):
        for name, kinds in scen.items():
            mask_times.clear()
            r = run(kinds)
            entry = {"decode_tok_s": [x["decode_tok_s"] for x in r], "tokens": [x["tokens"] for x in r],
                     "finish": [x["finish"] for x in r], "chained_steps": r[0]["chained_steps"]}
            if mask_times:
                mt = np.asarray(mask_times) * 1e6
                entry["mask_us"] = {"n": len(mt), "median": round(float(np.median(mt)), 1),
                                    "mean": round(float(mt.mean()), 1), "p99": round(float(np.percentile(mt, 99)), 1)}
            res["runs"].setdefault(name, []).append(entry)
    summary = {}
    for name, runs in res["runs"].items():
        rates = [r["decode_tok_s"][0] for r in runs]
        summary[name] = {"first_request_tok_s_median": round(float(np.median(rates)), 1),
                         "aggregate_tok_s_median": round(float(np.median([sum(r["decode_tok_s"]) for r in runs])), 1)}
        if "mask_us" in runs[-1]:
            summary[name]["mask_us"] = runs[-1]["mask_us"]
    if scen:
        base = summary["free"]["first_request_tok_s_median"]
        for name in ("json-device", "json-host"):
            summary[name]["vs_free"] = round(summary[name]["first_request_tok_s_median"] / base, 3)
        summary["batch-mixed"]["aggregate_vs_batch_free"] = round(
            summary["batch-mixed"]["aggregate_tok_s_median"] / summary["batch-free"]["aggregate_tok_s_median"], 3)
    res["summary"] = summary
    if args.probe or args.probe_only:
        w.runner.settle()
        summary["probe"] = res["probe"] = probe(eng, prompt, args.tokens, args.reps)
    print(json.dumps(summary, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    w.runner.settle()
    eng.close()
    return 0


def probe(eng, prompt: list[int], n: int, reps: int) -> dict:
    """Decode of one sequence by the engine alone, greedy, steps chained:
    `free` (no masks), `masked-early` (masks given with each step: the pick
    program's own cost), `masked-late` (each step's masks given after the step
    before it is collected, as the runner must: the host's round trip on the
    critical path), the same with a 0.3 ms host delay (a grammar's mask), and
    both late forms with poll_picks on. Median tok/s over reps."""
    from vkengine.engine import Readback
    ones = np.full((1, eng.layout.mask_words), -1, np.int32)

    waits: list[float] = []   # host time in collect(), submit() and submit_masks() a step (the last rep's)
    subs: list[float] = []
    msubs: list[float] = []

    def run(kind: str, poll: bool, delay: float) -> float:
        eng.poll_picks = poll
        tok = eng.prefill(prompt, 0)
        pos = len(prompt)
        masked = kind != "free"
        early = ones if kind == "masked-early" else None
        eng.submit([int(tok[0]) if hasattr(tok, "__len__") else int(tok)], [pos], [0], [0], Readback.ARGMAX,
                   masked=masked, masks=ones if masked else None)
        waits.clear()
        subs.clear()
        msubs.clear()
        t0 = time.perf_counter()
        for i in range(1, n):
            ts = time.perf_counter()
            eng.submit([0], [pos + i], [0], [0], Readback.ARGMAX, chain=[0], masked=masked, masks=early)
            tw = time.perf_counter()
            subs.append(tw - ts)
            eng.collect()
            waits.append(time.perf_counter() - tw)
            if delay:       # host work after a step's tokens arrive (a grammar's mask), in every kind
                t = time.perf_counter() + delay
                while time.perf_counter() < t:
                    pass
            if kind == "masked-late":
                tm = time.perf_counter()
                eng.submit_masks(ones)
                msubs.append(time.perf_counter() - tm)
        eng.collect()
        return (n - 1) / (time.perf_counter() - t0)

    # the host delay swept: the step grows by the delay where the host's round trip is on the
    # critical path, and not at all while the forward of the step in flight hides it
    cases = [("free", False, 0.0), ("masked-early", False, 0.0), ("masked-late", False, 0.0),
             ("masked-late", True, 0.0)]
    cases += [("masked-late", False, d) for d in (1e-4, 2e-4, 4e-4, 8e-4)]
    cases += [("masked-early", False, 4e-4), ("free", False, 8e-4), ("masked-late", True, 4e-4)]
    out: dict = {}
    wait_us: dict = {}
    for kind, poll, delay in cases:
        run(kind, poll, delay)      # warm-up: the recordings
        rates = []
        for _ in range(reps):
            rates.append(run(kind, poll, delay))
        name = f"{kind}{'-poll' if poll else ''}{f'-delay{delay * 1e3:g}ms' if delay else ''}"
        out[name] = round(float(np.median(rates)), 1)
        wait_us[name] = {"collect": round(float(np.median(waits)) * 1e6, 1),
                         "submit": round(float(np.median(subs)) * 1e6, 1),
                         "submit_masks": round(float(np.median(msubs)) * 1e6, 1) if msubs else None}
    base = out["free"]
    out["vs_free"] = {k: round(v / base, 3) for k, v in out.items() if k != "free"}
    out["host_us_median"] = wait_us   # (a submit that blocks shows here, not as GPU time)
    eng.poll_picks = False
    return out


if __name__ == "__main__":
    sys.exit(main())
