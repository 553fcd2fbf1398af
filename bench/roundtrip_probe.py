"""The host's round trip a program pays when it is submitted and waited for,
by how long the wait polls the fence first (VKENGINE_FENCE_SPIN_US, patches/kp
0003) - the cost of every step the host must see before the next: a split
model's parts, MTP's verify steps, constrained decoding's masks.

Programs: an empty one (the round trip alone) and chains of dependent small
dispatches (`add` over 4,096 floats, a barrier between each) of about --work
microseconds of GPU time, so that the fence signals while the host already
waits. For each spin (microseconds; 0: the driver's blocking wait alone) the
fastest and the median of --runs submissions are printed, in microseconds.

    there:  python3 bench/roundtrip_probe.py --spins 0,20,100,500 --out $OUT/roundtrip.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spins", default="0,20,100,500", help="fence polling budgets, microseconds")
    ap.add_argument("--chains", default="0,50,400", help="dispatches of each program (0: empty)")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import numpy as np

    from vkengine.device import Device
    from vkengine.kernels import Kernels, Region
    dev = Device()
    if not dev.can_spin:
        print("kp lacks patches/kp/0003-fence-spin.patch", file=sys.stderr)
        return 1
    kn = Kernels(dev)
    n = 4096
    buf = dev.buffer(3 * n * 4, "device", "probe")
    dev.upload(buf, np.zeros(3 * n, np.float32).view(np.uint32))
    a, b, c = (Region(buf, i * n, n) for i in range(3))
    rows = []
    for chain in (int(x) for x in args.chains.split(",")):
        prog = dev.program()
        for i in range(chain):
            kn.add(prog, b if i % 2 else a, n, c, n, a if i % 2 else b, n, n, 1)
        prog.run()
        for spin in (int(x) for x in args.spins.split(",")):
            dev.fence_spin_ns = spin * 1000
            prog.run()
            times = []
            for _ in range(args.runs):
                t0 = time.perf_counter()
                prog.run()
                times.append((time.perf_counter() - t0) * 1e6)
            row = {"dispatches": chain, "spin_us": spin, "min_us": min(times), "median_us": statistics.median(times)}
            rows.append(row)
            print(f"{chain:4d} dispatches, spin {spin:5d} us: min {row['min_us']:8.1f}  "
                  f"median {row['median_us']:8.1f} us", flush=True)
    dev.fence_spin_ns = 0
    if args.out:
        Path(args.out).write_text(json.dumps({"device": dev.info.name, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
