"""Kernel wrappers: one Python method per shader, which picks the variant,
packs the push constants (push.py: declared once per shader), sizes the grid
and declares what the dispatch reads and writes, so that Program records only
the barriers that are needed. By op family: matmul.py, attention.py, norm.py,
elementwise.py, sample.py, delta_rule.py, moe.py; what the device can do is
decided once (caps.py).

Conventions: every offset and stride is in 32-bit words of its buffer.
Activations, the params buffer and the KV cache are float/uint arrays; weights
are in weight buffers in the layouts of shaders/quant.glsl.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .attention import AttentionKernels
from .caps import Caps, device_has_coopmat2
from .delta_rule import DeltaRuleKernels
from .elementwise import ElementwiseKernels
from .matmul import MatmulKernels
from .moe import MoeKernels
from .norm import NormKernels
from .sample import SampleKernels
from .types import (
    ConvOut,
    Halves,
    KVTypes,
    Matrix,
    NormIn,
    NormOut,
    NormParts,
    Q8Out,
    Region,
    RopeOut,
    RouteOut,
    q8_words,
    rows_range,
)

if TYPE_CHECKING:
    from ..device import Device

__all__ = ["Caps", "ConvOut", "Halves", "KVTypes", "Kernels", "Matrix", "NormIn", "NormOut", "NormParts", "Q8Out",
           "Region", "RopeOut", "RouteOut", "device_has_coopmat2", "q8_words", "rows_range"]


class Kernels(MatmulKernels, AttentionKernels, DeltaRuleKernels, NormKernels, ElementwiseKernels, SampleKernels,
              MoeKernels):
    """Every kernel wrapper, for one device and its Caps."""

    def __init__(self, device: Device, caps: Caps | None = None, spirv_cache: Path | None = None) -> None:
        super().__init__(device, caps, spirv_cache)
        # pipelines of kernels that have a stand-in (a slow one is recorded on it meanwhile) compile after
        # the others on the device's pipeline threads: a start waits only for those without one
        device.deferrable = self.has_stand_in

    def step_thresholds(self, max_out: int) -> list[int]:
        """Row counts from which a step's kernels change on this device (a step
        of fewer rows runs others): the tiled matmuls, attention on cooperative
        matrices (any head size: conservative), and the end of split decode
        attention (steps of up to max_out rows, Graph.attention)."""
        return self.thresholds_of(self.caps, max_out)

    @classmethod
    def thresholds_of(cls, c: Caps, max_out: int | None) -> list[int]:
        """step_thresholds for caps c, before any Kernels exist (max_out None:
        leave out split attention's, which follows the engine's max_out)."""
        t = [c.tiled_from] if c.tiled_from is not None else []
        if c.coopmat and c.attention_mc:
            t.append(cls.ATTN_MC_FROM)
        if c.split_attention and max_out is not None:
            t.append(max_out + 1)
        return t
