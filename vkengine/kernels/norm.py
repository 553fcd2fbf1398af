"""Normalizations: RMSNorm of rows (a workgroup per row on GPUs), per-head L2
norm and the gated RMSNorm of the linear-attention block."""
from __future__ import annotations

import math

from ..device import Buffer, Program
from .base import KernelBase
from .types import NO_MAP, Region, rows_range


class NormKernels(KernelBase):
    def rms_norm(self, prog: Program, weight: Region, x: Region, x_stride: int, y: Region, y_stride: int,
                 n: int, rows: int, eps: float, params: Buffer, map_off: int | None = None,
                 label: str = "rms_norm") -> None:
        """y[r] = x[src] / rms(x[src]) * weight, src = r or params[map_off + r]."""
        act = self._same_buffer(x, y)
        if n % 4 or x.off % 4 or y.off % 4 or x_stride % 4 or y_stride % 4 or weight.off % 4:
            raise ValueError("rms_norm needs rows of a multiple of 4 floats, 16-byte aligned")
        c = self.caps
        name = "rms_norm_wg" if c.split_k else "rms_norm"   # GPUs: a workgroup per row
        push = self._push(name, x_off=x.off, x_stride=x_stride, y_off=y.off, y_stride=y_stride, w_off=weight.off,
                          n=n, rows=rows, map_off=NO_MAP if map_off is None else map_off, eps=eps)
        per_wg = 1 if c.split_k else c.items
        alg = self._alg(name, [weight.buf, act, act, params], push, c.wg, per_wg)
        if map_off is None:
            reads = [weight.range, rows_range(x, rows, x_stride, n)]
        else:  # gathered rows: any row of x may be read
            reads = [weight.range, x.range, (params, map_off * 4, (map_off + rows) * 4)]
        prog.dispatch(alg, push, self._grid(math.ceil(rows / per_wg)), reads,
                      [rows_range(y, rows, y_stride, n)], label)

    def l2_norm(self, prog: Program, x: Region, x_stride: int, y: Region, y_stride: int, head_dim: int,
                n_heads: int, rows: int, eps: float, label: str = "l2_norm") -> None:
        """y[r][h] = x[r][h] / sqrt(|x[r][h]|^2 + eps) per head (in place allowed)."""
        act = self._same_buffer(x, y)
        push = self._push("l2_norm", x_off=x.off, x_stride=x_stride, y_off=y.off, y_stride=y_stride,
                          head_dim=head_dim, n_heads=n_heads, rows=rows, eps=eps)
        alg = self._alg("l2_norm", [act], push, self.caps.wg)
        width = head_dim * n_heads
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n_heads / self.caps.items)),
                      [rows_range(x, rows, x_stride, width)], [rows_range(y, rows, y_stride, width)], label)

    def gated_rms_norm(self, prog: Program, w: Region, x: Region, x_stride: int, z: Region, z_stride: int,
                       y: Region, y_stride: int, head_dim: int, n_heads: int, rows: int, eps: float,
                       label: str = "gated_rms_norm") -> None:
        """y[r][h] = rms_norm(x[r][h]) * w * silu(z[r][h]) per head (y may alias x)."""
        act = self._same_buffer(x, z, y)
        push = self._push("gated_rms_norm", x_off=x.off, x_stride=x_stride, z_off=z.off, z_stride=z_stride,
                          y_off=y.off, y_stride=y_stride, w_off=w.off, head_dim=head_dim, n_heads=n_heads,
                          rows=rows, eps=eps)
        alg = self._alg("gated_rms_norm", [w.buf, act], push, self.caps.wg)
        width = head_dim * n_heads
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n_heads / self.caps.items)),
                      [w.range, rows_range(x, rows, x_stride, width), rows_range(z, rows, z_stride, width)],
                      [rows_range(y, rows, y_stride, width)], label)
