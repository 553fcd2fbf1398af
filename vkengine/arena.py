"""Packing many arrays into few device buffers.

A pipeline (kp Algorithm) is bound to fixed buffers, so the engine keeps all
weights in a handful of large buffers and addresses tensors by word offsets in
push constants: one pipeline per (shader, buffer) instead of one per tensor.
Sizes are planned first (from the model file's header), then each buffer is
allocated at its exact size, never above the device's storage-buffer range.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .device import Buffer, Device
from .errors import VkEngineError
from .kernels import Region

ALIGN_WORDS = 4   # 16-byte alignment of every array (vec4 reads)

# Tests: split weight matrices (by rows) and expert stacks (by experts) that are
# larger than this many bytes, as on a device with a smaller storage-buffer range.
SPLIT_BYTES: int | None = None


def _aligned(words: int) -> int:
    return (words + ALIGN_WORDS - 1) // ALIGN_WORDS * ALIGN_WORDS


@dataclass
class ArenaPlan:
    """Groups of arrays that must share a buffer, placed into buffers of at most
    `limit_words` words."""
    limit_words: int
    groups: list[list[int]] = field(default_factory=list)     # sizes (words) per group
    placement: list[tuple[int, list[int]]] = field(default_factory=list)  # (buffer index, offsets)
    buffer_words: list[int] = field(default_factory=list)

    def add(self, sizes: list[int], what: str = "array") -> int:
        """Reserve a group of arrays (placed in one buffer); returns its id."""
        total = sum(_aligned(s) for s in sizes)
        if total > self.limit_words:
            raise VkEngineError(
                f"{what} needs {total * 4 / 2**20:.1f} MiB in one buffer, more than this device's "
                f"storage-buffer limit ({self.limit_words * 4 / 2**20:.0f} MiB)")
        if not self.buffer_words or self.buffer_words[-1] + total > self.limit_words:
            self.buffer_words.append(0)
        b = len(self.buffer_words) - 1
        offsets = []
        for s in sizes:
            offsets.append(self.buffer_words[b])
            self.buffer_words[b] += _aligned(s)
        self.groups.append(sizes)
        self.placement.append((b, offsets))
        return len(self.groups) - 1


class Arena:
    """Buffers allocated from an ArenaPlan; `regions(group)` gives the group's
    Regions, `write(region, array)` uploads into one."""

    def __init__(self, device: Device, plan: ArenaPlan, kind: str = "device", name: str = "arena"):
        self.device = device
        self.plan = plan
        self.buffers: list[Buffer] = [
            device.buffer(max(w, ALIGN_WORDS) * 4, kind, f"{name}{i}") for i, w in enumerate(plan.buffer_words)]

    def regions(self, group: int) -> list[Region]:
        b, offsets = self.plan.placement[group]
        return [Region(self.buffers[b], off, size) for off, size in zip(offsets, self.plan.groups[group])]

    def write(self, region: Region, array: np.ndarray) -> None:
        a = np.ascontiguousarray(array).reshape(-1).view(np.uint32)
        if a.size > region.words:
            raise ValueError(f"{a.size} words do not fit a region of {region.words}")
        self.device.upload(region.buf, a, region.off * 4)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


def packed_words(type_name: str, rows: int, cols: int) -> tuple[int, int]:
    """(value words, scale words) of a matrix in quant.glsl's layout."""
    from .quant import block_shape
    n, b = block_shape(type_name)
    blocks = rows * cols // n
    if type_name in ("f32", "f16", "bf16", "q4_k", "q5_k", "iq4_xs"):
        return blocks * b // 4, 0
    if type_name == "q6_k":
        return blocks * 53, 0
    if type_name in ("q4_1", "q5_1"):
        return blocks * (b - 4) // 4, blocks
    if type_name == "mxfp4":        # 16 bytes of nibbles, one exponent byte (four a word)
        return blocks * (b - 1) // 4, (blocks + 3) // 4
    return blocks * (b - 2) // 4, (blocks + 1) // 2


def matrix_words(type_name: str, rows: int, cols: int) -> int:
    """Words a matrix takes in an arena (values and scales, each aligned)."""
    return sum(_aligned(w) for w in packed_words(type_name, rows, cols))


def split_limit_words(plan: ArenaPlan) -> int:
    return plan.limit_words if SPLIT_BYTES is None else min(plan.limit_words, SPLIT_BYTES // 4)


def row_parts(type_name: str, rows: int, cols: int, limit_words: int, unit: int = 1,
              what: str = "matrix") -> list[tuple[int, int]]:
    """(first row, end row) of each part of a matrix that one storage buffer
    cannot hold, parts of whole `unit`s of rows (an expert's rows) as large as
    fit `limit_words`; [(0, rows)] when it fits."""
    if matrix_words(type_name, rows, cols) <= limit_words:
        return [(0, rows)]
    lo, hi = 1, rows // unit                 # the most units that fit: binary search
    if matrix_words(type_name, unit, cols) > limit_words:
        raise VkEngineError(f"{what}: {unit} row(s) need {matrix_words(type_name, unit, cols) * 4 / 2**20:.1f} "
                            f"MiB, more than this device's storage-buffer limit ({limit_words * 4 / 2**20:.0f} MiB)")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if matrix_words(type_name, mid * unit, cols) <= limit_words:
            lo = mid
        else:
            hi = mid - 1
    step = lo * unit
    if unit == 1 and step > 4:   # whole groups of 4 rows (the GPU matvecs' norm sums: Kernels.fuses_norm_parts)
        step -= step % 4
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]
