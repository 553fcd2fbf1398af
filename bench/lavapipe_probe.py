"""How fast can a compute shader read a storage buffer on this device?

Four read-only shaders sum 64 MiB of words: scalar or uvec4 loads, each lane
walking its own contiguous run or lanes interleaved GPU-style. On llvmpipe
(Mesa 22.3) all four run at about the same speed (0.8-1.0 GB/s on 2 cores),
because every load whose address differs across lanes becomes a loop over the
lanes; a kernel there gains only by loading fewer words (shaders/variants.py,
SG_ROWS). Usage: python bench/lavapipe_probe.py [--device N]
"""
from __future__ import annotations

import argparse
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SRC = """#version 450
layout(local_size_x_id = 0) in;
layout(binding = 0) readonly buffer W { uint w[]; };
layout(binding = 1) readonly buffer W4 { uvec4 w4[]; };
layout(binding = 2) buffer Y { float y[]; };
layout(push_constant) uniform P { uint n; uint per; } p;
void main() {
    uint g = gl_GlobalInvocationID.x, S = gl_WorkGroupSize.x, acc = 0u;
#if MODE == 0
    for (uint i = 0; i < p.per; i++) acc += w[g * p.per + i];
#elif MODE == 1
    for (uint i = 0; i < p.per / 4u; i++) { uvec4 v = w4[g * (p.per / 4u) + i]; acc += v.x + v.y + v.z + v.w; }
#elif MODE == 2
    uint b = gl_WorkGroupID.x * S * p.per + gl_LocalInvocationID.x;
    for (uint i = 0; i < p.per; i++) acc += w[b + i * S];
#else
    uint b = gl_WorkGroupID.x * S * (p.per / 4u) + gl_LocalInvocationID.x;
    for (uint i = 0; i < p.per / 4u; i++) { uvec4 v = w4[b + i * S]; acc += v.x + v.y + v.z + v.w; }
#endif
    y[g] = float(acc);
}
"""
MODES = ["scalar, contiguous per lane", "uvec4, contiguous per lane", "scalar, lanes interleaved",
         "uvec4, lanes interleaved"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", type=int, default=None)
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    from vkengine.device import Device
    dev = Device(args.device)
    n = args.mib << 18                     # words
    per, wg = 256, 64
    w = dev.buffer(n * 4, "device", "probe-w")
    dev.upload(w, np.arange(n, dtype=np.uint32))
    y = dev.buffer(n // per * 4, "device", "probe-y")
    print(f"{dev.info.name}: reading {args.mib} MiB")
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "probe.comp"
        src.write_text(SRC)
        for mode, what in enumerate(MODES):
            spv = Path(d) / f"probe{mode}.spv"
            subprocess.run(["glslc", "-fshader-stage=compute", "--target-env=vulkan1.1", f"-DMODE={mode}", "-O",
                            str(src), "-o", str(spv)], check=True)
            push = struct.pack("<2I", n, per)
            alg = dev.algorithm(f"probe{mode}", spv.read_bytes(), [w, w, y], (wg, 1), len(push))
            prog = dev.program()
            prog.dispatch(alg, push, (n // per // wg, 1, 1), [], [], "probe")
            prog.run()
            best = min(_timed(prog) for _ in range(3))
            print(f"  {what:30s} {n * 4 / best / 1e9:6.2f} GB/s")
    return 0


def _timed(prog) -> float:
    t = time.perf_counter()
    prog.run()
    return time.perf_counter() - t


if __name__ == "__main__":
    sys.exit(main())
