"""Gemma 2 and Gemma 3 (issue 32) on synthetic models (`vkengine synth --arch
gemma2|gemma3`): sliding-window layers among global ones (a window of 8
positions, shorter than the prompt), the two RoPE bases (gemma3), norms after
attention and the FFN, GELU-gated FFNs, embeddings times sqrt(n_embd), q/k
norms (gemma3: 256-wide heads, one KV head, as Gemma 3 270M/1B), score and
logit soft-caps (gemma2, a score cap of 5 so that it bites).

- The GGUF files hold what llama.cpp 11434 reads (src/models/gemma2.cpp,
  gemma3.cpp), transcribed below as data.
- The engine against the independent numpy reference (tests/ref_gemma.py),
  prefill against step-by-step decode, the GPUs' decode path, four sequences
  batched against each alone, GGUF against the Hugging Face copy (whose norm
  weights hold w where the GGUF's hold 1 + w).
- llama-server (CPU in CI; the Vulkan build on the GPU machine) on the same f32
  GGUF: its top-8 log-probabilities after every prefix of a prompt against ours,
  and its 12 greedy tokens against ours.
"""
from __future__ import annotations

import numpy as np
import pytest

from vkengine.engine import Readback
from vkengine.gguf_file import GGUFFile
from vkengine.model import load_model
from vkengine.tools.synth.llama import SynthConfig, config_for, synth_llama

from .ref_gemma import RefGemma
from .test_gguf_qwen35 import assert_tensors
from .test_models import GPU_DECODE, PROMPT, _assert_logits_close, _batched_and_alone, _prefill_logits
from .test_models_llama_family import (
    _engine,
    assert_hf_variant_refused,
    assert_llama_server_agrees,
    assert_served_in_batches,
)

ARCHES = ["gemma2", "gemma3"]
CONFIGS = {"gemma2": SynthConfig(n_embd=64, n_layer=3, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="gemma2",
                                 head_size=32, tied=True, window=8, attn_softcap=5.0),
           "gemma3": SynthConfig(n_embd=64, n_layer=6, n_head=2, n_head_kv=1, n_ff=160, n_ctx=256, arch="gemma3",
                                 head_size=256, tied=True, window=8, rope_base=1e6)}
# llama-server agreement bound (nats, top-8 log-probabilities), from the measured gaps (lavapipe, 11434 CPU,
# 2026-12-03): gemma2 1.2e-3, gemma3 4.4e-3 (llama.cpp's CPU GELU reads its input rounded to f16: ggml's
# GGML_GELU_FP16 table); the greedy tokens equal
TOL = {"gemma2": 5e-3, "gemma3": 1e-2}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_source):
    out = tmp_path_factory.mktemp("synth-gemma")
    return {(a, q): synth_llama(CONFIGS[a], q, seed=13, out_dir=out, name=f"{a}-tiny", workers=1,
                                tokenizer_from=tokenizer_source, formats=("gguf", "hf") if q == "q8_0" else ("gguf",))
            for a in ARCHES for q in ("q8_0", "f32")}


def expected_tensors(f: GGUFFile) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """name -> (numpy shape, required type or None) as llama.cpp's loader
    creates them for gemma2 / gemma3 (no output.weight: tied)."""
    a, m = f.arch, f.meta
    D, L = int(m(f"{a}.embedding_length")), int(m(f"{a}.block_count"))
    H = int(m(f"{a}.attention.head_count"))
    Hkv = int(m(f"{a}.attention.head_count_kv", H))
    hd = int(m(f"{a}.attention.key_length"))
    F = int(m(f"{a}.feed_forward_length"))
    V = f.tensor_info("token_embd.weight")[1][0]
    t: dict[str, tuple[tuple[int, ...], str | None]] = {"token_embd.weight": ((V, D), None),
                                                        "output_norm.weight": ((D,), "f32")}
    for i in range(L):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": ((D,), "f32"), p + "attn_q.weight": ((H * hd, D), None),
                  p + "attn_k.weight": ((Hkv * hd, D), None), p + "attn_v.weight": ((Hkv * hd, D), None),
                  p + "attn_output.weight": ((D, H * hd), None), p + "post_attention_norm.weight": ((D,), "f32"),
                  p + "ffn_norm.weight": ((D,), "f32"), p + "ffn_gate.weight": ((F, D), None),
                  p + "ffn_up.weight": ((F, D), None), p + "ffn_down.weight": ((D, F), None),
                  p + "post_ffw_norm.weight": ((D,), "f32")})
        if a == "gemma3":
            t.update({p + "attn_q_norm.weight": ((hd,), "f32"), p + "attn_k_norm.weight": ((hd,), "f32")})
    return t


