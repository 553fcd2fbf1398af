"""Compare GPU matvec kernels by wall time: for each weight shape, a program of
R dispatches of one kernel (a barrier between them, as in a decode step), each
on the next of several weight copies that together overflow the L2 cache, is
run a few times; the fastest run / R is a dispatch's time. Wall time, not
timestamps: the timestamped figures of the script it replaces (mv_tune.py)
did not match the decode steps they were meant to model (docs/bench/notes.md,
run 7).

Kernels (mul_mvk.comp, workgroup 128, butterfly reduction):
  base    the defines the engine uses now (shaders/variants.py)
  magic   + DQ_MAGIC: nibbles to floats without int -> float conversions (Q4)
  hoist   + HOIST: the block scale once per unit instead of once per value
          (Q4 with DQ_MAGIC)
  mvq     bench/shaders/mul_mvq.comp (Q8_0 only): x quantized to 8 bits per 32-value block
          (here, on the host), integer dot products (4 multiply-adds a
          instruction), lanes taking 8, 16 or 32 values at a time (reported as
          "unroll"); checked against x so quantized, and its distance from
          the float x's result reported as qerr
  xq8     the engine's XQ8 variant of mul_mvk.comp (Q8_0, Q4_0; Caps.xq8):
          mvq's x blocks and arithmetic inside the engine's kernel
  xq8_nb, xq8_ne, xq8_wg, xq8_all, base_nb, base_ne, base_wg: xq8 and base
          with one difference from mvq removed (KNOBS below), or all of them
--rows and --unroll also replace base's rows per workgroup and units in
flight (the engine's otherwise).
A third kind, Q4 rows stored in tiles so that a lane loads 16 bytes (4 units)
at once, measured within noise of "hoist" (H200, 2026-11-30 21:20) and was
not kept; so was x read as halves (half the bytes of every x load: within
2% either way at 1, 4 and 8 columns, 2026-12-01 01:45).

    here:   .venv/bin/python bench/mv_probe.py --compile-only
    there:  python3 bench/mv_probe.py --out $OUT/mv-probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shaders.variants import VARIANTS, XQ8_TYPES, mv_gpu_config  # noqa: E402

SHAPES = {"q4_0": ["28672x4096", "4096x14336", "6144x4096", "16384x2048", "2048x8192"],
          "q8_0": ["16384x2048", "2048x8192", "3072x2048", "49152x2048"]}
# mvq: values a lane takes at a time (a quarter, half or whole block), in the
# "unroll" slot of a configuration
MVQ_VALS = (8, 16, 32)
KINDS = {"base": {}, "magic": {"DQ_MAGIC": 1}, "hoist": {"DQ_MAGIC": 1, "HOIST": 1}, "mvq": {}, "xq8": {"XQ8": 1}}
# what separates mul_mvk.comp from mvq, one at a time: the subgroupAdd reduction
# instead of the butterfly (_nb), no fused epilogues compiled in (_ne), the
# workgroup size fixed at compile time (_wg); base_* keep the engine's defines
KNOBS = {"nb": {"BFLY": 0}, "ne": {"NO_EPI": 1}, "wg": {"FIXED_WG": 128}}
for _k, _d in KNOBS.items():
    KINDS[f"xq8_{_k}"] = {"XQ8": 1, **_d}
    KINDS[f"base_{_k}"] = _d
KINDS["xq8_all"] = {"XQ8": 1, **{k: v for d in KNOBS.values() for k, v in d.items()}}
# kinds that read x as 8-bit blocks (quantized here, on the host)
XQ_KINDS = ("mvq", "xq8", *(k for k in KINDS if k.startswith("xq8_")))
PUSH_BYTES = 116   # mul_mvk.comp's push constants (the fused norm's and RoPE's unused here)


def configs(wt: str, cols: list[int], rows: list[int] | None = None, kinds: list[str] | None = None,
            unrolls: list[int] | None = None):
    """(kind, columns, rows per workgroup, units in flight) to probe; rows
    replaces the default rows per workgroup (2, 4, 8 for one column, 2, 4 else),
    unrolls base's units in flight."""
    for kind, extra in KINDS.items():
        if kinds and kind not in kinds:
            continue
        if "DQ_MAGIC" in extra and "HOIST" not in extra and wt not in ("q4_0", "q4_1"):
            continue
        if kind == "mvq" and wt != "q8_0" or kind in XQ_KINDS and wt not in XQ8_TYPES:
            continue
        for nc in cols:
            if kind.startswith("base"):   # base and base_*: the engine's configuration
                rps, un, _extra = mv_gpu_config(wt, nc)
                for r in rows or (rps,):
                    for u in unrolls or (un,):
                        yield kind, nc, r, u
                continue
            for rps in rows or ((2, 4, 8) if nc == 1 else (2, 4)):
                for un in (MVQ_VALS if kind == "mvq" else (1,) if kind in XQ_KINDS else (1, 2)):
                    yield kind, nc, rps, un


