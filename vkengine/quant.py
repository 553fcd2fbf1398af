"""GGML weight types: sizes, and repacking GGUF blocks into the device layouts of
shaders/quant.glsl.

GGUF blocks of the simple quant types are not 4-byte aligned (Q4_0: 18 bytes,
Q8_0: 34) and storage buffers are 32-bit here, so their quants and scales are
split into two arrays (both still quantized: the same bytes, reordered; IQ4_NL
as Q4_0, MXFP4's 17-byte blocks as its exponent bytes and its nibbles). K-quant
blocks (and IQ4_XS's 136-byte ones) are kept as they are (Q6_K padded from 210
to 212 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .errors import VkEngineError

# GGML type -> device type name (shaders/variants.py WEIGHT_TYPES)
SUPPORTED = {
    GGMLQuantizationType.F32: "f32",
    GGMLQuantizationType.F16: "f16",
    GGMLQuantizationType.BF16: "bf16",
    GGMLQuantizationType.Q8_0: "q8_0",
    GGMLQuantizationType.Q4_0: "q4_0",
    GGMLQuantizationType.Q4_1: "q4_1",
    GGMLQuantizationType.Q5_0: "q5_0",
    GGMLQuantizationType.Q5_1: "q5_1",
    GGMLQuantizationType.Q4_K: "q4_k",
    GGMLQuantizationType.Q5_K: "q5_k",
    GGMLQuantizationType.Q6_K: "q6_k",
    GGMLQuantizationType.IQ4_NL: "iq4_nl",
    GGMLQuantizationType.IQ4_XS: "iq4_xs",
    GGMLQuantizationType.MXFP4: "mxfp4",
}
BY_NAME = {v: k for k, v in SUPPORTED.items()}

# (value bytes offset, value bytes end, scale bytes end) inside a GGUF block of
# the repacked types: scales are bytes [0, s), values [s, block)
_SPLIT = {"q8_0": 2, "q4_0": 2, "q4_1": 4, "q5_0": 2, "q5_1": 4, "iq4_nl": 2, "mxfp4": 1}


def type_name(qtype: int) -> str:
    try:
        return SUPPORTED[GGMLQuantizationType(qtype)]
    except (KeyError, ValueError):
        try:
            name = GGMLQuantizationType(qtype).name
        except ValueError:
            name = f"#{qtype}"
        supported = ", ".join(t.name for t in SUPPORTED)
        raise VkEngineError(f"tensor type {name} is not supported (supported: {supported})") from None


def block_shape(name: str) -> tuple[int, int]:
    """(values per block, bytes per block) in GGUF."""
    return GGML_QUANT_SIZES[BY_NAME[name]]


def row_bytes(name: str, cols: int) -> int:
    n, b = block_shape(name)
    return cols // n * b


def row_slice(raw: np.ndarray, name: str, cols: int, r0: int, r1: int) -> np.ndarray:
    """GGUF bytes of rows [r0, r1) of a (rows, cols) tensor's bytes (a part of a
    matrix split across storage buffers)."""
    rb = row_bytes(name, cols)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)[r0 * rb:r1 * rb]


def check_shape(name: str, rows: int, cols: int, what: str = "tensor") -> None:
    from shaders.variants import UNIT_VALUES
    n, _ = block_shape(name)
    unit = UNIT_VALUES[name]
    if cols % n or cols % unit:
        raise VkEngineError(f"{what}: {cols} columns are not a multiple of the {name} block ({max(n, unit)})")


def _halves_to_words(h: np.ndarray) -> np.ndarray:
    """uint16 array -> uint32 words, two halves a word (little-endian), padded."""
    h = np.ascontiguousarray(h.reshape(-1))
    if h.size % 2:
        h = np.concatenate([h, np.zeros(1, np.uint16)])
    return h.view(np.uint32)


def repack(name: str, raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray | None]:
    """GGUF bytes of a (rows, cols) tensor -> (value words, scale words or None)."""
    check_shape(name, rows, cols)
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    expected = rows * row_bytes(name, cols)
    if raw.size != expected:
        raise VkEngineError(f"{name} tensor of {rows}x{cols} should hold {expected} bytes, it holds {raw.size}")
    if name in ("f32", "f16", "bf16", "q4_k", "q5_k", "iq4_xs"):
        return raw.view(np.uint32), None
    n, b = block_shape(name)
    blocks = raw.reshape(-1, b)
    if name == "q6_k":
        padded = np.zeros((blocks.shape[0], 212), np.uint8)
        padded[:, :210] = blocks
        return padded.reshape(-1).view(np.uint32), None
    s = _SPLIT[name]
    values = np.ascontiguousarray(blocks[:, s:]).reshape(-1).view(np.uint32)
    scale_bytes = np.ascontiguousarray(blocks[:, :s])
    if s == 2:
        scales = _halves_to_words(scale_bytes.view(np.uint16))
    elif s == 1:     # (MXFP4's exponent bytes, four a word)
        eb = scale_bytes.reshape(-1)
        scales = np.concatenate([eb, np.zeros(-eb.size % 4, np.uint8)]).view(np.uint32)
    else:
        scales = scale_bytes.reshape(-1).view(np.uint32)
    return values, scales


@dataclass(frozen=True)
class Stream:
    """How a repacked buffer's bytes come from GGUF blocks, for uploading them
    without building the repacked array first (Device.upload_blocks): each
    block of `block` bytes gives bytes [lo, hi) of itself, written as `out`
    bytes (zeros after hi - lo); the whole padded with zeros to whole words.
    The same bytes as `repack` gives (tests/test_quant_stream.py)."""
    block: int
    lo: int
    hi: int
    out: int


def repack_streams(name: str, rows: int, cols: int) -> tuple[Stream, Stream | None]:
    """(values, scales or None) of a (rows, cols) tensor, as `repack` lays them out."""
    check_shape(name, rows, cols)
    _, b = block_shape(name)
    if name in ("f32", "f16", "bf16", "q4_k", "q5_k", "iq4_xs"):
        return Stream(b, 0, b, b), None
    if name == "q6_k":
        return Stream(b, 0, b, 212), None
    s = _SPLIT[name]
    return Stream(b, s, b, b - s), Stream(b, 0, s, s)


def fill_blocks(dst: np.ndarray, blocks: np.ndarray, st: Stream, pool=None, parts: int = 1) -> None:
    """Write the stream's bytes of `blocks` ((k, st.block) uint8) into dst
    (k * st.out bytes), in the widest unit that divides every offset (a 16-bit
    copy of Q4_0's 18-byte blocks runs ~2x a byte-wise one). With a pool, in
    `parts` ranges of blocks on its threads (numpy copies without the GIL: one
    thread filled 1.56 GB/s of the 8B's weights on the H200's host)."""
    k = blocks.shape[0]
    if pool is not None and parts > 1 and k >= 4096:
        step = -(-k // parts)
        futs = [pool.submit(fill_blocks, dst[i * st.out:(i + step) * st.out], blocks[i:i + step], st)
                for i in range(0, k, step)]
        for f in futs:
            f.result()
        return
    width = st.hi - st.lo
    unit = next(u for u in (4, 2, 1) if not (st.block % u or st.lo % u or st.hi % u or st.out % u)
                and blocks.ctypes.data % u == 0 and dst.ctypes.data % u == 0)
    dt = {4: np.uint32, 2: np.uint16, 1: np.uint8}[unit]
    src = blocks.reshape(-1).view(dt).reshape(k, st.block // unit)[:, st.lo // unit:st.hi // unit]
    out = dst[:k * st.out].view(dt).reshape(k, st.out // unit)
    if width == st.out:
        np.copyto(out, src)
    else:
        np.copyto(out[:, :width // unit], src)
        out[:, width // unit:] = 0


def dequantize(name: str, raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """float32 (rows, cols) from GGUF bytes (reference for tests and loaders)."""
    from gguf import quants
    t = BY_NAME[name]
    if name == "f32":
        return np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.float32).reshape(rows, cols).copy()
    if name == "f16":
        return np.frombuffer(np.ascontiguousarray(raw).tobytes(), np.float16).astype(np.float32).reshape(rows, cols)
    data = np.ascontiguousarray(raw).reshape(rows, row_bytes(name, cols)).view(np.uint8)
    return quants.dequantize(data, t).astype(np.float32).reshape(rows, cols)


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 bytes from a Hugging Face checkpoint's MXFP4 tensors (gpt-oss:
    `*_blocks` uint8 (..., cols/32, 16) and `*_scales` uint8 (..., cols/32)).
    The same E8M0 exponent and E2M1 codes, only placed differently: transformers
    packs elements 2j and 2j+1 in byte j (low nibble first), ggml elements j and
    j+16 (llama.cpp's conversion/gpt_oss.py transform_nibble_layout); GGUF puts
    each block's exponent byte before its 16 bytes of nibbles."""
    blocks = np.asarray(blocks, np.uint8)
    scales = np.asarray(scales, np.uint8)
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise VkEngineError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair "
                            "(blocks (..., n, 16) with scales (..., n) expected)")
    b = blocks.reshape(-1, 16)
    elems = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(-1, 32)    # element order
    qs = elems[:, :16] | (elems[:, 16:] << 4)
    return np.concatenate([scales.reshape(-1, 1), qs.astype(np.uint8)], axis=1).reshape(-1)


