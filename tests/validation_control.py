"""The positive control of the validation-layer run (tests/test_vulkan_validation.py):
real Programs whose dependency tracker is told there are no hazards, so that
they leave out barriers they need, and the same Programs recorded normally.

    python -m tests.validation_control [--with-barriers]

Three missing barriers: a dispatch's write read by a copy (read after write),
a copy's write overwritten by a dispatch (write after write), and a dispatch
reading a weight that a later copy overwrites (write after read). Under the
Khronos layer with synchronization validation each must be reported; with the
barriers the tracker records, nothing may be. (Two dispatches that both write
one buffer were not reported with the barrier between them removed, by 1.3.239
and 1.4.309 alike, so the controls cross the dispatch/transfer boundary; the
ordering of dependent dispatches is tested by value in test_kernels.py's
dependent chain.)
"""
from __future__ import annotations

import sys

import numpy as np

from vkengine.device import Device
from vkengine.kernels import Kernels

from .conftest import Workspace


def main(with_barriers: bool) -> int:
    dev = Device(None)
    k, ws = Kernels(dev), Workspace(dev)
    n = 1 << 12
    a, b, c = (ws.act_region(n, np.full(n, v, np.float32)) for v in (0, 0, 1))
    out = dev.buffer(4 * n, "device", "control-out")

    def program():
        prog = dev.program()
        if not with_barriers:
            prog._hazard = lambda reads, writes: False    # the tracker sees nothing: every barrier left out
        return prog

    prog = program()                                     # dispatch writes a, copy reads it
    k.add(prog, b, n, c, n, a, n, n, 1)
    prog.copy(a.buf, out, 4 * a.off, 0, 4 * n)
    prog.run()
    prog = program()                                     # copy writes b, dispatch writes it too
    prog.copy(out, b.buf, 0, 4 * b.off, 4 * n)
    k.add(prog, a, n, c, n, b, n, n, 1)
    prog.run()
    bias = ws.weight_region(np.ones(n, np.float32))
    prog = program()                                     # dispatch reads a weight, copy overwrites it
    k.add_bias(prog, bias, a, n, n, 1)
    prog.copy(out, bias.buf, 0, 4 * bias.off, 4 * n)
    prog.run()
    print(f"control ran {'with' if with_barriers else 'without'} barriers", flush=True)
    dev.free(out)
    ws.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main("--with-barriers" in sys.argv[1:]))
