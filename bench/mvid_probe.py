"""Compare the decode steps' fused expert matvecs by wall time, as
bench/mv_probe.py does the dense ones: per MoE shape, a program of R dispatches
of one kernel (a barrier between them, as in a decode step), each with its own
random routes over one stack of E experts (so each reads k experts' rows that
the last one did not), run a few times; the fastest run / R is a dispatch's
time, and GB/s counts the bytes of the experts it reads (k experts a row, each
row's own).

Kernels (each as the GLU gate|up matvec with the SwiGLU and the COMBINE down
matvec with the weighted sum and the RMSNorm after it):
  sg        mul_mv_id.comp, a subgroup a weight row (the engine's default)
  sg4       its "4" variants (4 units a lane in flight; Caps.mvid_unroll)
  splitk    mul_mvk_id.comp (Caps.mvid_splitk): mul_mvk's split-K form, with
            --rps rows and --unroll units in flight (r4u1: the engine's Q4_0)
  dense     the dense decode matvec (mul_mvk, Kernels.mul_mat) over a matrix of
            the same bytes (k experts' rows stacked; one row only): what the
            same bytes cost without the routing, through a stream of copies

    here:   .venv/bin/python bench/mvid_probe.py --compile-only
    there:  python3 bench/mvid_probe.py --out $OUT/mvid-probe.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mv_probe import compile_probes, random_blocks  # noqa: E402 (same dir)

from shaders.variants import VARIANTS, mv_gpu_config  # noqa: E402

# name: (experts, expert FFN width F, model width D, experts a row)
SHAPES = {"qwen3moe-30b-a3b": (128, 768, 2048, 8), "qwen35moe-35b-a3b": (256, 512, 2048, 8),
          "tiny": (8, 64, 256, 2)}   # (a check on lavapipe)


def splitk_variant(wt: str, kind: str, rps: int, unroll: int, bfly: int) -> str:
    name = f"probe_mvkid_{kind}_{wt}_r{rps}_u{unroll}_b{bfly}"
    extra = mv_gpu_config(wt, 1)[2]
    VARIANTS.setdefault(name, ("mul_mvk_id.comp", {f"WT_{wt.upper()}": 1, **extra, "RPS": rps, "UNROLL": unroll,
                                                   "BFLY": bfly, {"idg": "GLU", "idc": "COMBINE"}[kind]: 1}))
    return name


class Regions:
    """Consecutive 16-byte aligned regions of one activation buffer."""

    def __init__(self, dev, buf):
        self.dev, self.buf, self.off = dev, buf, 0

    def __call__(self, n: int, data=None):
        from vkengine.kernels.types import Region
        r = Region(self.buf, self.off, n)
        self.off += (n + 3) // 4 * 4
        if data is not None:
            self.dev.upload(self.buf, np.ascontiguousarray(data, np.float32).reshape(-1).view(np.uint32), r.off * 4)
        return r


def dispatch_splitk(st, prog, variant: str, epilogue: str, n: int, rr, ff, y, norm) -> None:
    """One probe variant of mul_mvk_id.comp, as MoeKernels.mul_mat_id dispatches the engine's."""
    from vkengine import spirv
    from vkengine.kernels.push import push_for
    w = st.mats["gu" if epilogue == "glu" else "dn"]
    F, D, k, rs, act = st.F, st.D, st.k, st.rs, st.act
    M = 2 * F if epilogue == "glu" else D
    pc = dict(w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=M, k=k, n_rows=n,
              ids_off=rr.off, ids_stride=rs, b_off=0xFFFFFFFF)
    rps = VARIANTS[variant][1]["RPS"]
    if epilogue == "glu":
        pc.update(x_off=st.hr.off, x_stride=D, x_slot_stride=0, y_off=ff.off, y_stride=k * F, y_slot_stride=F)
        bufs = [w.data.buf, act, act, act, act]
        grid, items = (math.ceil(F / (rps // 2)), 1, n * k), rps // 2
    else:
        pc.update(x_off=st.xsr.off, x_stride=k * F, x_slot_stride=F, y_off=y.off, y_stride=D,
                  norm=int(norm is not None), sync_off=norm.sync.off if norm else 0, nw_off=0,
                  h_off=norm.h.off if norm else 0, h_stride=D, eps=1e-6)
        bufs = [w.data.buf, act, act, st.nwbuf, act]
        grid, items = (math.ceil(D / rps), 1, n), rps
    push = push_for(variant).pack(**pc)
    alg = st.dev.algorithm(variant, spirv.spirv(variant), bufs, (st.wg, items), len(push))
    prog.dispatch(alg, push, grid, [], [(act, 0, act.nbytes)], variant)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="q4_0")
    ap.add_argument("--shapes", default="qwen3moe-30b-a3b,qwen35moe-35b-a3b")
    ap.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4],
                    help="decode rows a step (sequences)")
    ap.add_argument("--rps", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8])
    ap.add_argument("--unroll", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    ap.add_argument("--reps", type=int, default=48)
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--stream-mb", type=int, default=256)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    types = args.types.split(",")
    probe_names = [splitk_variant(wt, kind, r, u, b) for wt in types for kind in ("idg", "idc")
                   for r in args.rps for u in args.unroll for b in (0, 1)]
    if args.compile_only:

        compile_probes(probe_names)
        return 0

    import dataclasses

    from vkengine.arena import packed_words
    from vkengine.device import Device
    from vkengine.kernels import Kernels, NormOut
    from vkengine.kernels.caps import Caps
    from vkengine.kernels.types import Matrix, Region
    from vkengine.quant import dequantize, repack

    dev = Device()
    print(f"device: {dev.info.name}", flush=True)
    rng = np.random.default_rng(0)
    base = Caps.detect(dev)
    kern = {"sg": Kernels(dev, dataclasses.replace(base, mvid_unroll=False, mvid_splitk=False)),
            "sg4": Kernels(dev, dataclasses.replace(base, mvid_unroll=True, mvid_splitk=False))}
    results = []
    for wt in types:
        for shape in args.shapes.split(","):
            E, F, D, k = SHAPES[shape]
            # the stacks: gate|up E x 2F rows of D, down E x D rows of F
            mats, raws = {}, {}
            for name, M, K in (("gu", E * 2 * F, D), ("dn", E * D, F)):
                raw = random_blocks(wt, M, K, rng)
                data, scales = repack(wt, raw, M, K)
                dw, sw = packed_words(wt, M, K)
                buf = dev.buffer((dw + sw) * 4 + 64, "device", f"w-{name}")
                dev.upload(buf, data.reshape(-1).view(np.uint32))
                if scales is not None:
                    dev.upload(buf, scales.reshape(-1).view(np.uint32), dw * 4)
                mats[name] = Matrix(wt, M, K, Region(buf, 0, dw), Region(buf, dw, sw) if sw else None)
                raws[name] = raw
                del data, scales
            nmax = max(args.rows)
            R = args.reps
            # activations: h (nmax x D), per-slot x (nmax x k x F), per rep: routes, ff out, y (residual), norm out
            rs = 2 * k
            words = nmax * D + nmax * k * F + R * (nmax * rs + nmax * k * F + 2 * nmax * D) + 4 * k * 2 * F + D + 64
            act = dev.buffer(words * 4, "device", "act")
            nwbuf = dev.buffer(D * 4 + 64, "device", "nw")
            region = Regions(dev, act)
            h = rng.standard_normal((nmax, D)).astype(np.float32)
            xs = rng.standard_normal((nmax, k, F)).astype(np.float32)
            hr, xsr = region(h.size, h), region(xs.size, xs)
            nw = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
            dev.upload(nwbuf, nw.view(np.uint32))
            nwr = Region(nwbuf, 0, D)
            sync = region(4, np.zeros(4, np.float32))
            st = SimpleNamespace(dev=dev, act=act, nwbuf=nwbuf, mats=mats, hr=hr, xsr=xsr, F=F, D=D, k=k, rs=rs,
                                 wg=base.wg)
            reps = []
            for _ in range(R):
                ids = np.stack([rng.permutation(E)[:k] for _ in range(nmax)]).astype(np.uint32)
                wts = rng.uniform(0.05, 0.3, (nmax, k)).astype(np.float32)
                rr = region(nmax * rs, np.concatenate([ids.view(np.float32), wts], 1))
                reps.append((ids, wts, rr, region(nmax * k * F), region(nmax * D, np.zeros(nmax * D)),
                             region(nmax * D)))
            # the numpy reference of rep 0 (its experts' rows dequantized)
            ids0, wts0 = reps[0][0], reps[0][1]
            want = {}
            for n in args.rows:
                g = np.zeros((n, k, F))
                u = np.zeros((n, k, F))
                dn = np.zeros((n, D))
                for r in range(n):
                    for i in range(k):
                        e = int(ids0[r, i])
                        wgu = dequantize(wt, raws["gu"][e * 2 * F:(e + 1) * 2 * F], 2 * F, D).astype(np.float64)
                        g[r, i], u[r, i] = wgu[:F] @ h[r], wgu[F:] @ h[r]
                        wdn = dequantize(wt, raws["dn"][e * D:(e + 1) * D], D, F).astype(np.float64)
                        dn[r] += wts0[r, i] * (wdn @ xs[r, i])
                want[n] = (g / (1 + np.exp(-g)) * u, dn)

            for n in args.rows:
                configs: list[tuple[str, str]] = [("sg", "glu"), ("sg", "combine"), ("sg4", "glu"), ("sg4", "combine")]
                configs += [(f"splitk_r{r}_u{u}_b{b}", ep) for r in args.rps for u in args.unroll
                            for b in ((0, 1) if base.bfly else (0,)) for ep in ("glu", "combine")]
                progs = []
                for cfg, ep in configs:
                    prog = dev.program()
                    for rep in range(R):
                        _ids, _wts, rr, ff, y, hn = reps[rep]
                        norm = NormOut(nwr, hn, D, sync, 1e-6) if base.split_k else None
                        prog.barrier()
                        if cfg in kern:
                            kn = kern[cfg]
                            if ep == "glu":
                                kn.mul_mat_id(prog, mats["gu"], 2 * F, hr, D, 0, rr, rs, k, ff, k * F, F, n,
                                              epilogue="glu")
                            else:
                                kn.mul_mat_id(prog, mats["dn"], D, xsr, k * F, F, rr, rs, k, y, D, 0, n,
                                              epilogue="combine", norm=norm)
                        else:
                            _s, r_, u_, b_ = cfg.split("_")
                            kind = "idg" if ep == "glu" else "idc"
                            dispatch_splitk(st, prog, splitk_variant(wt, kind, int(r_[1:]), int(u_[1:]), int(b_[1:])),
                                            ep, n, rr, ff, y, norm)
                    # zero the residuals, run once, check rep 0
                    for rep in reps:
                        dev.upload(act, np.zeros(nmax * D, np.float32).view(np.uint32), rep[4].off * 4)
                    prog.run()
                    _ids, _wts, _rr, ff, y, _hn = reps[0]
                    if ep == "glu":
                        got = dev.download(act, ff.off * 4, n * k * F * 4, np.uint8).view(np.float32)
                        ref = want[n][0].reshape(-1)
                    else:
                        got = dev.download(act, y.off * 4, n * D * 4, np.uint8).view(np.float32)
                        ref = want[n][1].reshape(-1)
                    err = float(np.abs(got - ref).max() / max(1.0, np.abs(ref).max()))
                    progs.append((cfg, ep, prog, err, []))
                for _ in range(args.runs):
                    for cfg, ep, prog, err, times in progs:
                        t0 = time.perf_counter()
                        prog.run()
                        times.append((time.perf_counter() - t0) / R * 1e6)
                for cfg, ep, prog, err, times in progs:
                    us = min(times)
                    nbytes = n * k * (2 * F * D if ep == "glu" else D * F) * {"q4_0": 18 / 32, "q8_0": 34 / 32}.get(
                        wt, 2)
                    row = {"type": wt, "shape": shape, "rows": n, "kernel": cfg, "epilogue": ep, "us": us,
                           "us_median": sorted(times)[len(times) // 2], "gbps": nbytes / (us * 1e-6) / 1e9,
                           "err": err}
                    results.append(row)
                    print(f"{wt} {shape} rows {n} {ep:7s} {cfg:16s}: {us:7.1f} us (median {row['us_median']:7.1f}, "
                          f"{row['gbps']:5.0f} GB/s) err {err:.1e}", flush=True)
                del progs
            # the dense reference (one row): the same bytes as one row's k experts, a stream of copies
            for ep, M, K in (("glu", k * 2 * F, D), ("down", D, k * F)):
                raw = random_blocks(wt, M, K, rng)
                data, scales = repack(wt, raw, M, K)
                dw, sw = packed_words(wt, M, K)
                copies = max(2, math.ceil(args.stream_mb * 2**20 / ((dw + sw) * 4)))
                bufs = []
                for _ in range(copies):
                    b = dev.buffer((dw + sw) * 4 + 64, "device", "dense")
                    dev.upload(b, data.reshape(-1).view(np.uint32))
                    if scales is not None:
                        dev.upload(b, scales.reshape(-1).view(np.uint32), dw * 4)
                    bufs.append(b)
                xr = region(K, rng.standard_normal(K).astype(np.float32))
                yr = region(M)
                prog = dev.program()
                for rep in range(R):
                    b = bufs[rep % copies]
                    m = Matrix(wt, M, K, Region(b, 0, dw), Region(b, dw, sw) if sw else None)
                    prog.barrier()
                    if ep == "glu":
                        glu = kern["sg"].fuses_glu(m, 1)
                        kern["sg"].mul_mat(prog, m, xr, K, yr, M // 2 if glu else M, 1, glu=glu)
                    else:
                        kern["sg"].mul_mat(prog, m, xr, K, yr, M, 1, accumulate=True)
                prog.run()
                times = []
                for _ in range(args.runs):
                    t0 = time.perf_counter()
                    prog.run()
                    times.append((time.perf_counter() - t0) / R * 1e6)
                us = min(times)
                nbytes = (dw + sw) * 4
                row = {"type": wt, "shape": shape, "rows": 1, "kernel": "dense", "epilogue": ep, "us": us,
                       "us_median": sorted(times)[len(times) // 2], "gbps": nbytes / (us * 1e-6) / 1e9}
                results.append(row)
                print(f"{wt} {shape} rows 1 {ep:7s} dense {M}x{K}  : {us:7.1f} us ({row['gbps']:5.0f} GB/s)",
                      flush=True)
                for b in bufs:
                    dev.free(b)
            for m in mats.values():
                dev.free(m.data.buf)
            dev.free(act)
            dev.free(nwbuf)
    if args.out:
        Path(args.out).write_text(json.dumps(results))
    bad = [r for r in results if r.get("err", 0) > 1e-3]
    if bad:
        print("WRONG RESULTS:", sorted({(r["kernel"], r["epilogue"], r["rows"]) for r in bad}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