def variant(wt: str, kind: str, nc: int, rps: int, un: int) -> str:
    if kind == "mvq":
        from shaders.variants import EXT_DEFINE
        name = f"probe_mvq_{wt}_c{nc}_r{rps}_v{un}"
        VARIANTS.setdefault(name, (str(ROOT / "bench" / "shaders" / "mul_mvq.comp"),
                                   {"NCOLS": nc, "RPS": rps, "VALS": un, EXT_DEFINE: 1}))
        return name
    name = f"probe_mv_{wt}_{kind}_c{nc}_r{rps}_u{un}"
    extra = {**(mv_gpu_config(wt, nc)[2] if kind.startswith("base") else {}), **KINDS[kind]}
    if kind in XQ_KINDS:
        from shaders.variants import EXT_DEFINE, EXT_V12_DEFINE
        extra = {**extra, EXT_DEFINE: 1, EXT_V12_DEFINE: 1}
    # the butterfly reduction needs a lane per sum (32-lane subgroups)
    VARIANTS.setdefault(name, ("mul_mvk.comp", {f"WT_{wt.upper()}": 1, "NCOLS": nc, "UNROLL": un, "RPS": rps,
                                                "BFLY": int(rps * nc <= 32), **extra}))
    return name


def quantize_x(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x (rows x K) to 8 bits per 32-value block: (int8 quants, scales, x as
    those quants give it back)."""
    b = x.reshape(x.shape[0], -1, 32)
    d = np.abs(b).max(axis=2) / 127.0
    q = np.round(b / np.where(d > 0, d, 1.0)[..., None]).astype(np.int8)
    return q, d.astype(np.float32), (q.astype(np.float32) * d[..., None]).reshape(x.shape)


def random_blocks(wt: str, M: int, K: int, rng) -> np.ndarray:
    """GGUF bytes of random blocks with sane scales (quantizing 100M floats is slow)."""
    from vkengine.quant import block_shape
    if wt in ("f16", "f32"):
        return rng.standard_normal((M, K)).astype(wt.replace("f", "float")).view(np.uint8)
    n, b = block_shape(wt)
    blocks = rng.integers(0, 256, (M * K // n, b), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(0.002, 0.02, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if wt in ("q4_1", "q5_1"):
        blocks[:, 2:4] = rng.uniform(-0.1, 0.0, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(M, -1)


def probe_parser(doc: str, reps: int, runs: int) -> argparse.ArgumentParser:
    """The options both kernel probes take (this one and mm_probe.py)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--types", default="q4_0,q8_0")
    ap.add_argument("--reps", type=int, default=reps, help="dispatches per program")
    ap.add_argument("--runs", type=int, default=runs, help="rounds over all kernels")
    ap.add_argument("--shapes", default=None, help="type:MxK,... instead of the bench models' shapes")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    return ap


def parse_probe_args(ap: argparse.ArgumentParser, shapes: dict) -> argparse.Namespace:
    """Parsed options; --shapes replaces the probe's shape table, and
    args.types is the list of weight types to probe."""
    args = ap.parse_args()
    if args.shapes:
        shapes.clear()
        for item in args.shapes.split(","):
            t, shp = item.split(":")
            shapes.setdefault(t, []).append(shp)
        args.types = ",".join(shapes)
    args.types = args.types.split(",")
    return args


def compile_probes(names: list[str]) -> None:
    """--compile-only: the probe variants into the SPIR-V cache (on a machine with glslc)."""
    from concurrent.futures import ThreadPoolExecutor

    from vkengine import spirv
    with ThreadPoolExecutor() as ex:
        list(ex.map(spirv.compile_variant, names))
    print(f"{len(names)} probe variants compiled")


def weight_buffer(dev, data: np.ndarray, scales: np.ndarray, dw: int, sw: int):
    """A device buffer holding one repacked matrix: quants, then scales at word dw."""
    wbuf = dev.buffer((dw + sw) * 4 + 64, "device", "w")
    dev.upload(wbuf, data.reshape(-1).view(np.uint32))
    if scales is not None:
        dev.upload(wbuf, scales.reshape(-1).view(np.uint32), dw * 4)
    return wbuf


def probe_device():
    """The device (announced) and the probes' random generator (seed 0)."""
    from vkengine.device import Device
    dev = Device()
    print(f"device: {dev.info.name}", flush=True)
    return dev, np.random.default_rng(0)


def probe_matrices(types: list[str], shapes: dict, rng):
    """(type, shape, M, K, GGUF blocks, repacked quants and scales, their word
    counts) of one random matrix per shape of each type."""
    from vkengine.arena import packed_words
    from vkengine.quant import repack
    for wt in types:
        for shape in shapes[wt]:
            M, K = (int(v) for v in shape.split("x"))
            raw = random_blocks(wt, M, K, rng)
            data, scales = repack(wt, raw, M, K)
            dw, sw = packed_words(wt, M, K)
            yield wt, shape, M, K, raw, data, scales, dw, sw


def main() -> int:
    ap = probe_parser(__doc__, reps=48, runs=8)
    ap.add_argument("--cols", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    ap.add_argument("--stream-mb", type=int, default=256, help="weight copies cycled through")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="rows per workgroup to try (default 2,4,8 for one column, 2,4 for more)")
    ap.add_argument("--unroll", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="units in flight per lane to try for base (default: the engine's)")
    ap.add_argument("--kinds", type=lambda s: s.split(","), default=None, help=f"of {','.join(KINDS)}")
    ap.add_argument("--wg", type=lambda s: [int(x) for x in s.split(",")], default=[128],
                    help="workgroup sizes (the engine's: 4 subgroups)")
    args = parse_probe_args(ap, SHAPES)
    types = args.types
    from vkengine import spirv
    names = sorted({variant(wt, *c) for wt in types
                    for c in configs(wt, args.cols, args.rows, args.kinds, args.unroll)})
    if args.compile_only:
        compile_probes(names)
        return 0

    from vkengine.quant import dequantize

    dev, rng = probe_device()
    results = []
    for wt, shape, M, K, raw, data, scales, dw, sw in probe_matrices(types, SHAPES, rng):
        copies = max(2, math.ceil(args.stream_mb * 2**20 / ((dw + sw) * 4)))
        n = max(args.cols)
        x = rng.standard_normal(n * K).astype(np.float32)
        act = dev.buffer((n * K + args.reps * n * M) * 4 + 64, "device", "act")
        dev.upload(act, x.view(np.uint32))
        check = min(M, 256)
        wref = dequantize(wt, raw[:check], check, K).astype(np.float64).T
        ref = x.reshape(n, K).astype(np.float64) @ wref
        xq = None
        if any(c[0] in XQ_KINDS for c in configs(wt, args.cols, args.rows, args.kinds, args.unroll)):
            q, d, xback = quantize_x(x.reshape(n, K))
            ref_q = xback.astype(np.float64) @ wref
            xq = dev.buffer(q.nbytes + d.nbytes + 64, "device", "xq")
            dev.upload(xq, q.reshape(-1).view(np.uint32))
            dev.upload(xq, d.reshape(-1).view(np.uint32), q.nbytes)
        # every kernel's program first, then rounds over all of them (the
        # fastest of its runs counts): a kernel measured first on freshly
        # written buffers is not penalized, and clock drift hits all alike
        progs, bufs = [], []
        for _ in range(copies):
            bufs.append(weight_buffer(dev, data, scales, dw, sw))
        for (kind, nc, rps, un), wg in ((c, wg) for c in configs(wt, args.cols, args.rows, args.kinds, args.unroll)
                                         for wg in args.wg):
            name = variant(wt, kind, nc, rps, un)
            spv = spirv.spirv(name)
            mvq = kind in XQ_KINDS
            if kind == "mvq":
                if wg != 128:
                    continue
                algs = [dev.algorithm(name, spv, [b, xq, act], (), 36) for b in bufs]
            elif mvq:   # bindings 7 and 8: x's blocks (8 unused)
                algs = [dev.algorithm(name, spv, [b, act, act, b, b, b, b, xq, xq], (wg, rps), PUSH_BYTES + 8)
                        for b in bufs]
            else:
                # bindings 3-6 (the fused norm's and RoPE's) unused: any buffer
                algs = [dev.algorithm(name, spv, [b, act, act, b, b, b, b], (wg, rps), PUSH_BYTES) for b in bufs]
            prog = dev.program()
            for r in range(args.reps):
                prog.barrier()
                yoff = n * K + r * n * M
                if kind == "mvq":
                    push = struct.pack("<9I", 0, dw, K, M, nc, 0, n * K // 4, yoff, M)
                else:
                    push = struct.pack("<10I4If", 0, dw, K, M, nc, 0, K, yoff, M, 0, 0, 0, 0, 0, 0.0)
                    push += bytes(PUSH_BYTES - len(push))
                    if mvq:   # xq_off, xd_off
                        push += struct.pack("<2I", 0, n * K // 4)
                prog.dispatch(algs[r % copies], push, (math.ceil(M / rps), 1, 1), [],
                              [(act, yoff * 4, (yoff + nc * M) * 4)], "mv")
            prog.run()
            y = dev.download(act, (n * K) * 4, nc * M * 4, np.uint8).view(np.float32).reshape(nc, M)
            want = ref_q if mvq else ref
            err = float(np.abs(y[:, :check] - want[:nc]).max() / max(1.0, np.abs(want).max()))
            if mvq:
                qerr = float(np.abs(y[:, :check] - ref[:nc]).max() / max(1.0, np.abs(ref).max()))
                print(f"{wt} {shape} {kind} cols {nc} rps {rps}: x quantization moves y by {qerr:.1e} (relative)")
            progs.append(((kind, nc, rps, un, wg), prog, algs, err, []))
        for _ in range(args.runs):
            for _cfg, prog, _algs, _err, times in progs:
                t0 = time.perf_counter()
                prog.run()
                times.append((time.perf_counter() - t0) / args.reps * 1e6)
        for (kind, nc, rps, un, wg), prog, algs, err, times in progs:
            us = min(times)
            row = {"type": wt, "shape": shape, "kind": kind, "ncols": nc, "rps": rps, "unroll": un, "wg": wg,
                   "us": us, "us_median": sorted(times)[len(times) // 2], "err": err,
                   "gbps": (dw + sw) * 4 / (us * 1e-6) / 1e9}
            results.append(row)
            print(f"{wt} {shape} {kind:5s} cols {nc} rps {rps} unroll {un} wg {wg}: {us:7.1f} us "
                  f"(median {row['us_median']:7.1f}, {row['gbps']:5.0f} GB/s) err {err:.1e}", flush=True)
        del progs
        for b in bufs:
            dev.free(b)
        dev.free(act)
        if xq is not None:
            dev.free(xq)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    summarize(results)
    return 0


def summarize(results: list[dict]) -> None:
    bad = [r for r in results if not r["err"] < 1e-4]
    if bad:
        print(f"WRONG RESULTS: {sorted({(r['type'], r['kind'], r['ncols'], r['rps'], r['unroll']) for r in bad})}")
    by: dict = {}
    for r in results:
        if r["err"] < 1e-4:
            by.setdefault((r["type"], r["shape"], r["ncols"]), []).append(r)
    print("\nfastest per kind (us, GB/s):")
    for (wt, shape, nc), rows in by.items():
        best = {}
        for r in rows:
            if r["kind"] not in best or r["us"] < best[r["kind"]]["us"]:
                best[r["kind"]] = r
        cells = "  ".join(f"{k} {r['us']:.1f} ({r['gbps']:.0f}, r{r['rps']}u{r['unroll']}w{r['wg']})"
                          for k, r in best.items())
        print(f"{wt} {shape} cols {nc}: {cells}")


if __name__ == "__main__":
    sys.exit(main())
