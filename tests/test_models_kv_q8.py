"""Model level with a q8_0 KV cache (EngineConfig.kv_types, --cache-type-k/-v):
tiny llama and qwen35 models with 64-wide heads against the numpy references
that round K and V to the same blocks, prefill against step-by-step decode
(also on the GPUs' decode path, whose QKV matvec then leaves the cache write
to rope_kv), and the per-sequence state's round trips (park/restore, prefix
copies) in the q8_0 layout."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.errors import VkEngineError
from vkengine.kernels import Caps, KVTypes
from vkengine.model import load_model
from vkengine.serving.generate import generate
from vkengine.state import KVCache
from vkengine.tools.synth.llama import SynthConfig, synth_llama
from vkengine.tools.synth.qwen35 import SHAPES, synth_qwen35
from vkengine.tools.synth.writer import tokenizer_meta

from .ref_llama import RefLlama
from .ref_qwen35 import RefQwen35
from .test_models import assert_batched_equals_alone

PROMPT = "The quick brown fox jumps over the lazy dog. 1234567, and then"
Q8 = KVTypes("q8_0", "q8_0")
GPU_DECODE = {"split_k": True, "multi_column_from": 2, "norm_in": True, "split_attention": True,
              "attention_dec": True, "attn_items": 16}   # the GPUs' decode path (tests/test_models.py)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_source):
    """A tiny llama and a tiny qwen35 with 64-wide heads (q8_0 rows are whole 64-value units)."""
    out = tmp_path_factory.mktemp("synth-kvq8")
    llama = synth_llama(SynthConfig(n_embd=128, n_layer=2, n_head=2, n_head_kv=1, n_ff=160, n_ctx=256), "q8_0",
                        seed=5, out_dir=out, name="llama-hd64", workers=1, tokenizer_from=tokenizer_source)
    qcfg = dataclasses.replace(SHAPES[("qwen35", "tiny")], head_dim=64)
    qwen = synth_qwen35(qcfg, "q8_0", seed=13, out_dir=out, name="qwen35-hd64", workers=1,
                        tmeta=tokenizer_meta(tokenizer_source))
    return {"llama": load_model(llama["gguf"]), "qwen35": load_model(qwen["gguf"])}


def _engine(device, model, kv: KVTypes = Q8, caps: dict | None = None, **kw) -> Engine:
    cfg = EngineConfig(**{"n_slots": 4, "n_ctx": 190, "max_batch": 64, "max_out": 64, "kv_types": kv, **kw})
    c = dataclasses.replace(Caps.detect(device), xq8_in=False, **(caps or {}))
    return Engine(model, device, cfg, caps=c)


def _reference(model, kv: KVTypes):
    types = (kv.k, kv.v)
    if model.file.arch == "llama":
        ref = RefLlama(model.file, model.args)
        return lambda ids: ref.logits(ids, kv=types)
    return RefQwen35(model.file, model.args, kv=types).logits


def _prefill(eng, ids, slot=0):
    return eng.step(ids, range(len(ids)), [slot] * len(ids), range(len(ids)), Readback.LOGITS)


def _err(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("kv", [Q8, KVTypes("q8_0", "f16"), KVTypes("f16", "q8_0")])
def test_prefill_matches_reference_with_q8_cache(device, models, arch, kv):
    """Prefill logits against the reference whose K and V (or one of them) go
    through the same q8_0 blocks; they are closer to it than to the f16
    reference (the blocks are what the engine attended to)."""
    m = models[arch]
    eng = _engine(device, m, kv)
    assert eng.kv.types == kv
    ids = m.tokenizer.encode(PROMPT)
    got = _prefill(eng, ids)
    want = _reference(m, kv)(ids)
    assert _err(got, want) <= 2e-3, _err(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    assert _err(got, want) < 0.5 * _err(got, _reference(m, KVTypes())(ids))


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_greedy_decode_matches_reference_with_q8_cache(device, models, arch):
    m = models[arch]
    eng = _engine(device, m)
    ids = m.tokenizer.encode(PROMPT)
    toks = [s.token for s in generate(eng, ids, 8, ignore_eos=True)]
    want = _reference(m, Q8)(ids + toks)[len(ids) - 1:-1].argmax(-1)
    assert (np.asarray(toks) == want).sum() >= len(toks) - 1   # one near-tie flip allowed on random weights


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_prefill_equals_step_by_step_decode_with_q8_cache(device, models, arch):
    m = models[arch]
    eng = _engine(device, m)
    ids = m.tokenizer.encode(PROMPT)
    pre = _prefill(eng, ids, slot=1)
    steps = np.stack([eng.step([t], [p], [2], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    np.testing.assert_allclose(steps, pre, rtol=0, atol=1e-4 * float(np.abs(pre).max()))


def test_gpu_decode_path_at_depth_with_q8_cache(device, models):
    """The GPUs' decode path over a q8_0 cache: the split-K QKV matvec, which
    fuses RoPE and the cache write for an f16 cache, leaves them to rope_kv
    here, and split decode attention (attention_dec, parts of 32+ positions)
    reads the blocks. Decoding from position 100 to 124 matches the reference,
    writes the blocks a prefill writes (bit for bit), and rows of three
    sequences at different depths batched equal each alone, bit for bit.
    The prompt runs on the matvecs too, as on lavapipe, so that the cache
    holds the blocks the reference rounds to. GPUs also check the default
    prompt path (the tiled matmuls, fp16 sums): a K or V value that lands one
    quant step from the reference's moves the logits by far more than the
    rounding that put it there (H100: 3.26e-3 with q8_0 against 4.20e-4 with
    an f16 cache; on the matvecs 1.02e-5 and 4.82e-5), so its bound is ten
    times the f16 cache's distance on that path."""
    m = models["llama"]
    ids = (m.tokenizer.encode(PROMPT) * 40)[:124]

    def decode_at_depth(kv: KVTypes, **caps) -> tuple[Engine, float]:
        eng = _engine(device, m, kv, caps={**GPU_DECODE, **caps})
        eng.prefill(ids[:100], 1)
        steps = np.stack([eng.step([ids[p]], [p], [1], [0], Readback.LOGITS)[0] for p in range(100, 124)])
        return eng, _err(steps, _reference(m, kv)(ids)[100:])

    eng, err = decode_at_depth(Q8, coopmat=False, tiled_from=None)
    assert err <= 2e-3, err
    if device.info.type != "cpu":
        tiled, f16 = decode_at_depth(Q8)[1], decode_at_depth(KVTypes())[1]
        assert tiled <= max(2e-3, 10 * f16), (tiled, f16)
    labels = [op.label for (n, *_), prog in eng._programs.items() if n == 1 for op in prog.ops
              if op.kind == "dispatch"]
    assert any(lb.startswith("mul_mat qkv") for lb in labels) and not any(lb.endswith("+rope_kv") for lb in labels)
    assert "rope_kv" in labels
    assert {"rope_kv_kvq8", "attention_dec_kvq8"} <= {key[0] for key in device._algorithms}
    eng.prefill(ids, 3)
    for a, b in zip(_slot_rows(eng.kv, 1, len(ids)), _slot_rows(eng.kv, 3, len(ids))):
        if device.info.type == "cpu":   # lavapipe: prompt and decode rows take the same arithmetic
            np.testing.assert_array_equal(a, b)
        else:   # GPUs: a prompt's matvecs of many columns need not round as decode's split-K ones (nor
            # a 124-row prompt as a 100-row one), so a value may land one quant step away
            np.testing.assert_allclose(a, b, rtol=0, atol=2 * float(np.abs(b).max()) / 127)
    assert_batched_equals_alone(eng, ids, (40, 90, 120))