def mxfp4_to_hf(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of mxfp4_from_hf: (blocks (rows, cols/32, 16), scales (rows, cols/32))."""
    blk = np.asarray(raw, np.uint8).reshape(rows, cols // 32, 17)
    qs = blk[..., 1:]
    elems = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)            # element order
    pairs = elems.reshape(rows, cols // 32, 16, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8), np.ascontiguousarray(blk[..., 0])


_MXFP4_MIDS = np.array([0.5, 1.5, 2.5, 3.5, 5.0, 7.0, 10.0], np.float32)   # between ggml's doubled E2M1 magnitudes


def quantize_mxfp4(w: np.ndarray) -> np.ndarray:
    """GGUF MXFP4 bytes of float32 rows (cols a multiple of 32): the blocks
    gguf-py's MXFP4.quantize_blocks writes (exponent floor(log2 amax) - 2; each
    value the nearest doubled E2M1 value, the smaller magnitude on a tie), by
    comparing |x| / d against the midpoints instead of materializing the
    error against all 16 candidates (16 floats a weight: gguf-py's form ran a
    16-worker machine out of memory on gpt-oss-20b's 265M-weight expert stacks)."""
    x = np.asarray(w, np.float32).reshape(-1, 32)
    amax = np.abs(x).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
    bits = np.where(e < 2, np.uint32(0x00200000) << e.astype(np.uint32), (e.astype(np.uint32) - 1) << np.uint32(23))
    d = bits.view(np.float32)
    v = np.abs(x) / d                     # (d > 0: e < 2 gives a denormal)
    mag = np.zeros(v.shape, np.uint8)
    for mid in _MXFP4_MIDS:
        mag += v > mid
    idx = mag + np.where((x < 0) & (mag > 0), np.uint8(8), np.uint8(0))
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([e, qs.astype(np.uint8)], axis=1).reshape(-1)
