"""Kernel wrappers of the hybrid models (Gated DeltaNet linear attention, gated
full attention, mixture of experts): one method per shader, with the
conventions of vkengine/kernels.py (offsets and strides in 32-bit words,
declared reads and writes so that Program records only the barriers needed).

Kept apart from kernels.py so that the llama kernels' module stays small;
HybridKernels is a Kernels with these methods added.
"""
from __future__ import annotations

import math
import struct

from .device import Buffer, Program
from .errors import VkEngineError
from .kernels import Kernels, Matrix, Region, _rows_range

NONE = 0xFFFFFFFF
CONV_KMAX = 8          # KMAX in conv1d.comp
DELTA_MAX_PER_LANE = 16   # MAXE in delta_rule.comp
ROUTER_KMAX = 16       # KMAX in moe_router.comp


def _params_range(params: Buffer, *offs_and_counts: tuple[int, int]) -> list[tuple[Buffer, int, int]]:
    return [(params, o * 4, (o + n) * 4) for o, n in offs_and_counts]


class HybridKernels(Kernels):
    @classmethod
    def like(cls, k: Kernels) -> "HybridKernels":
        """The same device and launch configuration as an existing Kernels."""
        return cls(k.device, k.items, k.ew_wg, k._spirv_cache)

    def conv1d(self, prog: Program, w: Region, x: Region, x_stride: int, y: Region, y_stride: int,
               C: int, K: int, n_rows: int, state: Region, snap: Region | None, snap_rows: int,
               params: Buffer, pos_off: int, slot_off: int, label: str = "conv1d") -> None:
        """y = silu(causal depthwise conv(x)) with the last K-1 inputs per slot in `state`
        ([slot][K-1][C]); with snap_rows > 0 the window after row r goes to snap[r]."""
        if not 1 <= K <= CONV_KMAX:
            raise VkEngineError(f"conv kernel size {K} is not supported (1..{CONV_KMAX})")
        act = self._same_buffer(x, y)
        if snap is not None and snap.buf is not state.buf:
            raise ValueError("conv state and its snapshots must share a buffer")
        slot_stride = (K - 1) * C
        snap_rows = snap_rows if snap is not None else 0
        push = struct.pack("<14I", x.off, x_stride, y.off, y_stride, w.off, C, K, n_rows, state.off, slot_stride,
                           snap.off if snap is not None else 0, snap_rows, pos_off, slot_off)
        alg = self._alg("conv1d", [w.buf, act, params, state.buf], push, self.ew_wg, 1)
        writes = [_rows_range(y, n_rows, y_stride, C), state.range]
        if snap_rows:
            writes.append(snap.range)
        prog.dispatch(alg, push, self._grid(math.ceil(C / self.ew_wg)),
                      [w.range, _rows_range(x, n_rows, x_stride, C), state.range,
                       *_params_range(params, (pos_off, n_rows), (slot_off, n_rows))], writes, label)

    def l2_norm(self, prog: Program, x: Region, x_stride: int, y: Region, y_stride: int, head_dim: int,
                n_heads: int, rows: int, eps: float, label: str = "l2_norm") -> None:
        """y[r][h] = x[r][h] / sqrt(|x[r][h]|^2 + eps) per head (in place allowed)."""
        act = self._same_buffer(x, y)
        push = struct.pack("<7If", x.off, x_stride, y.off, y_stride, head_dim, n_heads, rows, eps)
        alg = self._alg("l2_norm", [act], push, self.wg)
        width = head_dim * n_heads
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n_heads / self.items)),
                      [_rows_range(x, rows, x_stride, width)], [_rows_range(y, rows, y_stride, width)], label)

    def gated_rms_norm(self, prog: Program, w: Region, x: Region, x_stride: int, z: Region, z_stride: int,
                       y: Region, y_stride: int, head_dim: int, n_heads: int, rows: int, eps: float,
                       label: str = "gated_rms_norm") -> None:
        """y[r][h] = rms_norm(x[r][h]) * w * silu(z[r][h]) per head (y may alias x)."""
        act = self._same_buffer(x, z, y)
        push = struct.pack("<10If", x.off, x_stride, z.off, z_stride, y.off, y_stride, w.off, head_dim, n_heads,
                           rows, eps)
        alg = self._alg("gated_rms_norm", [w.buf, act], push, self.wg)
        width = head_dim * n_heads
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n_heads / self.items)),
                      [w.range, _rows_range(x, rows, x_stride, width), _rows_range(z, rows, z_stride, width)],
                      [_rows_range(y, rows, y_stride, width)], label)

    def delta_rule(self, prog: Program, a_log: Region, dt_bias: Region, q: Region, k: Region, v: Region,
                   qkv_stride: int, alpha: Region, beta: Region, ab_stride: int, o: Region, o_stride: int,
                   nk: int, nv: int, dk: int, dv: int, n_rows: int, n_groups: int, state: Region,
                   snap: Region | None, snap_rows: int, params: Buffer, pos_off: int, slot_off: int,
                   tiled: bool, scale: float, label: str = "delta_rule") -> None:
        """Gated delta rule over the rows of up to n_groups sequences (runs of equal
        slots); state [slot][nv][dv][dk] fp32; `a_log` holds A = -exp(A_log)."""
        if dk > DELTA_MAX_PER_LANE * self.sg:
            raise VkEngineError(f"linear-attention key head size {dk} is not supported on subgroups of "
                                f"{self.sg} (at most {DELTA_MAX_PER_LANE * self.sg})")
        if nv % nk:
            raise VkEngineError(f"{nv} value heads do not divide among {nk} key heads")
        if a_log.buf is not dt_bias.buf:
            raise ValueError("A and dt_bias must share a weight buffer")
        act = self._same_buffer(q, k, v, alpha, beta, o)
        if snap is not None and snap.buf is not state.buf:
            raise ValueError("recurrent state and its snapshots must share a buffer")
        snap_rows = snap_rows if snap is not None else 0
        slot_stride = nv * dv * dk
        push = struct.pack("<24If", q.off, k.off, v.off, qkv_stride, alpha.off, beta.off, ab_stride,
                           o.off, o_stride, nk, nv, dk, dv, n_rows, n_groups, a_log.off, dt_bias.off,
                           state.off, slot_stride, snap.off if snap is not None else 0, snap_rows,
                           pos_off, slot_off, int(tiled), scale)
        alg = self._alg("delta_rule", [a_log.buf, act, params, state.buf], push, self.wg)
        reads = [a_log.range, dt_bias.range, _rows_range(q, n_rows, qkv_stride, nk * dk),
                 _rows_range(k, n_rows, qkv_stride, nk * dk), _rows_range(v, n_rows, qkv_stride, nv * dv),
                 _rows_range(alpha, n_rows, ab_stride, nv), _rows_range(beta, n_rows, ab_stride, nv),
                 state.range, *_params_range(params, (pos_off, n_rows), (slot_off, n_rows))]
        writes = [_rows_range(o, n_rows, o_stride, nv * dv), state.range]
        if snap_rows:
            writes.append(snap.range)
        prog.dispatch(alg, push, self._grid(math.ceil(n_groups * nv * dv / self.items)), reads, writes, label)

    def norm_rope_kv(self, prog: Program, table: Region, wq: Region, wk: Region, qkv: Region, qkv_stride: int,
                     q_head_stride: int, k_col: int, v_col: int, q_out: Region, q_stride: int, n_rows: int,
                     n_head: int, n_kv: int, head_dim: int, n_rot: int, k_cache: Region, v_cache: Region,
                     slot_stride: int, params: Buffer, pos_off: int, slot_off: int, eps: float,
                     label: str = "norm_rope_kv") -> None:
        """Per-head RMSNorm (wq, wk) + NEOX RoPE of q and k; q to q_out, k and v (f16)
        into the cache at each row's (slot, position)."""
        if not (table.buf is wq.buf is wk.buf):
            raise ValueError("the RoPE table and the q/k norm weights must share a weight buffer")
        if head_dim % 2 or n_rot % 2 or n_rot > head_dim:
            raise VkEngineError(f"head size {head_dim} with {n_rot} rotated dims is not supported")
        act = self._same_buffer(qkv, q_out)
        kv = self._same_buffer(k_cache, v_cache)
        push = struct.pack("<20If", qkv.off, qkv_stride, q_head_stride, k_col, v_col, q_out.off, q_stride, n_rows,
                           n_head, n_kv, head_dim, n_rot, table.off, wq.off, wk.off, k_cache.off, v_cache.off,
                           slot_stride, pos_off, slot_off, eps)
        alg = self._alg("norm_rope_kv", [table.buf, act, params, kv], push, self.wg)
        width = v_col + n_kv * head_dim
        reads = [table.range, wq.range, wk.range, _rows_range(qkv, n_rows, qkv_stride, width),
                 *_params_range(params, (pos_off, n_rows), (slot_off, n_rows))]
        writes = [_rows_range(q_out, n_rows, q_stride, n_head * head_dim), k_cache.range, v_cache.range]
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * (n_head + 2 * n_kv) / self.items)),
                      reads, writes, label)

    def sigmoid_mul(self, prog: Program, x: Region, x_stride: int, g: Region, g_stride: int, blk: int,
                    g_blk_stride: int, g_step: int, y: Region, y_stride: int, n: int, rows: int,
                    label: str = "sigmoid_mul") -> None:
        """y[r][i] = x[r][i] * sigmoid(g[r][(i // blk) * g_blk_stride + (i % blk) * g_step])."""
        act = self._same_buffer(x, g, y)
        push = struct.pack("<11I", x.off, x_stride, y.off, y_stride, g.off, g_stride, blk, g_blk_stride, g_step,
                           n, rows)
        alg = self._alg("sigmoid_mul", [act], push, self.ew_wg, 1)
        gw = (n - 1) // blk * g_blk_stride + (min(blk, n) - 1) * g_step + 1
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n / self.ew_wg)),
                      [_rows_range(x, rows, x_stride, n), _rows_range(g, rows, g_stride, gw)],
                      [_rows_range(y, rows, y_stride, n)], label)

    def moe_router(self, prog: Program, logits: Region, l_stride: int, y: Region, y_stride: int, E: int, k: int,
                   rows: int, w_scale: float = 1.0, rec: Region | None = None, rec_stride: int = 0,
                   fixed: tuple[Region, Region, int, int] | None = None, label: str = "moe_router") -> None:
        """route[r] = (top-k expert ids, their renormalized softmax weights * w_scale).
        fixed = (f32 router weights (E x D), hidden rows, hidden stride, D): compute
        the logits in a fixed serial order (parity mode) instead of reading them."""
        if not 1 <= k <= min(E, ROUTER_KMAX):
            raise VkEngineError(f"{k} experts per token out of {E} is not supported (at most {ROUTER_KMAX})")
        act = self._same_buffer(logits, y, *([rec] if rec is not None else []))
        w, h, h_stride, D = fixed if fixed is not None else (None, logits, 0, 0)
        if fixed is not None:
            self._same_buffer(h, logits)
        push = struct.pack("<13If", h.off, h_stride, logits.off, l_stride, y.off, y_stride, E, D, k, rows,
                           w.off if w is not None else 0, rec.off if rec is not None else NONE, rec_stride,
                           w_scale)
        wbuf = w.buf if w is not None else act
        name = "moe_router_fixed" if fixed is not None else "moe_router"
        alg = self._alg(name, [wbuf, act], push, self.wg)
        lr = _rows_range(logits, rows, l_stride, E)
        reads = [lr] if fixed is None else [w.range, _rows_range(h, rows, h_stride, D)]
        writes = [_rows_range(y, rows, y_stride, 2 * k)] + ([lr] if fixed is not None else [])
        if rec is not None:
            writes.append(_rows_range(rec, rows, rec_stride, k))
        prog.dispatch(alg, push, self._grid(math.ceil(rows / self.items)), reads, writes, label)

    def mul_mat_id(self, prog: Program, w: Matrix, M: int, x: Region, x_stride: int, x_slot_stride: int,
                   route: Region, route_stride: int, k: int, y: Region, y_stride: int, y_slot_stride: int,
                   n_rows: int, label: str = "", part: tuple[int, int] | None = None) -> None:
        """y[r][i] = W[e_ri] @ x[r][i] (x_slot_stride 0: x[r] for every i), one
        matvec per pair: decode-sized steps. W holds E*M rows (M per expert).
        A stack split across buffers (W.parts of whole experts): one dispatch per
        part, with part = (e_lo, e_hi) of the experts it holds; the pairs routed
        to other experts are left to their parts."""
        if w.parts:
            for r0, pw in w.parts:
                self.mul_mat_id(prog, pw, M, x, x_stride, x_slot_stride, route, route_stride, k, y, y_stride,
                                y_slot_stride, n_rows, label, (r0 // M, (r0 + pw.rows) // M))
            return
        act = self._same_buffer(x, route, y)
        self._check_id(w, M, x, x_stride, x_slot_stride)
        variant = f"mul_mv_id_{w.type}" if part is None else f"mul_mv_idp_{w.type}"
        push = struct.pack("<14I", w.data.off, w.scales.off if w.scales else 0, w.cols, M, k, n_rows,
                           route.off, route_stride, x.off, x_stride, x_slot_stride, y.off, y_stride, y_slot_stride)
        if part is not None:
            push += struct.pack("<2I", *part)
        alg = self._alg(variant, [w.data.buf, act], push, self.wg)
        if n_rows * k > 65535:
            raise VkEngineError(f"{n_rows} rows x {k} experts exceed one dispatch; use a smaller batch")
        reads = w.regions + [_rows_range(x, n_rows, x_stride, (k - 1) * x_slot_stride + w.cols),
                             _rows_range(route, n_rows, route_stride, k)]
        prog.dispatch(alg, push, self._grid(math.ceil(M / self.items), n_rows * k), reads,
                      [_rows_range(y, n_rows, y_stride, (k - 1) * y_slot_stride + M)], label or variant)

    def moe_sort(self, prog: Program, route: Region, route_stride: int, k: int, n_rows: int, E: int,
                 lst: Region, list_stride: int, cnt: Region, label: str = "moe_sort") -> None:
        """Per expert e: lst[j][e] = the j-th pair r*k + i routed to e, cnt[e] = their number."""
        act = self._same_buffer(route, lst, cnt)
        push = struct.pack("<8I", route.off, route_stride, k, n_rows, E, lst.off, list_stride, cnt.off)
        alg = self._alg("moe_sort", [act], push, self.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(E / self.ew_wg)), [_rows_range(route, n_rows, route_stride, k)],
                      [_rows_range(lst, n_rows, list_stride, E), (cnt.buf, cnt.off * 4, (cnt.off + E) * 4)], label)

    def mul_mm_id(self, prog: Program, w: Matrix, M: int, E: int, x: Region, x_stride: int, x_slot_stride: int,
                  lst: Region, list_stride: int, cnt: Region, k: int, y: Region, y_stride: int, y_slot_stride: int,
                  n_rows: int, label: str = "", part: tuple[int, int] | None = None) -> None:
        """The same products as mul_mat_id, expert-major over moe_sort's lists: each
        dequantized weight unit serves up to 8 pairs of its expert (prefill).
        A split stack: one dispatch per part, as mul_mat_id."""
        if w.parts:
            for r0, pw in w.parts:
                self.mul_mm_id(prog, pw, M, E, x, x_stride, x_slot_stride, lst, list_stride, cnt, k, y, y_stride,
                               y_slot_stride, n_rows, label, (r0 // M, (r0 + pw.rows) // M))
            return
        act = self._same_buffer(x, lst, cnt, y)
        self._check_id(w, M, x, x_stride, x_slot_stride)
        variant = f"mul_mm_id_{w.type}" if part is None else f"mul_mm_idp_{w.type}"
        push = struct.pack("<14I", w.data.off, w.scales.off if w.scales else 0, w.cols, M, k, lst.off, list_stride,
                           cnt.off, x.off, x_stride, x_slot_stride, y.off, y_stride, y_slot_stride)
        if part is not None:
            push += struct.pack("<2I", *part)
        alg = self._alg(variant, [w.data.buf, act], push, self.wg)
        reads = w.regions + [_rows_range(x, n_rows, x_stride, (k - 1) * x_slot_stride + w.cols),
                             _rows_range(lst, n_rows, list_stride, E), (cnt.buf, cnt.off * 4, (cnt.off + E) * 4)]
        n_exp = E if part is None else part[1] - part[0]
        prog.dispatch(alg, push, self._grid(math.ceil(M / self.items), n_exp), reads,
                      [_rows_range(y, n_rows, y_stride, (k - 1) * y_slot_stride + M)], label or variant)

    def moe_combine(self, prog: Program, e: Region, e_stride: int, e_slot_stride: int, route: Region,
                    route_stride: int, k: int, y: Region, y_stride: int, D: int, rows: int,
                    label: str = "moe_combine") -> None:
        """y[r] += sum_i route_weight[r][i] * e[r][i] (the residual add of the experts)."""
        act = self._same_buffer(e, route, y)
        push = struct.pack("<10I", e.off, e_stride, e_slot_stride, route.off, route_stride, k, y.off, y_stride, D,
                           rows)
        alg = self._alg("moe_combine", [act], push, self.ew_wg, 1)
        yr = _rows_range(y, rows, y_stride, D)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * D / self.ew_wg)),
                      [_rows_range(e, rows, e_stride, (k - 1) * e_slot_stride + D),
                       _rows_range(route, rows, route_stride, 2 * k), yr], [yr], label)

    @staticmethod
    def _check_id(w: Matrix, M: int, x: Region, x_stride: int, x_slot_stride: int) -> None:
        if x.off % 4 or x_stride % 4 or x_slot_stride % 4 or w.cols % 8 or w.rows % M:
            raise ValueError("expert matmuls need 16-byte aligned x rows, K a multiple of 8 and whole experts")