# -- per-sequence state in the q8_0 layout ------------------------------------------------

def _slot_rows(kv, slot: int, n: int) -> list[np.ndarray]:
    return [x for layer in kv.layers for x in kv.read(layer, slot, n)]


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
@pytest.mark.parametrize("kv", [Q8, KVTypes("f16", "q8_0")])
def test_park_restore_round_trip_with_q8_cache(device, models, arch, kv):
    """A parked slot restored into another holds the same quants and scales
    (bit for bit) and continues with the same logits; a llama prefix restored
    (fewer positions than parked) too."""
    m = models[arch]
    eng = _engine(device, m, kv)
    ids = m.tokenizer.encode(PROMPT)
    eng.prefill(ids, 0)
    before = _slot_rows(eng.kv, 0, len(ids))
    parked = eng.kv.park(0, len(ids))
    assert parked.buffer.nbytes >= len(ids) * eng.kv.bytes_per_position()
    want = eng.step([42], [len(ids)], [0], [0], Readback.LOGITS)[0]
    eng.prefill(m.tokenizer.encode("something else entirely, and longer than that"), 0)   # overwrite slot 0
    eng.kv.restore(parked, 2)
    for a, b in zip(_slot_rows(eng.kv, 2, len(ids)), before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(eng.step([42], [len(ids)], [2], [0], Readback.LOGITS)[0], want)
    if eng.kv.rewindable:   # a prefix of the parked rows (prefix cache)
        n = 9
        eng.kv.restore(parked, 3, n)
        for a, b in zip(_slot_rows(eng.kv, 3, n), before):
            np.testing.assert_array_equal(a, b[:n])
        got = eng.prefill(ids[n:], 3, start=n, readback=Readback.LOGITS)
        np.testing.assert_array_equal(got, eng.prefill(ids, 1, readback=Readback.LOGITS))


@pytest.mark.parametrize("arch", ["llama", "qwen35"])
def test_copy_prefix_with_q8_cache(device, models, arch):
    """The prefix cache's copy between slots: the same blocks, and continuing
    the copy gives the logits of a whole prefill."""
    m = models[arch]
    eng = _engine(device, m)
    ids = m.tokenizer.encode(PROMPT)
    n = 8
    eng.prefill(ids[:n], 0)
    eng.kv.copy_prefix(0, 1, n)
    for a, b in zip(_slot_rows(eng.kv, 1, n), _slot_rows(eng.kv, 0, n)):
        np.testing.assert_array_equal(a, b)
    got = eng.prefill(ids[n:], 1, start=n, readback=Readback.LOGITS)
    np.testing.assert_allclose(got, eng.prefill(ids, 2, readback=Readback.LOGITS), rtol=0,
                               atol=1e-4 * float(np.abs(got).max()))


def test_state_sizes_with_q8_cache(device, models):
    """A q8_0 side takes 17/32 of an f16 side's bytes; slots hold a multiple
    of 4 positions; the engine's memory estimate counts what the cache holds."""
    m = models["llama"]
    a = m.args
    f16 = KVCache.position_bytes(a.n_layer, a.n_head_kv, a.head_dim)
    assert KVCache.position_bytes(a.n_layer, a.n_head_kv, a.head_dim, Q8) * 32 == f16 * 17
    assert KVCache.position_bytes(a.n_layer, a.n_head_kv, a.head_dim, KVTypes("q8_0", "f16")) * 64 == f16 * 49
    eng = _engine(device, m, n_ctx=190)
    assert eng.kv.cap == 192 and eng.kv.ctx == 190
    assert eng.kv.nbytes >= KVCache.bytes_needed(a.n_layer, 4, 190, a.n_head_kv, a.head_dim, Q8)
    per_pos, per_slot = m.arch.state_bytes(a, 4, 190, Q8)
    assert per_pos * 190 + per_slot == KVCache.bytes_needed(a.n_layer, 1, 190, a.n_head_kv, a.head_dim, Q8)


def test_q8_cache_needs_heads_of_64(device, models):
    """A model whose head size is not a multiple of 64 is refused with the
    flags that work, before its weights load; other cache types too."""
    m = models["llama"]
    odd = dataclasses.replace(m, args=dataclasses.replace(m.args, head_dim=48))
    with pytest.raises(VkEngineError, match="multiple of 64, and this model's is 48: use --cache-type-k f16"):
        Engine(odd, device, EngineConfig(n_ctx=64, kv_types=KVTypes("f16", "q8_0")))
    with pytest.raises(VkEngineError, match="--cache-type-v q4_0: the KV cache can be f16 or q8_0"):
        KVTypes("f16", "q4_0")
