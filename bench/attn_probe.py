"""Compare the prompt attention kernels by wall time: one slot's prefill of N
rows (positions 0..N-1, causal) over a cache holding them, for the bench
models' head layouts; a program of R dispatches (a barrier between them) is
run a few times and the fastest run / R is a dispatch's time.

Kernels:
  simt   attention.comp (one subgroup per row and head, every GPU)
  mc     attention_mc.comp (cooperative matrices, 16 rows a subgroup, 4
         subgroups sharing staged keys and values), the variant
         Kernels.attention runs for prompt-sized steps (head sizes of
         shaders/variants.py ATTN_MC_HEAD_DIMS; others compiled here with
         2 subgroups and 16-position blocks)
  mc2sg  the same with 2 subgroups a workgroup
Measured and dropped (H200, 2026-12-01): attention_mc with S = Q K^T and
O += P V (A operands reused): 3-18% slower than the transposed products; 2
subgroups a workgroup (mc2sg): slower than 4, and 4-5x slower with 128-wide
heads (its prefetch registers spill). Run one layout per process: a process
that had run the spilling variant measured every kernel after it 2-5x slower.

    here:   .venv/bin/python bench/attn_probe.py --compile-only
    there:  python3 bench/attn_probe.py --out $OUT/attn-probe.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mv_probe import compile_probes, probe_device  # noqa: E402 (same dir)

from vkengine.kernels import Caps, Kernels, Region  # noqa: E402

# name -> (query heads, kv heads, head dim)
LAYOUTS = {"8b": (32, 8, 128), "1b": (32, 8, 64), "qwen35-4b": (16, 4, 256)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("-n", type=int, default=512, help="prompt rows")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from shaders.variants import ATTN_MC_HEAD_DIMS, ATTN_MC_NSG, EXT_DEFINE, VARIANTS
    probe_nsg = 2   # the probe variants' subgroups a workgroup
    hds = sorted({LAYOUTS[k][2] for k in args.layouts.split(",")})
    names = ["attention"] + [f"attention_mc_d{hd}" for hd in hds if hd in ATTN_MC_HEAD_DIMS]
    for hd in hds:
        if hd not in ATTN_MC_HEAD_DIMS:   # left to attention.comp by the engine; 48 KB of shared memory
            VARIANTS.setdefault(f"probe_attention_mc_d{hd}",
                                ("attention_mc.comp", {"HD": hd, "BC": 16, "NSG": probe_nsg, EXT_DEFINE: 1}))
            names.append(f"probe_attention_mc_d{hd}")
        else:
            VARIANTS.setdefault(f"probe_attention_mc2sg_d{hd}",
                                ("attention_mc.comp", {"HD": hd, "NSG": probe_nsg, EXT_DEFINE: 1}))
            names.append(f"probe_attention_mc2sg_d{hd}")
    if args.compile_only:
        compile_probes(sorted(set(names)))
        return 0

    import reference as ref
    dev, rng = probe_device()
    caps = Caps.detect(dev)
    n, results = args.n, []
    for lay in args.layouts.split(","):
        nh, nkv, hd = LAYOUTS[lay]
        slot_stride = n * nkv * hd // 2
        q = rng.standard_normal((n, nh, hd)).astype(np.float32)
        kv = rng.standard_normal((2, n, nkv, hd)).astype(np.float16)
        qw, ow = n * nh * hd, n * nh * hd
        act = dev.buffer((qw + ow + 2 * slot_stride) * 4 + 64, "device", "act")
        dev.upload(act, q.view(np.uint32))
        dev.upload(act, kv.view(np.uint32), (qw + ow) * 4)
        params = dev.buffer(2 * n * 4, "host", "params")
        params.array()[:n] = np.arange(n)
        params.array()[n:2 * n] = 0
        qr, orr = Region(act, 0, qw), Region(act, qw, ow)
        kc, vc = Region(act, qw + ow, slot_stride), Region(act, qw + ow + slot_stride, slot_stride)
        check = [0, 1, n // 2, n - 1]
        for kind in ("simt", "mc", "mc2sg"):
            if kind == "mc2sg" and hd not in ATTN_MC_HEAD_DIMS:
                continue
            kn = Kernels(dev, dataclasses.replace(
                caps, attention_mc=kind != "simt", attention_mc_head_dims=tuple(hds),
                attention_mc_variant=("attention_mc_d{hd}" if kind == "mc" and hd in ATTN_MC_HEAD_DIMS else
                                      "probe_attention_mc2sg_d{hd}" if kind == "mc2sg" else "probe_attention_mc_d{hd}"),
                attention_mc_nsg=ATTN_MC_NSG if kind == "mc" and hd in ATTN_MC_HEAD_DIMS else probe_nsg))
            if kind != "simt" and not kn.attention_on_coopmat(n, hd):
                continue
            prog = dev.program()
            for _ in range(args.reps):
                prog.barrier()
                kn.attention(prog, qr, nh * hd, orr, nh * hd, n, nh, nkv, hd, kc, vc,
                             slot_stride, params, 0, n, 1 / np.sqrt(hd))
            prog.run()
            got = dev.download(act, qw * 4, ow * 4, np.float32).reshape(n, nh, hd)
            qq = q.astype(np.float16).astype(np.float32) if kind != "simt" else q
            err = max(float(np.abs(got[r] - ref.attention(qq[r], kv[0, :r + 1].astype(np.float32),
                                                             kv[1, :r + 1].astype(np.float32), 1 / np.sqrt(hd))).max())
                      for r in check)
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                prog.run()
                times.append((time.perf_counter() - t0) / args.reps * 1e6)
            us = min(times)
            flops = 4 * nh * hd * n * (n + 1) / 2   # q.k and p.v over the causal triangle
            row = {"layout": lay, "kind": kind, "n": n, "us": us, "tflops": flops / (us * 1e-6) / 1e12, "err": err}
            results.append(row)
            print(f"{lay} ({nh}/{nkv} heads of {hd}) n {n} {kind:5s}: {us:8.1f} us {row['tflops']:6.1f} TFLOPS "
                  f"err {err:.1e}", flush=True)
        dev.free(act)
        dev.free(params)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
