"""The synthesized qwen35 / qwen35moe GGUF files are what llama.cpp 11434 loads.

1. Static: the metadata keys and the tensor names, shapes and types that
   llama.cpp's loaders read (src/llama-model.cpp load_hparams,
   src/models/qwen35.cpp and qwen35moe.cpp load_arch_hparams/load_arch_tensors,
   transcribed below as data) against the file, exactly: nothing missing,
   nothing extra, no shape off.
2. With llama-server (the build the parity harness caches, or
   VKENGINE_LLAMA_SERVER): it loads the files, its top log-probabilities after
   every prefix match the engine's on f32 weights, its greedy tokens equal the
   engine's, also with its own MTP speculative decoding (--spec-type draft-mtp).
"""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.gguf_file import GGUFFile
from vkengine.model import load_model
from vkengine.serving.generate import generate
from vkengine.tools.synth.qwen35 import SHAPES, synth_qwen35
from vkengine.tools.synth.writer import tokenizer_meta

ARCHES = ["qwen35", "qwen35moe"]
PROMPT = "The quick brown fox jumps over the lazy dog. 1234567, and then"

# keys llama.cpp requires (get_key without `false`), per architecture
REQUIRED_KEYS = ["context_length", "embedding_length", "block_count", "attention.layer_norm_rms_epsilon",
                 "rope.dimension_sections", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
                 "ssm.time_step_rank", "ssm.group_count"]


