"""Ours vs llama.cpp on the same GGUF files, in one run.

    python bench/bench.py --models 135m:q4_1,1b:q8_0,1b:q4_0,8b:q4_0 \
        --llama-bench PATH/llama-bench --out docs/bench

For each model: `vkengine synth` writes it (GGUF, deterministic seed) unless it
exists; our engine runs pp512 and tg128 (median of --reps); llama-bench runs the
same file with all layers on the GPU. The device's copy bandwidth is measured
first with a vec4 copy shader (GPU timestamps). Writes
<out>/<date>-<device>.json and regenerates <out>/README.md.

`--depth 0,4096,16384` measures pp and tg after D tokens already in the context
(llama-bench -d on the same file): a row per model and depth. `-ctk q8_0 -ctv
q8_0` runs both engines with that KV cache (llama-bench with -fa 1, which a
quantized V cache needs there).

Decode streams every weight once per token (and, at depth D, D positions of
the KV cache), so tg tok/s x those bytes is the achieved bandwidth; it is reported as a fraction of the copy bandwidth
(read + write bytes of the copy, the device's practical ceiling).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vkengine.options import add_cache_args, device_list  # noqa: E402 (after the path)

SHAPE_ALIASES = {"135m": "smollm2-135m", "1b": "1b", "8b": "8b", "tiny": "tiny", "small": "small"}


def copy_bandwidth(dev, kernels, reps: int = 10) -> dict:
    """Read+write GB/s of a device-to-device vec4 copy (median over reps)."""
    from vkengine.kernels import Region
    nbytes = min(1 << 30, dev.max_buffer_bytes) // 4096 * 4096
    a = dev.buffer(nbytes, "device", "bw-src")
    b = dev.buffer(nbytes, "device", "bw-dst")
    words = nbytes // 4
    prog = dev.program(timestamps=True)
    kernels.copy(prog, Region(a, 0, words), Region(b, 0, words), label="copy")
    times = []
    for _ in range(reps + 1):
        prog.run()
        times.append(dict(prog.timings())["copy"])
    dev.free(a)
    dev.free(b)
    us = statistics.median(times[1:])
    return {"bytes": nbytes, "us": us, "gbps": 2 * nbytes / (us * 1e-6) / 1e9}


def gguf_weight_bytes(path: Path) -> tuple[int, int]:
    """(bytes of all tensors, bytes one decode token reads): the second leaves
    out the MTP layer (`nextn_predict_layers` last blocks), the embedding table
    when a separate output head exists (one row of it is read), and counts the
    `*_exps` tensors of a MoE model at expert_used_count / expert_count."""
    from gguf import GGUFReader
    r = GGUFReader(str(path), "r")

    def meta(suffix: str, default: int = 0) -> int:
        k = next((k for k in r.fields if k.endswith("." + suffix)), None)
        return int(r.fields[k].parts[-1][0]) if k else default

    n_block, n_mtp = meta("block_count"), meta("nextn_predict_layers")
    n_exp, n_used = meta("expert_count"), meta("expert_used_count")
    names = {t.name for t in r.tensors}
    total = read = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        total += n
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= n_block - n_mtp:
            continue
        if t.name == "token_embd.weight" and "output.weight" in names:
            continue
        read += n * n_used // n_exp if n_exp and "_exps." in t.name else n
    return total, read


def run_llama_bench(exe: str, model: Path, n_prompt: int, n_gen: int, reps: int,
                    depths: list[int] | None = None, kv: tuple[str, str] = ("f16", "f16"),
                    split: list[str] | None = None) -> dict[int, dict]:
    """llama-bench's pp and tg at each depth (its -d) with K/V cache types kv: {depth: {...}};
    split: its -sm/-ts arguments (our --devices' peer: -sm layer)."""
    depths = depths or [0]
    cmd = [exe, "-m", str(model), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(reps), "-ngl", "99", "-o", "json"]
    cmd += split or []
    if depths != [0]:
        cmd += ["-d", ",".join(map(str, depths))]
    if kv != ("f16", "f16"):   # (llama.cpp needs flash attention for a quantized V cache)
        cmd += ["-ctk", kv[0], "-ctv", kv[1], "-fa", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return {d: {"error": (r.stderr or r.stdout)[-2000:], "cmd": " ".join(cmd)} for d in depths}
    rows = json.loads(r.stdout[r.stdout.index("["):])
    out: dict[int, dict] = {}
    for d in depths:
        out[d] = {"cmd": " ".join(cmd), "build_commit": rows[0].get("build_commit"),
                  "backends": rows[0].get("backends"), "gpu_info": rows[0].get("gpu_info")}
    for row in rows:
        o = out.get(int(row.get("n_depth", 0)))
        if o is None:
            continue
        if row.get("n_prompt") and not row.get("n_gen"):
            o["pp_tps"], o["pp_std"] = row["avg_ts"], row.get("stddev_ts")
        elif row.get("n_gen") and not row.get("n_prompt"):
            o["tg_tps"], o["tg_std"] = row["avg_ts"], row.get("stddev_ts")
    return out


def _ours(path: str, device: int | None, n_prompt: int, n_gen: int, reps: int, par: list[int],
          depths: list[int], kv: tuple[str, str] = ("f16", "f16"), devices: list[int] | None = None,
          tensor_split: str | None = None):
    """Our pp/tg (and batched decode) on one model at each depth with K/V cache
    types kv, in the calling process (devices: split across them by layers,
    vkengine.split); also the bytes a decode step reads per position of context."""
    from vkengine.device import Device
    from vkengine.engine import Engine, EngineConfig
    from vkengine.kernels import KVTypes
    from vkengine.model import load_model
    from vkengine.options import Options
    from vkengine.tools.bench import bench_rows, run_batched, run_bench
    model = load_model(Path(path))
    cfg = EngineConfig(n_slots=max(par, default=1), n_ctx=max(depths) + max(n_prompt, n_gen) + 8,
                       max_batch=bench_rows(n_prompt, max(par, default=1), depths),
                       max_out=max(par, default=1), options=Options.from_env(), kv_types=KVTypes(*kv))
    if devices:
        from vkengine.split import open_split
        eng = open_split(model, devices, tensor_split, cfg)
    else:
        eng = Engine(model, Device(device), cfg)
    runs = []
    for d in depths:
        ours = run_bench(eng, n_prompt, n_gen, reps, depth=d)
        runs.append((ours, [run_batched(eng, b, n_gen, reps, depth=d) for b in par]))
    kv_per_pos = model.arch.state_bytes(model.args, 1, 1, KVTypes(*kv))[0]
    return runs, kv_per_pos


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="135m:q4_1,1b:q8_0,1b:q4_0,8b:q4_0",
                    help="synthetic models as shape:quant (written with vkengine synth if missing)")
    ap.add_argument("--files", default=None, help="existing GGUF files, benched before --models (comma separated; "
                    "'default' = the embedded SmolLM2; --models '' for files only)")
    ap.add_argument("--model-dir", default=os.environ.get("VKENGINE_BENCH_MODELS", "/tmp/vkengine-bench-models"))
    ap.add_argument("--llama-bench", default=None, help="llama-bench binary (skipped when absent)")
    ap.add_argument("--llama-label", default="llama.cpp", help="how to name the peer in the table")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--device", type=int, default=None)
    ap.add_argument("--devices", type=device_list, default=None, metavar="I,J[,...]",
                    help="ours split across these devices by layers (vkengine --devices); llama-bench with -sm layer")
    ap.add_argument("--tensor-split", "-ts", default=None, metavar="P,Q[,...]",
                    help="with --devices: each device's share of the layers (both engines)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    ap.add_argument("--parallel", default="", metavar="B[,B...]",
                    help="also measure batched decode: B sequences stepping together (the server's batch mode)")
    ap.add_argument("-d", "--depth", default="0", metavar="D[,D...]",
                    help="tokens already in the context before pp and tg (llama-bench's -d), e.g. 0,4096,16384")
    add_cache_args(ap)   # -ctk/-ctv: ours and llama-bench (with -fa 1) on the same cache types
    ap.add_argument("--note", default="")
    ap.add_argument("--tokenizer-from", default=None, help="tokenizer GGUF for synth (default: embedded SmolLM2)")
    args = ap.parse_args(argv)

    from vkengine.device import Device
    from vkengine.kernels import Caps, Kernels
    from vkengine.options import Options
    from vkengine.tools.bench import parse_depths, parse_parallel
    from vkengine.tools.synth.llama import config_for, synth_llama

    par = [b for b in parse_parallel(args.parallel) if b > 1]   # batched decode: sequence counts
    depths = parse_depths(args.depth)
    kv = (args.cache_type_k, args.cache_type_v)
    dev = Device(args.device)
    kn = Kernels(dev, Caps.detect(dev, Options.from_env()))
    bw = copy_bandwidth(dev, kn)
    print(f"device {dev.info.name}: copy bandwidth {bw['gbps']:.0f} GB/s (read+write)", flush=True)
    results = []
    jobs = []
    if args.files:
        from vkengine.model import default_model_path
        jobs = [(default_model_path() if f == "default" else Path(f), "file", "") for f in args.files.split(",")]
    if args.models:
        for spec in args.models.split(","):
            shape, quant = spec.split(":")
            shape = SHAPE_ALIASES.get(shape, shape)
            mdir = Path(args.model_dir)
            path = mdir / f"llama-{shape}-{quant}.gguf"
            if not path.exists():
                synth_llama(config_for(shape, None), quant, 0, mdir, f"llama-{shape}", formats=("gguf",),
                            tokenizer_from=Path(args.tokenizer_from) if args.tokenizer_from else None)
            jobs.append((path, shape, quant))
    for path, shape, quant in jobs:
        wbytes, rbytes = gguf_weight_bytes(path)
        # each model's engine in a fresh process, as a user runs one: a second
        # engine created on the same device in one process prefilled 3-4x slower
        # than the first (H200, 1B Q4_0: 28,300 then 6,300-10,400 tok/s; cause
        # not found), which had understated every model after the first
        with mp.get_context("spawn").Pool(1) as pool:
            runs, kv_per_pos = pool.apply(_ours, (str(path), args.device, args.n_prompt, args.n_gen, args.reps,
                                                  par, depths, kv, args.devices, args.tensor_split))
        split = (["-sm", "layer"] + (["-ts", args.tensor_split] if args.tensor_split else [])) if args.devices else None
        peers = run_llama_bench(args.llama_bench, path, args.n_prompt, args.n_gen, args.reps, depths, kv, split) \
            if args.llama_bench else {}
        for d, (ours, batched) in zip(depths, runs):
            peer = peers.get(d, {})
            # a decode token reads the weights and every cached position's state
            step_bytes = rbytes + d * kv_per_pos
            row = {"model": path.name, "shape": shape, "quant": quant, "depth": d, "weight_bytes": wbytes,
                   "read_bytes": rbytes, "kv_bytes_per_pos": kv_per_pos,
                   "ours": {"pp_tps": ours.get("pp_tps"), "tg_tps": ours.get("tg_tps")}, "llama": peer,
                   "tg_weight_gbps": step_bytes * ours["tg_tps"] / 1e9 if ours.get("tg_tps") else None}
            row["tg_frac_copy_bw"] = row["tg_weight_gbps"] / bw["gbps"] if row["tg_weight_gbps"] else None
            if batched:
                row["batched"] = [{"n_seq": b["n_seq"], "tps": b["tps"],
                                   "x_one": b["tps"] / ours["tg_tps"] if ours.get("tg_tps") else None}
                                  for b in batched]
            if peer.get("tg_tps") and ours.get("tg_tps"):
                row["tg_ratio"] = ours["tg_tps"] / peer["tg_tps"]
            if peer.get("pp_tps") and ours.get("pp_tps"):
                row["pp_ratio"] = ours["pp_tps"] / peer["pp_tps"]
            results.append(row)
            print(json.dumps(row), flush=True)

    now = dt.datetime.now(dt.UTC)
    date = now.strftime("%Y-%m-%d")
    dev_slug = re.sub(r"[^a-z0-9]+", "-", dev.info.name.lower()).strip("-")[:40]
    doc = {"date": date, "device": dev.info.name, "driver": f"{dev.info.driver_name} {dev.info.driver_info}",
           "features": list(dev.features),
           "prefill_kernel": "none (matvecs)" if kn.caps.tiled_from is None
           else ("mul_mc (cooperative matrices, fp16 tiles)"
                 + ("; mul_mc2 (NV cooperative matrix 2) for the "
                    f"{'/'.join(t.upper() for t in kn.caps.mc2_types)} matrices of {kn.caps.mc2_from_rows}+ rows"
                    + (", fp16 sums" if kn.caps.mc2_f16acc else "") if kn.caps.coopmat2 else "")) if kn.caps.coopmat
                                                else "mul_mt (fp32)",
           "copy_bandwidth": bw, "n_prompt": args.n_prompt, "n_gen": args.n_gen,
           "reps": args.reps, "depths": depths, "kv_cache": {"k": kv[0], "v": kv[1]}, "peer": args.llama_label,
           **({"devices": args.devices, "tensor_split": args.tensor_split} if args.devices else {}),
           "note": args.note, "results": results}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc["time"] = now.strftime("%H:%M")
    (out / f"{date}-{now.strftime('%H%M')}-{dev_slug}.json").write_text(json.dumps(doc, indent=1))
    render_readme(out)
    print(table(doc))
    return 0


def table(doc: dict) -> str:
    lines = [f"**{doc['date']} {doc.get('time', '')}, {doc['device']}** ({doc['driver']}); copy bandwidth "
             f"{doc['copy_bandwidth']['gbps']:.0f} GB/s; peer: {doc.get('peer', 'llama.cpp')}; "
             f"pp{doc.get('n_prompt', 512)}, tg{doc.get('n_gen', 128)}"
             + (f", depths {', '.join(map(str, doc['depths']))}" if doc.get("depths", [0]) != [0] else "")
             + (f", KV cache K {doc['kv_cache']['k']} V {doc['kv_cache']['v']} (both engines)"
                if doc.get("kv_cache", {"k": "f16", "v": "f16"}) != {"k": "f16", "v": "f16"} else "")
             + (f", split across devices {','.join(map(str, doc['devices']))} by layers"
                f"{' (' + doc['tensor_split'] + ')' if doc.get('tensor_split') else ''}, peer -sm layer"
                if doc.get("devices") else "")
             + (f"; our prefill matmul: {doc['prefill_kernel']}" if doc.get("prefill_kernel") else ""),
             "", "| model | weights | pp ours | pp peer | pp ratio | tg ours | tg peer | tg ratio | tg GB/s "
                 "| of copy bw |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in doc["results"]:
        lp = r.get("llama") or {}
        gbps = r.get("tg_weight_gbps")
        name = r["model"] + (f" @ d{r['depth']}" if r.get("depth") else "")
        lines.append(
            f"| {name} | {r['weight_bytes'] / 2**30:.2f} GiB | {f(r['ours']['pp_tps'])} "
            f"| {f(lp.get('pp_tps'))} | {f(r.get('pp_ratio'), 2)} | {f(r['ours']['tg_tps'])} "
            f"| {f(lp.get('tg_tps'))} | {f(r.get('tg_ratio'), 2)} | "
            + ("- | - |" if gbps is None else
               f"{gbps:.{0 if gbps >= 10 else 2}f} | {100 * r['tg_frac_copy_bw']:.0f}% |"))
    batched = [r for r in doc["results"] if r.get("batched")]
    if batched:
        ns = [b["n_seq"] for b in batched[0]["batched"]]
        lines += ["", "Batched decode (B sequences stepping together, aggregate tok/s, and x one sequence's tg):", "",
                  "| model | " + " | ".join(f"B = {n}" for n in ns) + " |", "| --- |" + " --- |" * len(ns)]
        for r in batched:
            name = r["model"] + (f" @ d{r['depth']}" if r.get("depth") else "")
            lines.append(f"| {name} | " + " | ".join(f"{b['tps']:.0f} ({f(b['x_one'], 2)}x)"
                                                    for b in r["batched"]) + " |")
    if doc.get("note"):
        lines += ["", doc["note"]]
    return "\n".join(lines)


def render_readme(folder: Path) -> None:
    docs = []
    for f in sorted(folder.glob("*.json")):
        try:
            docs.append(json.loads(f.read_text()))
        except json.JSONDecodeError:
            continue
    body = ["# Benchmarks: vkengine vs llama.cpp on the same GGUF files", "",
            "Generated by `bench/bench.py` (newest first). pp = prompt processing of N tokens, tg = N tokens "
            "generated one at a time (512 and 128 unless a run's heading says otherwise), both from an empty "
            "context unless the row says `@ dD` (D tokens already in the context, llama-bench's -d), tok/s. "
            "`tg GB/s` = weight bytes one decode "
            "token reads (at a depth, plus the KV cache's bytes of D positions) x tg tok/s "
            "(a MoE model: the active experts' share; not the MTP layer; not the "
            "embedding table when there is a separate output head; runs before 16:00 on 2026-11-30 counted "
            "all weight bytes); `of copy bw` = that over the device's measured copy bandwidth (read + write). "
            "See notes.md for the optimization log.", ""]
    for d in reversed(docs):
        body += [table(d), ""]
    (folder / "README.md").write_text("\n".join(body))


if __name__ == "__main__":
    sys.exit(main())
