"""gpt-oss (issue 32) on synthetic models (`vkengine synth --arch gpt-oss`): q/k/v
and output biases, YaRN (factor 4 from 64 positions), attention sinks, a
sliding window of 8 on the even layers, a router with a bias, experts with
biases and the clamped SwiGLU; f32, q8_0 and MXFP4 (gpt-oss's expert type)
weights.

- The GGUF files hold what llama.cpp 11434 reads (src/models/openai-moe.cpp),
  transcribed below as data.
- The engine against the independent numpy reference (tests/ref_gptoss.py),
  prefill against step-by-step decode, the GPUs' decode path, four sequences
  batched against each alone.
- llama-server (CPU in CI; the Vulkan build on the GPU machine) on the same f32
  GGUF: its top-8 log-probabilities after every prefix of a prompt against ours,
  and its 12 greedy tokens against ours.
- Hugging Face folders as openai/gpt-oss-20b's (MXFP4 `_blocks`/`_scales`,
  or dequantized experts) against the reference on the GGUF twin's weights;
  transformers is their oracle on the GPU machine (tests/gpu/hf_oracle_dense.py
  --arch gpt-oss).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from vkengine.engine import Readback
from vkengine.gguf_file import GGUFFile
from vkengine.model import load_model
from vkengine.tools.synth.llama import SynthConfig, synth_llama

from .ref_gptoss import RefGptOss
from .test_gguf_qwen35 import assert_tensors
from .test_models import GPU_DECODE, PROMPT, _assert_logits_close, _batched_and_alone, _prefill_logits
from .test_models_llama_family import TOL_VULKAN, _engine, assert_llama_server_agrees, assert_served_in_batches

CONFIG = SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=64, n_ctx=256, arch="gpt-oss", head_size=32,
                     n_expert=8, n_expert_used=2, n_ff_exp=32, window=8, yarn_factor=4.0, yarn_orig_ctx=64,
                     rope_base=150000.0)
QUANTS = ("f32", "q8_0", "mxfp4")
# llama-server agreement bound (nats, top-8 log-probabilities; CPU build, f32 weights), from the measured gap
# (lavapipe, 11434 CPU, 2026-12-03): 2.25e-2 with llama-server's default flash attention, 1.37e-2 with -fa off
# (its CPU attention takes q and the softmax weights as f16, the flash form accumulates V in f16 too; the
# biased q and k here are large), while the engine agrees with the float64 reference to 2e-6 of the largest
# logit; top-1 equal at every prefix and the greedy tokens equal
TOL = 3e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_source):
    out = tmp_path_factory.mktemp("synth-gptoss")
    return {q: synth_llama(CONFIG, q, seed=17, out_dir=out, name="gptoss-tiny", workers=1,
                           tokenizer_from=tokenizer_source, formats=("gguf",))["gguf"] for q in QUANTS}


def expected_tensors(f: GGUFFile) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """name -> (numpy shape, required type or None) as llama.cpp's loader creates them for gpt-oss."""
    a, m = f.arch, f.meta
    D, L = int(m(f"{a}.embedding_length")), int(m(f"{a}.block_count"))
    H, Hkv = int(m(f"{a}.attention.head_count")), int(m(f"{a}.attention.head_count_kv"))
    hd = int(m(f"{a}.attention.key_length"))
    E, F = int(m(f"{a}.expert_count")), int(m(f"{a}.expert_feed_forward_length"))
    V = f.tensor_info("token_embd.weight")[1][0]
    t: dict[str, tuple[tuple[int, ...], str | None]] = {
        "token_embd.weight": ((V, D), None), "output_norm.weight": ((D,), "f32"), "output.weight": ((V, D), None)}
    for i in range(L):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": ((D,), "f32"), p + "attn_q.weight": ((H * hd, D), None),
                  p + "attn_q.bias": ((H * hd,), "f32"), p + "attn_k.weight": ((Hkv * hd, D), None),
                  p + "attn_k.bias": ((Hkv * hd,), "f32"), p + "attn_v.weight": ((Hkv * hd, D), None),
                  p + "attn_v.bias": ((Hkv * hd,), "f32"), p + "attn_output.weight": ((D, H * hd), None),
                  p + "attn_output.bias": ((D,), "f32"), p + "attn_sinks.weight": ((H,), "f32"),
                  p + "post_attention_norm.weight": ((D,), "f32"), p + "ffn_gate_inp.weight": ((E, D), None),
                  p + "ffn_gate_inp.bias": ((E,), "f32"), p + "ffn_gate_exps.weight": ((E, F, D), None),
                  p + "ffn_gate_exps.bias": ((E, F), "f32"), p + "ffn_up_exps.weight": ((E, F, D), None),
                  p + "ffn_up_exps.bias": ((E, F), "f32"), p + "ffn_down_exps.weight": ((E, D, F), None),
                  p + "ffn_down_exps.bias": ((E, D), "f32")})
    return t