def expected_tensors(f: GGUFFile) -> dict[str, tuple[tuple[int, ...], str | None]]:
    """name -> (numpy shape, required type or None), from the hyperparameters as
    llama.cpp derives them (ggml ne order reversed into numpy order)."""
    a, m = f.arch, f.meta
    n_all = int(m(f"{a}.block_count"))
    n_nextn = int(m(f"{a}.nextn_predict_layers", 0))
    n_layer = n_all - n_nextn
    D = int(m(f"{a}.embedding_length"))
    H = int(m(f"{a}.attention.head_count"))
    Hkv = int(m(f"{a}.attention.head_count_kv", H))
    hd = int(m(f"{a}.attention.key_length", D // H))
    V = f.tensor_info("token_embd.weight")[1][0]
    d_state, d_inner = int(m(f"{a}.ssm.state_size")), int(m(f"{a}.ssm.inner_size"))
    nk, nv, K = int(m(f"{a}.ssm.group_count")), int(m(f"{a}.ssm.time_step_rank")), int(m(f"{a}.ssm.conv_kernel"))
    key_dim, value_dim = d_state * nk, d_state * nv     # llama.cpp takes head_v_dim = ssm_d_state
    assert d_inner == value_dim
    conv_dim = 2 * key_dim + value_dim
    rec = m(f"{a}.attention.recurrent_layers", None)
    if rec is not None:
        assert len(rec) == n_all, "recurrent_layers must have block_count entries"
        is_recr = [bool(x) for x in rec]
    else:
        iv = int(m(f"{a}.full_attention_interval", 4))
        is_recr = [i < n_layer and (i + 1) % iv != 0 for i in range(n_all)]
    assert not any(is_recr[n_layer:]), "MTP layers are not recurrent"
    F32 = "f32"
    t = {"token_embd.weight": ((V, D), None), "output_norm.weight": ((D,), F32)}
    if f.has("output.weight"):
        t["output.weight"] = ((V, D), None)

    def ffn(p):
        if a == "qwen35moe":
            E = int(m(f"{a}.expert_count"))
            Fe = int(m(f"{a}.expert_feed_forward_length"))
            Fs = int(m(f"{a}.expert_shared_feed_forward_length"))
            return {p + "ffn_gate_inp.weight": ((E, D), None), p + "ffn_down_exps.weight": ((E, D, Fe), None),
                    p + "ffn_gate_exps.weight": ((E, Fe, D), None), p + "ffn_up_exps.weight": ((E, Fe, D), None),
                    p + "ffn_gate_inp_shexp.weight": ((D,), F32), p + "ffn_gate_shexp.weight": ((Fs, D), None),
                    p + "ffn_up_shexp.weight": ((Fs, D), None), p + "ffn_down_shexp.weight": ((D, Fs), None)}
        F = int(m(f"{a}.feed_forward_length"))
        return {p + "ffn_gate.weight": ((F, D), None), p + "ffn_down.weight": ((D, F), None),
                p + "ffn_up.weight": ((F, D), None)}

    def attn(p):
        return {p + "attn_q.weight": ((2 * H * hd, D), None), p + "attn_k.weight": ((Hkv * hd, D), None),
                p + "attn_v.weight": ((Hkv * hd, D), None), p + "attn_output.weight": ((D, H * hd), None),
                p + "attn_q_norm.weight": ((hd,), F32), p + "attn_k_norm.weight": ((hd,), F32)}

    for i in range(n_all):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = ((D,), F32)
        t[p + "post_attention_norm.weight"] = ((D,), F32)
        if i >= n_layer:      # MTP block: a full-attention block plus the nextn tensors
            t.update(attn(p))
            t.update({p + "nextn.eh_proj.weight": ((D, 2 * D), None), p + "nextn.enorm.weight": ((D,), F32),
                      p + "nextn.hnorm.weight": ((D,), F32), p + "nextn.shared_head_norm.weight": ((D,), F32)})
        elif is_recr[i]:
            t.update({p + "attn_qkv.weight": ((conv_dim, D), None), p + "attn_gate.weight": ((value_dim, D), None),
                      p + "ssm_conv1d.weight": ((conv_dim, K), F32), p + "ssm_dt.bias": ((nv,), F32),
                      p + "ssm_a": ((nv,), F32), p + "ssm_beta.weight": ((nv, D), None),
                      p + "ssm_alpha.weight": ((nv, D), None), p + "ssm_norm.weight": ((d_state,), F32),
                      p + "ssm_out.weight": ((D, value_dim), None)})
        else:
            t.update(attn(p))
        t.update(ffn(p))
    return t


def assert_tensors(f: GGUFFile, want: dict[str, tuple[tuple[int, ...], str | None]]) -> dict:
    """The file holds exactly the tensors `want` names, of those shapes (and types
    where given); returns name -> (type, shape) of the file's tensors."""
    have = {n: f.tensor_info(n) for n in f.tensor_names()}
    assert set(have) == set(want), (set(want) - set(have), set(have) - set(want))
    for n, (shape, typ) in want.items():
        assert tuple(have[n][1]) == shape, (n, have[n][1], shape)
        if typ is not None:
            assert have[n][0] == typ, (n, have[n][0])
    return have


@pytest.fixture(scope="module")
def tmeta(tokenizer_source):
    return tokenizer_meta(tokenizer_source)


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory, tmeta):
    out = tmp_path_factory.mktemp("synth-qwen35-gguf")
    files = {}
    for arch in ARCHES:
        for q in ("f32", "q4_0"):
            files[(arch, q)] = synth_qwen35(SHAPES[(arch, "tiny")], q, seed=5, out_dir=out, name=f"{arch}-tiny",
                                            formats=("gguf",), workers=1, tmeta=tmeta)["gguf"]
    return files


@pytest.mark.parametrize("arch", ARCHES)
def test_gguf_has_what_llama_cpp_reads(gguf_models, arch):
    f = GGUFFile(gguf_models[(arch, "q4_0")])
    assert f.arch == arch
    for k in REQUIRED_KEYS:
        assert f.meta(f"{arch}.{k}", None) is not None, k
    assert len(f.meta(f"{arch}.rope.dimension_sections")) == 4       # get_key_or_arr(..., 4, true)
    assert f.meta(f"{arch}.ssm.inner_size") == f.meta(f"{arch}.ssm.state_size") * f.meta(f"{arch}.ssm.time_step_rank")
    have = assert_tensors(f, expected_tensors(f))
    assert have["blk.0.attn_qkv.weight"][0] == "q4_0"


# -- llama-server -------------------------------------------------------------------------------

class _Server:
    def __init__(self, exe: Path, model: Path, *extra: str):
        import httpx
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen([str(exe), "-m", str(model), "--port", str(self.port), "-t", "2", "-c", "512",
                                      "--parallel", "1", *extra],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=300)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise AssertionError(f"llama-server exited: {self.proc.stderr.read()[-3000:]}")
            try:
                if self.http.get("/health").status_code == 200:
                    return
            except Exception:
                pass
            time.sleep(0.2)
        raise AssertionError("llama-server did not come up")

    def completion(self, ids, n, **kw):
        return self.http.post("/completion", json={"prompt": list(ids), "n_predict": n, "temperature": 0,
                                                   "cache_prompt": False, "return_tokens": True, **kw}).json()

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_llama_server_agrees_with_engine(device, gguf_models, llama_server_exe, arch):
    """On f32 weights: llama.cpp's top-8 log-probabilities after every prefix of
    the prompt against the engine's, and 12 greedy tokens."""
    path = gguf_models[(arch, "f32")]
    m = load_model(path)
    eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=256, max_batch=64, max_out=64))
    ids = m.tokenizer.encode(PROMPT)
    lg = eng.step(ids, range(len(ids)), [0] * len(ids), range(len(ids)), Readback.LOGITS).astype(np.float64)
    lsm = lg - lg.max(-1, keepdims=True)
    lsm -= np.log(np.exp(lsm).sum(-1, keepdims=True))
    greedy = [s.token for s in generate(eng, ids, 12, ignore_eos=True)]
    srv = _Server(llama_server_exe, path)
    try:
        err = 0.0
        for n in range(1, len(ids) + 1):
            top = srv.completion(ids[:n], 1, n_probs=8)["completion_probabilities"][0]["top_logprobs"]
            assert top[0]["id"] == lg[n - 1].argmax(), n
            err = max(err, max(abs(t["logprob"] - lsm[n - 1, t["id"]]) for t in top))
        assert err < 5e-3, err
        assert srv.completion(ids, 12)["tokens"] == greedy
    finally:
        srv.close()


