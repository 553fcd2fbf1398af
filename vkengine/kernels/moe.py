"""Mixtures of experts: the router's top-k (moe_router.comp), the experts'
products one matvec per (row, expert) pair (mul_mv_id.comp: decode) or
expert-major over lists of the pairs routed to each expert (moe_sort.comp,
mul_mm_id.comp: prompt steps; with Caps.expert_tiles, the tiled matmuls'
MUL_ID variants over moe_sort's work list of (expert, block of its pairs):
mul_mc_id on cooperative matrices, mul_mt_id elsewhere), and the weighted sum
into the residual (moe_combine.comp). A layer's expert stack larger than one
storage buffer is held in parts of whole experts, one dispatch each."""
from __future__ import annotations

import math

from shaders.variants import MC_ID_TILE, TILE_SMALL, VARIANTS

from ..device import Program
from ..errors import VkEngineError
from .base import KernelBase
from .types import NO_MAP, Matrix, NormOut, Region, rows_range

ROUTER_KMAX = 16       # MOE_ROUTE_KMAX in moe_route.glsl
MM_ID_COLS = 8         # NCOLS in mul_mm_id.comp: the pairs of an expert one pass over its rows serves


class MoeKernels(KernelBase):
    def moe_bias(self, prog: Program, b: Region, M: int, route: Region, route_stride: int, k: int, y: Region,
                 y_stride: int, y_slot_stride: int, rows: int, label: str = "moe_bias") -> None:
        """y[r][i][:M] += b[e_ri] (each routed expert's bias row; b: E x M)."""
        act = self._same_buffer(route, y)
        push = self._push("moe_bias", b_off=b.off, M=M, route_off=route.off, route_stride=route_stride, k=k,
                          y_off=y.off, y_stride=y_stride, y_slot_stride=y_slot_stride, rows=rows)
        alg = self._alg("moe_bias", [b.buf, act], push, self.caps.ew_wg, 1)
        span = (k - 1) * y_slot_stride + M
        prog.dispatch(alg, push, self._grid(math.ceil(rows * k * M / self.caps.ew_wg)),
                      [b.range, rows_range(route, rows, route_stride, k), rows_range(y, rows, y_stride, span)],
                      [rows_range(y, rows, y_stride, span)], label)

    def moe_router(self, prog: Program, logits: Region, l_stride: int, y: Region, y_stride: int, E: int, k: int,
                   rows: int, w_scale: float = 1.0, rec: Region | None = None, rec_stride: int = 0,
                   fixed: tuple[Region, Region, int, int] | None = None, label: str = "moe_router") -> None:
        """route[r] = (top-k expert ids, their renormalized softmax weights * w_scale).
        fixed = (f32 router weights (E x D), hidden rows, hidden stride, D): compute
        the logits in a fixed serial order (parity mode) instead of reading them."""
        if not 1 <= k <= min(E, ROUTER_KMAX):
            raise VkEngineError(f"{k} experts per token out of {E} is not supported (at most {ROUTER_KMAX})")
        sg = self.min_subgroup()   # (lane j's experts j, j + S, ... in a 64-bit mask)
        if E > 64 * sg:
            raise VkEngineError(f"{E} experts: this device's router handles at most {64 * sg} "
                                f"(64 a lane of its {sg}-lane subgroups)")
        act = self._same_buffer(logits, y, *([rec] if rec is not None else []))
        w, h, h_stride, D = fixed if fixed is not None else (None, logits, 0, 0)
        if fixed is not None:
            self._same_buffer(h, logits)
        name = "moe_router_fixed" if fixed is not None else "moe_router"
        push = self._push(name, h_off=h.off, h_stride=h_stride, l_off=logits.off, l_stride=l_stride, y_off=y.off,
                          y_stride=y_stride, E=E, D=D, k=k, rows=rows, w_off=w.off if w is not None else 0,
                          rec_off=rec.off if rec is not None else NO_MAP, rec_stride=rec_stride, w_scale=w_scale)
        alg = self._alg(name, [w.buf if w is not None else act, act], push, self.caps.wg)
        lr = rows_range(logits, rows, l_stride, E)
        reads = [lr] if w is None else [w.range, rows_range(h, rows, h_stride, D)]
        writes = [rows_range(y, rows, y_stride, 2 * k)] + ([lr] if fixed is not None else [])
        if rec is not None:
            writes.append(rows_range(rec, rows, rec_stride, k))
        prog.dispatch(alg, push, self._grid(math.ceil(rows / self.caps.items)), reads, writes, label)

    def mul_mat_id(self, prog: Program, w: Matrix, M: int, x: Region, x_stride: int, x_slot_stride: int,
                   route: Region, route_stride: int, k: int, y: Region, y_stride: int, y_slot_stride: int,
                   n_rows: int, label: str = "", part: tuple[int, int] | None = None, epilogue: str = "",
                   norm: NormOut | None = None, bias: Region | None = None,
                   oai: tuple[float, float] | None = None) -> None:
        """y[r][i] = W[e_ri] @ x[r][i] (x_slot_stride 0: x[r] for every i), one
        matvec per pair: decode-sized steps. W holds E*M rows (M per expert).
        A stack split across buffers (W.parts of whole experts): one dispatch per
        part, with part = (e_lo, e_hi) of the experts it holds; the pairs routed
        to other experts are left to their parts.
        epilogue "glu": each expert's rows are gate over up, y[r][i][:M/2] =
        silu(gate @ x) * (up @ x); "combine": y[r] += sum_i weight_ri * W[e_ri] @
        x[r][i] (moe_combine's sum, the weights at route[r][k + i]), y_slot_stride
        unused. Neither on a stack split across buffers. norm (with "combine"):
        also norm.h[r] = rms_norm(y[r]) * norm.weight, by the row's last
        workgroup (norm.sync: n_rows zeroed words of y's buffer, a row's counter
        each, left zero). bias (with an
        epilogue): each expert's bias row (E x M floats) added to its sums first,
        as moe_bias after the plain matvec; oai = (alpha, limit) (with "glu"):
        gpt-oss's clamped SwiGLU, as swiglu's."""
        if (bias is not None and not epilogue) or (oai is not None and epilogue != "glu"):
            raise ValueError("expert biases go with an epilogue, the clamped SwiGLU with glu")
        if epilogue not in ("", "glu", "combine"):
            raise ValueError(f"unknown expert matvec epilogue {epilogue!r}")
        if w.parts:
            if epilogue:
                raise ValueError("expert matvec epilogues need the stack in one buffer")
            for r0, pw in w.parts:
                self.mul_mat_id(prog, pw, M, x, x_stride, x_slot_stride, route, route_stride, k, y, y_stride,
                                y_slot_stride, n_rows, label, (r0 // M, (r0 + pw.rows) // M))
            return
        assert w.data is not None
        act = self._same_buffer(x, route, y)
        self._check_id(w, M, x, x_stride, x_slot_stride)
        if epilogue == "glu" and M % 2:
            raise ValueError(f"a gate|up expert of {M} rows")
        if norm is not None and not self.combine_takes_norm(M, y, y_stride, norm):
            raise ValueError("the expert matvec's norm needs rows of a multiple of 4 floats, 16-byte aligned, and "
                             "h and its counter in y's buffer")
        if norm is not None and epilogue != "combine":
            raise ValueError("only the combined down projection takes the norm")
        if norm is not None and norm.sync.words < n_rows:
            raise ValueError(f"the combined down projection's norm counts each of its {n_rows} rows on a word of "
                             f"norm.sync ({norm.sync.words})")
        if epilogue == "combine" and k > ROUTER_KMAX:
            raise VkEngineError(f"{k} experts a row: the combined down projection takes at most {ROUTER_KMAX}")
        kind = {"": "id", "glu": "idg", "combine": "idc"}[epilogue]
        unroll = "4" if self.caps.mvid_unroll else ""
        variant = f"mul_mv_{kind}{unroll}_{w.type}" if part is None else f"mul_mv_idp_{w.type}"
        # the split-K form (mul_mvk_id.comp): a workgroup takes RPS weight rows (glu: RPS / 2 outputs)
        items, wg = self.caps.items, self.caps.wg
        if epilogue and self.caps.mvid_splitk:
            base = f"mul_mvk{'b' if self.caps.bfly else ''}_{kind}"
            variant = f"{base}_{w.type}"
            more = self.caps.mvid_glu_rows if epilogue == "glu" else self.caps.mvid_combine_rows
            # (the butterfly reduction needs a lane a row: more rows than a subgroup's lanes keep MVID_ROWS's)
            if more and f"{base}r{more}_{w.type}" in VARIANTS and not (self.caps.bfly and more > self.caps.sg):
                variant = f"{base}r{more}_{w.type}"
            items = VARIANTS[variant][1]["RPS"] // (2 if epilogue == "glu" else 1)
            if epilogue == "glu" and self.caps.mvid_glu_wg:
                wg = self.caps.mvid_glu_wg
        pc: dict[str, int | float] = dict(
            w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=M, k=k, n_rows=n_rows,
            ids_off=route.off, ids_stride=route_stride, x_off=x.off, x_stride=x_stride, x_slot_stride=x_slot_stride,
            y_off=y.off, y_stride=y_stride, y_slot_stride=y_slot_stride)
        if part is not None:
            pc.update(e_lo=part[0], e_hi=part[1])
        bufs = [w.data.buf, act]
        if epilogue == "combine":
            pc.update(norm=(1 if self.caps.cn_rows else 2) if norm is not None else 0,
                      sync_off=norm.sync.off if norm else 0, nw_off=norm.weight.off if norm else 0,
                      h_off=norm.h.off if norm else 0,
                      h_stride=norm.h_stride if norm else 0, eps=norm.eps if norm else 0.0)
            bufs += [act, norm.weight.buf if norm else act]
        elif epilogue == "glu":
            pc.update(oai=int(oai is not None), alpha=oai[0] if oai else 0.0, limit=oai[1] if oai else 0.0)
            bufs += [act, act]   # (bindings 2 and 3 unused)
        if epilogue:   # binding 4: the experts' biases (unused without)
            pc.update(b_off=bias.off if bias is not None else 0xFFFFFFFF)
            bufs.append(bias.buf if bias is not None else act)
        push = self._push(variant, **pc)
        alg = self._alg(variant, bufs, push, wg, items)
        if n_rows * k > 65535:
            raise VkEngineError(f"{n_rows} rows x {k} experts exceed one dispatch; use a smaller batch")
        reads = w.regions + [rows_range(x, n_rows, x_stride, (k - 1) * x_slot_stride + w.cols),
                             rows_range(route, n_rows, route_stride, 2 * k if epilogue == "combine" else k)]
        if bias is not None:
            reads.append(bias.range)
        if epilogue == "combine":
            yr = rows_range(y, n_rows, y_stride, M)
            writes = [yr]
            if norm is not None:
                reads += [norm.weight.range, norm.sync.range]
                writes += [rows_range(norm.h, n_rows, norm.h_stride, M), norm.sync.range]
            prog.dispatch(alg, push, self._grid(math.ceil(M / items), n_rows), reads + [yr], writes,
                          label or variant)
            return
        out_rows = M // 2 if epilogue == "glu" else M
        prog.dispatch(alg, push, self._grid(math.ceil(out_rows / items), n_rows * k), reads,
                      [rows_range(y, n_rows, y_stride, (k - 1) * y_slot_stride + out_rows)], label or variant)

    def combine_takes_norm(self, M: int, y: Region, y_stride: int, norm: NormOut) -> bool:
        """Whether mul_mat_id(epilogue="combine", norm=...) can take the RMSNorm
        after its residual add: on devices whose rms_norm runs a workgroup a row
        (rms_norm_wg: GPUs, Caps.split_k), whose arithmetic the epilogue
        repeats, so that h is bit for bit the unfused ops'; 16-byte aligned
        rows."""
        return (self.caps.split_k and M % 4 == 0 and not (y.off % 4 or y_stride % 4 or norm.h.off % 4
                                                          or norm.h_stride % 4 or norm.weight.off % 4)
                and norm.sync.buf is y.buf and norm.h.buf is y.buf)

    def moe_sort(self, prog: Program, route: Region, route_stride: int, k: int, n_rows: int, E: int,
                 lst: Region, list_stride: int, cnt: Region, blocks: tuple[Region, int] | None = None,
                 label: str = "moe_sort") -> None:
        """Per expert e: lst[j][e] = the j-th pair r*k + i routed to e (in increasing
        order), cnt[e] = their number (one subgroup per expert). blocks = (region,
        bn): also the tiled expert matmuls' work list there, words enough for
        expert_blocks(n_rows * k, E, bn) + 1, in increasing (expert, block) order
        (a second dispatch, one workgroup: moe_sort.comp BLOCKS)."""
        act = self._same_buffer(route, lst, cnt, *([blocks[0]] if blocks else []))
        counts = (cnt.buf, cnt.off * 4, (cnt.off + E) * 4)
        pc = dict(ids_off=route.off, ids_stride=route_stride, k=k, n_rows=n_rows, E=E, list_off=lst.off,
                  list_stride=list_stride, cnt_off=cnt.off)
        push = self._push("moe_sort", **pc)
        alg = self._alg("moe_sort", [act], push, self.caps.wg)
        prog.dispatch(alg, push, self._grid(math.ceil(E / self.caps.items)),
                      [rows_range(route, n_rows, route_stride, k)], [rows_range(lst, n_rows, list_stride, E), counts],
                      label)
        if blocks is not None:
            b, bn = blocks
            push = self._push("moe_sort_blocks", **pc, bn=bn, blocks_off=b.off)
            alg = self._alg("moe_sort_blocks", [act], push, self.caps.ew_wg, 1)
            prog.dispatch(alg, push, (1, 1, 1), [counts],
                          [(b.buf, b.off * 4, (b.off + 1 + self.expert_blocks(n_rows * k, E, bn)) * 4)],
                          "moe_blocks")

    @staticmethod
    def expert_blocks(pairs: int, E: int, bn: int) -> int:
        """The most (expert, block of bn pairs) entries of a work list of `pairs`
        pairs: every expert's partial block beside the whole ones."""
        return math.ceil(pairs / bn) + min(E, pairs)

    def expert_tile(self, w: Matrix) -> tuple[str, int, int] | None:
        """(variant, BM, BN) of the tiled expert matmul of w on this device, or
        None where prompt steps keep mul_mm_id (Caps.expert_tiles off, a CPU, or
        a stack split across buffers)."""
        c = self.caps
        if not c.expert_tiles or c.tiled_from is None or w.parts:
            return None
        if c.coopmat:
            return f"mul_mc_id_{w.type}", MC_ID_TILE[0], MC_ID_TILE[1]
        return f"mul_mt_id_{w.type}", 16 * TILE_SMALL[0], 16 * TILE_SMALL[1]

    def mul_tiled_id(self, prog: Program, w: Matrix, M: int, E: int, x: Region, x_stride: int, x_slot_stride: int,
                     lst: Region, list_stride: int, cnt: Region, blocks: Region, k: int, y: Region, y_stride: int,
                     y_slot_stride: int, n_rows: int, label: str = "") -> None:
        """mul_mm_id's products in tiles (expert_tile's variant): grid y walks
        moe_sort's work list in `blocks` (made for this variant's BN)."""
        tile = self.expert_tile(w)
        if tile is None:
            raise ValueError("no tiled expert matmul for this matrix on this device (expert_tile)")
        variant, bm, bn = tile
        assert w.data is not None
        act = self._same_buffer(x, lst, cnt, blocks, y)
        self._check_id(w, M, x, x_stride, x_slot_stride)
        pc = dict(w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=M, N=0, x_off=x.off,
                  x_stride=x_stride, y_off=y.off, y_stride=y_stride, k=k, list_off=lst.off, list_stride=list_stride,
                  cnt_off=cnt.off, blocks_off=blocks.off, x_slot_stride=x_slot_stride, y_slot_stride=y_slot_stride)
        push = self._push(variant, **pc)
        alg = self._alg_spec(variant, [w.data.buf, act, act], (), push)
        n_blocks = self.expert_blocks(n_rows * k, E, bn)
        reads = w.regions + [rows_range(x, n_rows, x_stride, (k - 1) * x_slot_stride + w.cols),
                             rows_range(lst, n_rows, list_stride, E), (cnt.buf, cnt.off * 4, (cnt.off + E) * 4),
                             (blocks.buf, blocks.off * 4, (blocks.off + 1 + n_blocks) * 4)]
        prog.dispatch(alg, push, (math.ceil(M / bm), n_blocks, 1), reads,
                      [rows_range(y, n_rows, y_stride, (k - 1) * y_slot_stride + M)], label or variant)

    def mul_mm_id(self, prog: Program, w: Matrix, M: int, E: int, x: Region, x_stride: int, x_slot_stride: int,
                  lst: Region, list_stride: int, cnt: Region, k: int, y: Region, y_stride: int, y_slot_stride: int,
                  n_rows: int, label: str = "", part: tuple[int, int] | None = None,
                  blocks: Region | None = None) -> None:
        """The same products as mul_mat_id, expert-major over moe_sort's lists: each
        dequantized weight unit serves up to 8 pairs of its expert (prefill).
        A split stack: one dispatch per part, as mul_mat_id. blocks: grid z
        walks moe_sort's work list of (expert, block of MM_ID_COLS pairs) in it
        instead of every expert (decode steps of several rows: Caps.expert_union)."""
        if blocks is not None and w.parts:
            raise ValueError("a stack split across buffers takes mul_mm_id without a work list")
        if w.parts:
            for r0, pw in w.parts:
                self.mul_mm_id(prog, pw, M, E, x, x_stride, x_slot_stride, lst, list_stride, cnt, k, y, y_stride,
                               y_slot_stride, n_rows, label, (r0 // M, (r0 + pw.rows) // M))
            return
        assert w.data is not None
        act = self._same_buffer(x, lst, cnt, y)
        self._check_id(w, M, x, x_stride, x_slot_stride)
        variant = (f"mul_mm_idb_{w.type}" if blocks is not None else
                   f"mul_mm_id_{w.type}" if part is None else f"mul_mm_idp_{w.type}")
        pc = dict(w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=M, k=k, list_off=lst.off,
                  list_stride=list_stride, cnt_off=cnt.off, x_off=x.off, x_stride=x_stride,
                  x_slot_stride=x_slot_stride, y_off=y.off, y_stride=y_stride, y_slot_stride=y_slot_stride)
        if part is not None:
            pc.update(e_lo=part[0], e_hi=part[1])
        reads = w.regions + [rows_range(x, n_rows, x_stride, (k - 1) * x_slot_stride + w.cols),
                             rows_range(lst, n_rows, list_stride, E), (cnt.buf, cnt.off * 4, (cnt.off + E) * 4)]
        n_exp = E if part is None else part[1] - part[0]
        if blocks is not None:
            pc.update(blocks_off=blocks.off)
            n_exp = self.expert_blocks(n_rows * k, E, MM_ID_COLS)
            reads.append((blocks.buf, blocks.off * 4, (blocks.off + 1 + n_exp) * 4))
        push = self._push(variant, **pc)
        alg = self._alg(variant, [w.data.buf, act], push, self.caps.wg)
        prog.dispatch(alg, push, self._grid(math.ceil(M / self.caps.items), n_exp), reads,
                      [rows_range(y, n_rows, y_stride, (k - 1) * y_slot_stride + M)], label or variant)

    def moe_combine(self, prog: Program, e: Region, e_stride: int, e_slot_stride: int, route: Region,
                    route_stride: int, k: int, y: Region, y_stride: int, D: int, rows: int,
                    label: str = "moe_combine") -> None:
        """y[r] += sum_i route_weight[r][i] * e[r][i] (the residual add of the experts)."""
        act = self._same_buffer(e, route, y)
        push = self._push("moe_combine", e_off=e.off, e_stride=e_stride, e_slot_stride=e_slot_stride,
                          route_off=route.off, route_stride=route_stride, k=k, y_off=y.off, y_stride=y_stride, D=D,
                          rows=rows)
        alg = self._alg("moe_combine", [act], push, self.caps.ew_wg, 1)
        yr = rows_range(y, rows, y_stride, D)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * D / self.caps.ew_wg)),
                      [rows_range(e, rows, e_stride, (k - 1) * e_slot_stride + D),
                       rows_range(route, rows, route_stride, 2 * k), yr], [yr], label)

    @staticmethod
    def _check_id(w: Matrix, M: int, x: Region, x_stride: int, x_slot_stride: int) -> None:
        if x.off % 4 or x_stride % 4 or x_slot_stride % 4 or w.cols % 8 or w.rows % M:
            raise ValueError("expert matmuls need 16-byte aligned x rows, K a multiple of 8 and whole experts")
