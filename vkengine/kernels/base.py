"""What every kernel wrapper shares: the device, its capabilities (Caps), the
pipelines of shader variants and the grid of a dispatch."""
from __future__ import annotations

import math
from pathlib import Path

from .. import spirv
from ..device import Buffer, Device
from .caps import Caps
from .push import push_for
from .types import Region


class KernelBase:
    def __init__(self, device: Device, caps: Caps | None = None, spirv_cache: Path | None = None):
        self.device = device
        self.caps = caps if caps is not None else Caps.detect(device)
        # resolved once: looked up from the environment and ~ for each dispatch recorded, it was a fifth of
        # a server's startup recording (SmolLM2's 30 layers, 26 steps on lavapipe: 0.37 -> 0.29 s)
        self._spirv_cache = spirv_cache if spirv_cache is not None else spirv.default_cache_dir()
        # scratch buffers of the matmuls (_scratch): mul_mc2's halves of x, split
        # K's partial sums, XQ8's 8-bit x; the last of each list is the largest
        self._x16: list[Buffer] = []
        self._x16g: list[Buffer] = []   # gate|up's SwiGLU as halves for the down projection (mul_mat_glu_halves)
        self._parts: list[Buffer] = []
        self._xq: list[Buffer] = []
        self._dr: list[Buffer] = []    # the chunked delta rule's G, W, U and Aqk (delta_rule.py)
        self._amc: list[Buffer] = []   # attention_mc's parts (attention.py, its split form)
        # matmuls recorded on another kernel because theirs was still compiling (Device.is_slow): the
        # engine records those steps again once it is built
        self.substituted = 0

    def min_subgroup(self) -> int:
        """The smallest subgroup the kernels may run with: the device's own where
        it is fixed, else at most 8 (lavapipe's vary)."""
        return self.caps.sg if self.device.info.subgroups_fixed else min(self.caps.sg, 8)

    def _alg(self, name: str, buffers: list[Buffer], push: bytes, wg: int, items: int | None = None):
        """The pipeline of a variant whose specialization constants are (workgroup size, items per workgroup)."""
        spv = spirv.spirv(name, self._spirv_cache)
        return self.device.algorithm(name, spv, buffers, (wg, items or self.caps.items), len(push))

    def _alg_spec(self, name: str, buffers: list[Buffer], spec: tuple[int, ...], push: bytes):
        """The pipeline of a variant with its own specialization constants (or none)."""
        return self.device.algorithm(name, spirv.spirv(name, self._spirv_cache), buffers, spec, len(push))

    @staticmethod
    def _push(variant: str, **fields) -> bytes:
        return push_for(variant).pack(**fields)

    def _grid(self, n_groups: int, z: int = 1) -> tuple[int, int, int]:
        max_x = self.caps.max_x
        if n_groups <= max_x:
            return (n_groups, 1, z)
        return (max_x, math.ceil(n_groups / max_x), z)

    @staticmethod
    def _same_buffer(*regions: Region) -> Buffer:
        b = regions[0].buf
        if any(r.buf is not b for r in regions):
            raise ValueError("these operands must live in the same activation buffer")
        return b

    def scratch_buffers(self) -> list[Buffer]:
        """The matmuls' scratch buffers allocated so far (the owner frees them)."""
        return [*self._x16, *self._x16g, *self._parts, *self._xq, *self._dr, *self._amc]

    def _scratch(self, bufs: list[Buffer], words: int, name: str) -> Buffer:
        """The last of `bufs`, or a new device buffer of at least `words` words
        appended to them where it is smaller. Recorded programs keep the
        buffers they were recorded with, so a larger one is added rather than
        swapped in."""
        if not bufs or bufs[-1].nbytes < words * 4:
            bufs.append(self.device.buffer(max(words, 1 << 16) * 4, "device", f"{name}_{len(bufs)}"))
        return bufs[-1]
