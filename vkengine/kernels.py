"""One Python function per shader: picks the variant, packs the push-constant
struct (the field order of the shader's `P` block), sizes the grid and declares
what the dispatch reads and writes so that Program records only the barriers
that are needed.

Conventions: every offset and stride is in 32-bit words of its buffer.
Activations, the params buffer and the KV cache are float/uint arrays; weights
are in weight buffers in the layouts of shaders/quant.glsl.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from shaders.variants import (ATTN_MC_HEAD_DIMS, ATTN_MC_NSG, MATMUL_COLS, MC2_ENGINE_TYPES, MC2_F32_FROM_ROWS,
                              MC2_FROM_ROWS, MC2_TILES, MC2_TYPES, MC2H_TILES, MC_TILE, MM_GPU_COLS, MV_BFLY_LANES,
                              NORM_PARTS_TYPES, SG_ROWS, TILE, TILE_SMALL, UNIT_VALUES, XQ8_TYPES, mv_gpu_config)

from . import spirv
from .device import Buffer, Device, Program
from .errors import VkEngineError

NO_MAP = 0xFFFFFFFF


@dataclass(frozen=True)
class Region:
    """`words` 32-bit words of `buf` starting at word `off`."""
    buf: Buffer
    off: int
    words: int

    def at(self, off: int, words: int) -> "Region":
        return Region(self.buf, self.off + off, words)

    @property
    def range(self) -> tuple[Buffer, int, int]:
        return (self.buf, self.off * 4, (self.off + self.words) * 4)


@dataclass(frozen=True)
class Matrix:
    """A weight matrix (rows x cols) on the device in one of quant.glsl's layouts:
    `data` holds the values (or quant blocks), `scales` the per-block scales of
    the repacked types (None otherwise); both lie in the same buffer.
    A matrix larger than the device's storage-buffer range is split by rows:
    `parts` = (first row, matrix of the following rows) and data is None; mul_mat
    and get_rows dispatch once per part."""
    type: str
    rows: int
    cols: int
    data: Region | None
    scales: Region | None = None
    parts: tuple[tuple[int, "Matrix"], ...] = ()

    @property
    def regions(self) -> list[tuple[Buffer, int, int]]:
        if self.parts:
            return [r for _, m in self.parts for r in m.regions]
        r = [self.data.range]
        if self.scales is not None:
            r.append(self.scales.range)
        return r


@dataclass(frozen=True)
class NormOut:
    """What mul_mat's fused RMSNorm writes: h[r] = rms_norm(y[r]) * weight, h
    rows `h_stride` apart; `sync` is a zeroed word of the activation buffer
    that the matvec's workgroups count themselves on."""
    weight: Region
    h: Region
    h_stride: int
    sync: Region
    eps: float


