"""Compare the prefill matmul kernels by wall time on the bench models' shapes:
for each weight shape and N tokens, a program of R dispatches of one kernel
(a barrier between them) is run a few times; the fastest run / R is a
dispatch's time, reported with its TFLOPS (2 M K N flops).

Kernels:
  mt<T>         mul_mt.comp, fp32 (every GPU), T x T tiles
  mc<BM>x<BN>s<SGM><SGN>   mul_mc.comp, cooperative matrices (fp16 tiles, fp32
                sums), BM weight rows x BN tokens, 8 subgroups in an SGM x SGN
                grid (the engine's is shaders/variants.py MC_TILE)
  mc2*_<BM>x<BN>  mul_mc2.comp: NVIDIA's workgroup-scope matrices
                (VK_NV_cooperative_matrix2), one BM x BN matrix a workgroup,
                weights loaded directly (F16) or decoded by the loads; only on
                request (--kinds); x uploaded as halves (the engine converts it
                with to_f16.comp)
Measured and dropped (H200, 2026-11-30, mul_mc): BK = 64 (5-25% slower than
32) and issuing the next slice's global loads before the current slice's
multiplies (within noise). Wall times here are only comparable within one
process: on 2026-12-04 separate processes (one a kind) read 3-5x the engine's
GPU timestamps for the same kernels (notes.md run 37); compare kinds in one run.

    here:   .venv/bin/python bench/mm_probe.py --compile-only
    there:  python3 bench/mm_probe.py --out $OUT/mm-probe.json
"""
from __future__ import annotations

import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mv_probe import compile_probes, parse_probe_args, probe_device, probe_matrices, probe_parser, weight_buffer  # noqa: E402 (same dir)

from shaders.variants import EXT_DEFINE, MC2_TYPES, VARIANTS  # noqa: E402

SHAPES = {"q4_0": ["6144x4096", "4096x4096", "28672x4096", "4096x14336"],
          "q8_0": ["3072x2048", "2048x2048", "16384x2048", "2048x8192"]}
# name -> None (mul_mt, 128 x 128 and 64 x 64 tiles) or mul_mc's (BM, BN, SGM, SGN, BK)
KINDS = {"mt128": None, "mt64": None,
         "mc64x128s18": (64, 128, 1, 8, 32), "mc128x64s24": (128, 64, 2, 4, 32), "mc64x64": (64, 64, 2, 4, 32),
         "mc128x128s18": (128, 128, 1, 8, 32), "mc128x128s24": (128, 128, 2, 4, 32),
         # mul_mc2 (BM, BN, defines): u4/u16 chunks of 4/16 slices (8 otherwise)
         "mc2_128x128": (128, 128), "mc2_128x256": (128, 256), "mc2_64x128": (64, 128), "mc2_64x256": (64, 256),
         "mc2_256x128": (256, 128), "mc2u4_128x256": (128, 256, "UNROLL=4"),
         "mc2u16_128x256": (128, 256, "UNROLL=16"),
         # h: fp16 accumulators (ACC_F16, llama.cpp's f16acc)
         "mc2h_128x256": (128, 256, "ACC_F16", "UNROLL=4"), "mc2h_256x256": (256, 256, "ACC_F16", "UNROLL=4"),
         "mc2h_128x128": (128, 128, "ACC_F16"), "mc2h_256x128": (256, 128, "ACC_F16"),
         "mc2h_64x128": (64, 128, "ACC_F16"), "mc2h_64x256": (64, 256, "ACC_F16", "UNROLL=4"),
         "mc2h_128x64": (128, 64, "ACC_F16"),
         # k64: 64-deep slices (llama.cpp's BK for these tiles)
         "mc2h_128x256k64": (128, 256, "ACC_F16", "UNROLL=4", "BK=64"),
         "mc2h_64x256k64": (64, 256, "ACC_F16", "UNROLL=4", "BK=64")}


def tile_of(kind: str) -> tuple[int, int]:
    if KINDS[kind] is None:
        t = int(kind[2:])
        return t, t
    return KINDS[kind][0], KINDS[kind][1]


def variant(wt: str, kind: str) -> str:
    name = f"probe_mm_{wt}_{kind}"
    d = {f"WT_{wt.upper()}": 1}
    if KINDS[kind] is None:
        t = tile_of(kind)[0] // 16
        VARIANTS.setdefault(name, ("mul_mt.comp", {**d, "TM": t, "TN": t}))
    elif kind.startswith("mc2"):
        bm, bn, *flags = KINDS[kind]
        extra = {f.split("=")[0]: int(f.split("=")[1]) if "=" in f else 1 for f in flags}
        VARIANTS.setdefault(name, ("mul_mc2.comp", {**d, "BM": bm, "BN": bn, **extra, EXT_DEFINE: 1}))
    else:
        bm, bn, sgm, sgn, bk = KINDS[kind]
        VARIANTS.setdefault(name, ("mul_mc.comp", {**d, "BM": bm, "BN": bn, "SGM": sgm, "SGN": sgn, "BK": bk,
                                                   EXT_DEFINE: 1}))
    return name


