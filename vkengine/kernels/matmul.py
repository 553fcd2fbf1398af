"""Matrix products: decode-sized steps on matvecs (mul_mv.comp on lavapipe,
mul_mvk.comp's split-K variants and fused epilogues on GPUs), prompt-sized
steps on tiled matmuls (mul_mt, mul_mc on cooperative matrices, mul_mc2 on
NVIDIA's workgroup-scope ones), with split K (reduce_k) where a tile grid is
small; the x conversions some of them take (quantize_q8, to_f16)."""
from __future__ import annotations

import math

from shaders.variants import (
    MATMUL_COLS,
    MC2_GLU_TILES,
    MC2_GLU_TYPES,
    MC2_K64,
    MC2_SC_F16_UNROLLS,
    MC2_TILES,
    MC2_TYPES,
    MC2H_BIG_TILES,
    MC2H_SMALL_BN,
    MC2H_UNROLL,
    MC_TILE,
    MM_GPU_COLS,
    NORM_PARTS_TYPES,
    ROUTE_TYPES,
    SG_ROWS,
    TILE,
    TILE_SMALL,
    XQ8_TYPES,
    mv_gpu_config,
)

from ..device import Buffer, Program
from ..errors import VkEngineError
from .base import KernelBase
from .types import (
    ConvOut,
    Halves,
    Matrix,
    NormIn,
    NormOut,
    NormParts,
    Q8Out,
    Region,
    RopeOut,
    RouteOut,
    params_range,
    q8_words,
    rows_range,
)

# split K's largest scratch of partial sums (fewer parts beyond), and the
# column multiple of its parts (a multiple of every kernel's K slice and unit span)
SPLIT_K_SCRATCH = 64 << 20     # bytes
SPLIT_K_ALIGN = 256


