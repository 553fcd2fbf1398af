"""Weights repacked on their way into the staging buffer (Device.upload_blocks
with quant.repack_streams) give the very bytes quant.repack gives, for every
weight type, across staging chunks and the two staging halves, from one tensor
or from fused parts, into device and host buffers."""
from __future__ import annotations

import numpy as np
import pytest

from vkengine.device import Device
from vkengine.quant import SUPPORTED, block_shape, repack, repack_streams, row_bytes

TYPES = sorted(SUPPORTED.values())


@pytest.fixture(scope="module")
def small_staging():
    """A device whose staging buffer holds a few hundred blocks: every tensor crosses many chunks."""
    with Device(staging_bytes=1 << 12, pipeline_cache=None) as dev:
        yield dev


def _tensor(rng, name: str, rows: int, blocks_per_row: int) -> tuple[np.ndarray, int]:
    n, _ = block_shape(name)
    cols = n * blocks_per_row
    return rng.integers(0, 256, rows * row_bytes(name, cols), np.uint8), cols


def _expect(name: str, raws: list[np.ndarray], rows_each: list[int], cols: int) -> list[bytes]:
    raw = np.concatenate(raws)
    values, scales = repack(name, raw, sum(rows_each), cols)
    return [values.tobytes()] + ([scales.tobytes()] if scales is not None else [])


@pytest.mark.parametrize("kind", ["device", "host"])
@pytest.mark.parametrize("name", TYPES)
def test_streamed_repack_equals_repack(small_staging, rng, name, kind):
    dev = small_staging
    n, _ = block_shape(name)
    bpr = 9 if n == 32 else 256 // n   # 288 or 256 values a row
    rows_each = [45, 8]          # fused parts; an odd block count in all (Q4_0's scales pad to a word)
    parts, cols = [], 0
    for r in rows_each:
        raw, cols = _tensor(rng, name, r, bpr)
        parts.append(raw)
    if name in ("q4_0", "q8_0", "q5_0", "iq4_nl", "mxfp4"):
        parts.append(np.zeros(0, np.uint8))   # an empty part is harmless
    want = _expect(name, [p for p in parts if p.size], rows_each, cols)
    streams = [s for s in repack_streams(name, sum(rows_each), cols) if s is not None]
    assert len(streams) == len(want)
    for st, w in zip(streams, want):
        buf = dev.buffer(len(w) + 64, kind, "dst")
        try:
            if kind == "device":
                dev.upload(buf, np.full((len(w) + 64) // 4, 0xA5A5A5A5, np.uint32))
            else:
                buf.array()[:] = 0xA5A5A5A5
            written = dev.upload_blocks(buf, 16, parts, st)
            assert written == len(w)
            got = dev.download(buf, 16, written).tobytes()
            assert got == w, f"{name}: first difference at byte {next(i for i in range(len(w)) if got[i] != w[i])}"
            assert dev.download(buf, 0, 16).tobytes() == b"\xa5" * 16               # nothing before
            assert dev.download(buf, 16 + written, 16).tobytes() == b"\xa5" * 16    # nor after
        finally:
            dev.free(buf)


def test_upload_blocks_refuses_partial_blocks_and_overflow(small_staging):
    dev = small_staging
    vs, _ = repack_streams("q4_0", 1, 32)
    buf = dev.buffer(64, "device", "dst")
    try:
        with pytest.raises(ValueError, match="whole 18-byte blocks"):
            dev.upload_blocks(buf, 0, [np.zeros(20, np.uint8)], vs)
        with pytest.raises(ValueError, match="overflows"):
            dev.upload_blocks(buf, 0, [np.zeros(18 * 5, np.uint8)], vs)
    finally:
        dev.free(buf)


def test_large_chunks_fill_on_threads(rng):
    """Chunks of thousands of blocks are filled by several threads (Device._fill_pool): the same bytes."""
    with Device(staging_bytes=4 << 20, pipeline_cache=None) as dev:
        dev._fill_threads = 3
        rows, cols = 4801, 256                      # 38,408 Q4_0 blocks, cut in 3
        raw = rng.integers(0, 256, rows * row_bytes("q4_0", cols), np.uint8)
        want = _expect("q4_0", [raw], [rows], cols)
        for st, w in zip(repack_streams("q4_0", rows, cols), want):
            buf = dev.buffer(len(w), "device", "dst")
            assert dev.upload_blocks(buf, 0, [raw], st) == len(w)
            assert dev.download(buf, 0, len(w)).tobytes() == w
            dev.free(buf)
        assert dev._filler is not None
