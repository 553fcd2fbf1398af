"""Row-wise and elementwise kernels: embedding rows (get_rows), SwiGLU and
GeGLU, adds, softmax, sigmoid gates, soft-capping and a plain copy."""
from __future__ import annotations

import math

from shaders.variants import UNIT_VALUES

from ..device import Buffer, Program
from .base import KernelBase
from .types import Matrix, Region, rows_range


class ElementwiseKernels(KernelBase):
    def get_rows(self, prog: Program, w: Matrix, params: Buffer, ids_off: int, y: Region, y_stride: int,
                 n: int, label: str = "get_rows", scale: float = 1.0) -> None:
        """y[r][:] = scale * W[params[ids_off + r]][:] (dequantized) for r < n. A matrix split
        by rows: one dispatch per part, each writing the rows whose ids it holds."""
        ew = self.caps.ew_wg
        total = n * (w.cols // UNIT_VALUES[w.type])
        for r0, part in (w.parts or ((0, w),)):
            assert part.data is not None
            pc = dict(w_off=part.data.off, w_off2=part.scales.off if part.scales else 0, K=w.cols, n_rows=n,
                      ids_off=ids_off, y_off=y.off, y_stride=y_stride, scale=scale)
            variant = f"get_rows_{w.type}"
            if w.parts:
                pc.update(row_lo=r0, row_hi=r0 + part.rows)
                variant = f"get_rows_p_{w.type}"
            push = self._push(variant, **pc)
            alg = self._alg(variant, [part.data.buf, y.buf, params], push, ew, 1)
            prog.dispatch(alg, push, self._grid(math.ceil(total / ew)),
                          part.regions + [(params, ids_off * 4, (ids_off + n) * 4)],
                          [rows_range(y, n, y_stride, w.cols)], label)

    def swiglu(self, prog: Program, gu: Region, gu_stride: int, y: Region, y_stride: int, F: int, rows: int,
               label: str = "swiglu", gelu: bool = False, oai: tuple[float, float] | None = None) -> None:
        """y[r][i] = silu(gu[r][i]) * gu[r][F + i] (gelu: GELU, tanh form, for
        silu; oai = (alpha, limit): gpt-oss's clamped form, swiglu.comp)."""
        act = self._same_buffer(gu, y)
        vec4 = not (F % 4 or gu.off % 4 or gu_stride % 4 or y.off % 4 or y_stride % 4)
        name = ("swiglu_oai" if oai else "geglu" if gelu else "swiglu") + ("4" if vec4 else "")
        extra = dict(alpha=oai[0], limit=oai[1]) if oai else {}
        push = self._push(name, gu_off=gu.off, gu_stride=gu_stride, y_off=y.off, y_stride=y_stride, F=F, rows=rows,
                          **extra)
        ew = self.caps.ew_wg
        alg = self._alg(name, [act], push, ew, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * F // (4 if vec4 else 1) / ew)),
                      [rows_range(gu, rows, gu_stride, 2 * F)], [rows_range(y, rows, y_stride, F)], label)

    def softcap(self, prog: Program, x: Region, x_stride: int, n: int, rows: int, cap: float,
                label: str = "softcap") -> None:
        """x[r][:n] = cap * tanh(x[r][:n] / cap), in place (Gemma 2's logits)."""
        push = self._push("softcap", x_off=x.off, x_stride=x_stride, n=n, rows=rows, cap=cap)
        alg = self._alg("softcap", [x.buf], push, self.caps.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n / self.caps.ew_wg)),
                      [rows_range(x, rows, x_stride, n)], [rows_range(x, rows, x_stride, n)], label)

    def add(self, prog: Program, a: Region, a_stride: int, b: Region, b_stride: int, y: Region, y_stride: int,
            n: int, rows: int, label: str = "add") -> None:
        act = self._same_buffer(a, b, y)
        push = self._push("add", a_off=a.off, a_stride=a_stride, b_off=b.off, b_stride=b_stride, y_off=y.off,
                          y_stride=y_stride, n=n, rows=rows)
        alg = self._alg("add", [act], push, self.caps.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n / self.caps.ew_wg)),
                      [rows_range(a, rows, a_stride, n), rows_range(b, rows, b_stride, n)],
                      [rows_range(y, rows, y_stride, n)], label)

    def add_bias(self, prog: Program, b: Region, y: Region, y_stride: int, n: int, rows: int,
                 label: str = "add_bias") -> None:
        """y[r][:n] += b (a weight vector) for each of rows rows."""
        if b.words < n:
            raise ValueError(f"bias of {b.words} values for rows of {n}")
        push = self._push("add_bias", b_off=b.off, y_off=y.off, y_stride=y_stride, n=n, rows=rows)
        alg = self._alg("add_bias", [b.buf, y.buf], push, self.caps.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n / self.caps.ew_wg)),
                      [b.range, rows_range(y, rows, y_stride, n)], [rows_range(y, rows, y_stride, n)], label)

    def softmax(self, prog: Program, x: Region, x_stride: int, y: Region, y_stride: int, n: int, rows: int,
                scale: float = 1.0, label: str = "softmax") -> None:
        act = self._same_buffer(x, y)
        push = self._push("softmax", x_off=x.off, x_stride=x_stride, y_off=y.off, y_stride=y_stride, n=n, rows=rows,
                          scale=scale)
        alg = self._alg("softmax", [act], push, self.caps.wg)
        prog.dispatch(alg, push, self._grid(math.ceil(rows / self.caps.items)),
                      [rows_range(x, rows, x_stride, n)], [rows_range(y, rows, y_stride, n)], label)

    def sigmoid_mul(self, prog: Program, x: Region, x_stride: int, g: Region, g_stride: int, blk: int,
                    g_blk_stride: int, g_step: int, y: Region, y_stride: int, n: int, rows: int,
                    label: str = "sigmoid_mul") -> None:
        """y[r][i] = x[r][i] * sigmoid(g[r][(i // blk) * g_blk_stride + (i % blk) * g_step])."""
        act = self._same_buffer(x, g, y)
        push = self._push("sigmoid_mul", x_off=x.off, x_stride=x_stride, y_off=y.off, y_stride=y_stride, g_off=g.off,
                          g_stride=g_stride, blk=blk, g_blk_stride=g_blk_stride, g_step=g_step, n=n, rows=rows)
        alg = self._alg("sigmoid_mul", [act], push, self.caps.ew_wg, 1)
        gw = (n - 1) // blk * g_blk_stride + (min(blk, n) - 1) * g_step + 1
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n / self.caps.ew_wg)),
                      [rows_range(x, rows, x_stride, n), rows_range(g, rows, g_stride, gw)],
                      [rows_range(y, rows, y_stride, n)], label)

    def copy(self, prog: Program, src: Region, dst: Region, label: str = "copy") -> None:
        """dst = src (word counts a multiple of 4, 16-byte aligned), by a shader."""
        if src.off % 4 or dst.off % 4 or src.words % 4 or dst.words < src.words:
            raise ValueError("copy needs 16-byte aligned regions of whole vec4s")
        n = src.words // 4
        push = self._push("copy", src_off=src.off // 4, dst_off=dst.off // 4, n=n)
        wg = max(self.caps.ew_wg, 256)
        alg = self._alg("copy", [src.buf, dst.buf], push, wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(n / (wg * 4))), [src.range], [dst.range], label)