class MatmulKernels(KernelBase):
    # rows a matvec's fused RMSNorm takes (its last workgroup normalizes them
    # all): at most the 4-column variants, which mul_mvk.comp compiles NORM into
    NORM_MAX_ROWS = 4
    SPLIT_K_ALIGN = SPLIT_K_ALIGN
    SPLIT_K_SCRATCH = SPLIT_K_SCRATCH

    # -- which path a matrix and step take ----------------------------------------
    def tiled(self, w: Matrix, n: int) -> bool:
        """Whether mul_mat takes n rows of x through a tiled matmul (prefill)."""
        tf = self.caps.tiled_from
        return tf is not None and n >= tf and w.cols % 32 == 0

    def split_k_columns(self, n: int, conv: bool = False) -> int:
        """Columns of the split-K variant that takes a step of n rows (mul_mvk: 1):
        at most Caps.mv_cols, the step's rows then in several column groups (grid
        z), except for conv (the "c" variants: a slot's run of rows is one
        invocation's, in order, so all n rows in one group)."""
        if n < self.caps.multi_column_from:
            return 1
        if not conv:
            n = min(n, self.caps.mv_cols)
        return next((c for c in MM_GPU_COLS if c >= n), MM_GPU_COLS[-1])

    def fuses_glu(self, w: Matrix, n: int) -> bool:
        """Whether mul_mat(glu=True) can multiply n rows by this gate|up matrix
        (the split-K matvecs: GPUs, decode-sized steps)."""
        return (self.caps.split_k and not w.parts and not self.tiled(w, n) and w.rows % 2 == 0
                and mv_gpu_config(w.type, self.split_k_columns(n))[0] % 2 == 0)

    def _epilogue_matvec(self, w: Matrix, n: int) -> bool:
        """Whether n rows of w go through a split-K matvec variant compiled with
        the fused epilogues (mul_mvk.comp's NORM_CODE: up to 4 columns)."""
        return (self.caps.split_k and n <= self.NORM_MAX_ROWS and self.split_k_columns(n) <= 4
                and not w.parts and not self.tiled(w, n))

    def fuses_norm(self, w: Matrix, n: int, y: Region, y_stride: int, norm: NormOut) -> bool:
        """Whether mul_mat(accumulate=True, norm=...) can take the RMSNorm of y
        (the split-K matvecs: GPUs, decode steps of up to NORM_MAX_ROWS rows;
        vec4-aligned rows)."""
        return (self._epilogue_matvec(w, n) and w.rows % 4 == 0
                and not (y.off % 4 or y_stride % 4 or norm.h.off % 4 or norm.h_stride % 4 or norm.weight.off % 4)
                and norm.sync.buf is y.buf and norm.h.buf is y.buf)

    def fuses_route(self, w: Matrix, n: int, y: Region, y_stride: int, route: RouteOut) -> bool:
        """Whether mul_mat(route=...) can choose a MoE router's experts from the
        logits it makes (the "r" variants: GPUs, decode steps of up to
        NORM_MAX_ROWS rows, router weight types ROUTE_TYPES; the router's limits:
        k <= ROUTER_KMAX, E <= 64 lanes of the smallest subgroup)."""
        from .moe import ROUTER_KMAX
        E = w.rows
        return (self._epilogue_matvec(w, n) and w.type in ROUTE_TYPES and 1 <= route.k <= min(E, ROUTER_KMAX)
                and E <= 64 * self.min_subgroup() and route.route.buf is y.buf and route.sync.buf is y.buf
                and y_stride >= E)

    def fuses_conv(self, w: Matrix, n: int, y: Region, conv: ConvOut) -> bool:
        """Whether mul_mat(conv=...) can run the conv1d after a Gated DeltaNet
        input projection (the "c" variants: GPUs' decode steps; kernels of up to
        8 taps; the conv's channels the matrix's first rows)."""
        return (self._epilogue_matvec(w, n) and 1 <= conv.K <= 8 and conv.C <= w.rows and conv.y.buf is y.buf
                and (conv.snap is None or conv.snap.buf is conv.state.buf))

    def fuses_bias(self, w: Matrix, n: int) -> bool:
        """Whether mul_mat(bias=...) can add a bias vector to y's rows in its
        epilogue (the split-K matvecs' epilogue variants: GPUs' decode steps),
        what add_bias after it gives, bit for bit."""
        return self._epilogue_matvec(w, n)

    def fuses_gate(self, w: Matrix, n: int) -> bool:
        """Whether mul_mat(gate=...) can scale each column's sums by the sigmoid
        of a gate word: the split-K matvecs (GPUs) at every column count below
        the tiled matmuls, so that a row rounds alike in steps of any size there
        (sigmoid(g) * (W x) is not W (x sigmoid(g)) to the bit: the row counts
        from which kernels change, Kernels.step_thresholds, stay where they were),
        a matrix held in parts too (each part's matvec scales its rows alike)."""
        return self.caps.split_k and not self.tiled(w, n)

    def fuses_norm_in(self, w: Matrix, n: int, slots: Region) -> bool:
        """Whether mul_mat(norm_in=...) can read a NormParts' h' as its norm
        (the split-K matvecs' "n" variants: GPUs, decode-sized steps of any
        width; the sums of squares 16-byte aligned)."""
        return (self.caps.norm_in and self.caps.split_k and not self.tiled(w, n) and w.cols % 16 == 0
                and slots.off % 4 == 0 and slots.words >= n * w.cols // 4)

    def fuses_norm_parts(self, w: Matrix, n: int, y: Region, parts: NormParts) -> bool:
        """Whether mul_mat(accumulate=True, norm_parts=...) can write h' and
        the sums of squares (the "p" variants: weight types whose matvecs take
        4 rows a workgroup at every width, NORM_PARTS_TYPES)."""
        return (self.caps.norm_in and self.caps.split_k and not self.tiled(w, n) and w.type in NORM_PARTS_TYPES
                and w.rows % 4 == 0 and all(part.rows % 4 == 0 for _, part in w.parts)
                and parts.h.buf is y.buf and parts.slots.buf is y.buf and parts.slot_stride * 4 >= w.rows
                and parts.slots.words >= (n - 1) * parts.slot_stride + w.rows // 4)

    def fuses_norm_parts_q8(self, w: Matrix, n: int, q8: Q8Out) -> bool:
        """Whether a "p" producer (fuses_norm_parts) of n rows can also write
        its h' as 8-bit blocks (Q8Out) for an XQ8 reader (Caps.xq8_in)."""
        z = math.ceil(n / self.split_k_columns(n))
        return (self.caps.xq8_in and w.rows % 32 == 0 and not w.parts and q8.q.off % 4 == 0
                and q8.q.buf is q8.sync.buf and q8.sync.words >= z * w.rows // 32
                and q8.q2_off % 4 == 0)

    def takes_q8_in(self, w: Matrix, n: int) -> bool:
        """Whether a gate|up with the SwiGLU (fuses_glu) reading h' can take it
        as a "pq" producer's 8-bit blocks (the XQ8 "nx" variants: Q8_0
        weights, or Q4_0 with Caps.xq8_q4; 16-byte aligned rows)."""
        return (self.caps.xq8_in and w.type in XQ8_TYPES and (w.type != "q4_0" or self.caps.xq8_q4)
                and w.data is not None and w.data.off % 4 == 0
                and w.cols % 32 == 0 and self.fuses_glu(w, n) and not self.tiled(w, n))

    def fuses_rope(self, w: Matrix, n: int, rope: RopeOut) -> bool:
        """Whether mul_mat(rope=...) can take RoPE and the KV-cache write of its
        rows (the split-K matvecs of up to 4 columns: GPUs, decode steps; RoPE
        on adjacent pairs, which a workgroup's even number of rows holds)."""
        return (self._epilogue_matvec(w, n) and not rope.neox and w.rows % 2 == 0 and rope.row0 % 2 == 0
                and rope.n_rot % 2 == 0 and rope.head_dim % 2 == 0
                and mv_gpu_config(w.type, self.split_k_columns(n))[0] % 2 == 0
                and rope.k_cache.buf is rope.v_cache.buf
                and not rope.kv_types.quantized)   # a q8_0 cache is written by rope_kv (its blocks' maxima)

    @staticmethod
    def has_stand_in(shader: str) -> bool:
        """Whether another kernel can be recorded while this one's pipeline builds
        (_mul_tiled's tiles, AttentionKernels.attention's attention_mc2)."""
        return shader.startswith(("mul_mc2", "mul_mt_", "mul_mt64_", "attention_mc2_"))

    def on_coopmat2(self, w: Matrix) -> bool:
        """Whether a prefill-sized mul_mat of w runs mul_mc2: the types and
        sizes where it measured faster (Caps.mc2_types, mc2_from_rows). Its
        loads need the matrix 16-byte aligned (arenas align every array so)."""
        c = self.caps
        return (c.coopmat2 and w.type in c.mc2_types and w.type in MC2_TYPES
                and w.rows >= c.mc2_from_rows and w.data is not None and w.data.off % 4 == 0)

    @property
    def prompt_granule(self) -> int:
        """The widest tile of tokens the tiled matmuls pad a step's rows to
        (mul_mc2's, mul_mc's or mul_mt's, whichever the device runs)."""
        c = self.caps
        if c.coopmat2:
            tiles = (c.mc2h_tiles + (MC2H_BIG_TILES if c.mc2_big_from else ())) if c.mc2_f16acc else MC2_TILES
            return max(bn for _rows, (_bm, bn) in tiles)
        if c.coopmat:
            return MC_TILE[1]
        return 16 * TILE[1]

    def mc2_variant(self, w: Matrix, n: int | None = None) -> tuple[int, int, str]:
        """mul_mc2's BM x BN tile for w and its variant: the first of the tile
        table whose row floor w reaches (fp32 sums: MC2_TILES; fp16 sums:
        Caps.mc2h_tiles), with 64-deep slices where they measured faster
        (MC2_K64) and K is a multiple of 64. n (a step's rows), with
        Caps.mc2_small and fp16 sums: the narrowest of MC2H_SMALL_BN's token
        tiles that holds them, where narrower than the table's."""
        tiles, tag = (self.caps.mc2h_tiles, "h") if self.caps.mc2_f16acc else (MC2_TILES, "")
        if tag and n is not None and self.caps.mc2_big_from and n >= self.caps.mc2_big_from:
            tiles = MC2H_BIG_TILES
        bm, bn = next(t for rows, t in tiles if w.rows >= rows)
        if tag and n is not None and self.caps.mc2_small:
            small = next((b for b in MC2H_SMALL_BN if n <= b), bn)
            if small < bn and (bm, small) in MC2H_UNROLL:
                bn = small
        if (tag and self.caps.mc2_k64 and w.type in MC2_K64["types"] and (bm, bn) in MC2_K64["tiles"]
                and w.cols % 64 == 0):
            tag += "k64"
        if tag and self.caps.mc2_unroll and w.type == "q4_0":
            if self.caps.mc2_unroll not in MC2_SC_F16_UNROLLS:
                raise VkEngineError(f"VKENGINE_MC2_UNROLL={self.caps.mc2_unroll}: one of {MC2_SC_F16_UNROLLS} or 0")
            tag += f"_u{self.caps.mc2_unroll}"
        return bm, bn, f"mul_mc2{tag}_{bm}x{bn}_{w.type}"

    def glu_halves(self, gu: Matrix, down: Matrix, n: int) -> bool:
        """Whether n rows of gate|up (gate over up, 2F rows) with the SwiGLU can
        go out as halves straight into the down projection's x
        (mul_mat_glu_halves, then mul_mat with x_halves): Caps.mc2_glu, both on
        mul_mc2 with fp16 sums for these rows, a GLU tile for gate|up
        (MC2_GLU_TILES) whose tokens are as wide as down's, F a multiple of 8,
        and neither pipeline still compiling."""
        c = self.caps
        if not (c.mc2_glu and c.mc2_f16acc and gu.type in MC2_GLU_TYPES and not gu.parts and not down.parts
                and gu.rows % 16 == 0 and down.cols == gu.rows // 2 and self.tiled(gu, n) and self.tiled(down, n)
                and self.on_coopmat2(gu) and self.on_coopmat2(down)):
            return False
        bm, bn, v_glu = self._glu_variant(gu, n)
        _, bn_down, v_down = self.mc2_variant(down, n)
        return ((bm, bn) in MC2_GLU_TILES and bn_down == bn and not self.device.is_slow(v_glu)
                and not self.device.is_slow(v_down))

    def _glu_variant(self, w: Matrix, n: int) -> tuple[int, int, str]:
        """mc2_variant's tile for n rows of w and the name of its GLU form
        (compiled for MC2_GLU_TILES only: glu_halves checks the tile)."""
        bm, bn, _ = self.mc2_variant(w, n)
        return bm, bn, f"mul_mc2hg_{bm}x{bn}_{w.type}"

    def mul_mat_glu_halves(self, prog: Program, w: Matrix, x: Region, x_stride: int, n: int,
                           label: str = "") -> Halves:
        """silu(gate @ x[c]) * (up @ x[c]) for c < n (w: gate over up, where
        glu_halves says), written as halves in mul_mc2's layout for the next
        mul_mat's x (its x_halves): mul_mc2.comp's GLU variant, after to_f16 of
        x. The rows past n (up to the token tile) are zeros."""
        assert w.data is not None
        bm, bn, variant = self._glu_variant(w, n)   # (a GLU tile: glu_halves said so for these rows)
        F = w.rows // 2
        gm, gn = math.ceil(F / (bm // 2)), math.ceil(n / bn)
        n_pad = gn * bn
        xh = self._x_to_halves(prog, x, x_stride, w.cols, n, n_pad)
        out = Halves(self._scratch(self._x16g, n_pad * F // 2, "x16g"), F, F, n, n_pad)
        push = self._push(variant, w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=w.rows,
                          N=n_pad, x_off=0, x_stride=xh.stride, y_off=0, y_stride=F, accumulate=0)
        alg = self._alg_spec(variant, [w.data.buf, xh.buf, out.buf], (), push)
        prog.dispatch(alg, push, (gm, gn, 1), w.regions + [xh.range], [out.range], label or variant)
        return out

    def _x_to_halves(self, prog: Program, x: Region, x_stride: int, cols: int, n: int, n_pad: int) -> Halves:
        """mul_mc2's x: the n rows of x as halves (to_f16.comp: rows of a
        multiple of 8, zero rows up to n_pad) in the x16 scratch."""
        stride8 = math.ceil(cols / 8)
        buf = self._scratch(self._x16, n_pad * stride8 * 4, "x16")
        self.to_f16(prog, x, x_stride, cols, n, n_pad, buf)
        return Halves(buf, cols, stride8 * 8, n, n_pad)

    def split_k_parts(self, groups: int, K: int, n: int, M: int) -> tuple[int, int]:
        """(parts, columns per part) for a tiled matmul of `groups` tile
        workgroups over K columns (n rows of M outputs): (1, 0) for no split."""
        c = self.caps
        if c.split_k_wgs <= 0 or groups >= c.split_k_wgs:
            return 1, 0
        parts = min(math.ceil(c.split_k_wgs / groups), K // max(c.split_k_min, self.SPLIT_K_ALIGN),
                    self.SPLIT_K_SCRATCH // max(1, 4 * n * M))
        if parts <= 1:
            return 1, 0
        klen = math.ceil(K / parts / self.SPLIT_K_ALIGN) * self.SPLIT_K_ALIGN
        parts = math.ceil(K / klen)
        return (parts, klen) if parts > 1 else (1, 0)

    def scratch_bytes_bound(self, max_rows: int, max_cols: int) -> int:
        """An upper bound of the device memory _scratch takes for steps of up to
        max_rows rows of matrices of up to max_cols columns: split K's partial
        sums (at most SPLIT_K_SCRATCH), mul_mc2's halves of x (rows padded to
        its widest token tile, 256) and the XQ8 matvecs' 8-bit x, where this
        device runs them."""
        c = self.caps
        total = 0
        if c.xq8:   # x as 8-bit blocks for the matvec steps (below the tiled threshold)
            rows = max_rows if c.tiled_from is None else min(max_rows, c.tiled_from - 1)
            total += q8_words(rows, max_cols) * 4
        if c.tiled_from is None or max_rows < c.tiled_from:
            return total
        total += self.SPLIT_K_SCRATCH if c.split_k_wgs > 0 else 0
        if c.coopmat2:
            total += math.ceil(max_rows / 256) * 256 * math.ceil(max_cols / 8) * 16
            if c.mc2_glu:   # (the SwiGLU's halves: F <= the down projection's K <= max_cols)
                total += math.ceil(max_rows / 256) * 256 * max_cols * 2
        return total

    # -- the product -----------------------------------------------------------------
    def mul_mat(self, prog: Program, w: Matrix, x: Region, x_stride: int, y: Region, y_stride: int,
                n: int, accumulate: bool = False, label: str = "", glu: bool = False,
                norm: NormOut | None = None, rope: RopeOut | None = None, no_epilogues: bool = False,
                norm_in: NormIn | None = None, norm_parts: NormParts | None = None,
                route: RouteOut | None = None, gate: tuple[Region, int] | None = None,
                conv: ConvOut | None = None, bias: Region | None = None,
                x_halves: Halves | None = None) -> None:
        """y[c][:M] (+)= W @ x[c][:K] for c < n (x rows K floats, y rows M floats).
        x_halves: x is those halves (mul_mat_glu_halves' output, where
        glu_halves said so for this matrix), not x's floats.
        glu: W is gate over up (M = 2F) and y[c][:F] = silu(gate @ x[c]) * (up @ x[c])
        (only where fuses_glu). norm (with accumulate, where fuses_norm): then
        norm.h[c] = rms_norm(y[c]) * norm.weight, as rms_norm gives it. rope
        (where fuses_rope): rope_kv's writes instead of y's, as it gives them.
        norm_parts (with accumulate, where fuses_norm_parts): also the h' and
        sums of squares of the RMSNorm after y (NormParts). norm_in (where
        fuses_norm_in): x is such an h', and W @ rms_norm(y[c]) * weight is
        what the matvec gives (with glu or rope too). no_epilogues: the caller
        never fuses a norm or RoPE into this matrix, at any step size. Such a
        matrix, and a gate|up with glu, may take the XQ8 variants (which have
        no epilogue but the SwiGLU) and then take them at every step size, so
        batched rows still equal single ones. route (where fuses_route, nothing
        else fused): y is a MoE router's logits, and each row's top-k experts
        and weights go to route.route as moe_router writes them. gate = (g, stride)
        (where fuses_gate; with accumulate and nothing else): y[c] (+)= sigmoid(g[c
        * stride]) * (W @ x[c]), Qwen3.5's gated shared expert."""
        if gate is not None and (glu or norm is not None or rope is not None or norm_in is not None
                                 or norm_parts is not None or route is not None or not self.fuses_gate(w, n)
                                 or gate[0].buf is not y.buf):
            raise ValueError("mul_mat: this matrix and step cannot take the sigmoid gate")
        if conv is not None and (accumulate or glu or norm is not None or rope is not None or norm_in is not None
                                 or norm_parts is not None or route is not None or gate is not None
                                 or not self.fuses_conv(w, n, y, conv)):
            raise ValueError("mul_mat: this matrix and step cannot run the conv1d after it")
        if bias is not None and (glu or rope is not None or conv is not None or norm_parts is not None
                                 or bias.words < w.rows or not self.fuses_bias(w, n)):
            raise ValueError("mul_mat: this matrix and step cannot add the bias")
        if route is not None and (accumulate or glu or norm is not None or rope is not None or norm_in is not None
                                  or norm_parts is not None or not self.fuses_route(w, n, y, y_stride, route)):
            raise ValueError("mul_mat: this matrix and step cannot choose the router's experts")
        if glu and (accumulate or not self.fuses_glu(w, n)):
            raise ValueError("mul_mat: this matrix and step cannot fuse the gated linear unit")
        if norm is not None and (not accumulate or glu or not self.fuses_norm(w, n, y, y_stride, norm)):
            raise ValueError("mul_mat: this matrix and step cannot fuse the RMSNorm")
        if rope is not None and (accumulate or glu or norm is not None or not self.fuses_rope(w, n, rope)):
            raise ValueError("mul_mat: this matrix and step cannot fuse RoPE")
        if no_epilogues and (norm is not None or rope is not None):
            raise ValueError("mul_mat: no_epilogues with a norm or RoPE")
        if norm_in is not None and (norm is not None or not self.fuses_norm_in(w, n, norm_in.slots)):
            raise ValueError("mul_mat: this matrix and step cannot take the RMSNorm of its input")
        if norm_parts is not None and (not accumulate or glu or rope is not None or norm is not None
                                       or norm_in is not None or not self.fuses_norm_parts(w, n, y, norm_parts)):
            raise ValueError("mul_mat: this matrix and step cannot write the RMSNorm's parts")
        if norm_parts is not None and norm_parts.q8 is not None and not self.fuses_norm_parts_q8(w, n, norm_parts.q8):
            raise ValueError("mul_mat: this matrix and step cannot write the RMSNorm's parts as 8-bit blocks")
        if norm_in is not None and norm_in.q8 is not None and not (glu and self.takes_q8_in(w, n)):
            raise ValueError("mul_mat: this matrix and step cannot read x as a producer's 8-bit blocks")
        if x_halves is not None and (glu or norm is not None or rope is not None or norm_in is not None
                                     or norm_parts is not None or route is not None or gate is not None
                                     or conv is not None or bias is not None or w.parts or not self.tiled(w, n)
                                     or x_halves.cols != w.cols or x_halves.n != n):
            raise ValueError("mul_mat: this matrix and step cannot read x as mul_mat_glu_halves' halves")
        if w.parts:       # split by rows: each part fills its rows of y
            for r0, part in w.parts:
                self.mul_mat(prog, part, x, x_stride, y.at(r0, max(0, y.words - r0)), y_stride, n, accumulate,
                             f"{label or 'mul_mat'}[{r0}:{r0 + part.rows}]", no_epilogues=no_epilogues,
                             norm_in=norm_in, norm_parts=norm_parts.rows_from(r0) if norm_parts else None,
                             gate=gate)
            return
        assert w.data is not None
        act = self._same_buffer(x, y, *([rope.q_out] if rope is not None else []))
        if x.off % 4 or x_stride % 4 or w.cols % 8:
            raise ValueError("mul_mat needs 16-byte aligned x rows and K a multiple of 8")
        if self.tiled(w, n):   # (no epilogues there: fuses_glu/norm/rope exclude tiled steps)
            self._mul_tiled(prog, w, x, x_stride, y, y_stride, n, accumulate, act, label, x_halves)
            return
        c = self.caps
        # XQ8 only where no norm or RoPE is ever fused (its variants have none):
        # the SwiGLU's gate|up and matrices the caller marks (the output head)
        # (its loads of 16 weights need 16-byte aligned rows: every arena array is)
        xq8 = (c.split_k and c.xq8 and w.type in XQ8_TYPES and (glu or no_epilogues)
               and w.data.off % 4 == 0 and norm_in is None)
        pc: dict[str, int | float] = dict(
            w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=w.rows, N=n, x_off=x.off,
            x_stride=x_stride, y_off=y.off, y_stride=y_stride,
            flags=int(accumulate) | (2 if glu else 0) | (4 if norm is not None else 0) | (8 if rope is not None else 0)
            | (16 if gate is not None else 0) | (32 if bias is not None else 0))
        if norm_in is not None:   # (the "nx" variants add the producer's sums a block)
            pc.update(sync_off=norm_in.q8.s_off if norm_in.q8 is not None else norm_in.slots.off, eps=norm_in.eps)
        elif norm_parts is not None:
            pc.update(h_off=norm_parts.h.off, h_stride=norm_parts.h_stride, nw_off=norm_parts.weight.off,
                      sync_off=norm_parts.slots.off)
        elif norm is not None:
            pc.update(h_off=norm.h.off, h_stride=norm.h_stride, nw_off=norm.weight.off, sync_off=norm.sync.off,
                      eps=norm.eps)
        pq = norm_parts.q8 if norm_parts is not None else None
        if pq is not None:   # the "pq" variants: its offsets in the RoPE words (mul_mvk.comp's PQ_OFF ...)
            pc.update(rope_row0=pq.q.off, n_q=pq.d_off, n_k=pq.sync.off, head_dim=pq.s_off, n_rot=pq.q2_off)
        elif norm_in is not None and norm_in.q8 is not None:   # "nx": the second plane (XQ2_OFF)
            pc.update(rope_row0=norm_in.q8.q2_off)
        elif conv is not None:   # (mul_mvk.comp's CONV_C ...: the RoPE words)
            cv = conv
            pc.update(n_q=cv.C, n_k=cv.K, q_off=cv.y.off, q_stride=cv.y_stride, table_off=cv.weight.off,
                      k_off=cv.state.off, slot_stride=(cv.K - 1) * cv.C, v_off=cv.snap.off if cv.snap else 0,
                      kv_row_words=cv.snap_rows if cv.snap else 0, pos_off=cv.pos_off, slot_off=cv.slot_off)
        elif gate is not None:   # (mul_mvk.comp's GATE: the RoPE words)
            pc.update(rope_row0=gate[0].off, n_q=gate[1])
        elif route is not None:   # (mul_mvk.comp's ROUTE_OFF ...: the RoPE words, and eps)
            pc.update(rope_row0=route.route.off, n_q=route.route_stride, n_k=route.k, eps=route.w_scale,
                      sync_off=route.sync.off)
        elif rope is not None:
            r = rope
            pc.update(rope_row0=r.row0, n_q=r.n_head * r.head_dim, n_k=r.n_kv * r.head_dim, head_dim=r.head_dim,
                      n_rot=r.n_rot, table_off=r.table.off, q_off=r.q_out.off, q_stride=r.q_stride,
                      k_off=r.k_cache.off, v_off=r.v_cache.off, slot_stride=r.slot_stride,
                      kv_row_words=r.n_kv * r.head_dim // 2, pos_off=r.pos_off, slot_off=r.slot_off)
        yr = rows_range(y, n, y_stride, w.rows // 2 if glu else w.rows)
        reads = w.regions + [rows_range(x, n, x_stride, w.cols)] + ([yr] if accumulate else [])
        writes = [yr]
        if norm_in is not None and norm_in.q8 is None:   # the producer's sums of squares
            s0 = norm_in.slots.off
            reads.append((norm_in.slots.buf, s0 * 4, (s0 + n * w.cols // 4) * 4))
        if norm_parts is not None:
            s0, ss = norm_parts.slots.off, norm_parts.slot_stride
            reads.append(norm_parts.weight.at(0, w.rows).range)
            writes += [rows_range(norm_parts.h, n, norm_parts.h_stride, w.rows),
                       (norm_parts.slots.buf, s0 * 4, (s0 + (n - 1) * ss + w.rows // 4) * 4)]
            if pq is not None:   # the blocks, their scales and the counters
                writes += [rows_range(pq.q, n, w.rows // 4, w.rows // 4),
                           (pq.q.buf, pq.q2_off * 4, (pq.q2_off + n * w.rows // 4) * 4),
                           (pq.q.buf, pq.d_off * 4, (pq.d_off + n * w.rows // 32) * 4),
                           (pq.q.buf, pq.s_off * 4, (pq.s_off + n * w.rows // 32) * 4), pq.sync.range]
        xq8_in = norm_in.q8 if norm_in is not None else None
        if xq8_in is not None:   # the producer's blocks and scales
            reads += [rows_range(xq8_in.q, n, w.cols // 4, w.cols // 4),
                      (xq8_in.q.buf, xq8_in.q2_off * 4, (xq8_in.q2_off + n * w.cols // 4) * 4),
                      (xq8_in.q.buf, xq8_in.d_off * 4, (xq8_in.d_off + n * w.cols // 32) * 4),
                      (xq8_in.q.buf, xq8_in.s_off * 4, (xq8_in.s_off + n * w.cols // 32) * 4)]
        if norm is not None:
            reads += [norm.weight.range, norm.sync.range]
            writes += [rows_range(norm.h, n, norm.h_stride, w.rows), norm.sync.range]
        if route is not None:
            writes += [rows_range(route.route, n, route.route_stride, 2 * route.k), route.sync.range]
        if gate is not None:
            reads.append(rows_range(gate[0], n, gate[1], 1))
        if bias is not None:   # (mul_mvk.comp's BIAS: binding 4 at table_off)
            pc["table_off"] = bias.off
            reads.append(bias.at(0, w.rows).range)
        if conv is not None:
            reads += [conv.weight.range, conv.state.range,
                      *params_range(conv.params, (conv.pos_off, n), (conv.slot_off, n))]
            writes += [rows_range(conv.y, n, conv.y_stride, conv.C), conv.state.range]
            if conv.snap is not None and conv.snap_rows:
                writes.append(conv.snap.range)
        if rope is not None:   # q rows of q_out (all of them: conservative), the caches
            r = rope
            reads += [r.table.range, (r.params, min(r.pos_off, r.slot_off) * 4, (max(r.pos_off, r.slot_off) + n) * 4)]
            writes = [rows_range(r.q_out, n, r.q_stride, r.n_head * r.head_dim), r.k_cache.range, r.v_cache.range]
        single = n < c.multi_column_from
        if c.split_k:
            ncols = self.split_k_columns(n, conv is not None)
            tag = "b" if c.bfly else ""
            variant = f"mul_mvk{tag}_{w.type}" if single else f"mul_mm{tag}{ncols}_{w.type}"
            rows_per_wg = mv_gpu_config(w.type, ncols)[0]   # the workgroup shares its rows' K
        elif single:
            variant, ncols, rows_per_wg = f"mul_mv_{w.type}", 1, c.items * SG_ROWS
        else:
            variant, ncols, rows_per_wg = f"mul_mm_{w.type}", MATMUL_COLS, c.items * SG_ROWS
        bufs = [w.data.buf, act, act]
        if c.split_k:   # bindings 3-6: the fused RMSNorm's weight, RoPE's table, params and
            # KV cache (any buffer when unused)
            nw = norm.weight if norm is not None else norm_parts.weight if norm_parts is not None else \
                conv.weight if conv is not None else None
            bufs.append(nw.buf if nw is not None else w.data.buf)
            bufs += [rope.table.buf, rope.params, rope.k_cache.buf] if rope is not None else \
                [w.data.buf, conv.params, w.data.buf] if conv is not None else \
                [bias.buf if bias is not None else w.data.buf] + [w.data.buf] * 2
            if xq8_in is not None:   # binding 7: x as the producer's 8-bit blocks (the "nx" variants)
                variant = variant.replace(f"_{w.type}", f"nx_{w.type}")
                pc.update(xq_off=xq8_in.q.off, xd_off=xq8_in.d_off)
                bufs.append(xq8_in.q.buf)
            elif xq8:   # binding 7: x as 8-bit blocks, quantized here
                qbuf = self._scratch(self._xq, q8_words(n, w.cols), "xq")
                reads.append(self.quantize_q8(prog, x, x_stride, w.cols, n, qbuf))
                variant = variant.replace(f"_{w.type}", f"x_{w.type}")
                pc.update(xq_off=0, xd_off=n * w.cols // 4)
                bufs.append(qbuf)
            elif norm_in is not None:   # the "n" variants
                variant = variant.replace(f"_{w.type}", f"n_{w.type}")
            elif route is not None:   # the "r" variants
                variant = variant.replace(f"_{w.type}", f"r_{w.type}")
            elif conv is not None:   # the "c" variants; binding 8: the conv state (7 unused)
                variant = variant.replace(f"_{w.type}", f"c_{w.type}")
                bufs += [w.data.buf, conv.state.buf]
            elif norm_parts is not None:   # the "p" variants ("pq": and h' as 8-bit blocks)
                variant = variant.replace(f"_{w.type}", f"{'pq' if pq is not None else 'p'}_{w.type}")
                pc.update(sq_stride=norm_parts.slot_stride)
        push = self._push(variant, **pc)
        if conv is not None:   # (CONV_PRE: the columns' slot windows loaded first, Caps.conv_pre)
            alg = self._alg_spec(variant, bufs, (c.wg, rows_per_wg, int(c.conv_pre)), push)
        else:
            alg = self._alg(variant, bufs, push, c.wg, rows_per_wg)
        # glu: a workgroup takes rows_per_wg / 2 gate rows and the same up rows
        row_groups = math.ceil(w.rows // 2 / (rows_per_wg // 2)) if glu else math.ceil(w.rows / rows_per_wg)
        groups = self._grid(row_groups, math.ceil(n / ncols))
        prog.dispatch(alg, push, groups, reads, writes, label or variant)

    def _mul_tiled(self, prog: Program, w: Matrix, x: Region, x_stride: int, y: Region, y_stride: int, n: int,
                   accumulate: bool, act: Buffer, label: str, x_halves: Halves | None = None) -> None:
        """mul_mat of a prefill-sized step: tiles of mul_mc2, mul_mc or mul_mt,
        the latter two with K split across grid z where the tile grid is small
        (split_k_parts). x_halves: mul_mc2 reads those (mul_mat's)."""
        assert w.data is not None
        mc2 = self.on_coopmat2(w)
        if mc2 and self.device.is_slow(self.mc2_variant(w, n)[2]):   # still compiling (Device.settle): mul_mc meanwhile
            mc2 = False
            self.substituted += 1
        if x_halves is not None and not mc2:   # (glu_halves checked both pipelines: they do not go back to compiling)
            raise ValueError("mul_mat: x as halves needs the matrix on mul_mc2")
        if mc2:
            bm, bn, variant = self.mc2_variant(w, n)
        elif self.caps.coopmat:
            (bm, bn), variant = MC_TILE[:2], f"mul_mc_{w.type}"
        else:
            small = math.ceil(w.rows / (16 * TILE[0])) * math.ceil(n / (16 * TILE[1])) < self.caps.small_tiles_below
            if self.device.is_slow(f"mul_mt64_{w.type}" if small else f"mul_mt_{w.type}"):
                small = not small   # the other tile while this one compiles (either multiplies any shape)
                self.substituted += 1
            tile, variant = (TILE_SMALL, f"mul_mt64_{w.type}") if small else (TILE, f"mul_mt_{w.type}")
            bm, bn = 16 * tile[0], 16 * tile[1]
        yr = rows_range(y, n, y_stride, w.rows)
        gm, gn = math.ceil(w.rows / bm), math.ceil(n / bn)
        # mul_mc2 does not split K: with K ranges from a push constant its
        # tensor loads ran at half speed (notes.md run 12)
        parts, klen = (1, 0) if mc2 else self.split_k_parts(gm * gn, w.cols, n, w.rows)
        if parts > 1:   # partial sums to a scratch of their own, then reduce_k into y
            out = self._scratch(self._parts, parts * n * w.rows, "parts")
            out_off, out_stride, out_acc = 0, w.rows, False
            out_range = (out, 0, parts * n * w.rows * 4)
        else:
            out, out_off, out_stride, out_acc, out_range = y.buf, y.off, y_stride, accumulate, yr
        pc = dict(w_off=w.data.off, w_off2=w.scales.off if w.scales else 0, K=w.cols, M=w.rows, N=n, x_off=x.off,
                  x_stride=x_stride, y_off=out_off, y_stride=out_stride, accumulate=int(out_acc))
        name = label or variant
        if mc2:
            # x as halves (mul_mat's x_halves, its rows padded to this tile's tokens: glu_halves; else x
            # converted, zero rows up to whole tiles), whose offset and stride replace x's
            if x_halves is not None and x_halves.n_pad != gn * bn:
                raise ValueError("mul_mat: x's halves are not padded to this matrix's token tile")
            xh = x_halves if x_halves is not None else self._x_to_halves(prog, x, x_stride, w.cols, n, gn * bn)
            pc.update(x_off=0, x_stride=xh.stride)
            bufs, reads = [w.data.buf, xh.buf, out], w.regions + [xh.range]
        else:
            pc.update(klen=klen, z_stride=n * w.rows)
            bufs, reads = [w.data.buf, act, out], w.regions + [rows_range(x, n, x_stride, w.cols)]
        push = self._push(variant, **pc)
        alg = self._alg_spec(variant, bufs, (), push)
        prog.dispatch(alg, push, (gm, gn, parts), reads + ([yr] if out_acc else []), [out_range], name)
        if parts > 1:
            self._reduce_k(prog, parts, out, w.rows, n, yr, y.off, y_stride, accumulate, name)

    def _reduce_k(self, prog: Program, parts: int, part_buf: Buffer, M: int, n: int, yr: tuple, y_off: int,
                  y_stride: int, accumulate: bool, label: str) -> None:
        """y[c][:M] (+)= the sum of split K's parts (reduce_k.comp)."""
        push = self._push("reduce_k", parts=parts, z_stride=n * M, M=M, N=n, y_off=y_off, y_stride=y_stride,
                          accumulate=int(accumulate))
        alg = self._alg("reduce_k", [part_buf, yr[0]], push, self.caps.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(n * M / self.caps.ew_wg)),
                      [(part_buf, 0, parts * n * M * 4)] + ([yr] if accumulate else []), [yr], f"{label} reduce_k")

    # -- x conversions -----------------------------------------------------------------
    def quantize_q8(self, prog: Program, x: Region, x_stride: int, cols: int, n: int,
                    out: Buffer) -> tuple[Buffer, int, int]:
        """out (from word 0) = the n rows of x as 8-bit blocks of 32 (quantize_q8.comp:
        n * cols / 4 words of int8, then n * cols / 32 scales). Returns the byte
        range written."""
        if cols % 32 or x.off % 4 or x_stride % 4:
            raise ValueError("quantize_q8 needs 32-value blocks and 16-byte aligned rows")
        push = self._push("quantize_q8", x_off=x.off, x_stride=x_stride, K=cols, rows=n, q_off=0, d_off=n * cols // 4)
        alg = self._alg("quantize_q8", [x.buf, out], push, self.caps.ew_wg, 1)
        qr = (out, 0, q8_words(n, cols) * 4)
        prog.dispatch(alg, push, self._grid(math.ceil(n * cols // 32 / self.caps.ew_wg)),
                      [rows_range(x, n, x_stride, cols)], [qr], "quantize_q8")
        return qr

    def to_f16(self, prog: Program, x: Region, x_stride: int, cols: int, n: int, n_pad: int,
               out: Buffer) -> tuple[Buffer, int, int]:
        """out (from byte 0) = the n rows of x as halves, in rows of cols rounded
        up to 8 halves, zeros past cols and in rows n .. n_pad. Returns the
        byte range written."""
        stride8 = math.ceil(cols / 8)
        push = self._push("to_f16", x_off=x.off, x_stride=x_stride, cols=cols, rows=n, rows_pad=n_pad, h_off8=0,
                          h_stride8=stride8)
        alg = self._alg("to_f16", [x.buf, out], push, self.caps.ew_wg, 1)
        hr = (out, 0, n_pad * stride8 * 16)
        prog.dispatch(alg, push, self._grid(math.ceil(n_pad * stride8 / self.caps.ew_wg)),
                      [rows_range(x, n, x_stride, cols)], [hr], "to_f16")
        return hr
