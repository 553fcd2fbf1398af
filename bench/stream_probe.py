"""The ceiling a decode step's dispatch structure puts on weight bandwidth.

A decode step of a llama model is, per layer, five dependent dispatches (qkv
with RoPE and the cache write, attention, o, gate|up with SwiGLU, down), a
barrier between each, then the output head: 5 x 32 + 2 for an 8B shape. This
probe runs the same structure with the device's own copy shader
(shaders/copy.comp, the one that defines "copy bandwidth" in bench.py): one
dispatch per matrix of the model, each moving (reading + writing) as many bytes
as that matrix holds, every dispatch on bytes no other touches (so the L2
cache cannot help), in the step's order. Programs:

  step        that, a barrier between dispatches (what a decode step must do)
  no-barrier  the same dispatches with no barriers between them
  per-layer   one dispatch per layer (all of a layer's bytes), barriers between
  one         every byte of the step in as few dispatches as the buffers
              allow (copies of at most 1 GiB), no barriers

Each is timed on the host the way decode steps run: two copies of the
program submitted in turn, the next one before waiting for the last, so the
GPU never waits for the host (--runs programs a timing, the fastest of
--rounds timings); a program holds --repeat steps, so that its GPU time is
well above the host's round trip (H200: ~0.45 ms for an empty program). An empty
program, submitted and awaited alone, is reported too: that host round trip is
what the chaining hides. If `step` moves the bytes at well under the copy
bandwidth, no kernel design with these dependencies can reach it: the
shortfall is the barriers' (drain and refill of the GPU) and the small
dispatches', not the matvecs'.

    there:  python3 bench/stream_probe.py --model llama-8b-q4_0.gguf --out $OUT/stream.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# a decode step's dispatches per layer and the GGUF tensors each reads
LAYER_OPS = (("qkv", ("attn_q", "attn_k", "attn_v")), ("attention", ()), ("o", ("attn_output",)),
             ("gate|up", ("ffn_gate", "ffn_up")), ("down", ("ffn_down",)))


def step_ops(path: Path, position: int) -> list[tuple[str, int]]:
    """(label, bytes) of each dispatch of a decode step of a llama GGUF at
    `position`: the matrices' bytes, attention's the K and V rows it reads
    (f16), then the output head (the embedding table when tied)."""
    from gguf import GGUFReader
    r = GGUFReader(str(path), "r")
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")

    def field(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])
    n_layer, n_embd, n_head = field("block_count"), field("embedding_length"), field("attention.head_count")
    n_kv = field("attention.head_count_kv")
    kv_bytes = 2 * position * n_kv * (n_embd // n_head) * 2
    ops = []
    for i in range(n_layer):
        for label, names in LAYER_OPS:
            nbytes = sum(sizes[f"blk.{i}.{n}.weight"] for n in names) if names else kv_bytes
            ops.append((f"{label}.{i}", nbytes))
    ops.append(("head", sizes.get("output.weight", sizes["token_embd.weight"])))
    return ops


class Arena:
    """Pairs of device buffers handed out front to back: each dispatch copies
    its own bytes from a source region to a destination region."""

    def __init__(self, dev, total: int, chunk: int):
        self.dev, self.chunk = dev, chunk
        self.pairs = [(dev.buffer(chunk, "device", f"src{i}"), dev.buffer(chunk, "device", f"dst{i}"))
                      for i in range(math.ceil(total / chunk) + 1)]
        self.reset()

    def reset(self) -> None:
        self.pair, self.off = 0, 0

    def take(self, nbytes: int):
        from vkengine.kernels import Region
        nbytes = max(4096, nbytes // 4096 * 4096)
        if nbytes > self.chunk:
            raise ValueError(f"a copy of {nbytes} bytes does not fit a buffer of {self.chunk}")
        if self.off + nbytes > self.chunk:
            self.pair, self.off = self.pair + 1, 0
        src, dst = self.pairs[self.pair]
        words, off = nbytes // 4, self.off // 4
        self.off += nbytes
        return Region(src, off, words), Region(dst, off, words)

    def free(self) -> None:
        for a, b in self.pairs:
            self.dev.free(a)
            self.dev.free(b)


def build(dev, kn, arena: Arena, ops: list[tuple[str, int]], mode: str, repeat: int):
    """The program of one mode over `ops` (each op copies half its bytes, so
    it moves, read plus write, the bytes its matrix holds), `repeat` steps of
    it one after another (a barrier between steps but in no-barrier mode)."""
    prog = dev.program()
    if mode == "one":   # halves of at most a buffer each
        total, cap = sum(b for _, b in ops), 2 * arena.chunk
        groups = [cap] * (total // cap) + ([total % cap] if total % cap else [])
    elif mode == "per-layer":
        groups, cur = [], 0
        for label, b in ops:
            cur += b
            if label.startswith("down.") or label == "head":
                groups.append(cur)
                cur = 0
    else:
        groups = [b for _, b in ops]
    for r in range(repeat):
        arena.reset()
        for i, b in enumerate(groups):
            if (i or r) and mode not in ("no-barrier", "one"):
                prog.barrier()
            src, dst = arena.take(b // 2)
            kn.copy(prog, src, dst)
    return prog, len(groups)


def chained(a, b, n: int) -> float:
    """Microseconds a program when `a` and `b` (the same program twice) run
    n times in turn, each submitted before the other is awaited."""
    t0 = time.perf_counter()
    a.submit()
    for i in range(1, n):
        nxt, cur = (b, a) if i % 2 else (a, b)
        nxt.submit()
        cur.wait()
    (b if n % 2 == 0 else a).wait()
    return (time.perf_counter() - t0) / n * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", required=True, help="llama GGUF (repeatable)")
    ap.add_argument("--position", type=int, default=64, help="decode position (attention's K/V bytes)")
    ap.add_argument("--runs", type=int, default=20, help="programs a timing")
    ap.add_argument("--rounds", type=int, default=5, help="timings a mode (the fastest counts)")
    ap.add_argument("--repeat", type=int, default=4,
                    help="steps a program: the GPU time of a program must exceed the host's round trip")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from bench import copy_bandwidth
    from vkengine.device import Device
    from vkengine.kernels import Kernels

    dev = Device()
    kn = Kernels(dev)
    bw = copy_bandwidth(dev, kn)
    print(f"device {dev.info.name}: copy bandwidth {bw['gbps']:.0f} GB/s (read+write, timestamps)", flush=True)
    empty = dev.program()
    empty.run()
    t_empty = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        empty.run()
        t_empty.append((time.perf_counter() - t0) * 1e6)
    floor = min(t_empty)
    print(f"empty program: {floor:.1f} us a submission", flush=True)
    results = {"device": dev.info.name, "copy_gbps": bw["gbps"], "empty_us": floor, "models": []}
    for m in args.model:
        ops = step_ops(Path(m), args.position)
        total = sum(b for _, b in ops)
        arena = Arena(dev, total // 2, min(1 << 30, dev.max_buffer_bytes) // 4096 * 4096)
        row = {"model": Path(m).name, "dispatches": len(ops), "bytes": total, "position": args.position,
               "repeat": args.repeat, "modes": {}}
        progs = {}   # mode -> (the program, its twin for chaining, dispatches a step)
        for mode in ("step", "no-barrier", "per-layer", "one"):
            a, n = build(dev, kn, arena, ops, mode, args.repeat)
            progs[mode] = (a, build(dev, kn, arena, ops, mode, args.repeat)[0], n)
        times = {mode: [] for mode in progs}
        for a, b, _ in progs.values():
            a.run()
            b.run()
        for _ in range(args.rounds):   # rounds over the modes: drift hits them alike
            for mode, (a, b, _) in progs.items():
                times[mode].append(chained(a, b, args.runs))
        print(f"{row['model']}: {len(ops)} dispatches a step, {total / 1e9:.3f} GB", flush=True)
        for mode, (_a, _b, n) in progs.items():
            us = min(times[mode]) / args.repeat
            gbps = total / (us * 1e-6) / 1e9
            med = sorted(times[mode])[len(times[mode]) // 2] / args.repeat
            row["modes"][mode] = {"dispatches": n, "us": us, "us_median": med,
                                  "gbps": gbps, "frac_copy": gbps / bw["gbps"]}
            print(f"  {mode:10s} {n:4d} dispatches: {us:8.1f} us (median {row['modes'][mode]['us_median']:8.1f}), "
                  f"{gbps:6.0f} GB/s = {100 * gbps / bw['gbps']:4.1f}% of copy bandwidth", flush=True)
        s, nb = row["modes"]["step"], row["modes"]["no-barrier"]
        row["barrier_us"] = (s["us"] - nb["us"]) / max(1, s["dispatches"] - 1)
        print(f"  a barrier costs {row['barrier_us']:.2f} us ((step - no-barrier) / barriers)", flush=True)
        results["models"].append(row)
        del progs
        arena.free()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