@pytest.mark.parametrize("arch", ARCHES)
def test_gguf_has_what_llama_cpp_reads(models, arch):
    f = GGUFFile(models[(arch, "q8_0")]["gguf"])
    assert f.arch == arch
    for k in ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
              "attention.layer_norm_rms_epsilon", "attention.key_length", "attention.sliding_window"):
        assert f.meta(f"{arch}.{k}", None) is not None, k
    if arch == "gemma2":
        assert f.meta("gemma2.attn_logit_softcapping") == 5.0
        assert f.meta("gemma2.final_logit_softcapping") == 30.0
    assert_tensors(f, expected_tensors(f))


@pytest.mark.parametrize("arch", ARCHES)
def test_args_from_the_file(models, arch):
    """GGUF metadata (llama.cpp's rules) and config.json give the same
    hyperparameters: the layer kinds, the window, the RoPE bases, the scale."""
    c = CONFIGS[arch]
    for fmt in ("gguf", "hf"):
        a = load_model(models[(arch, "q8_0")][fmt]).args
        want_swa = (True, False, True) if arch == "gemma2" else (True,) * 5 + (False,)
        assert a.swa == want_swa and a.window == 8, fmt
        assert a.attn_scale == pytest.approx(c.head_dim ** -0.5), fmt
        assert (a.attn_softcap, a.final_softcap) == ((5.0, 30.0) if arch == "gemma2" else (0.0, 0.0)), fmt
        assert (a.rope_base, a.rope_base_swa) == ((1e6, 1e4) if arch == "gemma3" else (1e5, 1e5)), fmt
        assert a.qk_norm == (arch == "gemma3") and a.head_dim == c.head_dim, fmt


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("quant", ["q8_0", "f32"])
def test_prefill_matches_numpy_reference(device, models, arch, quant):
    m, eng = _engine(device, models[(arch, quant)]["gguf"])
    ids = m.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * CONFIGS[arch].window
    _assert_logits_close(_prefill_logits(eng, ids), RefGemma(m.file, m.args).logits(ids))


@pytest.mark.parametrize("arch", ARCHES)
def test_window_changes_the_result(device, models, arch):
    """The reference with the window off differs from the engine past the
    window (the window is what the engine computes, not a no-op)."""
    import dataclasses
    m, eng = _engine(device, models[(arch, "f32")]["gguf"])
    ids = m.tokenizer.encode(PROMPT)
    got = _prefill_logits(eng, ids)
    full = RefGemma(m.file, dataclasses.replace(m.args, window=0)).logits(ids)
    w = CONFIGS[arch].window
    np.testing.assert_allclose(got[:w], full[:w], rtol=0, atol=2e-3 * float(np.abs(full).max()))
    assert float(np.abs(got[w:] - full[w:]).max()) > 0.05 * float(np.abs(full).max())


