"""Compare the prompt attention kernels by wall time: one slot's prefill of N
rows (positions 0..N-1, causal) over a cache holding them, for the bench
models' head layouts; a program of R dispatches (a barrier between them) is
run a few times and the fastest run / R is a dispatch's time.

Kernels:
  simt   attention.comp (one subgroup per row and head, every GPU)
  mc     attention_mc.comp as the engine runs it (shaders/variants.py
         ATTN_MC: subgroups a workgroup, subgroups a 16-row block, positions
         a block, by head size)
  mc2sg  the same with 2 subgroups a workgroup (64 and 128)
  mc16   256-wide heads: 2 subgroups, one 16-row block, 16-position blocks
         (DS 2), and mc16s the same with one subgroup on all dims (DS 1)
Measured and dropped (H200, 2026-12-01): attention_mc with S = Q K^T and
O += P V (A operands reused): 3-18% slower than the transposed products; 2
subgroups a workgroup (mc2sg): slower than 4, and 4-5x slower with 128-wide
heads (its prefetch registers spill). Run one layout per process: a process
that had run the spilling variant measured every kernel after it 2-5x slower.
--depth D puts the N rows at positions D..D+N-1 over a cache of D+N (a
prompt chunk after D tokens of context).

--decode: split decode attention instead, one row a slot at position D of
each of -n slots (a decode step at depth D), for each --dec variant:
  slices  attention.comp's 64-position slices of each query head
  v1      attention_dec.comp as of 3b60573 (bench/shaders/attention_dec_v1.comp:
          a partial per part, no K prefetch), options as dec's
  dec     attention_dec.comp as the engine runs it; dec:items=N+lp+nolp+nokpf+vpre+vb=N+parts=N+gq=N
          change Caps.attn_items, attn_lp (lanes a position for the layout's heads, or
          none), attn_kpf, its V rows loaded ahead (before the scores or after), its most
          parts and the query heads an item takes (gq=N: N heads; default: Caps.attn_group's
          dims); +kh / +nokh: Caps.attn_khoist, +vw / +novw: Caps.attn_vwide (+vpre with wide V
          rows: the tile's first round of wide loads before the scores), +qsh: Caps.attn_qsh
          (q in shared memory), +cmb / +nocmb: Caps.attn_combine (a workgroup's subgroups combined in
          one round), +om=N: Caps.attn_merge (the partials merged in one pass, N a round; 0: two),
          +pd / +nopd: Caps.attn_parts_down (parts rounded down to whole tiles, twice the grid)
Printed: a dispatch's time and the K/V bytes it reads a microsecond.

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
LAYOUTS = {"8b": (32, 8, 128), "1b": (32, 8, 64), "qwen35-4b": (16, 4, 256), "qwen35-0.8b": (8, 2, 256),
           "qwen35-35b": (16, 2, 256)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("-n", type=int, default=512, help="prompt rows")
    ap.add_argument("--depth", type=int, default=0, help="positions already in the cache before the rows")
    ap.add_argument("--reps", type=int, default=None, help="dispatches a program (8; --decode 200)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode", action="store_true", help="split decode attention: -n rows at depth --depth")
    ap.add_argument("--dec", default="slices,v1,dec,dec:nokpf,dec:items=512,dec:items=2048,dec:vb=32,dec:lp",
                    help="(--decode) variants, comma-separated")
    args = ap.parse_args()
    if args.reps is None:
        # a decode dispatch takes 10-300 us: enough of them that the ~0.5 ms
        # submit-and-wait round trip of a program is a few percent
        args.reps = 200 if args.decode else 8
    if args.decode:
        return decode(args)
    from shaders.variants import ATTN_MC, EXT_DEFINE, VARIANTS
    hds = sorted({LAYOUTS[k][2] for k in args.layouts.split(",")})
    # head size -> [(kind, variant, 16-row blocks a workgroup)]
    kinds: dict[int, list[tuple[str, str, int]]] = {}
    for hd in hds:
        kinds[hd] = [("simt", "attention", 0)]
        if hd in ATTN_MC:
            nsg, ds, _ = ATTN_MC[hd]
            kinds[hd].append(("mc", f"attention_mc_d{hd}", nsg // ds))
        probes = ({"mc2sg": {"NSG": 2}} if hd != 256 else
                  {"mc16": {"NSG": 2, "DS": 2, "BC": 16}, "mc16s": {"NSG": 2, "DS": 1, "BC": 16}})
        for kind, d in probes.items():
            name = f"probe_attention_{kind}_d{hd}"
            VARIANTS.setdefault(name, ("attention_mc.comp", {"HD": hd, **d, EXT_DEFINE: 1}))
            kinds[hd].append((kind, name, d["NSG"] // d.get("DS", 1)))
    names = sorted({v for ks in kinds.values() for _, v, _ in ks})
    if args.compile_only:
        compile_probes(names)
        return 0

    import reference as ref
    dev, rng = probe_device()
    caps = Caps.detect(dev)
    n, dep, results = args.n, args.depth, []
    for lay in args.layouts.split(","):
        nh, nkv, hd = LAYOUTS[lay]
        t = dep + n   # cache positions
        slot_stride = t * nkv * hd // 2
        q = rng.standard_normal((n, nh, hd)).astype(np.float32)
        kv = rng.standard_normal((2, t, nkv, hd)).astype(np.float16)
        qw, ow = n * nh * hd, n * nh * hd
        act = dev.buffer((qw + ow + 2 * slot_stride) * 4 + 64, "device", "act")
        dev.upload(act, q.view(np.uint32))
        dev.upload(act, kv.view(np.uint32), (qw + ow) * 4)
        params = dev.buffer(2 * n * 4, "host", "params")
        params.array()[:n] = np.arange(dep, dep + n)
        params.array()[n:2 * n] = 0
        qr, orr = Region(act, 0, qw), Region(act, qw, ow)
        kc, vc = Region(act, qw + ow, slot_stride), Region(act, qw + ow + slot_stride, slot_stride)
        check = [0, 1, n // 2, n - 1]
        for kind, variant, per_wg in kinds[hd]:
            kn = Kernels(dev, dataclasses.replace(
                caps, attention_mc=kind != "simt", attention_mc_layouts=((hd, per_wg),),
                attention_mc_variant=variant.replace(str(hd), "{hd}")))
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
            err = max(float(np.abs(got[r] - ref.attention(qq[r], kv[0, :dep + r + 1].astype(np.float32),
                                                             kv[1, :dep + r + 1].astype(np.float32),
                                                             1 / np.sqrt(hd))).max())
                      for r in check)
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                prog.run()
                times.append((time.perf_counter() - t0) / args.reps * 1e6)
            us = min(times)
            flops = 4 * nh * hd * n * (dep + (n + 1) / 2)   # q.k and p.v over the causal rows
            row = {"layout": lay, "kind": kind, "n": n, "depth": dep, "us": us,
                   "tflops": flops / (us * 1e-6) / 1e12, "err": err}
            results.append(row)
            print(f"{lay} ({nh}/{nkv} heads of {hd}) n {n} depth {dep} {kind:5s}: {us:8.1f} us "
                  f"{row['tflops']:6.1f} TFLOPS err {err:.1e}", flush=True)
        dev.free(act)
        dev.free(params)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


def decode(args) -> int:
    """--decode: one decode row a slot at position --depth in each of -n slots."""
    import reference as ref

    from shaders.variants import VARIANTS
    from vkengine.kernels.push import LAYOUTS as PUSH
    v1 = "../bench/shaders/attention_dec_v1.comp"
    VARIANTS.setdefault("probe_attention_dec_v1", (v1, {}))
    PUSH.setdefault(v1, PUSH["attention_dec.comp"])
    if args.compile_only:
        compile_probes(["probe_attention_dec_v1"])
        return 0
    dev, rng = probe_device()
    caps = Caps.detect(dev)
    n, dep, results = args.n, args.depth, []
    for lay in args.layouts.split(","):
        nh, nkv, hd = LAYOUTS[lay]
        t = dep + 1
        slot_stride = t * nkv * hd // 2
        q = rng.standard_normal((n, nh, hd)).astype(np.float32)
        kv = rng.standard_normal((2, n, t, nkv, hd)).astype(np.float16)
        qw = ow = n * nh * hd
        kn0 = Kernels(dev, dataclasses.replace(caps, split_attention=True, attention_dec=False))
        tmp_w = max(kn0.attention_tmp_words(n, nh, nkv, hd, t), 1024 * n * nh * (hd + 2))
        sync_w = n * nh
        cache_w = 2 * n * slot_stride
        act = dev.buffer((qw + ow + tmp_w + sync_w) * 4 + 64, "device", "act")
        kvb = dev.buffer(cache_w * 4 + 64, "device", "kv")
        dev.upload(act, q.view(np.uint32))
        dev.upload(act, np.zeros(sync_w, np.uint32), (qw + ow + tmp_w) * 4)
        dev.upload(kvb, np.ascontiguousarray(kv).view(np.uint32))
        params = dev.buffer(2 * n * 4, "host", "params")
        params.array()[:n] = dep
        params.array()[n:2 * n] = np.arange(n)
        qr, orr = Region(act, 0, qw), Region(act, qw, ow)
        tmp, sync = Region(act, qw + ow, tmp_w), Region(act, qw + ow + tmp_w, sync_w)
        kc, vc = Region(kvb, 0, n * slot_stride), Region(kvb, n * slot_stride, n * slot_stride)
        for spec in args.dec.split(","):
            kind, _, opts = spec.partition(":")
            over = dict(split_attention=True, attention_dec=kind in ("dec", "v1"), attn_kpf=True)
            max_parts = 0
            for o in filter(None, opts.split("+")):
                if o == "lp":
                    over["attn_lp"] = hd
                elif o == "nolp":
                    over["attn_lp"] = 0
                elif o == "nokpf":
                    over["attn_kpf"] = False
                elif o.startswith("items="):
                    over["attn_items"] = int(o[6:])
                elif o.startswith("vb="):
                    over["attn_vb"] = int(o[3:])
                elif o in ("vpre", "novpre"):
                    over["attn_vpre"] = o == "vpre"
                elif o.startswith("parts="):
                    max_parts = int(o[6:])
                elif o.startswith("gq="):
                    over["attn_group"] = int(o[3:]) * hd
                elif o in ("kh", "nokh"):
                    over["attn_khoist"] = o == "kh"
                elif o in ("cmb", "nocmb"):
                    over["attn_combine"] = o == "cmb"
                elif o.startswith("om="):
                    over["attn_merge"] = int(o[3:])
                elif o in ("pd", "nopd"):
                    over["attn_parts_down"] = o == "pd"
                elif o in ("vw", "novw"):
                    over["attn_vwide"] = o == "vw"
                elif o == "qsh":
                    over["attn_qsh"] = True
            kn = Kernels(dev, dataclasses.replace(caps, **over))
            if max_parts:
                kn.DEC_MAX_PARTS = max_parts
            if kind == "v1":
                kn.dec_variant = "probe_attention_dec_v1"
            prog = dev.program()
            for _ in range(args.reps):
                prog.barrier()
                kn.attention(prog, qr, nh * hd, orr, nh * hd, n, nh, nkv, hd, kc, vc, slot_stride, params, 0, n,
                             1 / np.sqrt(hd), tmp, t, sync)
            prog.run()
            got = dev.download(act, qw * 4, ow * 4, np.float32).reshape(n, nh, hd)
            err = max(float(np.abs(got[r] - ref.attention(q[r], kv[0, r].astype(np.float32),
                                                             kv[1, r].astype(np.float32), 1 / np.sqrt(hd))).max())
                      for r in range(min(n, 2)))
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                prog.run()
                times.append((time.perf_counter() - t0) / args.reps * 1e6)
            us = min(times)
            gbs = n * 2 * t * nkv * hd * 2 / (us * 1e-6) / 1e9
            row = {"layout": lay, "variant": spec, "rows": n, "depth": dep, "us": us, "GBps": gbs, "err": err}
            results.append(row)
            print(f"decode {lay} ({nh}/{nkv} heads of {hd}) rows {n} depth {dep} {spec:20s}: {us:8.1f} us "
                  f"{gbs:7.0f} GB/s err {err:.1e}", flush=True)
        dev.free(act)
        dev.free(kvb)
        dev.free(params)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