def main() -> int:
    import faulthandler
    faulthandler.enable()
    ap = probe_parser(__doc__, reps=8, runs=5)
    ap.add_argument("--kinds", default=",".join(k for k in KINDS if not k.startswith("mc2")),
                    help="default: all but mc2* (mul_mc2 needs VK_NV_cooperative_matrix2)")
    ap.add_argument("-n", type=int, default=512, help="tokens")
    args = parse_probe_args(ap, SHAPES)
    types, kinds = args.types, args.kinds.split(",")
    from vkengine import spirv
    runs = {wt: [k for k in kinds if not k.startswith("mc2") or wt in MC2_TYPES] for wt in types}
    names = sorted({variant(wt, k) for wt in types for k in runs[wt]})
    if args.compile_only:
        compile_probes(names)
        return 0

    from vkengine.quant import dequantize

    dev, rng = probe_device()
    from vkengine.kernels.caps import COOPMAT2_FEATURES, device_has_coopmat2
    if any(k.startswith("mc2") for k in kinds) and not device_has_coopmat2(dev):
        print(f"mc2 kinds need VK_NV_cooperative_matrix2: {dev.info.name} lacks "
              f"{sorted(COOPMAT2_FEATURES - set(dev.features))}", file=sys.stderr)
        return 2
    n = args.n
    results = []
    for wt, shape, M, K, raw, data, scales, dw, sw in probe_matrices(types, SHAPES, rng):
        x = rng.standard_normal(n * K).astype(np.float32)
        act = dev.buffer((n * K + n * M) * 4 + 64, "device", "act")
        dev.upload(act, x.view(np.uint32))
        wbuf = weight_buffer(dev, data, scales, dw, sw)
        check = min(M, 256)
        ref = x.reshape(n, K).astype(np.float64) @ dequantize(wt, raw[:check], check, K).astype(np.float64).T
        progs, x16bufs = [], []
        for kind in runs[wt]:
            name, (bm, bn) = variant(wt, kind), tile_of(kind)
            if kind.startswith("mc2"):   # x as halves in whole tiles of tokens (Kernels.to_f16's layout)
                n_pad = math.ceil(n / bn) * bn
                x16 = np.zeros((n_pad, K), np.float16)
                x16[:n] = x.reshape(n, K)
                xbuf = dev.buffer(x16.nbytes, "device", "x16")
                dev.upload(xbuf, x16.view(np.uint32))
                x16bufs.append(xbuf)
                bufs, grid_n = [wbuf, xbuf, act], n_pad // bn
            else:
                bufs, grid_n = [wbuf, act, act], math.ceil(n / bn)
            # progress: creating a pipeline takes the driver 5-40 s a kind on the H200,
            # and a shape's rows print only after all its kinds ran
            print(f"  {wt} {shape} {kind}: pipeline", file=sys.stderr, flush=True)
            alg = dev.algorithm(name, spirv.spirv(name), bufs, (), 40)
            prog = dev.program()
            push = struct.pack("<10I", 0, dw, K, M, n, 0, K, n * K, M, 0)
            for _ in range(args.reps):
                prog.barrier()
                prog.dispatch(alg, push, (math.ceil(M / bm), grid_n, 1), [],
                              [(act, n * K * 4, (n * K + n * M) * 4)], "mm")
            prog.run()
            y = dev.download(act, n * K * 4, n * M * 4, np.uint8).view(np.float32).reshape(n, M)
            err = float(np.abs(y[:, :check] - ref).max() / max(1.0, np.abs(ref).max()))
            progs.append((kind, f"{bm}x{bn}", prog, alg, err, []))
        for _ in range(args.runs):
            for _k, _t, prog, _alg, _err, times in progs:
                t0 = time.perf_counter()
                prog.run()
                times.append((time.perf_counter() - t0) / args.reps * 1e6)
        for kind, tile, prog, alg, err, times in progs:
            us = min(times)
            row = {"type": wt, "shape": shape, "n": n, "kind": kind, "tile": tile, "us": us,
                   "us_median": sorted(times)[len(times) // 2], "err": err,
                   "tflops": 2 * M * K * n / (us * 1e-6) / 1e12}
            results.append(row)
            print(f"{wt} {shape} n {n} {kind:10s} tile {tile:7s}: {us:8.1f} us (median {row['us_median']:8.1f}) "
                  f"{row['tflops']:6.1f} TFLOPS err {err:.1e}", flush=True)
        del progs
        for b in x16bufs:
            dev.free(b)
        dev.free(wbuf)
        dev.free(act)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
