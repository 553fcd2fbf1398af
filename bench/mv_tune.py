"""Tune the GPU matvec (mul_mv.comp, KSPLIT = 1) on a device: GPU time of one
matrix times 1 and 4 columns for each workgroup size, rows per workgroup (RPS),
units in flight per lane (UNROLL) and reduction (subgroupAdd or the butterfly
reduce-scatter, BFLY), on the weight shapes of the bench models.

A row's sum order depends on the workgroup size and the reduction only, so the
1- and 4-column variants of one matrix must share those two (batched decode
gives each sequence the tokens it gets alone); RPS and UNROLL are free per
column count. The summary gives, per shape, the fastest such pair.

    here:   .venv/bin/python bench/mv_tune.py --compile-only    # SPIR-V into the cache
    there:  python3 bench/mv_tune.py --out $OUT/mv-tune.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shaders.variants import VARIANTS  # noqa: E402

SHAPES = {"q8_0": ["16384x2048", "2048x8192", "3072x2048", "2048x2048", "49152x2048"],
          "q4_0": ["16384x2048", "2048x8192", "3072x2048", "28672x4096", "4096x14336", "6144x4096"]}


def variant(wt: str, nc: int, rps: int, unroll: int, bfly: int) -> str:
    name = f"tune_mv_{wt}_c{nc}_r{rps}_u{unroll}_b{bfly}"
    VARIANTS.setdefault(name, ("mul_mv.comp", {f"WT_{wt.upper()}": 1, "NCOLS": nc, "UNROLL": unroll, "RPS": rps,
                                               "KSPLIT": 1, "BFLY": bfly}))
    return name


def grid(args):
    for wt in args.types.split(","):
        for nc, rps, un, bf in itertools.product(args.cols, args.rps, args.unroll, args.bfly):
            yield wt, nc, rps, un, bf


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--cols", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    ap.add_argument("--rps", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--unroll", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    ap.add_argument("--bfly", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    ap.add_argument("--wg", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=24)
    ap.add_argument("--stream-mb", type=int, default=256, help="weight copies cycled through per timing")
    ap.add_argument("--shapes", default=None, help="type:MxK,... instead of the bench models' shapes")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    if args.shapes:
        SHAPES.clear()
        for item in args.shapes.split(","):
            t, shp = item.split(":")
            SHAPES.setdefault(t, []).append(shp)
        args.types = ",".join(SHAPES)
    from vkengine import shaders
    names = sorted({variant(*g) for g in grid(args)})
    if args.compile_only:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor() as ex:
            list(ex.map(shaders.compile_variant, names))
        print(f"{len(names)} tuning variants compiled")
        return 0

    from tests.quant_util import random_quantized
    from vkengine.arena import packed_words
    from vkengine.device import Device
    from vkengine.kernels import Matrix, Region
    from vkengine.quant import repack

    dev = Device()
    print(f"device: {dev.info.name}", flush=True)
    rng = np.random.default_rng(0)
    results = []
    t_start = time.time()
    for wt in args.types.split(","):
        for shape in SHAPES[wt]:
            M, K = (int(v) for v in shape.split("x"))
            raw, _ = random_quantized(wt, M, K, rng)
            data, scales = repack(wt, raw, M, K)
            dw, sw = packed_words(wt, M, K)
            # enough copies that one pass over them does not fit the GPU's L2
            # cache (H200: 60 MB): decode streams weights from memory
            copies = max(1, math.ceil(args.stream_mb * 2**20 / ((dw + sw) * 4)))
            mats = []
            for _ in range(copies):
                wbuf = dev.buffer((dw + sw) * 4 + 64, "device", "w")
                dev.upload(wbuf, data.reshape(-1).view(np.uint32))
                sc = None
                if scales is not None:
                    dev.upload(wbuf, scales.reshape(-1).view(np.uint32), dw * 4)
                    sc = Region(wbuf, dw, sw)
                mats.append(Matrix(wt, M, K, Region(wbuf, 0, dw), sc))
            n = max(args.cols)
            act = dev.buffer((n * K + args.reps * n * M) * 4 + 64, "device", "act")
            x = rng.standard_normal(n * K).astype(np.float32)
            dev.upload(act, x.view(np.uint32))
            ref = None
            for wt_, nc, rps, un, bf in grid(args):
                if wt_ != wt:
                    continue
                name = variant(wt, nc, rps, un, bf)
                spv = shaders.spirv(name)
                if bf and rps * nc > dev.info.subgroup_size:
                    continue       # the butterfly needs a lane for every sum
                for wg in args.wg:
                    push = struct.pack("<10I4If", 0, dw, K, M, nc, 0, K, 0, M, 0, 0, 0, 0, 0, 0.0)
                    algs = [dev.algorithm(name, spv, [m.data.buf, act, act, m.data.buf], (wg, rps), len(push)) for m in mats]
                    prog = dev.program(timestamps=True)
                    for r in range(args.reps):
                        prog.barrier()     # one at a time: overlapping dispatches blur their timestamps
                        yoff = n * K + r * n * M
                        push = struct.pack("<10I4If", 0, dw, K, M, nc, 0, K, yoff, M, 0, 0, 0, 0, 0, 0.0)
                        prog.dispatch(algs[r % copies], push, (math.ceil(M / rps), 1, 1), [],
                                      [(act, yoff * 4, (yoff + nc * M) * 4)], "mv")
                    prog.run()
                    prog.run()
                    us = sorted(t for lbl, t in prog.timings() if lbl == "mv")
                    y = dev.download(act, (n * K) * 4, nc * M * 4, np.uint8).view(np.float32).reshape(nc, M)
                    if ref is None:
                        ref = (x.reshape(n, K).astype(np.float64) @ _deq(wt, raw, M, K).T)
                    err = float(np.abs(y - ref[:nc]).max() / max(1.0, np.abs(ref).max()))
                    row = {"type": wt, "shape": shape, "ncols": nc, "rps": rps, "unroll": un, "bfly": bf, "wg": wg,
                           "us": us[len(us) // 2], "us_min": us[0], "err": err,
                           "gbps": (dw + sw) * 4 / (us[len(us) // 2] * 1e-6) / 1e9, "copies": copies}
                    results.append(row)
            dev.free(act)
            for m in mats:
                dev.free(m.data.buf)
            print(f"{wt} {shape}: done ({time.time() - t_start:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    summarize(results)
    return 0


_DEQ = {}


def _deq(wt, raw, M, K):
    key = (wt, M, K, id(raw))
    if key not in _DEQ:
        from vkengine.quant import dequantize
        _DEQ.clear()
        _DEQ[key] = dequantize(wt, raw, M, K).astype(np.float64)
    return _DEQ[key]


def summarize(results: list[dict]) -> None:
    bad = [r for r in results if not r["err"] < 1e-4]
    if bad:
        print(f"WRONG RESULTS: {len(bad)} configs:", sorted({(r['type'], r['ncols'], r['rps'], r['bfly']) for r in bad}))
    by = {}
    for r in results:
        by.setdefault((r["type"], r["shape"]), []).append(r)
    for (wt, shape), rows in by.items():
        base1 = next((r for r in rows if (r["ncols"], r["rps"], r["unroll"], r["bfly"], r["wg"]) == (1, 2, 2, 0, 128)), None)
        base4 = next((r for r in rows if (r["ncols"], r["rps"], r["unroll"], r["bfly"], r["wg"]) == (4, 4, 2, 0, 128)), None)
        best = {}
        for r in rows:
            if r["err"] >= 1e-4:
                continue
            k = (r["ncols"], r["wg"], r["bfly"])
            if k not in best or r["us"] < best[k]["us"]:
                best[k] = r
        pairs = []
        for (nc, wg, bf), r1 in best.items():
            if nc != 1 or (4, wg, bf) not in best:
                continue
            r4 = best[(4, wg, bf)]
            pairs.append((r1["us"] + r4["us"], wg, bf, r1, r4, best.get((8, wg, bf))))
        pairs.sort(key=lambda p: p[0])
        base8 = next((r for r in rows if (r["ncols"], r["rps"], r["unroll"], r["bfly"], r["wg"]) == (8, 4, 1, 0, 128)), None)
        now = [f"{r['us']:.1f} us" if r else "-" for r in (base1, base4, base8)]
        print(f"\n{wt} {shape}: now 1 col {now[0]}, 4 col {now[1]}, 8 col {now[2]}")
        for tot, wg, bf, r1, r4, r8 in pairs[:4]:
            c8 = f", 8 col {r8['us']:.1f} us (rps {r8['rps']} unroll {r8['unroll']})" if r8 else ""
            print(f"  wg {wg} bfly {bf}: 1 col {r1['us']:.1f} us (rps {r1['rps']} unroll {r1['unroll']}, "
                  f"{r1['gbps']:.0f} GB/s), 4 col {r4['us']:.1f} us (rps {r4['rps']} unroll {r4['unroll']}, "
                  f"{r4['us'] / r1['us']:.2f}x){c8}")


if __name__ == "__main__":
    sys.exit(main())
