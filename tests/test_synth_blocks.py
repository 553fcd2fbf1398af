"""vkengine synth's random blocks (writer.random_blocks): the q4_0 / q8_0
matrices of bench-sized models drawn as GGUF blocks directly."""
from __future__ import annotations

import numpy as np
import pytest

from vkengine.quant import dequantize
from vkengine.tools.synth.writer import draws_blocks, random_blocks


@pytest.mark.parametrize("quant,block", [("q4_0", 18), ("q8_0", 34)])
def test_random_blocks_have_the_asked_spread(quant, block):
    rows, cols, std = 512, 2048, 0.02
    raw = random_blocks(np.random.default_rng(7), quant, rows * cols, std)
    assert raw is not None and raw.dtype == np.uint8 and raw.size == rows * cols // 32 * block
    w = dequantize(quant, raw, rows, cols)
    assert np.isfinite(w).all()
    assert abs(float(w.std()) / std - 1.0) < 0.05                     # the spread asked for
    assert abs(float(w.mean())) < 0.01 * std                           # symmetric codes: no offset
    assert float(np.abs(w).max()) < 3.0 * std                          # (no outliers beyond the codes' range)
    # per row too: each row's spread near std (a matvec of any row sums alike)
    assert np.allclose(w.std(axis=1), std, rtol=0.15)
    # the same generator state gives the same bytes (a tensor is a function of (seed, name))
    assert np.array_equal(raw, random_blocks(np.random.default_rng(7), quant, rows * cols, std))


def test_other_types_are_drawn_as_weights():
    rng = np.random.default_rng(1)
    for quant in ("f32", "f16", "q4_1", "q5_0", "mxfp4"):
        assert random_blocks(rng, quant, 1024, 0.02) is None
    assert random_blocks(rng, "q4_0", 1000, 0.02) is None              # not whole blocks


def test_only_bench_sized_models_draw_blocks():
    """The tests' tiny and small models keep Gaussian weights (their references
    and parity artifacts were made from them); the bench shapes draw blocks."""
    from vkengine.tools.synth import llama, qwen35

    def bench_sized(plan) -> bool:
        return draws_blocks(p[1] for p in plan)
    n_vocab = 49152
    for shape in ("tiny", "small"):
        assert not bench_sized(llama._tensor_plan(llama.config_for(shape), n_vocab))
    assert not bench_sized(llama._tensor_plan(llama.config_for("tiny-moe", None, "qwen3moe"), n_vocab))
    for arch in ("qwen35", "qwen35moe"):
        assert not bench_sized(qwen35._tensor_plan(qwen35.config_for(arch, "tiny"), n_vocab))
    assert bench_sized(llama._tensor_plan(llama.config_for("1b"), n_vocab))
    assert bench_sized(qwen35._tensor_plan(qwen35.config_for("qwen35", "0.8B"), 248320))