@dataclass(frozen=True)
class NormParts:
    """What a residual add's matvec writes for the RMSNorm after it (the "p"
    variants): h'[r] = y[r] * weight (rows h_stride apart) and, per row r,
    the sums of y[r]'s squares 4 values at a time into `slots` (r *
    slot_stride words on; slot_stride = M / 4), for the matvecs that read h'
    (NormIn)."""
    weight: Region
    h: Region
    h_stride: int
    slots: Region
    slot_stride: int
    q8: "Q8Out | None" = None   # h' also as 8-bit blocks (the "pq" variants; Kernels.xq8_in)

    def rows_from(self, r0: int) -> "NormParts":
        """what a part of the matrix from row r0 (a multiple of 4) writes"""
        return NormParts(self.weight.at(r0, self.weight.words - r0), self.h.at(r0, max(0, self.h.words - r0)),
                         self.h_stride, self.slots.at(r0 // 4, self.slots.words - r0 // 4), self.slot_stride)


@dataclass(frozen=True)
class Q8Out:
    """h' (NormParts) as 8-bit blocks of 32 values for an XQ8 reader
    (Kernels.xq8_in), in two planes: row r's int8 words from q.off + r * M /
    4 and, what those leave in steps of a 254th of the block's scale, from
    q2_off + r * M / 4; its scales (floats) from d_off + r * M / 32 and its
    sums of squares a block from s_off + r * M / 32, all in q's buffer (the
    activation buffer); `sync` holds a zeroed word per block of 32 rows and
    grid z of the producer (M / 32 * max rows words at most), which its
    workgroups count themselves on."""
    q: Region
    q2_off: int
    d_off: int
    s_off: int
    sync: Region


@dataclass(frozen=True)
class NormIn:
    """What a matvec reading h' (NormParts) needs to take x[r] as
    rms_norm(y[r]) * weight (the "n" variants): the sums of squares; q8:
    where the producer also wrote h' as 8-bit blocks (the XQ8 "nx" variants
    read those)."""
    slots: Region
    eps: float
    q8: Q8Out | None = None


@dataclass(frozen=True)
class RopeOut:
    """What mul_mat's fused RoPE writes instead of y (rope_kv's work): y's rows
    are rows row0.. of each step row's qkv vector [q (n_head heads) | k (n_kv
    heads) | v (n_kv heads)]; q rows RoPE'd (adjacent pairs) to q_out, k rows
    RoPE'd and v rows as they are into the caches at the step row's (slot,
    position) from params, as f16 pairs."""
    row0: int
    neox: bool     # pairs half a head apart (the fused path takes adjacent pairs only)
    n_head: int
    n_kv: int
    head_dim: int
    n_rot: int
    table: Region
    q_out: Region
    q_stride: int
    k_cache: Region
    v_cache: Region
    slot_stride: int
    params: Buffer
    pos_off: int
    slot_off: int


def _rows_range(r: Region, n_rows: int, stride: int, width: int) -> tuple[Buffer, int, int]:
    """Byte range touched by n_rows rows of `width` words, `stride` apart."""
    if n_rows <= 0:
        return (r.buf, r.off * 4, r.off * 4)
    return (r.buf, r.off * 4, (r.off + (n_rows - 1) * stride + width) * 4)


def q8_words(n: int, cols: int) -> int:
    """Words of n rows of `cols` values as 8-bit blocks (quantize_q8.comp): the
    int8 values, 4 a word, then a float scale per 32."""
    return n * (cols // 4 + cols // 32)


# Split K of small tiled matmuls (Kernels.split_k_parts): the workgroups a
# matmul's grid should reach, and the fewest K columns a part takes.
SPLIT_K_WGS = 256
SPLIT_K_MIN = 512


class Kernels:
    """Kernel launcher for one device."""

    def __init__(self, device: Device, items_per_wg: int = 4, elementwise_wg: int = 64,
                 spirv_cache: Path | None = None, tiled_from: int | None = -1):
        """tiled_from: batch size (tokens) from which matmuls use the shared-memory
        tiled kernel; None never (default on CPU devices such as lavapipe, where
        barrier() is slow), -1 picks the default (64 on GPUs). Below it, batches
        use the multi-column matvec, whose per-token arithmetic does not depend
        on the batch: decode rows give the same results batched or alone."""
        self.device = device
        self.sg = device.info.subgroup_size
        self.items = items_per_wg
        self.wg = self.sg * items_per_wg
        self.ew_wg = max(elementwise_wg, self.sg)
        self.max_x = device.info.max_workgroup_count[0]
        self._spirv_cache = spirv_cache
        if tiled_from == -1:
            tiled_from = None if device.info.type == "cpu" else 64
        self.tiled_from = tiled_from
        # split-K attention pays off where many subgroups run at once (GPUs);
        # lavapipe runs a handful, and each extra dispatch costs it more
        self.split_attention = device.info.type != "cpu"
        # The 8-column matmul reuses each dequantized weight for 8 tokens, which
        # pays on GPUs (bandwidth). On lavapipe its accumulators spill out of the
        # CPU's vector registers: 2 rows cost 6x one row (tiny model), and it only
        # breaks even from 8 rows; below that every column runs the
        # single-column kernel (grid z = n). Both walk a row in the same order,
        # so results do not depend on which one ran.
        self.multi_column_from = 8 if device.info.type == "cpu" else 2
        # GPUs: matvecs split each row group's K across a whole workgroup
        # (mul_mvk, and mul_mm{2,4,8} for batches of 2..8 rows and beyond, 8 at a
        # time), which keeps more loads in flight than a subgroup per row group;
        # lavapipe keeps the subgroup kernels (mul_mv, mul_mm): barrier() is slow there
        self.split_k = device.info.type != "cpu"
        # their butterfly-reduced twins where every subgroup has a lane for each
        # of a workgroup's sums (both the 1- and the n-column variants, so that
        # a row sums in one order batched or alone)
        self.bfly = device.info.subgroups_fixed and self.sg >= MV_BFLY_LANES
        # tiled matmuls whose 128 x 128 grid has fewer workgroups than this use
        # 64 x 64 tiles (4x the workgroups; a GPU has ~100 compute units)
        self.small_tiles_below = 256
        # the tiled matmuls on cooperative matrices (mul_mc: fp16 tiles, fp32
        # sums) where the device multiplies 16 x 16 x 16 f16 subgroup matrices
        # and runs 8 subgroups of 32 lanes a workgroup; VKENGINE_COOPMAT=0 keeps
        # the fp32 kernels (to measure the gain)
        info = device.info
        self.coopmat = (self.tiled_from is not None and os.environ.get("VKENGINE_COOPMAT", "1") != "0"
                        and {"cooperativeMatrix", "shaderFloat16"} <= set(device.features)
                        and info.COOPMAT_F16 in info.cooperative_matrix
                        and info.subgroups_fixed and self.sg == 32 and info.max_shared_memory >= 32 * 1024)
        # and, where the device has NVIDIA's workgroup-scope matrices with
        # tensor-addressed loads (VK_NV_cooperative_matrix2), mul_mc2 for the
        # weight types it decodes; VKENGINE_COOPMAT2=0 keeps mul_mc (to measure
        # the gain). Its x goes through halves in a scratch buffer of its own.
        self.coopmat2 = (self.coopmat and os.environ.get("VKENGINE_COOPMAT2", "1") != "0"
                         and self.device_has_coopmat2(device))
        self._x16: list[Buffer] = []   # the scratch buffers (the last is the largest)
        # Split K: a tiled matmul whose tile grid has fewer workgroups than
        # split_k_wgs (a GPU runs ~100+ at once) cuts K into parts of at least
        # split_k_min columns, run as grid z and added by reduce_k.comp, up to
        # split_k_wgs workgroups in all (a short prompt's 64 rows make a 1B
        # model's 2048-row matrices a grid of 32). VKENGINE_SPLITK_WGS=0 turns
        # it off (to measure the gain).
        self.split_k_wgs = int(os.environ.get("VKENGINE_SPLITK_WGS", SPLIT_K_WGS))
        self.split_k_min = int(os.environ.get("VKENGINE_SPLITK_MIN", SPLIT_K_MIN))
        self._parts: list[Buffer] = []   # their partial sums' scratch buffers (the last is the largest)
        # XQ8: Q8_0 matvecs (split-K variants) on integer dot products, x
        # quantized to 8-bit blocks first (quantize_q8.comp, a dispatch).
        # Opt-in (VKENGINE_XQ8=1). Only matrices that never fuse a norm or
        # RoPE take it (gate|up, the output head; mul_mat): its variants have
        # no such epilogues, which made it slower than the float kernel on the
        # H200 (notes.md run 16). Without them (run 17, 1B Q8_0, the split norm
        # off) the 4-row step went 1.40 -> 1.33 ms but the 1-row step lost 2%
        # (the quantize dispatches); h's blocks written by the fused norm
        # instead (removed since) made the 4-row step 1.65 ms. With the split
        # RMSNorm (norm_in) gate|up reads a norm's h' and stays float, so only
        # the head takes it
        self.xq8 = (self.split_k and "shaderIntegerDotProduct" in getattr(device, "features", ())
                    and os.environ.get("VKENGINE_XQ8", "0") == "1")
        # NORM_IN: on decode-sized steps the RMSNorm after a residual add is
        # split between the add's matvec (norm_parts: y * weight and sums of
        # 4 squares) and the matvecs that read it (norm_in: they add the sums
        # and scale their results), instead of the add's fused norm, whose last
        # workgroup normalizes every row alone (notes.md run 17).
        # VKENGINE_NORM_IN=0 keeps the fused norm (to measure the gain)
        self.norm_in = self.split_k and os.environ.get("VKENGINE_NORM_IN", "1") != "0"
        # XQ8_IN: with the split norm, the producer of gate|up's input (the
        # attention output's residual add, a "pq" variant) also writes h' as
        # two planes of 8-bit blocks (the last workgroup of each 32 rows,
        # which also adds the block's sums of squares), and a Q8_0 gate|up
        # takes them through the XQ8 "nx" variants: integer dot products, no
        # quantize dispatch, a 32nd of the sums to add. H200, 1B Q8_0 (notes.md
        # run 23): decode steps of 4 rows 1.22-1.24 -> 1.16 ms, 8 rows 2.16 ->
        # 1.97, 16 rows 3.52 -> 3.05; 1 row within noise (GPU time +1%); the
        # same parity figures against llama.cpp as the float path (one plane
        # alone: mean KL 9x, teacher-forced top-1 below 99%).
        # VKENGINE_XQ8_IN=0 keeps it float
        self.xq8_in = (self.norm_in and "shaderIntegerDotProduct" in getattr(device, "features", ())
                       and os.environ.get("VKENGINE_XQ8_IN", "1") != "0")
        self._xq: list[Buffer] = []   # x's 8-bit blocks (the last is the largest)
        # for which matrices (tests widen both to every type and size it takes)
        # (VKENGINE_MC2_FROM_ROWS=<rows> moves the threshold, to measure a rule)
        self.mc2_types = MC2_ENGINE_TYPES
        # with fp16 sums, as llama.cpp's Vulkan backend multiplies quantized
        # weights on these devices by default; VKENGINE_MC2_F16ACC=0 keeps fp32
        # sums (and mul_mc2 where it measured faster with those)
        self.mc2_f16acc = os.environ.get("VKENGINE_MC2_F16ACC", "1") != "0"
        self.mc2_from_rows = int(os.environ.get("VKENGINE_MC2_FROM_ROWS",
                                                MC2_FROM_ROWS if self.mc2_f16acc else MC2_F32_FROM_ROWS))
        self.mc2h_tiles = MC2H_TILES   # (from rows, tile), widest first
        # and prompt-sized attention on them (attention_mc, 24-32 KB of shared
        # memory); VKENGINE_ATTN_MC=0 keeps attention.comp (to measure the gain)
        self.attention_mc = info.max_shared_memory >= 36 * 1024 and os.environ.get("VKENGINE_ATTN_MC", "1") != "0"
        # (bench/attn_probe.py tries other variants and head sizes)
        self.attention_mc_variant, self.attention_mc_head_dims = "attention_mc_d{hd}", ATTN_MC_HEAD_DIMS
        self.attention_mc_nsg = ATTN_MC_NSG

    COOPMAT2_FEATURES = frozenset({"cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                                   "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads",
                                   "bufferDeviceAddress", "vulkanMemoryModel"})

    @classmethod
    def device_has_coopmat2(cls, device: Device) -> bool:
        """Whether the device was created with everything mul_mc2 needs (whatever
        VKENGINE_COOPMAT2 says: tests and probes ask the device)."""
        return cls.COOPMAT2_FEATURES <= set(device.features)

    # -- helpers -----------------------------------------------------------
    def _alg(self, name: str, buffers: list[Buffer], push: bytes, wg: int, items: int | None = None):
        spv = spirv.spirv(name, self._spirv_cache)
        return self.device.algorithm(name, spv, buffers, (wg, items or self.items), len(push))

    def _grid(self, n_groups: int, z: int = 1) -> tuple[int, int, int]:
        if n_groups <= self.max_x:
            return (n_groups, 1, z)
        return (self.max_x, math.ceil(n_groups / self.max_x), z)

    @staticmethod
    def _same_buffer(*regions: Region) -> Buffer:
        b = regions[0].buf
        if any(r.buf is not b for r in regions):
            raise ValueError("these operands must live in the same activation buffer")
        return b

    # -- ops ---------------------------------------------------------------
    def tiled(self, w: Matrix, n: int) -> bool:
        """Whether mul_mat takes n rows of x through the shared-memory matmul (prefill)."""
        return self.tiled_from is not None and n >= self.tiled_from and w.cols % 32 == 0

    def fuses_glu(self, w: Matrix, n: int) -> bool:
        """Whether mul_mat(glu=True) can multiply n rows by this gate|up matrix
        (the split-K matvecs: GPUs, decode-sized steps)."""
        return (self.split_k and not w.parts and not self.tiled(w, n) and w.rows % 2 == 0
                and mv_gpu_config(w.type, self.split_k_columns(n))[0] % 2 == 0)

    # Rows a matvec's fused RMSNorm takes: its last workgroup normalizes them all,
    # one pass per 4 rows, while the separate rms_norm runs a workgroup per row
    # in parallel. Not measured apart (H200, 1B Q8_0 server at 16 sequences:
    # 2,684 tok/s with the norm fused, 2,656 with it separate; both below the
    # 3,030 of an earlier run, cause not found)
    NORM_MAX_ROWS = 4   # at most the 4-column variants (mul_mv.comp compiles NORM into NCOLS <= 4 only)

    def split_k_columns(self, n: int) -> int:
        """Columns of the split-K variant that takes a step of n rows (mul_mvk: 1)."""
        return 1 if n < self.multi_column_from else next((c for c in MM_GPU_COLS if c >= n), MM_GPU_COLS[-1])

    def _epilogue_matvec(self, w: Matrix, n: int) -> bool:
        """Whether n rows of w go through a split-K matvec variant compiled with
        the fused epilogues (mul_mv.comp's NORM_CODE: up to 4 columns)."""
        return (self.split_k and n <= self.NORM_MAX_ROWS and self.split_k_columns(n) <= 4
                and not w.parts and not self.tiled(w, n))

    def fuses_norm(self, w: Matrix, n: int, y: Region, y_stride: int, norm: NormOut) -> bool:
        """Whether mul_mat(accumulate=True, norm=...) can take the RMSNorm of y
        (the split-K matvecs: GPUs, decode steps of up to NORM_MAX_ROWS rows;
        vec4-aligned rows)."""
        return (self._epilogue_matvec(w, n) and w.rows % 4 == 0
                and not (y.off % 4 or y_stride % 4 or norm.h.off % 4 or norm.h_stride % 4 or norm.weight.off % 4)
                and norm.sync.buf is y.buf and norm.h.buf is y.buf)

    def fuses_norm_in(self, w: Matrix, n: int, slots: Region) -> bool:
        """Whether mul_mat(norm_in=...) can read a NormParts' h' as its norm
        (the split-K matvecs' "n" variants: GPUs, decode-sized steps of any
        width; the sums of squares 16-byte aligned)."""
        return (self.norm_in and self.split_k and not self.tiled(w, n) and w.cols % 16 == 0
                and slots.off % 4 == 0 and slots.words >= n * w.cols // 4)

    def fuses_norm_parts(self, w: Matrix, n: int, y: Region, parts: NormParts) -> bool:
        """Whether mul_mat(accumulate=True, norm_parts=...) can write h' and
        the sums of squares (the "p" variants: weight types whose matvecs take
        4 rows a workgroup at every width, NORM_PARTS_TYPES)."""
        return (self.norm_in and self.split_k and not self.tiled(w, n) and w.type in NORM_PARTS_TYPES
                and w.rows % 4 == 0 and all(part.rows % 4 == 0 for _, part in w.parts)
                and parts.h.buf is y.buf and parts.slots.buf is y.buf and parts.slot_stride * 4 >= w.rows
                and parts.slots.words >= (n - 1) * parts.slot_stride + w.rows // 4)

    def fuses_norm_parts_q8(self, w: Matrix, n: int, q8: Q8Out) -> bool:
        """Whether a "p" producer (fuses_norm_parts) of n rows can also write
        its h' as 8-bit blocks (Q8Out) for an XQ8 reader (xq8_in)."""
        z = math.ceil(n / self.split_k_columns(n))
        return (self.xq8_in and w.rows % 32 == 0 and not w.parts and q8.q.off % 4 == 0
                and q8.q.buf is q8.sync.buf and q8.sync.words >= z * w.rows // 32
                and q8.q2_off % 4 == 0)

    def takes_q8_in(self, w: Matrix, n: int) -> bool:
        """Whether a gate|up with the SwiGLU (fuses_glu) reading h' can take it
        as a "pq" producer's 8-bit blocks (the XQ8 "nx" variants: Q8_0
        weights, 16-byte aligned rows)."""
        return (self.xq8_in and w.type in XQ8_TYPES and not w.parts and w.data.off % 4 == 0
                and w.cols % 32 == 0 and self.fuses_glu(w, n) and not self.tiled(w, n))

    def fuses_rope(self, w: Matrix, n: int, rope: RopeOut) -> bool:
        """Whether mul_mat(rope=...) can take RoPE and the KV-cache write of its
        rows (the split-K matvecs of up to 4 columns: GPUs, decode steps; RoPE
        on adjacent pairs, which a workgroup's even number of rows holds)."""
        return (self._epilogue_matvec(w, n) and not rope.neox and w.rows % 2 == 0 and rope.row0 % 2 == 0
                and rope.n_rot % 2 == 0 and rope.head_dim % 2 == 0
                and mv_gpu_config(w.type, self.split_k_columns(n))[0] % 2 == 0
                and rope.k_cache.buf is rope.v_cache.buf)

    def mul_mat(self, prog: Program, w: Matrix, x: Region, x_stride: int, y: Region, y_stride: int,
                n: int, accumulate: bool = False, label: str = "", glu: bool = False,
                norm: NormOut | None = None, rope: RopeOut | None = None, no_epilogues: bool = False,
                norm_in: NormIn | None = None, norm_parts: NormParts | None = None) -> None:
        """y[c][:M] (+)= W @ x[c][:K] for c < n (x rows K floats, y rows M floats).
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
        batched rows still equal single ones."""
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
        if w.parts:       # split by rows: each part fills its rows of y
            for r0, part in w.parts:
                self.mul_mat(prog, part, x, x_stride, y.at(r0, max(0, y.words - r0)), y_stride, n, accumulate,
                             f"{label or 'mul_mat'}[{r0}:{r0 + part.rows}]", no_epilogues=no_epilogues,
                             norm_in=norm_in, norm_parts=norm_parts.rows_from(r0) if norm_parts else None)
            return
        act = self._same_buffer(x, y, *([rope.q_out] if rope is not None else []))
        if x.off % 4 or x_stride % 4 or w.cols % 8:
            raise ValueError("mul_mat needs 16-byte aligned x rows and K a multiple of 8")
        if self.tiled(w, n):   # (no epilogues there: fuses_glu/norm/rope exclude tiled steps)
            self._mul_tiled(prog, w, x, x_stride, y, y_stride, n, accumulate, act, label)
            return
        # XQ8 only where no norm or RoPE is ever fused (its variants have none):
        # the SwiGLU's gate|up and matrices the caller marks (the output head)
        # (its loads of 16 weights need 16-byte aligned rows: every arena array is)
        xq8 = (self.split_k and self.xq8 and w.type in XQ8_TYPES and (glu or no_epilogues)
               and w.data.off % 4 == 0 and norm_in is None)
        flags = int(accumulate) | (2 if glu else 0) | (4 if norm is not None else 0) | (8 if rope is not None else 0)
        push = struct.pack("<10I", w.data.off, w.scales.off if w.scales else 0, w.cols, w.rows, n,
                           x.off, x_stride, y.off, y_stride, flags)
        if norm_in is not None:   # (the "nx" variants add the producer's sums a block)
            sums = norm_in.q8.s_off if norm_in.q8 is not None else norm_in.slots.off
            push += struct.pack("<4If", 0, 0, 0, sums, norm_in.eps)
        elif norm_parts is not None:
            np_ = norm_parts
            push += struct.pack("<4If", np_.h.off, np_.h_stride, np_.weight.off, np_.slots.off, 0.0)
        elif norm is None:
            push += struct.pack("<4If", 0, 0, 0, 0, 0.0)
        else:
            push += struct.pack("<4If", norm.h.off, norm.h_stride, norm.weight.off, norm.sync.off, norm.eps)
        pq = norm_parts.q8 if norm_parts is not None else None
        if pq is not None:   # the "pq" variants: its offsets in the RoPE words
            push += struct.pack("<5I", pq.q.off, pq.d_off, pq.sync.off, pq.s_off, pq.q2_off) + bytes(9 * 4)
        elif norm_in is not None and norm_in.q8 is not None:   # "nx": the second plane in the RoPE words
            push += struct.pack("<I", norm_in.q8.q2_off) + bytes(13 * 4)
        elif rope is None:
            push += bytes(14 * 4)
        else:
            r = rope
            push += struct.pack("<14I", r.row0, r.n_head * r.head_dim, r.n_kv * r.head_dim, r.head_dim, r.n_rot,
                                r.table.off, r.q_out.off, r.q_stride, r.k_cache.off, r.v_cache.off, r.slot_stride,
                                r.n_kv * r.head_dim // 2, r.pos_off, r.slot_off)
        yr = _rows_range(y, n, y_stride, w.rows // 2 if glu else w.rows)
        reads = w.regions + [_rows_range(x, n, x_stride, w.cols)] + ([yr] if accumulate else [])
        writes = [yr]
        if norm_in is not None and norm_in.q8 is None:   # the producer's sums of squares
            s0 = norm_in.slots.off
            reads.append((norm_in.slots.buf, s0 * 4, (s0 + n * w.cols // 4) * 4))
        if norm_parts is not None:
            s0, ss = norm_parts.slots.off, norm_parts.slot_stride
            reads.append(norm_parts.weight.at(0, w.rows).range)
            writes += [_rows_range(norm_parts.h, n, norm_parts.h_stride, w.rows),
                       (norm_parts.slots.buf, s0 * 4, (s0 + (n - 1) * ss + w.rows // 4) * 4)]
            if pq is not None:   # the blocks, their scales and the counters
                writes += [_rows_range(pq.q, n, w.rows // 4, w.rows // 4),
                           (pq.q.buf, pq.q2_off * 4, (pq.q2_off + n * w.rows // 4) * 4),
                           (pq.q.buf, pq.d_off * 4, (pq.d_off + n * w.rows // 32) * 4),
                           (pq.q.buf, pq.s_off * 4, (pq.s_off + n * w.rows // 32) * 4), pq.sync.range]
        xq8_in = norm_in.q8 if norm_in is not None else None
        if xq8_in is not None:   # the producer's blocks and scales
            reads += [_rows_range(xq8_in.q, n, w.cols // 4, w.cols // 4),
                      (xq8_in.q.buf, xq8_in.q2_off * 4, (xq8_in.q2_off + n * w.cols // 4) * 4),
                      (xq8_in.q.buf, xq8_in.d_off * 4, (xq8_in.d_off + n * w.cols // 32) * 4),
                      (xq8_in.q.buf, xq8_in.s_off * 4, (xq8_in.s_off + n * w.cols // 32) * 4)]
        if norm is not None:
            reads += [norm.weight.range, norm.sync.range]
            writes += [_rows_range(norm.h, n, norm.h_stride, w.rows), norm.sync.range]
        if rope is not None:   # q rows of q_out (all of them: conservative), the caches
            r = rope
            reads += [r.table.range, (r.params, min(r.pos_off, r.slot_off) * 4, (max(r.pos_off, r.slot_off) + n) * 4)]
            writes = [_rows_range(r.q_out, n, r.q_stride, r.n_head * r.head_dim), r.k_cache.range, r.v_cache.range]
        single = n < self.multi_column_from
        if self.split_k:
            ncols = self.split_k_columns(n)
            tag = "b" if self.bfly else ""
            variant = f"mul_mvk{tag}_{w.type}" if single else f"mul_mm{tag}{ncols}_{w.type}"
            rows_per_wg = mv_gpu_config(w.type, ncols)[0]   # the workgroup shares its rows' K
        elif single:
            variant, ncols, rows_per_wg = f"mul_mv_{w.type}", 1, self.items * SG_ROWS
        else:
            variant, ncols, rows_per_wg = f"mul_mm_{w.type}", MATMUL_COLS, self.items * SG_ROWS
        bufs = [w.data.buf, act, act]
        if self.split_k:   # bindings 3-6: the fused RMSNorm's weight, RoPE's table, params and
            # KV cache (any buffer when unused)
            nw = norm.weight if norm is not None else norm_parts.weight if norm_parts is not None else None
            bufs.append(nw.buf if nw is not None else w.data.buf)
            bufs += [rope.table.buf, rope.params, rope.k_cache.buf] if rope is not None else [w.data.buf] * 3
            if xq8_in is not None:   # binding 7: x as the producer's 8-bit blocks (the "nx" variants)
                variant = variant.replace(f"_{w.type}", f"nx_{w.type}")
                push += struct.pack("<2I", xq8_in.q.off, xq8_in.d_off)
                bufs.append(xq8_in.q.buf)
            elif xq8:   # binding 7: x as 8-bit blocks, quantized here
                qbuf = self._scratch(self._xq, q8_words(n, w.cols), "xq")
                reads.append(self.quantize_q8(prog, x, x_stride, w.cols, n, qbuf))
                variant = variant.replace(f"_{w.type}", f"x_{w.type}")
                push += struct.pack("<2I", 0, n * w.cols // 4)
                bufs.append(qbuf)
            elif norm_in is not None:   # the "n" variants
                variant = variant.replace(f"_{w.type}", f"n_{w.type}")
            elif norm_parts is not None:   # the "p" variants ("pq": and h' as 8-bit blocks)
                variant = variant.replace(f"_{w.type}", f"{'pq' if pq is not None else 'p'}_{w.type}")
                push += struct.pack("<I", norm_parts.slot_stride)
        alg = self._alg(variant, bufs, push, self.wg, rows_per_wg)
        # glu: a workgroup takes rows_per_wg / 2 gate rows and the same up rows
        row_groups = math.ceil(w.rows // 2 / (rows_per_wg // 2)) if glu else math.ceil(w.rows / rows_per_wg)
        groups = self._grid(row_groups, math.ceil(n / ncols))
        prog.dispatch(alg, push, groups, reads, writes, label or variant)

    def _mul_tiled(self, prog: Program, w: Matrix, x: Region, x_stride: int, y: Region, y_stride: int, n: int,
                   accumulate: bool, act: Buffer, label: str) -> None:
        """mul_mat of a prefill-sized step: tiles of mul_mc2, mul_mc or mul_mt,
        the latter two with K split across grid z where the tile grid is small
        (split_k_parts)."""
        mc2 = self.on_coopmat2(w)
        if mc2:
            bm, bn, variant = self.mc2_variant(w)
        elif self.coopmat:
            (bm, bn), variant = MC_TILE[:2], f"mul_mc_{w.type}"
        else:
            tile, variant = TILE, f"mul_mt_{w.type}"
            if math.ceil(w.rows / (16 * TILE[0])) * math.ceil(n / (16 * TILE[1])) < self.small_tiles_below:
                tile, variant = TILE_SMALL, f"mul_mt64_{w.type}"
            bm, bn = 16 * tile[0], 16 * tile[1]
        yr = _rows_range(y, n, y_stride, w.rows)
        gm, gn = math.ceil(w.rows / bm), math.ceil(n / bn)
        # mul_mc2 does not split: with K ranges from a push constant its tensor
        # loads ran at half speed (H200, 8B Q4_0 prefill 8,629 -> 3,939 tok/s,
        # split or not; likely k0 no longer provably aligned, as its comments
        # on strides say; rounding the range's start down to 256 is the fix to
        # measure)
        parts, klen = (1, 0) if mc2 else self.split_k_parts(gm * gn, w.cols, n, w.rows)
        if parts > 1:   # partial sums to a scratch of their own, then reduce_k into y
            out = self._scratch(self._parts, parts * n * w.rows, "parts")
            out_off, out_stride, out_acc = 0, w.rows, False
            out_range = (out, 0, parts * n * w.rows * 4)
        else:
            out, out_off, out_stride, out_acc, out_range = y.buf, y.off, y_stride, accumulate, yr
        push = struct.pack("<12I", w.data.off, w.scales.off if w.scales else 0, w.cols, w.rows, n, x.off, x_stride,
                           out_off, out_stride, int(out_acc), klen, n * w.rows)
        name = label or variant
        if mc2:
            # x -> halves (to_f16.comp: rows of a multiple of 8, zero rows up to
            # whole tiles), whose offset and stride replace x's
            n_pad = gn * bn
            stride8 = math.ceil(w.cols / 8)
            scratch = self._scratch(self._x16, n_pad * stride8 * 4, "x16")
            hr = self.to_f16(prog, x, x_stride, w.cols, n, n_pad, scratch)
            push = push[:20] + struct.pack("<2I", 0, stride8 * 8) + push[28:]
            bufs, reads = [w.data.buf, scratch, out], w.regions + [hr]
        else:
            bufs, reads = [w.data.buf, act, out], w.regions + [_rows_range(x, n, x_stride, w.cols)]
        spv = spirv.spirv(variant, self._spirv_cache)
        alg = self.device.algorithm(variant, spv, bufs, (), len(push))
        prog.dispatch(alg, push, (gm, gn, parts), reads + ([yr] if out_acc else []), [out_range], name)
        if parts > 1:
            self._reduce_k(prog, parts, out, w.rows, n, yr, y.off, y_stride, accumulate, name)

    def on_coopmat2(self, w: Matrix) -> bool:
        """Whether a prefill-sized mul_mat of w runs mul_mc2: the types and
        sizes where it measured faster (mc2_types, mc2_from_rows rows). Its
        loads need the matrix 16-byte aligned (arenas align every array so;
        mul_mat already requires K % 8 == 0)."""
        return (self.coopmat2 and w.type in self.mc2_types and w.type in MC2_TYPES
                and w.rows >= self.mc2_from_rows and w.data.off % 4 == 0)

    def mc2_variant(self, w: Matrix) -> tuple[int, int, str]:
        """mul_mc2's BM x BN tile for w and its variant: the first of the tile
        table whose row floor w reaches (fp32 sums: MC2_TILES; fp16 sums:
        mc2h_tiles, which tests narrow to one tile)."""
        tiles, tag = (self.mc2h_tiles, "h") if self.mc2_f16acc else (MC2_TILES, "")
        bm, bn = next(t for rows, t in tiles if w.rows >= rows)
        return bm, bn, f"mul_mc2{tag}_{bm}x{bn}_{w.type}"

    # split K's defaults (Kernels.split_k_wgs, split_k_min) and the largest
    # scratch of partial sums it takes (fewer parts beyond)
    SPLIT_K_ALIGN = 256            # columns: a multiple of every kernel's K slice and unit span
    SPLIT_K_SCRATCH = 64 << 20     # bytes

    def split_k_parts(self, groups: int, K: int, n: int, M: int) -> tuple[int, int]:
        """(parts, columns per part) for a tiled matmul of `groups` tile
        workgroups over K columns (n rows of M outputs): (1, 0) for no split."""
        if self.split_k_wgs <= 0 or groups >= self.split_k_wgs:
            return 1, 0
        parts = min(math.ceil(self.split_k_wgs / groups), K // max(self.split_k_min, self.SPLIT_K_ALIGN),
                    self.SPLIT_K_SCRATCH // max(1, 4 * n * M))
        if parts <= 1:
            return 1, 0
        klen = math.ceil(K / parts / self.SPLIT_K_ALIGN) * self.SPLIT_K_ALIGN
        parts = math.ceil(K / klen)
        return (parts, klen) if parts > 1 else (1, 0)

    def _reduce_k(self, prog: Program, parts: int, part_buf: Buffer, M: int, n: int, yr: tuple, y_off: int,
                  y_stride: int, accumulate: bool, label: str) -> None:
        """y[c][:M] (+)= the sum of split K's parts (reduce_k.comp)."""
        push = struct.pack("<7I", parts, n * M, M, n, y_off, y_stride, int(accumulate))
        alg = self._alg("reduce_k", [part_buf, yr[0]], push, self.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(n * M / self.ew_wg)),
                      [(part_buf, 0, parts * n * M * 4)] + ([yr] if accumulate else []), [yr], f"{label} reduce_k")

    def scratch_bytes_bound(self, max_rows: int, max_cols: int) -> int:
        """An upper bound of the device memory _scratch takes for steps of up to
        max_rows rows of matrices of up to max_cols columns: split K's partial
        sums (at most SPLIT_K_SCRATCH), mul_mc2's halves of x (rows padded to
        its widest token tile, 256) and the XQ8 matvecs' 8-bit x, where this
        device runs them."""
        total = 0
        if self.xq8:   # x as 8-bit blocks for the matvec steps (below the tiled threshold)
            rows = max_rows if self.tiled_from is None else min(max_rows, self.tiled_from - 1)
            total += q8_words(rows, max_cols) * 4
        if self.tiled_from is None or max_rows < self.tiled_from:
            return total
        total += self.SPLIT_K_SCRATCH if self.split_k_wgs > 0 else 0
        if self.coopmat2:
            total += math.ceil(max_rows / 256) * 256 * math.ceil(max_cols / 8) * 16
        return total

    def _scratch(self, bufs: list[Buffer], words: int, name: str) -> Buffer:
        """The last of `bufs` (mul_mc2's halves of x: self._x16; split K's
        partial sums: self._parts; XQ8's 8-bit x: self._xq), or a new device buffer of at least `words`
        words appended to them where it is smaller. Recorded programs keep the
        buffers they were recorded with, so a larger one is added rather than
        swapped in."""
        if not bufs or bufs[-1].nbytes < words * 4:
            bufs.append(self.device.buffer(max(words, 1 << 16) * 4, "device", f"{name}_{len(bufs)}"))
        return bufs[-1]

    def quantize_q8(self, prog: Program, x: Region, x_stride: int, cols: int, n: int,
                    out: Buffer) -> tuple[Buffer, int, int]:
        """out (from word 0) = the n rows of x as 8-bit blocks of 32 (quantize_q8.comp:
        n * cols / 4 words of int8, then n * cols / 32 scales). Returns the byte
        range written."""
        if cols % 32 or x.off % 4 or x_stride % 4:
            raise ValueError("quantize_q8 needs 32-value blocks and 16-byte aligned rows")
        push = struct.pack("<6I", x.off, x_stride, cols, n, 0, n * cols // 4)
        alg = self._alg("quantize_q8", [x.buf, out], push, self.ew_wg, 1)
        qr = (out, 0, q8_words(n, cols) * 4)
        prog.dispatch(alg, push, self._grid(math.ceil(n * cols // 32 / self.ew_wg)),
                      [_rows_range(x, n, x_stride, cols)], [qr], "quantize_q8")
        return qr

    def to_f16(self, prog: Program, x: Region, x_stride: int, cols: int, n: int, n_pad: int,
               out: Buffer) -> tuple[Buffer, int, int]:
        """out (from byte 0) = the n rows of x as halves, in rows of cols rounded
        up to 8 halves, zeros past cols and in rows n .. n_pad. Returns the
        byte range written."""
        stride8 = math.ceil(cols / 8)
        push = struct.pack("<7I", x.off, x_stride, cols, n, n_pad, 0, stride8)
        alg = self._alg("to_f16", [x.buf, out], push, self.ew_wg, 1)
        hr = (out, 0, n_pad * stride8 * 16)
        prog.dispatch(alg, push, self._grid(math.ceil(n_pad * stride8 / self.ew_wg)),
                      [_rows_range(x, n, x_stride, cols)], [hr], "to_f16")
        return hr

    def get_rows(self, prog: Program, w: Matrix, params: Buffer, ids_off: int, y: Region, y_stride: int,
                 n: int, label: str = "get_rows") -> None:
        """y[r][:] = W[params[ids_off + r]][:] (dequantized) for r < n. A matrix split
        by rows: one dispatch per part, each writing the rows whose ids it holds."""
        total = n * (w.cols // UNIT_VALUES[w.type])
        for r0, part in (w.parts or ((0, w),)):
            push = struct.pack("<7I", part.data.off, part.scales.off if part.scales else 0, w.cols, n, ids_off,
                               y.off, y_stride)
            variant = f"get_rows_{w.type}"
            if w.parts:
                push += struct.pack("<2I", r0, r0 + part.rows)
                variant = f"get_rows_p_{w.type}"
            alg = self._alg(variant, [part.data.buf, y.buf, params], push, self.ew_wg, 1)
            prog.dispatch(alg, push, self._grid(math.ceil(total / self.ew_wg)),
                          part.regions + [(params, ids_off * 4, (ids_off + n) * 4)],
                          [_rows_range(y, n, y_stride, w.cols)], label)

    def rms_norm(self, prog: Program, weight: Region, x: Region, x_stride: int, y: Region, y_stride: int,
                 n: int, rows: int, eps: float, params: Buffer, map_off: int | None = None,
                 label: str = "rms_norm") -> None:
        """y[r] = x[src] / rms(x[src]) * weight, src = r or params[map_off + r]."""
        act = self._same_buffer(x, y)
        if n % 4 or x.off % 4 or y.off % 4 or x_stride % 4 or y_stride % 4 or weight.off % 4:
            raise ValueError("rms_norm needs rows of a multiple of 4 floats, 16-byte aligned")
        push = struct.pack("<8If", x.off, x_stride, y.off, y_stride, weight.off, n, rows,
                           NO_MAP if map_off is None else map_off, eps)
        per_wg = 1 if self.split_k else self.items   # GPUs: a workgroup per row (rms_norm_wg)
        alg = self._alg("rms_norm_wg" if self.split_k else "rms_norm", [weight.buf, act, act, params], push,
                        self.wg, per_wg)
        if map_off is None:
            xr = _rows_range(x, rows, x_stride, n)
            reads = [weight.range, xr]
        else:  # gathered rows: any row of x may be read
            reads = [weight.range, x.range, (params, map_off * 4, (map_off + rows) * 4)]
        prog.dispatch(alg, push, self._grid(math.ceil(rows / per_wg)), reads,
                      [_rows_range(y, rows, y_stride, n)], label)

    def rope_kv(self, prog: Program, table: Region, qkv: Region, qkv_stride: int, q_out: Region, q_stride: int,
                n_rows: int, n_head: int, n_kv: int, head_dim: int, n_rot: int, neox: bool,
                k_cache: Region, v_cache: Region, slot_stride: int, params: Buffer, pos_off: int, slot_off: int,
                label: str = "rope_kv") -> None:
        """RoPE on q and k of each row, k and v written (f16) into the cache at
        (params[slot_off + r], params[pos_off + r]); rotated q to q_out."""
        act = self._same_buffer(qkv, q_out)
        kv = self._same_buffer(k_cache, v_cache)
        push = struct.pack("<16I", qkv.off, qkv_stride, q_out.off, q_stride, n_rows, n_head, n_kv, head_dim,
                           n_rot, int(neox), table.off, k_cache.off, v_cache.off, slot_stride, pos_off, slot_off)
        alg = self._alg("rope_kv", [table.buf, act, params, kv], push, self.ew_wg, 1)
        per_row = (n_head + 2 * n_kv) * head_dim // 2
        width = (n_head + 2 * n_kv) * head_dim
        reads = [table.range, _rows_range(qkv, n_rows, qkv_stride, width),
                 (params, min(pos_off, slot_off) * 4, (max(pos_off, slot_off) + n_rows) * 4)]
        writes = [_rows_range(q_out, n_rows, q_stride, n_head * head_dim), k_cache.range, v_cache.range]
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * per_row / self.ew_wg)), reads, writes, label)

    # positions per slice in split-K attention; H200, 1B Q8_0 (notes.md run 18):
    # tg512 990 tok/s with 32, 995 with 64, 926-932 with 128
    ATTN_CHUNK = 64
    ATTN_MC_FROM = 16   # rows from which attention runs on cooperative matrices (where it can)

    @classmethod
    def attention_parts(cls, n_ctx: int) -> int:
        return -(-n_ctx // cls.ATTN_CHUNK)

    @classmethod
    def attention_tmp_words(cls, n_rows: int, n_head: int, head_dim: int, n_ctx: int) -> int:
        return n_rows * n_head * cls.attention_parts(n_ctx) * (head_dim + 2)

    @staticmethod
    def attention_sync_words(n_rows: int, n_head: int) -> int:
        """zeroed counters split-K attention needs: one per (row, head)"""
        return n_rows * n_head

    def attention(self, prog: Program, q: Region, q_stride: int, o: Region, o_stride: int, n_rows: int,
                  n_head: int, n_kv: int, head_dim: int, k_cache: Region, v_cache: Region, slot_stride: int,
                  params: Buffer, pos_off: int, slot_off: int, scale: float, split: Region | None = None,
                  n_ctx: int = 0, sync: Region | None = None, label: str = "attention") -> None:
        """o[r][h] = softmax(q[r][h] . K[slot][0..pos]) V[slot][0..pos].
        With `split` (scratch of attention_tmp_words), the cache's n_ctx and
        `sync` (attention_sync_words of zeros, left zero) the positions are cut
        into slices run in parallel and merged in the same dispatch by the last
        slice of each (row, head) to finish (flash-decoding): decode has few
        rows, so one pass would leave most of a GPU idle. Without
        it, prompt-sized steps run on cooperative matrices where the device
        can (attention_on_coopmat)."""
        if head_dim % 8 or n_head % n_kv or q.off % 4 or q_stride % 4 or k_cache.off % 4 or v_cache.off % 4:
            raise VkEngineError(f"attention needs head_dim a multiple of 8 ({head_dim}), n_head a multiple of "
                                f"n_kv ({n_head}/{n_kv}) and 16-byte aligned q rows and caches")
        act = self._same_buffer(q, o)
        kv = self._same_buffer(k_cache, v_cache)
        reads = [_rows_range(q, n_rows, q_stride, n_head * head_dim), k_cache.range, v_cache.range,
                 (params, min(pos_off, slot_off) * 4, (max(pos_off, slot_off) + n_rows) * 4)]
        out = [_rows_range(o, n_rows, o_stride, n_head * head_dim)]
        if self.attention_on_coopmat(n_rows, head_dim) and split is None:
            push = struct.pack("<13If", q.off, q_stride, o.off, o_stride, n_rows, n_head, n_kv, head_dim,
                               k_cache.off, v_cache.off, slot_stride, pos_off, slot_off, scale)
            name = self.attention_mc_variant.format(hd=head_dim)
            spv = spirv.spirv(name, self._spirv_cache)
            alg = self.device.algorithm(name, spv, [act, act, params, kv], (), len(push))
            # NSG 16-row blocks of one KV group's heads a workgroup (the shader's comment)
            blocks = math.ceil(n_rows / 16) * (n_head // n_kv)
            prog.dispatch(alg, push, (math.ceil(blocks / self.attention_mc_nsg), n_kv, 1), reads, out, label)
            return
        n_parts = self.attention_parts(n_ctx) if split is not None else 1
        chunk = self.ATTN_CHUNK if split is not None else 0
        part_off = split.off if split is not None else 0
        sync_off = sync.off if sync is not None else 0
        push = struct.pack("<13If4I", q.off, q_stride, o.off, o_stride, n_rows, n_head, n_kv, head_dim,
                           k_cache.off, v_cache.off, slot_stride, pos_off, slot_off, scale, chunk, n_parts, part_off,
                           sync_off)
        # V words per lane; sized for the smallest subgroup the device may use
        sg = self.sg if self.device.info.subgroups_fixed else min(self.sg, 8)
        wpl = -(-(head_dim // 2) // sg)
        # V rows a lane loads ahead of their use: up to 32 words, at least 8 rows
        vb = max(8, min(32, 32 // wpl))
        name = "attention_split" if split is not None else "attention"
        spv = spirv.spirv(name, self._spirv_cache)
        alg = self.device.algorithm(name, spv, [act, act, params, kv], (self.wg, self.items, wpl, head_dim, vb),
                                    len(push))
        if split is None:
            prog.dispatch(alg, push, self._grid(math.ceil(n_rows * n_head / self.items)), reads, out, label)
            return
        tmp_words = self.attention_tmp_words(n_rows, n_head, head_dim, n_ctx)
        if split.buf is not act or split.words < tmp_words:
            raise ValueError("split-K attention needs a scratch region in the activation buffer")
        if sync is None or sync.buf is not act or sync.words < self.attention_sync_words(n_rows, n_head):
            raise ValueError("split-K attention needs zeroed counters in the activation buffer")
        tmp = (split.buf, split.off * 4, (split.off + tmp_words) * 4)
        prog.dispatch(alg, push, self._grid(math.ceil(n_rows * n_head * n_parts / self.items)),
                      reads + [tmp, sync.range], out + [tmp, sync.range], label)

    def step_thresholds(self, max_out: int) -> list[int]:
        """Row counts from which a step's kernels change on this device (a step
        of fewer rows runs others): the tiled matmuls, attention on cooperative
        matrices (any head size: conservative), and the end of split decode
        attention (steps of up to max_out rows, Graph.attention)."""
        t = [self.tiled_from] if self.tiled_from is not None else []
        if self.coopmat and self.attention_mc:
            t.append(self.ATTN_MC_FROM)
        if self.split_attention:
            t.append(max_out + 1)
        return t

    def attention_on_coopmat(self, n_rows: int, head_dim: int) -> bool:
        """Whether attention() runs on cooperative matrices (attention_mc: 16
        query rows a subgroup, fp16 Q and P): prompt-sized steps of the head
        sizes it is compiled for, on devices that run mul_mc."""
        return (self.coopmat and self.attention_mc and n_rows >= self.ATTN_MC_FROM
                and head_dim in self.attention_mc_head_dims)

    def swiglu(self, prog: Program, gu: Region, gu_stride: int, y: Region, y_stride: int, F: int, rows: int,
               label: str = "swiglu") -> None:
        """y[r][i] = silu(gu[r][i]) * gu[r][F + i]."""
        act = self._same_buffer(gu, y)
        push = struct.pack("<6I", gu.off, gu_stride, y.off, y_stride, F, rows)
        vec4 = not (F % 4 or gu.off % 4 or gu_stride % 4 or y.off % 4 or y_stride % 4)
        alg = self._alg("swiglu4" if vec4 else "swiglu", [act], push, self.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * F // (4 if vec4 else 1) / self.ew_wg)),
                      [_rows_range(gu, rows, gu_stride, 2 * F)], [_rows_range(y, rows, y_stride, F)], label)

    def add(self, prog: Program, a: Region, a_stride: int, b: Region, b_stride: int, y: Region, y_stride: int,
            n: int, rows: int, label: str = "add") -> None:
        act = self._same_buffer(a, b, y)
        push = struct.pack("<8I", a.off, a_stride, b.off, b_stride, y.off, y_stride, n, rows)
        alg = self._alg("add", [act], push, self.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n / self.ew_wg)),
                      [_rows_range(a, rows, a_stride, n), _rows_range(b, rows, b_stride, n)],
                      [_rows_range(y, rows, y_stride, n)], label)

    def softmax(self, prog: Program, x: Region, x_stride: int, y: Region, y_stride: int, n: int, rows: int,
                scale: float = 1.0, label: str = "softmax") -> None:
        act = self._same_buffer(x, y)
        push = struct.pack("<6If", x.off, x_stride, y.off, y_stride, n, rows, scale)
        alg = self._alg("softmax", [act], push, self.wg)
        prog.dispatch(alg, push, self._grid(math.ceil(rows / self.items)),
                      [_rows_range(x, rows, x_stride, n)], [_rows_range(y, rows, y_stride, n)], label)

    ARGMAX_CHUNK = 2048

    @classmethod
    def argmax_tmp_words(cls, n: int, rows: int) -> int:
        return 2 * rows * -(-n // cls.ARGMAX_CHUNK)

    def argmax(self, prog: Program, x: Region, x_stride: int, n: int, rows: int, params: Buffer, out_off: int,
               tmp: Region, label: str = "argmax") -> None:
        """params[out_off + r] = argmax(x[r][:n]): per-slice winners into tmp
        (argmax_tmp_words), then one reduction per row."""
        act = self._same_buffer(x, tmp)
        if x.off % 4 or x_stride % 4 or tmp.words < self.argmax_tmp_words(n, rows):
            raise ValueError("argmax needs 16-byte aligned rows and a large enough tmp region")
        n_chunks = -(-n // self.ARGMAX_CHUNK)
        push = struct.pack("<6I", x.off, x_stride, n, rows, tmp.off, self.ARGMAX_CHUNK)
        alg = self._alg("argmax_part", [act], push, self.wg)
        tmp_range = (tmp.buf, tmp.off * 4, (tmp.off + self.argmax_tmp_words(n, rows)) * 4)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n_chunks / self.items)),
                      [_rows_range(x, rows, x_stride, n)], [tmp_range], label)
        push = struct.pack("<4I", tmp.off, n_chunks, rows, out_off)
        alg = self._alg("argmax", [act, params], push, self.wg)
        prog.dispatch(alg, push, self._grid(math.ceil(rows / self.items)), [tmp_range],
                      [(params, out_off * 4, (out_off + rows) * 4)], label)

    # sampling on the device (topk_part.comp, sample.comp): slices of
    # SAMPLE_WG * SAMPLE_VPL logits, the SAMPLE_K best of each, merged per row
    # by one workgroup that holds SAMPLE_WG * SAMPLE_VPL candidates
    SAMPLE_WG, SAMPLE_VPL, SAMPLE_K = 256, 16, 64
    SAMPLE_WORDS = 8        # params words a row: temperature, top_k, top_p, min_p, u

    @classmethod
    def sample_slices(cls, n: int) -> int:
        return -(-n // (cls.SAMPLE_WG * cls.SAMPLE_VPL))

    @classmethod
    def sample_tmp_words(cls, n: int, rows: int) -> int:
        return 2 * rows * cls.sample_slices(n) * cls.SAMPLE_K

    def can_sample(self, n: int) -> bool:
        """Whether rows of n logits can be sampled on this device (sample())."""
        # (topk.glsl's merge: at most 32 subgroups a workgroup, 4 lists a lane)
        return (self.device.info.max_workgroup_invocations >= self.SAMPLE_WG and self.sg >= 8
                and self.sample_slices(n) * self.SAMPLE_K <= self.SAMPLE_WG * self.SAMPLE_VPL)

    def sample(self, prog: Program, x: Region, x_stride: int, n: int, rows: int, params: Buffer, samp_off: int,
               out_off: int, tmp: Region, label: str = "sample") -> None:
        """params[out_off + r] = the token drawn from x[r][:n] with row r's
        sampling params (params words samp_off + SAMPLE_WORDS * r: temperature,
        top_k in 1..SAMPLE_K, top_p, min_p, uniform u), as Sampler draws it;
        temperature <= 0: the argmax. The K best of each slice into tmp
        (sample_tmp_words), then one workgroup per row."""
        act = self._same_buffer(x, tmp)
        if not self.can_sample(n):
            raise ValueError(f"rows of {n} values cannot be sampled on this device")
        samp_range = (params, samp_off * 4, (samp_off + self.SAMPLE_WORDS * rows) * 4)
        if tmp.words < self.sample_tmp_words(n, rows):
            raise ValueError("sample needs a large enough tmp region")
        n_sl, K = self.sample_slices(n), self.SAMPLE_K
        push = struct.pack("<7I", x.off, x_stride, n, rows, tmp.off, K, samp_off)
        alg = self._alg("topk_part", [act, params], push, self.SAMPLE_WG, 1)
        tmp_range = (tmp.buf, tmp.off * 4, (tmp.off + self.sample_tmp_words(n, rows)) * 4)
        prog.dispatch(alg, push, self._grid(rows * n_sl), [_rows_range(x, rows, x_stride, n), samp_range],
                      [tmp_range], f"{label} top-k")
        push = struct.pack("<5I", tmp.off, n_sl * K, rows, samp_off, out_off)
        alg = self._alg("sample", [act, params], push, self.SAMPLE_WG, 1)
        prog.dispatch(alg, push, self._grid(rows), [tmp_range, samp_range],
                      [(params, out_off * 4, (out_off + rows) * 4)], f"{label} draw")

    def copy(self, prog: Program, src: Region, dst: Region, label: str = "copy") -> None:
        """dst = src (word counts a multiple of 4, 16-byte aligned), by a shader."""
        if src.off % 4 or dst.off % 4 or src.words % 4 or dst.words < src.words:
            raise ValueError("copy needs 16-byte aligned regions of whole vec4s")
        n = src.words // 4
        push = struct.pack("<3I", src.off // 4, dst.off // 4, n)
        wg = max(self.ew_wg, 256)
        alg = self._alg("copy", [src.buf, dst.buf], push, wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(n / (wg * 4))), [src.range], [dst.range], label)
