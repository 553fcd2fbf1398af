"""Host sampling: the top-k selection in O(n) gives exactly the full stable
sort's order (ties by index, NaN last), so sampled tokens are what the full
sort gave for every seed."""
from __future__ import annotations

import numpy as np
import pytest

from vkengine.serving.sampling import Sampler, SamplingParams, top_order


def _rows(rng):
    n = 300
    yield rng.standard_normal(n).astype(np.float32)
    yield rng.integers(-3, 3, n).astype(np.float32)                   # many ties, across the k boundary
    x = rng.standard_normal(n)
    x[rng.choice(n, 40, replace=False)] = -np.inf
    x[rng.choice(n, 5, replace=False)] = np.inf
    yield x
    x = rng.integers(0, 4, n).astype(np.float32)
    x[rng.choice(n, 30, replace=False)] = np.nan
    yield x
    x = np.full(n, np.nan, np.float32)                                # fewer non-NaN values than k
    x[:10] = rng.standard_normal(10)
    yield x
    yield np.zeros(n, np.float32)                                     # all equal


def _long_rows(rng):
    """Vocabulary-sized rows (top_order's subsampled path)."""
    n = 49152
    yield (rng.standard_normal(n) * 3).astype(np.float32)
    yield rng.integers(-3, 3, n).astype(np.float32)                   # thousands of ties at the top
    x = rng.standard_normal(n)
    x[rng.choice(n, 40, replace=False)] = 50.0                        # a tie across k = 40
    yield x
    x = rng.standard_normal(n).astype(np.float32)
    x[np.arange(0, n, 16)[:50]] = np.nan                              # NaN among the sampled values
    x[1::97] = np.nan                                                 # and elsewhere
    yield x
    x = rng.standard_normal(n).astype(np.float32)
    x[3::16] = np.inf                                                 # the top is off the sample
    x[rng.choice(n, 100, replace=False)] = -np.inf
    yield x
    x = np.full(n, np.nan, np.float32)                                # fewer non-NaN values than k
    x[rng.choice(n, 20, replace=False)] = rng.standard_normal(20)
    yield x
    x = np.full(n, -np.inf, np.float32)
    x[5] = 0.0
    yield x
    x = rng.standard_normal(n).astype(np.float32)                     # NaN on k - 1 sampled values and
    x[np.arange(0, n, 16)[:39]] = np.nan                              # the row's maximum sampled: the
    x[16 * 100] = 100.0                                               # cut keeps fewer than k = 40
    yield x


@pytest.mark.parametrize("k", [1, 40, 700])
def test_top_order_equals_the_stable_sort_on_long_rows(rng, k):
    for x in _long_rows(rng):
        np.testing.assert_array_equal(top_order(x, k), np.argsort(-x, kind="stable")[:k])


@pytest.mark.parametrize("k", [1, 2, 7, 40, 299, 300, 301, 0, -1])
def test_top_order_equals_the_stable_sort(rng, k):
    for x in _rows(rng):
        want = np.argsort(-x, kind="stable")
        want = want[:k] if k > 0 else want
        got = top_order(x, k)
        np.testing.assert_array_equal(got, want)


def _reference_draw(p: SamplingParams, rng, logits: np.ndarray) -> int:
    """The sampler as it was, with a full stable sort (llama.cpp's order)."""
    idx = np.argsort(-logits, kind="stable")
    if p.top_k > 0:
        idx = idx[: p.top_k]
    lg = logits[idx].astype(np.float64)
    probs = np.exp(lg - lg[0])
    probs /= probs.sum()
    if p.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
        idx, lg, probs = idx[:keep], lg[:keep], probs[:keep]
    if p.min_p > 0.0:
        keep = probs >= p.min_p * probs[0]
        idx, lg = idx[keep], lg[keep]
    scaled = lg / p.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    return int(idx[rng.choice(len(idx), p=probs)])


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, seed=3),
    dict(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0, seed=4),
    dict(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0, seed=5),
    dict(temperature=2.0, top_k=1, seed=6),
    dict(temperature=1.0, top_k=200, top_p=0.99, min_p=0.01, seed=7),
])
def test_sampler_draws_what_the_full_sort_drew(rng, params):
    p = SamplingParams(**params)
    s = Sampler(p)
    ref_rng = np.random.default_rng(p.seed)
    for i in range(60):
        x = (rng.standard_normal(2000 if i % 2 else 49152) * 2).astype(np.float32)
        if i % 3 == 1:
            x = np.round(x).astype(np.float32)                         # ties at the top-k boundary
        assert s(x, []) == _reference_draw(p, ref_rng, x)
