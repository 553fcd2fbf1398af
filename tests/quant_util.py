"""Random weight matrices of every supported type, with float references."""
from __future__ import annotations

import numpy as np
from gguf import quants

from vkengine.kernels import Matrix
from vkengine.quant import BY_NAME, block_shape, dequantize, repack

K_QUANTS = ("q4_k", "q5_k", "q6_k", "iq4_xs")   # (256-value super-blocks)


def random_quantized(name: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0):
    """(GGUF bytes uint8 [rows, row_bytes], float32 reference [rows, cols])."""
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    if name == "f32":
        raw = x.view(np.uint8).reshape(rows, -1)
    elif name == "f16":
        raw = x.astype(np.float16).view(np.uint8).reshape(rows, -1)
    elif name in K_QUANTS:
        # gguf-py cannot quantize K-quants: random blocks with sane scales
        n, b = block_shape(name)
        blocks = rng.integers(0, 256, (rows * cols // n, b), dtype=np.uint8)
        d = (rng.uniform(0.002, 0.02, blocks.shape[0]) * scale).astype(np.float16).view(np.uint8).reshape(-1, 2)
        if name == "iq4_xs":      # d; random 6-bit scales (ls - 32: -32 to 31) and indices
            blocks[:, 0:2] = (d.view(np.float16) / 8).view(np.uint8).reshape(-1, 2)
        elif name == "q6_k":
            blocks[:, 208:210] = d
        else:
            blocks[:, 0:2] = d
            dmin = (rng.uniform(0.001, 0.01, blocks.shape[0]) * scale).astype(np.float16)
            blocks[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
        raw = blocks.reshape(rows, -1)
    elif name == "iq4_nl":
        # gguf-py cannot quantize IQ4_NL either: random indices under an f16 d of the levels' scale (127 ~ 3 sigma)
        n, b = block_shape(name)
        blocks = rng.integers(0, 256, (rows * cols // n, b), dtype=np.uint8)
        d = (rng.uniform(0.005, 0.03, blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        raw = blocks.reshape(rows, -1)
    else:
        raw = quants.quantize(x, BY_NAME[name]).view(np.uint8).reshape(rows, -1)
    return raw, dequantize(name, raw, rows, cols)


def upload_matrix(ws, name: str, raw: np.ndarray, rows: int, cols: int) -> Matrix:
    values, scales = repack(name, raw, rows, cols)
    data = ws.weight_region(values)
    sc = ws.weight_region(scales) if scales is not None else None
    return Matrix(name, rows, cols, data, sc)
