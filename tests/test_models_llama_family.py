"""The llama family's variants (issue 32) on synthetic models (`vkengine synth
--arch ...`): qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorms, a head size
that is not n_embd / n_head), both RoPE on split halves; qwen3moe (qwen3's
attention, routed experts in every layer) and a Mixtral-style llama (llama with
routed experts; "mixtral" below); phi3 (q|k|v and gate|up each one matrix),
also with LongRoPE ("phi3-longrope": the long factors, a context past the
original one); qwen3 with YaRN ("qwen3-yarn": rope.scaling.type yarn).

- The GGUF files hold what llama.cpp 11434 reads (src/llama-model.cpp's
  LLM_ARCH_QWEN2 / LLM_ARCH_QWEN3 tensors, transcribed below as data).
- The engine against the independent numpy reference (tests/ref_llama.py),
  prefill against step-by-step decode, on the GPUs' decode path as well, four
  sequences batched against each alone, GGUF against the Hugging Face copy.
- llama-server (CPU in CI; the Vulkan build on the GPU machine) on the same
  f32 GGUF: its top-8 log-probabilities after every prefix of a prompt against
  ours, and its 12 greedy tokens against ours.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.gguf_file import GGUFFile
from vkengine.kernels import Caps
from vkengine.model import load_model
from vkengine.serving.generate import generate
from vkengine.tools.synth.llama import SynthConfig, config_for, synth_llama

from .ref_llama import RefLlama
from .test_gguf_qwen35 import _Server, assert_tensors
from .test_models import GPU_DECODE, PROMPT, _assert_logits_close, _batched_and_alone, _prefill_logits

ARCHES = ["qwen2", "qwen3", "qwen3moe", "mixtral", "phi3", "phi3-longrope", "qwen3-yarn"]
# qwen3 with 32-wide heads on a 64-wide model (4 heads: q is 128 wide), as
# Qwen3's 128-wide heads on 1024-wide models
CONFIGS = {"qwen2": SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="qwen2"),
           "qwen3": SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="qwen3",
                                head_size=32),
           # 8 experts, 2 a token: prompt steps of 16+ rows take the expert-major batched matmuls
           "qwen3moe": SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="qwen3moe",
                                   head_size=32, n_expert=8, n_expert_used=2, n_ff_exp=32),
           "mixtral": SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="llama",
                                  n_expert=8, n_expert_used=2, n_ff_exp=32),
           "phi3": SynthConfig(n_embd=96, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="phi3"),
           # engines of 256 and 512 positions past the original 64: the long factors on both sides
           "phi3-longrope": SynthConfig(n_embd=96, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="phi3",
                                        rope_orig_ctx=64),
           # YaRN (Qwen3's 128k configs: factor 4 from 32k), here factor 4 from 64 positions
           "qwen3-yarn": SynthConfig(n_embd=64, n_layer=2, n_head=4, n_head_kv=2, n_ff=160, n_ctx=256, arch="qwen3",
                                     head_size=32, yarn_factor=4.0, yarn_orig_ctx=64)}
GGUF_ARCH = {"mixtral": "llama", "phi3-longrope": "phi3", "qwen3-yarn": "qwen3"}
# llama-server agreement bound (nats, top-8 log-probabilities), from the measured gaps (lavapipe, 11434 CPU,
# 2026-12-03) between llama.cpp and both our engine and the float64 numpy reference, which agree to 1.5e-4
# or better: qwen2 9.4e-3 (its biases make q and k larger; llama.cpp's CPU attention takes q and the
# softmax weights as f16: q rounded so in the reference takes its gap to 6.5e-3), qwen3 3.6e-3, qwen3moe
# 5.3e-3, mixtral 7.1e-3, phi3 1.56e-2 (its 24-wide heads), phi3 with LongRoPE 1.20e-2; the greedy
# tokens equal in all six
TOL = {"qwen2": 1.5e-2, "qwen3moe": 1e-2, "mixtral": 1e-2, "phi3": 2.5e-2, "phi3-longrope": 2e-2,
       "qwen3-yarn": 1e-2}   # (YaRN: 5.1e-3, where leaving it out moves log-probabilities by 3.7 nats)
# llama.cpp's Vulkan build (VKENGINE_LLAMA_SERVER on the GPU machine) takes f16 products in its matmuls and
# flash attention: gaps measured on the H200 (2026-12-03) qwen2 1.58e-2, qwen3 1.01e-2, qwen3moe 1.70e-2,
# mixtral 1.55e-2, phi3 with LongRoPE 2.39e-2 (top-1 equal at every prefix)
TOL_VULKAN = 3e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer_source, llama_server_exe):
    """Each variant in q8_0 (GGUF and HF) and f32 (GGUF); phi3 with the Phi-3
    vocabulary of the llama.cpp sdist (llama.cpp looks up its <|end|>)."""
    from parity import llamacpp
    phi3_vocab = None
    if any(CONFIGS[a].arch == "phi3" for a in ARCHES):
        phi3_vocab = llamacpp.source_tree() / "models" / "ggml-vocab-phi-3.gguf"
    out = tmp_path_factory.mktemp("synth-family")
    return {(a, q): synth_llama(CONFIGS[a], q, seed=11, out_dir=out, name=f"{a}-tiny", workers=1,
                                tokenizer_from=phi3_vocab if CONFIGS[a].arch == "phi3" else tokenizer_source,
                                formats=("gguf", "hf") if q == "q8_0" else ("gguf",))
            for a in ARCHES for q in ("q8_0", "f32")}


def _engine(device, path, caps: dict | None = None):
    m = load_model(path)
    c = Caps.detect(device)
    c = dataclasses.replace(c, **{"xq8_in": False, **(caps or {})})
    return m, Engine(m, device, EngineConfig(n_slots=4, n_ctx=256, max_batch=64, max_out=64), caps=c)


def expected_tensors(f: GGUFFile) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """name -> (numpy shape, required type or None) as llama.cpp's loader for
    the file's architecture creates them (output.weight optional: tied)."""
    a, m = f.arch, f.meta
    D, L = int(m(f"{a}.embedding_length")), int(m(f"{a}.block_count"))
    H = int(m(f"{a}.attention.head_count"))
    Hkv = int(m(f"{a}.attention.head_count_kv", H))
    hd = int(m(f"{a}.attention.key_length", D // H))
    F = int(m(f"{a}.feed_forward_length"))
    E = int(m(f"{a}.expert_count", 0))
    Fe = int(m(f"{a}.expert_feed_forward_length", F))
    V = f.tensor_info("token_embd.weight")[1][0]
    t: dict[str, tuple[tuple[int, ...], str | None]] = {"token_embd.weight": ((V, D), None),
                                                        "output_norm.weight": ((D,), "f32")}
    if f.has("output.weight"):
        t["output.weight"] = ((V, D), None)
    if f.has("rope_factors_long.weight"):
        n_rot = int(m(f"{a}.rope.dimension_count", hd))
        t.update({f"rope_factors_{w}.weight": ((n_rot // 2,), "f32") for w in ("long", "short")})
    for i in range(L):
        p = f"blk.{i}."
        t.update({p + "attn_norm.weight": ((D,), "f32"), p + "attn_output.weight": ((D, H * hd), None),
                  p + "ffn_norm.weight": ((D,), "f32")})
        if a == "phi3":
            t.update({p + "attn_qkv.weight": (((H + 2 * Hkv) * hd, D), None), p + "ffn_up.weight": ((2 * F, D), None),
                      p + "ffn_down.weight": ((D, F), None)})
            continue
        t.update({p + "attn_q.weight": ((H * hd, D), None), p + "attn_k.weight": ((Hkv * hd, D), None),
                  p + "attn_v.weight": ((Hkv * hd, D), None)})
        if E:
            t.update({p + "ffn_gate_inp.weight": ((E, D), None), p + "ffn_gate_exps.weight": ((E, Fe, D), None),
                      p + "ffn_up_exps.weight": ((E, Fe, D), None), p + "ffn_down_exps.weight": ((E, D, Fe), None)})
        else:
            t.update({p + "ffn_gate.weight": ((F, D), None), p + "ffn_up.weight": ((F, D), None),
                      p + "ffn_down.weight": ((D, F), None)})
        if a == "qwen2":
            t.update({p + "attn_q.bias": ((H * hd,), "f32"), p + "attn_k.bias": ((Hkv * hd,), "f32"),
                      p + "attn_v.bias": ((Hkv * hd,), "f32")})
        if a in ("qwen3", "qwen3moe"):
            t.update({p + "attn_q_norm.weight": ((hd,), "f32"), p + "attn_k_norm.weight": ((hd,), "f32")})
    return t


@pytest.mark.parametrize("arch", ARCHES)
def test_gguf_has_what_llama_cpp_reads(models, arch):
    f = GGUFFile(models[(arch, "q8_0")]["gguf"])
    ga = GGUF_ARCH.get(arch, arch)
    assert f.arch == ga
    keys = ["context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.layer_norm_rms_epsilon"] + (["expert_count", "expert_used_count"] if CONFIGS[arch].n_expert
                                                    else [])
    for k in keys:
        assert f.meta(f"{ga}.{k}", None) is not None, k
    assert_tensors(f, expected_tensors(f))


@pytest.mark.parametrize("arch", ARCHES)
def test_args_from_the_file(models, arch):
    for fmt in ("gguf", "hf"):
        a = load_model(models[(arch, "q8_0")][fmt]).args
        assert a.rope_neox == (arch != "mixtral" or fmt == "hf"), fmt    # llama GGUFs: adjacent pairs
        assert (a.qkv_bias, a.qk_norm) == (arch == "qwen2", arch in ("qwen3", "qwen3moe", "qwen3-yarn")), fmt
        assert (a.yarn.factor, a.yarn.orig_ctx, a.yarn.mscale()) == (4.0, 64, pytest.approx(1.1386294)) \
            if arch == "qwen3-yarn" else a.yarn is None, fmt
        assert a.head_dim == CONFIGS[arch].head_dim, fmt
        c = CONFIGS[arch]
        assert (a.n_expert, a.n_expert_used, a.n_ff_exp) == (c.n_expert, c.n_expert_used, c.n_ff_exp), fmt
        assert (a.rope_orig_ctx, len(a.rope_long)) == ((64, c.head_dim // 2) if c.rope_orig_ctx else (0, 0)), fmt
        if c.rope_orig_ctx:   # sqrt(1 + ln(256 / 64) / ln 64), and the long factors past 64 positions
            assert a.rope_attn_factor == pytest.approx(1.1547, abs=1e-4), fmt
            assert a.rope_factors(256)[-1] == 4.0 and a.rope_factors(64)[-1] == 1.25, fmt


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("quant", ["q8_0", "f32"])
def test_prefill_matches_numpy_reference(device, models, arch, quant):
    m, eng = _engine(device, models[(arch, quant)]["gguf"])
    ids = m.tokenizer.encode(PROMPT)
    _assert_logits_close(_prefill_logits(eng, ids), RefLlama(m.file, m.args).logits(ids))


@pytest.mark.parametrize("arch", ARCHES)
def test_prefill_equals_step_by_step_decode(device, models, arch):
    # (without expert tiles: on cooperative matrices a prompt step's tiles round W and x to fp16, ~3e-4 of the
    # largest logit here on the H200 (run 43); test_models_qwen35's test_tiled_expert_matmuls_in_prompt_steps
    # holds them to their own bound)
    m, eng = _engine(device, models[(arch, "q8_0")]["gguf"], caps={"expert_tiles": False})
    ids = m.tokenizer.encode(PROMPT)
    pre = _prefill_logits(eng, ids, slot=1)
    steps = np.stack([eng.step([t], [p], [2], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    np.testing.assert_allclose(steps, pre, rtol=0, atol=1e-4 * float(np.abs(pre).max()))


@pytest.mark.parametrize("arch", ARCHES)
def test_gpu_decode_path(device, models, arch):
    """The GPUs' decode path (split-K matvecs, the split RMSNorm, split decode
    attention by KV-head group): decode steps match the numpy reference, and
    four sequences batched give bit for bit the logits each gives alone."""
    caps = {**GPU_DECODE, "split_attention": True, "attention_dec": True, "attn_items": 16}
    m, eng = _engine(device, models[(arch, "q8_0")]["gguf"], caps=caps)
    ids = m.tokenizer.encode(PROMPT)[:12]
    want = RefLlama(m.file, m.args).logits(ids)
    steps = np.stack([eng.step([t], [p], [1], [0], Readback.LOGITS)[0] for p, t in enumerate(ids)])
    _assert_logits_close(steps, want)
    both, alone = _batched_and_alone(m, eng)
    np.testing.assert_array_equal(both, alone)
    labels = {op.label for prog in eng._programs.values() for op in prog.ops if op.kind == "dispatch"}
    assert ("add_bias" in labels) == (arch == "qwen2")   # (prompt steps: the decode steps' matvecs take it)
    dec = {op.label for key, prog in eng._programs.items() if key[0] <= 4 for op in prog.ops
           if op.kind == "dispatch"}
    assert "add_bias" not in dec and any(lb.startswith("mul_mat qkv<-h+bias") for lb in dec) == (arch == "qwen2"), dec
    assert ("norm_rope_kv" in labels) == (arch in ("qwen3", "qwen3moe", "qwen3-yarn"))
    assert any(lb.startswith("mul_mat_id") for lb in labels) == (arch in ("qwen3moe", "mixtral")), labels
    # the experts' down projection takes the next layer's attention norm (mul_mv_id's COMBINE): no rms_norm
    # dispatch of its own but the first layer's and the head's
    fused = {lb for lb in labels if lb.startswith("mul_mat_id") and lb.endswith("+rms_norm")}
    assert bool(fused) == (arch in ("qwen3moe", "mixtral")), labels
    # and the router's matvec chooses the experts (no moe_router dispatch in decode steps)
    assert ("mul_mat rl<-h+moe_router" in labels) == (arch in ("qwen3moe", "mixtral")), labels


@pytest.mark.parametrize("arch", ARCHES)
def test_gguf_and_hf_copy_agree(device, models, arch):
    mg, eg = _engine(device, models[(arch, "q8_0")]["gguf"])
    mh, eh = _engine(device, models[(arch, "q8_0")]["hf"])
    ids = mg.tokenizer.encode(PROMPT)
    assert ids == mh.tokenizer.encode(PROMPT)
    a, b = _prefill_logits(eg, ids), _prefill_logits(eh, ids)
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-3 * float(np.abs(a).max()))


def test_yarn_table():
    """vkengine.rope's YaRN table against ggml's per-pair formula (tests/reference.py
    yarn_table), at Qwen3's 128k setting (factor 4 from 32768, base 1e6, 128-wide
    heads) and a small one; and transformers' form (inverse frequencies mixed,
    not angles) gives the same angles."""
    from vkengine.rope import Yarn, rope_table, yarn_angles

    from . import reference as ref
    for n_rot, base, factor, orig in ((128, 1e6, 4.0, 32768), (32, 1e5, 4.0, 64)):
        got = rope_table(300, n_rot, base, yarn=Yarn(factor, orig))
        np.testing.assert_allclose(got, ref.yarn_table(300, n_rot, base, factor, orig), rtol=0, atol=2e-6)
        # transformers' _compute_yarn_parameters
        y = Yarn(factor, orig)
        low, high = y.corr_dims(n_rot, base)
        inv = base ** (-np.arange(0, n_rot, 2) / n_rot)
        extrap_w = 1 - np.clip((np.arange(n_rot // 2) - low) / max(high - low, 0.001), 0, 1)
        inv_mixed = inv / factor * (1 - extrap_w) + inv * extrap_w
        np.testing.assert_allclose(yarn_angles(300, n_rot, base, y), np.arange(300)[:, None] * inv_mixed[None, :],
                                   rtol=1e-12, atol=1e-9)


def test_synth_real_shapes_config():
    """The real shapes `vkengine synth` writes for these architectures."""
    q3 = config_for("qwen3-0.6b", None, "qwen3")
    assert (q3.n_embd, q3.n_head, q3.head_dim, q3.n_layer, q3.tied) == (1024, 16, 128, 28, True)
    q2 = config_for("qwen2.5-0.5b", None, "qwen2")
    assert (q2.n_embd, q2.n_head, q2.n_head_kv, q2.head_dim, q2.arch) == (896, 14, 2, 64, "qwen2")
    m = config_for("qwen3-30b-a3b", None, "qwen3moe")
    assert (m.n_embd, m.n_layer, m.head_dim, m.n_expert, m.n_expert_used, m.n_ff_exp) == (2048, 48, 128, 128, 8, 768)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_server_agrees_with_engine(device, models, llama_server_exe, arch):
    """On f32 weights: llama.cpp's top-8 log-probabilities after every prefix of
    the prompt against the engine's (the same top-1 everywhere), and 12 greedy
    tokens. Bounds: TOL (5e-3 nats where not listed)."""
    path = models[(arch, "f32")]["gguf"]
    m, eng = _engine(device, path)
    assert_llama_server_agrees(m, eng, path, llama_server_exe,
                               TOL_VULKAN if os.environ.get("VKENGINE_LLAMA_SERVER") else TOL.get(arch, 5e-3))


@pytest.mark.parametrize("arch", ARCHES)
def test_served_in_batches(models, arch, tmp_path):
    """`vkengine serve` on the model: four greedy chat completions at once (one
    batch) give what each gives alone (the chat template from the file)."""
    assert_served_in_batches(models[(arch, "q8_0")]["gguf"], tmp_path)


def test_unsupported_variants_are_refused(device, models, tmp_path):
    """What these graphs do not compute is a clear error, not a silent
    difference: --fixed-experts (qwen35moe's parity mode), a Qwen3-MoE config
    without top-k renormalization or with dense layers, a Qwen2 config with
    sliding-window attention on, a bias the graph would not add (o_proj's)."""
    from vkengine.errors import VkEngineError
    m = load_model(models[("qwen3moe", "q8_0")]["gguf"])
    fixed = dataclasses.replace(m, args=dataclasses.replace(m.args, fixed_experts=True))
    with pytest.raises(VkEngineError, match="fixed-experts"):
        Engine(fixed, device, EngineConfig(n_slots=1, n_ctx=64, max_batch=16, max_out=16))
    assert_hf_variant_refused(models[("qwen2", "q8_0")]["hf"], tmp_path / "o-bias", "attn_output.bias",
                              tensors={"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)})
    for arch, change, match in (("qwen3moe", {"norm_topk_prob": False}, "norm_topk_prob"),
                                ("qwen3moe", {"mlp_only_layers": [1]}, "dense FFN layers"),
                                ("qwen2", {"use_sliding_window": True}, "sliding-window")):
        assert_hf_variant_refused(models[(arch, "q8_0")]["hf"], tmp_path / f"{arch}-{next(iter(change))}", match,
                                  config=change)


# -- checks the architectures' test files share ------------------------------------------

def assert_hf_variant_refused(src, folder, match: str, config: dict | None = None,
                              tensors: dict | None = None) -> None:
    """A copy of the HF folder src with config keys changed and tensors added
    fails to load with an error matching `match`."""
    import json
    import shutil

    from safetensors.numpy import load_file, save_file

    from vkengine.errors import VkEngineError
    shutil.copytree(src, folder)
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        st = load_file(str(folder / "model.safetensors"))
        save_file({**st, **tensors}, str(folder / "model.safetensors"))
    with pytest.raises(VkEngineError, match=match):
        load_model(folder)


def assert_llama_server_agrees(m, eng, path, exe, tol: float, near_tie: float = 0.0) -> None:
    """llama-server on the same GGUF: its top-8 log-probabilities after every
    prefix of PROMPT against the engine's (the same top-1 everywhere, gaps below
    tol nats), and its 12 greedy tokens against ours. near_tie > 0: one prefix
    may pick differently where both sides put the two picks within near_tie
    nats of each other (the greedy tokens are not compared if that prefix is
    the whole prompt: they part there)."""
    ids = m.tokenizer.encode(PROMPT)
    lg = _prefill_logits(eng, ids).astype(np.float64)
    lsm = lg - lg.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    greedy = [s.token for s in generate(eng, ids, 12, ignore_eos=True)]
    srv = _Server(exe, path)
    try:
        err, seen, ties, tie_at_end = 0.0, 0, 0, False
        for n in range(1, len(ids) + 1):
            r = srv.completion(ids[:n], 1, n_probs=8)
            if not r.get("completion_probabilities"):
                # its token ends inside a UTF-8 character: llama-server reports the token without
                # probabilities
                assert r["tokens"] == [lg[n - 1].argmax()], (n, r)
                continue
            top = r["completion_probabilities"][0]["top_logprobs"]
            ours = int(lg[n - 1].argmax())
            theirs_of_ours = next((t["logprob"] for t in top if t["id"] == ours), None)
            if top[0]["id"] != ours and near_tie and theirs_of_ours is not None and \
                    top[0]["logprob"] - theirs_of_ours < near_tie and \
                    lsm[n - 1, ours] - lsm[n - 1, top[0]["id"]] < near_tie:
                ties += 1           # both sides call it a near tie: the two picks within near_tie nats either way
                tie_at_end = n == len(ids)
                continue
            assert top[0]["id"] == ours, (
                f"prefix {n}: llama-server's top-1 {top[0]['id']} ({top[0]['logprob']:.4f}; its #2 {top[1]['id']} "
                f"{top[1]['logprob']:.4f}), ours {ours} ({lsm[n - 1, ours]:.4f}; theirs at "
                f"{lsm[n - 1, top[0]['id']]:.4f}; its logprob of ours {theirs_of_ours})")
            err = max(err, max(abs(t["logprob"] - lsm[n - 1, t["id"]]) for t in top))
            seen += 1
        assert seen >= len(ids) - 3, f"llama-server reported {seen} of {len(ids)} prefixes"
        assert err < tol, err
        assert ties <= 1, f"{ties} near-tie prefixes"
        if not tie_at_end:
            assert srv.completion(ids, 12)["tokens"] == greedy
    finally:
        srv.close()


def assert_served_in_batches(path, tmp_path) -> None:
    """`vkengine serve` on the model: four greedy chat completions at once (one
    batch) give what each gives alone, and none is empty."""
    import concurrent.futures

    import httpx

    from .serving import ServerProcess
    srv = ServerProcess(["--model", str(path), "--ctx", "512", "--parallel", "4"], tmp_path / "server.log")
    try:
        def ask(text: str) -> str:
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": text}], "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        texts = ["Hello there", "Once upon a time", "def f(x):", "1, 2, 3,"]
        alone = [ask(t) for t in texts]
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            together = list(ex.map(ask, texts))
        assert together == alone
        assert all(alone)
    finally:
        srv.stop()