def test_gguf_has_what_llama_cpp_reads(models):
    f = GGUFFile(models["mxfp4"])
    assert f.arch == "gpt-oss"
    for k in ("context_length", "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
              "attention.key_length", "attention.sliding_window", "expert_count", "expert_used_count",
              "expert_feed_forward_length", "rope.freq_base", "attention.layer_norm_rms_epsilon"):
        assert f.meta(f"gpt-oss.{k}", None) is not None, k
    assert f.meta("gpt-oss.rope.scaling.type") == "yarn"
    assert_tensors(f, expected_tensors(f))
    assert f.tensor_info("blk.0.ffn_gate_exps.weight")[0] == "mxfp4"


def test_args_from_the_file(models):
    a = load_model(models["q8_0"]).args
    assert a.swa == (True, False) and a.window == 8
    assert (a.n_expert, a.n_expert_used, a.n_ff_exp, a.head_dim) == (8, 2, 32, 32)
    assert (a.yarn.factor, a.yarn.orig_ctx) == (4.0, 64)


@pytest.mark.parametrize("quant", QUANTS)
def test_prefill_matches_numpy_reference(device, models, quant):
    m, eng = _engine(device, models[quant])
    ids = m.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * CONFIG.window
    _assert_logits_close(_prefill_logits(eng, ids), RefGptOss(m.file, m.args).logits(ids))


def test_sinks_and_window_change_the_result(device, models):
    """The reference without the sinks, or without the window, is far from what
    the engine computes (neither is a no-op)."""
    import dataclasses
    m, eng = _engine(device, models["f32"])
    ids = m.tokenizer.encode(PROMPT)
    got = _prefill_logits(eng, ids)
    scale = float(np.abs(got).max())
    ref = RefGptOss(m.file, m.args)
    for i in range(m.args.n_layer):
        ref.w[f"blk.{i}.attn_sinks.weight"] = np.full(m.args.n_head, -1e9, np.float32)
    assert float(np.abs(ref.logits(ids) - got).max()) > 0.02 * scale
    no_window = RefGptOss(m.file, dataclasses.replace(m.args, window=0)).logits(ids)
    assert float(np.abs(no_window - got).max()) > 0.02 * scale


