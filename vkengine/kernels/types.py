"""The operands of the kernel wrappers: regions of buffers, weight matrices
in quant.glsl's layouts, and the descriptions of fused epilogues. Offsets and
strides are in 32-bit words of their buffer."""
from __future__ import annotations

from dataclasses import dataclass

from shaders.variants import KV_TYPES, kv_tag

from ..device import Buffer
from ..errors import VkEngineError

NO_MAP = 0xFFFFFFFF   # "no row map" in rms_norm's push constants; "none" in moe_router's


@dataclass(frozen=True)
class Region:
    """`words` 32-bit words of `buf` starting at word `off`."""
    buf: Buffer
    off: int
    words: int

    def at(self, off: int, words: int) -> Region:
        return Region(self.buf, self.off + off, words)

    @property
    def range(self) -> tuple[Buffer, int, int]:
        return (self.buf, self.off * 4, (self.off + self.words) * 4)


@dataclass(frozen=True)
class KVTypes:
    """The KV cache's storage types, K and V each: "f16" or "q8_0" (llama.cpp's
    block of 32 values with an f16 scale; layouts in shaders/kv.glsl and
    vkengine/state.py), as llama-server's --cache-type-k / --cache-type-v."""
    k: str = "f16"
    v: str = "f16"

    def __post_init__(self) -> None:
        for flag, t in (("--cache-type-k", self.k), ("--cache-type-v", self.v)):
            if t not in KV_TYPES:
                raise VkEngineError(f"{flag} {t}: the KV cache can be {' or '.join(KV_TYPES)} (llama-server's other "
                                    "cache types are not supported)")

    @property
    def quantized(self) -> bool:
        return self.k != "f16" or self.v != "f16"

    @property
    def tag(self) -> str:
        """The suffix of the cache's writer and reader variants (shaders/variants.py kv_tag)."""
        return kv_tag(self.k, self.v)

    @staticmethod
    def pos_words(t: str, head_dim: int) -> int:
        """Words of one position of one KV head in a cache of type t: its row
        (f16 pairs or int8 quads), and for q8_0 its scales (f16 pairs)."""
        return head_dim // 4 + head_dim // 64 if t == "q8_0" else head_dim // 2

    def check_head_dim(self, head_dim: int) -> None:
        """q8_0 rows are whole 64-value units (two blocks and their scale word)."""
        if self.quantized and head_dim % 64:
            raise VkEngineError(f"a q8_0 KV cache needs a head size that is a multiple of 64, and this model's is "
                                f"{head_dim}: use --cache-type-k f16 --cache-type-v f16")


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
    parts: tuple[tuple[int, Matrix], ...] = ()

    @property
    def regions(self) -> list[tuple[Buffer, int, int]]:
        if self.parts:
            return [r for _, m in self.parts for r in m.regions]
        assert self.data is not None
        r = [self.data.range]
        if self.scales is not None:
            r.append(self.scales.range)
        return r


@dataclass(frozen=True)
class Halves:
    """n rows of a matmul's x as halves in mul_mc2's layout (to_f16's: rows of
    `stride` halves, zero rows n .. n_pad) in a scratch buffer from word 0: what
    Kernels.mul_mat_glu_halves writes for the next mul_mat (its x_halves)."""
    buf: Buffer
    cols: int
    stride: int
    n: int
    n_pad: int

    @property
    def range(self) -> tuple[Buffer, int, int]:
        return (self.buf, 0, self.n_pad * self.stride * 2)


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
class ConvOut:
    """What a Gated DeltaNet input projection's matvec writes for the causal
    conv1d + SiLU after it (mul_mat's conv, mul_mvk.comp's CONV): its rows below
    C go through the conv (weights [C][K] f32) into y (rows y_stride apart)
    instead of the matvec's output, with each slot's window in state
    ([slot][K-1][C]) and, after each of the step's first snap_rows rows, in
    snap; positions and slots at words pos_off and slot_off of params."""
    weight: Region
    C: int
    K: int
    y: Region
    y_stride: int
    state: Region
    snap: Region | None
    snap_rows: int
    params: Buffer
    pos_off: int
    slot_off: int


@dataclass(frozen=True)
class RouteOut:
    """What a MoE router's matvec writes after its logits (mul_mat's route,
    mul_mvk.comp's ROUTE): each row's top-k expert ids and weights (times
    w_scale) into route rows `route_stride` apart, as moe_router does; `sync`
    is a zeroed word of the activation buffer its workgroups count themselves on."""
    route: Region
    route_stride: int
    k: int
    w_scale: float
    sync: Region


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
    q8: Q8Out | None = None   # h' also as 8-bit blocks (the "pq" variants; Kernels.xq8_in)

    def rows_from(self, r0: int) -> NormParts:
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
    position) from params, as f16 pairs (only an f16 cache: Kernels.fuses_rope)."""
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
    kv_types: KVTypes = KVTypes()


def rows_range(r: Region, n_rows: int, stride: int, width: int) -> tuple[Buffer, int, int]:
    """Byte range touched by n_rows rows of `width` words, `stride` apart."""
    if n_rows <= 0:
        return (r.buf, r.off * 4, r.off * 4)
    return (r.buf, r.off * 4, (r.off + (n_rows - 1) * stride + width) * 4)


def q8_words(n: int, cols: int) -> int:
    """Words of n rows of `cols` values as 8-bit blocks (quantize_q8.comp): the
    int8 values, 4 a word, then a float scale per 32."""
    return n * (cols // 4 + cols // 32)


def params_range(params: Buffer, *offs_and_counts: tuple[int, int]) -> list[tuple[Buffer, int, int]]:
    """Byte ranges of words [off, off + n) of the params buffer."""
    return [(params, o * 4, (o + n) * 4) for o, n in offs_and_counts]