@pytest.mark.slow
def test_llama_server_loads_quantized_and_runs_its_mtp(device, gguf_models, llama_server_exe):
    """The q4_0 MoE file loads; llama.cpp's MTP speculative decoding (which reads
    the nextn tensors) gives its plain greedy tokens."""
    path = gguf_models[("qwen35moe", "q4_0")]
    ids = load_model(path).tokenizer.encode("Once upon a time")
    plain = _Server(llama_server_exe, path)
    try:
        want = plain.completion(ids, 8)["tokens"]
    finally:
        plain.close()
    spec = _Server(llama_server_exe, path, "--spec-type", "draft-mtp")
    try:
        r = spec.completion(ids, 8)
        assert r["tokens"] == want
        assert r["timings"].get("draft_n", 0) > 0
    finally:
        spec.close()


def test_synth_is_deterministic(gguf_models, tmp_path, tmeta):
    """Same seed, same bytes, whatever the number of worker processes, and
    whether the GGUF streams (alone) or is written from memory (beside HF)."""
    again = synth_qwen35(SHAPES[("qwen35moe", "tiny")], "q4_0", seed=5, out_dir=tmp_path, name="qwen35moe-tiny",
                         formats=("gguf",), workers=2, tmeta=tmeta)["gguf"]
    assert again.read_bytes() == gguf_models[("qwen35moe", "q4_0")].read_bytes()
    both = synth_qwen35(SHAPES[("qwen35moe", "tiny")], "q4_0", seed=5, out_dir=tmp_path / "hf",
                        name="qwen35moe-tiny", formats=("gguf", "hf"), workers=2, tmeta=tmeta)
    assert both["gguf"].read_bytes() == again.read_bytes()
    other = synth_qwen35(SHAPES[("qwen35moe", "tiny")], "q4_0", seed=6, out_dir=tmp_path / "b",
                         name="qwen35moe-tiny", formats=("gguf",), workers=1, tmeta=tmeta)["gguf"]
    assert other.read_bytes() != again.read_bytes()


def test_qwen35_pretokenizer_keeps_combining_marks_with_letters():
    """llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35 regex ([\\p{L}\\p{M}]+), unlike qwen2's."""
    from tokenizers import Regex, pre_tokenizers

    from vkengine.tokenizer import PRE_TOKENIZERS
    split = pre_tokenizers.Split(Regex(PRE_TOKENIZERS["qwen35"][0]), behavior="isolated")
    pieces = [p for p, _ in split.pre_tokenize_str("नमस्ते e\u0301te, 123!")]
    assert pieces == ["नमस्ते", " e\u0301te", ",", " ", "1", "2", "3", "!"]