def test_prefill_equals_step_by_step_decode(device, models):
    # (without expert tiles: on cooperative matrices their prompt steps round W and x to fp16, 2e-3 of the
    # largest logit; test_models_qwen35's test_tiled_expert_matmuls_in_prompt_steps holds them to that)
    m, eng = _engine(device, models["q8_0"], caps={"expert_tiles": False})
    ids = m.tokenizer.encode(PROMPT)
    pre = _prefill_logits(eng, ids, slot=1)
    steps = np.stack([eng.step([t], [p], [2], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    np.testing.assert_allclose(steps, pre, rtol=0, atol=1e-4 * float(np.abs(pre).max()))


def test_gpu_decode_path(device, models):
    """The GPUs' decode path (split-K matvecs, split decode attention with the
    sinks): decode steps match the numpy reference; four sequences batched give
    bit for bit what each gives alone."""
    caps = {**GPU_DECODE, "split_attention": True, "attention_dec": True, "attn_items": 16}
    m, eng = _engine(device, models["mxfp4"], caps=caps)
    ids = m.tokenizer.encode(PROMPT)[:14]
    want = RefGptOss(m.file, m.args).logits(ids)
    steps = np.stack([eng.step([t], [p], [1], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    _assert_logits_close(steps, want)
    both, alone = _batched_and_alone(m, eng)
    np.testing.assert_array_equal(both, alone)
    labels = {op.label for prog in eng._programs.values() for op in prog.ops if op.kind == "dispatch"}
    assert any(lb.startswith("mul_mat_id") for lb in labels), labels
    # decode steps: the biases in the matvecs, the output projection's residual add and norm in its matvec,
    # the router's choice in its matvec (where its weight type has the "r" variants)
    dec = {op.label for key, prog in eng._programs.items() if key[0] <= 4 for op in prog.ops if op.kind == "dispatch"}
    assert {"mul_mat qkv<-h+bias", "mul_mat x<-att+bias+rms_norm", "mul_mat rl<-h+bias+moe_router"} <= dec, dec
    assert not {"add_bias", "add", "moe_router", "moe_bias", "moe_combine", "swiglu"} & dec, dec
    assert {"mul_mat_id ff_e+swiglu<-h+bias", "mul_mat_id x+=moe<-ff_e+bias"} <= dec, dec


@pytest.mark.slow
def test_llama_server_agrees_with_engine(device, models, llama_server_exe):
    """On f32 weights: llama.cpp's top-8 log-probabilities after every prefix of
    the prompt against the engine's (the same top-1 everywhere), and 12 greedy
    tokens."""
    path = models["f32"]
    m, eng = _engine(device, path)
    assert_llama_server_agrees(m, eng, path, llama_server_exe,
                               TOL_VULKAN if os.environ.get("VKENGINE_LLAMA_SERVER") else TOL)


def test_served_in_batches(models, tmp_path):
    """`vkengine serve` on the model: four greedy chat completions at once (one
    batch) give what each gives alone."""
    assert_served_in_batches(models["mxfp4"], tmp_path)


def test_o200k_pre_tokenizer():
    """The o200k split (llama.cpp's gpt-4o pre-tokenizer; tiktoken's pattern):
    cased words with their leading space and contractions, digits by three,
    punctuation runs with trailing newlines or slashes."""
    from tokenizers import Regex, pre_tokenizers

    from vkengine.tokenizer import PRE_TOKENIZERS
    pt = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated")
                                  for r in PRE_TOKENIZERS["gpt-4o"]])
    got = [s for s, _ in pt.pre_tokenize_str("Hello World's HTTPServer 12345 don't!!\n\n  x/y")]
    assert got == ["Hello", " World's", " HTTPServer", " ", "123", "45", " don't", "!!\n\n", " ", " x", "/y"]


def test_harmony_turn_ends():
    """gpt-oss's vocabulary (o200k_harmony): <|return|> and <|call|> end a turn,
    <|end|> (which closes the analysis channel's message before the final
    answer) does not, even where the file names it the end-of-turn token, as
    llama.cpp's vocabulary loader has it."""
    from vkengine.tokenizer import from_gguf
    tokens = ["a", "b", "<|endoftext|>", "<|return|>", "<|end|>", "<|call|>", "<|start|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-4o", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [1, 1, 3, 3, 3, 3, 3], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.eos_token_id": 3, "tokenizer.ggml.eot_token_id": 4}
    tok = from_gguf(lambda k, d=None: meta.get(k, d))
    assert tok.eot_ids == {3, 5} and not tok.add_bos
    assert tok.encode("<|start|>ab") == [6, 0, 1]      # (no BOS: the file asks for none)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory, tokenizer_source):
    """Hugging Face folders as openai/gpt-oss-20b's: MXFP4 experts as `_blocks`
    and `_scales` (mxfp4), or dequantized (q8_0: the GGUF's values as float32)."""
    out = tmp_path_factory.mktemp("synth-gptoss-hf")
    return {q: synth_llama(CONFIG, q, seed=17, out_dir=out, name="gptoss-tiny", workers=1,
                           tokenizer_from=tokenizer_source) for q in ("mxfp4", "q8_0")}


def test_mxfp4_hf_layout_repacks_exactly():
    """transformers' MXFP4 (integrations/mxfp4.py convert_moe_packed_tensors:
    byte j's low nibble element 2j, high nibble 2j+1, an FP4 table, scaled by
    2^(exponent - 127)), written out here, against GGUF's dequantization of
    the repacked bytes; and the repacking inverts."""
    from vkengine.quant import dequantize, mxfp4_from_hf, mxfp4_to_hf
    rng = np.random.default_rng(3)
    rows, nb = 6, 4
    blocks = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (rows, nb), dtype=np.uint8)
    lut = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    want = np.empty((rows, nb, 32))
    want[..., 0::2], want[..., 1::2] = lut[blocks & 0x0F], lut[blocks >> 4]
    want = np.ldexp(want, scales.astype(np.int32)[..., None] - 127).reshape(rows, nb * 32)
    raw = mxfp4_from_hf(blocks, scales)
    np.testing.assert_array_equal(dequantize("mxfp4", raw, rows, nb * 32), want)
    b2, s2 = mxfp4_to_hf(raw, rows, nb * 32)
    np.testing.assert_array_equal(b2, blocks)
    np.testing.assert_array_equal(s2, scales)


def test_mxfp4_quantizer_matches_gguf_py():
    """synth's MXFP4 quantizer (midpoint comparisons) writes gguf-py's blocks
    bit for bit: random rows, an all-zero block, exact midpoints (ties go to
    the smaller magnitude), denormal scales."""
    from gguf import GGMLQuantizationType, quants

    from vkengine.quant import quantize_mxfp4
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((64, 256)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0
    w[1, :32] = np.array([0.5, 1.5, 2.5, 3.5, 5, 7, 10, 12] * 4, np.float32) * np.float32(2.0 ** -3) \
        * np.sign(rng.standard_normal(32)).astype(np.float32)
    w[2, :32] = np.float32(1e-40)
    want = quants.quantize(w, GGMLQuantizationType.MXFP4).view(np.uint8).reshape(-1)
    np.testing.assert_array_equal(quantize_mxfp4(w), want)


@pytest.mark.parametrize("quant", ["mxfp4", "q8_0"])
def test_hf_folder_matches_reference(device, hf_models, quant):
    """The Hugging Face folder (experts repacked from MXFP4 blocks, or transposed
    from the dequantized layout; gate and up de-interleaved) computes what the
    reference computes from its GGUF twin's weights with the folder's RoPE
    (YaRN's correction range unrounded: truncate false)."""
    import dataclasses
    m, eng = _engine(device, hf_models[quant]["hf"])
    assert m.args.yarn is not None and not m.args.yarn.truncate
    assert m.args.swa == (True, False) and m.args.window == 8
    twin = load_model(hf_models[quant]["gguf"])
    ids = m.tokenizer.encode(PROMPT)
    assert ids == twin.tokenizer.encode(PROMPT)
    got = _prefill_logits(eng, ids)
    _assert_logits_close(got, RefGptOss(twin.file, m.args).logits(ids))
    # (the unrounded range is not a no-op here)
    rounded = RefGptOss(twin.file, dataclasses.replace(m.args, yarn=dataclasses.replace(m.args.yarn, truncate=True)))
    assert float(np.abs(rounded.logits(ids) - got).max()) > 0.01 * float(np.abs(got).max())


def test_hf_folder_bad_experts_are_refused(device, hf_models, tmp_path):
    """Blocks of the wrong shape and other quantization methods: a clear error."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from vkengine.errors import VkEngineError
    src = hf_models["mxfp4"]["hf"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    t = load_file(str(bad / "model.safetensors"))
    t["model.layers.0.mlp.experts.down_proj_blocks"] = t["model.layers.0.mlp.experts.down_proj_blocks"][:, :-1]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(VkEngineError, match="down_exps MXFP4 blocks"):
        _engine(device, bad)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes"}
    other = tmp_path / "other"
    shutil.copytree(src, other)
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VkEngineError, match="quantization_config 'bitsandbytes' is not supported"):
        load_model(other)