@pytest.mark.parametrize("arch", ARCHES)
def test_prefill_equals_step_by_step_decode(device, models, arch):
    m, eng = _engine(device, models[(arch, "q8_0")]["gguf"])
    ids = m.tokenizer.encode(PROMPT)
    pre = _prefill_logits(eng, ids, slot=1)
    steps = np.stack([eng.step([t], [p], [2], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    np.testing.assert_allclose(steps, pre, rtol=0, atol=1e-4 * float(np.abs(pre).max()))


@pytest.mark.parametrize("arch", ARCHES)
def test_gpu_decode_path(device, models, arch):
    """The GPUs' decode path (split-K matvecs, split decode attention by
    KV-head group, windowed): decode steps past the window match the numpy
    reference, and four sequences batched give bit for bit the logits each
    gives alone."""
    caps = {**GPU_DECODE, "split_attention": True, "attention_dec": True, "attn_items": 16}
    m, eng = _engine(device, models[(arch, "q8_0")]["gguf"], caps=caps)
    ids = m.tokenizer.encode(PROMPT)[:14]
    want = RefGemma(m.file, m.args).logits(ids)
    steps = np.stack([eng.step([t], [p], [1], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    _assert_logits_close(steps, want)
    both, alone = _batched_and_alone(m, eng)
    np.testing.assert_array_equal(both, alone)
    labels = {op.label for prog in eng._programs.values() for op in prog.ops if op.kind == "dispatch"}
    assert ("norm_rope_kv" in labels) == (arch == "gemma3")
    assert ("softcap" in labels) == (arch == "gemma2")


@pytest.mark.parametrize("arch", ARCHES)
def test_gguf_and_hf_copy_agree(device, models, arch):
    mg, eg = _engine(device, models[(arch, "q8_0")]["gguf"])
    mh, eh = _engine(device, models[(arch, "q8_0")]["hf"])
    ids = mg.tokenizer.encode(PROMPT)
    assert ids == mh.tokenizer.encode(PROMPT)
    a, b = _prefill_logits(eg, ids), _prefill_logits(eh, ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * float(np.abs(a).max()))


def _long_ids(m, n: int, seed: int = 5) -> list[int]:
    return np.random.default_rng(seed).integers(0, m.args.n_vocab, n).tolist()


@pytest.mark.parametrize("arch", ARCHES)
def test_bounded_window_cache(device, models, arch):
    """The sliding-window layers' KV rows live in rings of window + 2 x
    max_batch positions (136 here, against the context's 256): a 200-token
    prompt in chunks of 64 and decode steps past it wrap the ring, and every
    row's logits still match the numpy reference; the cache takes less memory
    than full rows would; a slot parked and restored elsewhere continues as
    the original does; going back past what the ring holds is refused, going
    back within it and restarting at 0 are not."""
    from vkengine.errors import VkEngineError
    from vkengine.state import KVCache
    m, eng = _engine(device, models[(arch, "q8_0")]["gguf"])
    kv = eng.kv
    swa = [i for i, s in enumerate(m.args.swa) if s]
    assert [kv.ring(i) for i in swa] == [136] * len(swa) and all(kv.ring(i) == 0 for i in range(m.args.n_layer)
                                                                  if i not in swa)
    full = KVCache.bytes_needed(m.args.n_layer, 4, 256, m.args.n_kv_heads, m.args.head_dim)
    assert kv.nbytes < full - len(swa) * 4 * 100 * KVCache.position_bytes(1, m.args.n_kv_heads, m.args.head_dim)
    ids = _long_ids(m, 216)
    want = RefGemma(m.file, m.args).logits(ids)
    got = []
    for a in range(0, 200, 64):            # prompt chunks of at most 64 rows (the engine's max_batch)
        chunk = ids[a:min(a + 64, 200)]
        got.append(eng.step(chunk, range(a, a + len(chunk)), [1] * len(chunk), range(len(chunk)),
                            Readback.LOGITS))
    parked = kv.park(1, 200)
    for p in range(200, 216):              # decode steps
        got.append(eng.step([ids[p]], [p], [1], [0], Readback.LOGITS))
    _assert_logits_close(np.concatenate(got), want)
    # restored into slot 3: the same decode logits as slot 1 gave
    kv.restore(parked, 3)
    again = np.stack([eng.step([ids[p]], [p], [3], [0], Readback.LOGITS)[0] for p in range(200, 216)])
    np.testing.assert_allclose(again, np.concatenate(got[-16:]), rtol=0, atol=1e-5 * float(np.abs(again).max()))
    with pytest.raises(VkEngineError, match="too far back"):
        eng.step([ids[20]], [20], [1], [0], Readback.LOGITS)
    assert kv.reusable_prefix(1, 20) == 0 and kv.reusable_parked(parked, 20) == 0
    assert kv.reusable_prefix(1, 205) == 205          # within the ring: positions 198..204 still held
    back = eng.step([ids[205]], [205], [1], [0], Readback.LOGITS)[0]
    np.testing.assert_allclose(back, got[-11][0], rtol=0, atol=1e-5 * float(np.abs(back).max()))
    restart = eng.step(ids[:8], range(8), [1] * 8, range(8), Readback.LOGITS)
    _assert_logits_close(restart, want[:8])


def test_multimodal_folder_loads_its_text_model(device, models, tmp_path):
    """A Gemma3ForConditionalGeneration folder (Gemma 3 4B and up: the text
    model's config under text_config, its tensors under model.language_model.,
    a vision tower beside them) gives the text model's logits."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file
    src = models[("gemma3", "q8_0")]["hf"]
    folder = tmp_path / "mm"
    shutil.copytree(src, folder)
    tensors = load_file(str(folder / "model.safetensors"))
    mm = {"model.language_model." + k[len("model."):]: v for k, v in tensors.items()}
    mm["model.vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((8, 3, 2, 2), np.float32)
    mm["model.multi_modal_projector.mm_input_projection_weight"] = np.zeros((8, 64), np.float32)
    (folder / "model.safetensors").unlink()
    save_file(mm, str(folder / "model.safetensors"))
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {**text, "model_type": "gemma3_text"}, "vision_config": {"model_type": "siglip_vision_model"},
        "mm_tokens_per_image": 256}))
    mt, et = _engine(device, src)
    mm_model, em = _engine(device, folder)
    ids = mt.tokenizer.encode(PROMPT)
    np.testing.assert_array_equal(_prefill_logits(em, ids), _prefill_logits(et, ids))


def _cached_tokens(url: str) -> float:
    import httpx
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vkengine_prompt_tokens_cached_total"):
            return float(line.split()[-1])
    raise AssertionError("no prompt_tokens_cached counter in /metrics")


def test_server_prefix_cache_over_rings(models, tmp_path):
    """`vkengine serve` on a model whose sliding-window layers keep rings (136
    positions: window 8 + 2 x 64-row steps, context 512): a 300-token prompt,
    then one that extends it (the prefix cache reuses the slot's 300+ rows,
    which the ring allows), then one sharing only its first 150 tokens (too far
    back for the ring: prefilled afresh) give what a server that never saw the
    first gives, and the prefix cache's counter shows which requests reused rows."""
    import httpx

    from .serving import ServerProcess
    rng = np.random.default_rng(3)
    words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "north", "quiet"]
    long = " ".join(rng.choice(words, 300))
    half = " ".join(long.split()[:150])
    prompts = [long, long + " and then", half + " but instead"]

    def run(prompts: list[str], name: str) -> tuple[list[str], list[float]]:
        # (--prompt-tokens 64: steps of at most 64 rows on any device; a GPU's default lone-prompt chunk makes
        # the ring the whole context, and the third request then reuses its 150 tokens)
        srv = ServerProcess(["--model", str(models[("gemma3", "q8_0")]["gguf"]), "--ctx", "512", "--parallel", "1",
                             "--prompt-tokens", "64"], tmp_path / f"{name}.log")
        try:
            out, cached = [], []
            for p in prompts:
                r = httpx.post(srv.url + "/v1/completions", timeout=300,
                               json={"prompt": p, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                out.append(r.json()["choices"][0]["text"])
                cached.append(_cached_tokens(srv.url))
            return out, cached
        finally:
            srv.stop()
    cached_out, counts = run(prompts, "cache")
    assert counts[0] == 0 and counts[1] >= 300 and counts[2] == counts[1], counts   # (a running total)
    # the last two on a server that never saw the first (nothing to reuse: the third shares too little)
    fresh_out, fresh_counts = run(prompts[1:], "fresh")
    assert fresh_counts == [0, 0]
    assert cached_out[1:] == fresh_out


def test_synth_real_shapes_config():
    g = config_for("gemma3-270m", None, "gemma3")
    assert (g.n_embd, g.n_layer, g.n_head, g.n_head_kv, g.head_dim, g.window) == (640, 18, 4, 1, 256, 512)
    g = config_for("gemma3-4b", None, "gemma3")
    assert (g.n_embd, g.n_layer, g.head_dim, g.window, g.rope_linear) == (2560, 34, 256, 1024, 8.0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_server_agrees_with_engine(device, models, llama_server_exe, arch):
    """On f32 weights: llama.cpp's top-8 log-probabilities after every prefix of
    the prompt against the engine's (the same top-1 everywhere), and 12 greedy
    tokens."""
    path = models[(arch, "f32")]["gguf"]
    m, eng = _engine(device, path)
    assert_llama_server_agrees(m, eng, path, llama_server_exe, TOL[arch])


@pytest.mark.parametrize("arch", ARCHES)
def test_served_in_batches(models, arch, tmp_path):
    """`vkengine serve` on the model: four greedy chat completions at once (one
    batch) give what each gives alone."""
    assert_served_in_batches(models[(arch, "q8_0")]["gguf"], tmp_path)


def test_unsupported_variants_are_refused(models, tmp_path):
    """A Gemma checkpoint with projection biases, another activation, or RoPE
    scaling of other kinds is a clear error, not a silent difference."""
    src = models[("gemma3", "q8_0")]["hf"]
    assert_hf_variant_refused(src, tmp_path / "bias", "attn_q.bias",
                              tensors={"model.layers.0.self_attn.q_proj.bias": np.zeros(512, np.float32)})
    for change, match in (({"hidden_activation": "silu"}, "hidden_activation"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling")):
        assert_hf_variant_refused(src, tmp_path / next(iter(change)), match, config=change)
