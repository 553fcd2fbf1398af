"""Deterministic random-weight models with the shapes of real ones, written as a
GGUF file (that llama.cpp loads) and as a Hugging Face folder (config.json +
safetensors + tokenizer.json) holding exactly the same function.

Text stays real: the tokenizer (vocab, merges, chat template) is SmolLM2's,
copied from the embedded model. Weights are scaled so that logits are peaked
(top-2 margins of a nat or more are common) and greedy choices are not coin
flips. Every tensor is drawn from a generator seeded by (seed, tensor name), so
the result does not depend on the order or the number of worker processes.

GGUF stores llama Q/K rows permuted for adjacent-pair RoPE (llama.cpp's
convert_hf_to_gguf.py LlamaModel.permute); the Hugging Face copy keeps the
original row order and NEOX RoPE, and its weights are the dequantized GGUF
weights, so both files compute the same logits.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .errors import VkEngineError

SHAPES = {
    # name: (n_embd, n_layer, n_head, n_head_kv, n_ff)
    "tiny": (64, 2, 4, 2, 128),
    "small": (128, 4, 4, 2, 352),
    "smollm2-135m": (576, 30, 9, 3, 1536),
    "1b": (2048, 16, 32, 8, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}
QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


@dataclass(frozen=True)
class SynthConfig:
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx: int = 8192
    rope_base: float = 100000.0
    rms_eps: float = 1e-5
    logit_scale: float = 8.0       # std of the output logits
    tied: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def config_for(shape: str | None, config_json: str | None) -> SynthConfig:
    if config_json:
        try:
            d = json.loads(Path(config_json).read_text()) if os.path.exists(config_json) else json.loads(config_json)
            return SynthConfig(**d)
        except (json.JSONDecodeError, TypeError) as e:
            raise VkEngineError(f"--config: {e}") from e
    if shape not in SHAPES:
        raise VkEngineError(f"unknown shape {shape!r} (shapes: {', '.join(SHAPES)})")
    e, L, h, kv, f = SHAPES[shape]
    return SynthConfig(e, L, h, kv, f)


def _rng(seed: int, name: str) -> np.random.Generator:
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, h])


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rows -> GGUF rows (llama.cpp convert_hf_to_gguf.py LlamaModel.permute)."""
    r, c = w.shape
    return w.reshape(n_head, 2, r // n_head // 2, c).swapaxes(1, 2).reshape(r, c)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    r, c = w.shape
    return w.reshape(n_head, r // n_head // 2, 2, c).swapaxes(1, 2).reshape(r, c)


def _tensor_plan(c: SynthConfig, n_vocab: int) -> list[tuple[str, tuple[int, ...], float]]:
    """(GGUF name, numpy shape, std) of every tensor; std 0 marks a norm weight."""
    D, F, hd = c.n_embd, c.n_ff, c.head_dim
    # Residual contributions of each block sized to keep activations O(1).
    plan = [("token_embd.weight", (n_vocab, D), 1.0), ("output_norm.weight", (D,), 0.0)]
    if not c.tied:
        plan.append(("output.weight", (n_vocab, D), c.logit_scale / np.sqrt(D)))
    for i in range(c.n_layer):
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (D,), 0.0),
            (p + "attn_q.weight", (c.n_head * hd, D), 2.0 / np.sqrt(D)),
            (p + "attn_k.weight", (c.n_head_kv * hd, D), 2.0 / np.sqrt(D)),
            (p + "attn_v.weight", (c.n_head_kv * hd, D), 1.0 / np.sqrt(D)),
            (p + "attn_output.weight", (D, c.n_head * hd), 0.5 / np.sqrt(c.n_head * hd * c.n_layer)),
            (p + "ffn_norm.weight", (D,), 0.0),
            (p + "ffn_gate.weight", (F, D), 1.0 / np.sqrt(D)),
            (p + "ffn_up.weight", (F, D), 1.0 / np.sqrt(D)),
            (p + "ffn_down.weight", (D, F), 1.0 / np.sqrt(F * c.n_layer)),
        ]
    return plan


def _make_tensor(job):
    """Worker: (name, shape, std, seed, quant, n_head, n_head_kv) -> (name, GGUF bytes, type, HF float32)."""
    name, shape, std, seed, quant, n_head, n_head_kv, want_hf = job
    from gguf import GGMLQuantizationType as T
    from gguf import quants

    from .quant import BY_NAME, dequantize
    rng = _rng(seed, name)
    if std == 0.0:   # norm weights stay f32, near 1
        w = (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np.float32)
        return name, w.view(np.uint8).reshape(-1), "f32", w if want_hf else None
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
    if name.endswith("attn_q.weight"):
        w = _permute(w, n_head)
    elif name.endswith("attn_k.weight"):
        w = _permute(w, n_head_kv)
    qt = BY_NAME[quant]
    if quant == "f32":
        raw = w.view(np.uint8)
    elif quant == "f16":
        raw = w.astype(np.float16).view(np.uint8)
    else:
        raw = quants.quantize(w, qt).view(np.uint8)
    raw = np.ascontiguousarray(raw).reshape(-1)
    hf = None
    if want_hf:
        hf = dequantize(quant, raw, shape[0], shape[1]) if qt != T.F32 else w
        if name.endswith("attn_q.weight"):
            hf = _unpermute(hf, n_head)
        elif name.endswith("attn_k.weight"):
            hf = _unpermute(hf, n_head_kv)
    return name, raw, quant, hf


TOKENIZER_KEYS = [
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"]


def iter_tensors(fn, jobs: list, workers: int | None = None):
    """Yield fn(job) -> (name, ...) for every job, in job order, from worker
    processes when there are several; at most 2 x workers results are pending,
    so a model larger than memory streams through. Each tensor seeds its own
    generator, so the result does not depend on the number of workers."""
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers <= 1:
        yield from map(fn, jobs)
        return
    with ProcessPoolExecutor(workers) as ex:
        todo = iter(jobs)
        pending = deque(ex.submit(fn, j) for j in itertools.islice(todo, 2 * workers))
        while pending:
            r = pending.popleft().result()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append(ex.submit(fn, nxt))
            yield r


def make_tensors(fn, jobs: list, workers: int | None = None) -> dict[str, tuple]:
    """{name: fn(job)} for every job (iter_tensors, all held in memory)."""
    return {r[0]: r for r in iter_tensors(fn, jobs, workers)}


def write_gguf_tensors(w, specs: list[tuple[str, tuple[int, ...], str]], results) -> None:
    """Finish GGUFWriter w (metadata already added): specs = (name, numpy shape,
    type name) of every tensor in file order; results = (name, raw bytes, ...)
    in the same order, from a dict or streamed (iter_tensors): each tensor's data
    is written as it arrives and then dropped."""
    from gguf.quants import quant_shape_to_byte_shape

    from .quant import BY_NAME
    for n, s, t in specs:
        if t == "f32":
            w.add_tensor_info(n, s, np.dtype(np.float32), 4 * int(np.prod(s)))
        else:   # the logical shape, with the storage type given as raw_dtype
            qt = BY_NAME[t]
            w.add_tensor_info(n, s, np.dtype(np.float32), int(np.prod(quant_shape_to_byte_shape(s, qt))),
                              raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for (n, _, t), r in zip(specs, results, strict=True):
        if r[0] != n or r[2] != t:
            raise AssertionError(f"synth: tensor {r[0]} ({r[2]}) arrived where {n} ({t}) was planned")
        w.write_tensor_data(np.ascontiguousarray(r[1]).view(np.uint8).reshape(-1))
    w.close()


def _tokenizer_meta(source: Path | None = None):
    """Tokenizer fields of a GGUF (default: the embedded SmolLM2)."""
    from .gguf_file import GGUFFile
    from .model import default_model_path
    src = GGUFFile(source or default_model_path())
    return {k: src.meta(k) for k in TOKENIZER_KEYS if src.meta(k, None) is not None}


def _add_meta(w, meta: dict) -> None:
    for k, v in meta.items():
        if isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)


def write_tokenizer_gguf(path: Path, source: Path | None = None) -> Path:
    """A GGUF holding only the tokenizer (about 2 MB): lets `synth` run where the
    embedded model cannot be carried (the GPU machine)."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    _add_meta(w, _tokenizer_meta(source))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


HF_NAME_OF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _hf_name(gguf_name: str) -> str:
    if gguf_name.startswith("blk."):
        _, i, rest = gguf_name.split(".", 2)
        return f"model.layers.{i}.{HF_NAME_OF[rest]}"
    return HF_NAME_OF[gguf_name]


def synth_llama(c: SynthConfig, quant: str, seed: int, out_dir: Path, name: str = "synth",
                formats=("gguf", "hf"), workers: int | None = None,
                tokenizer_from: Path | None = None) -> dict[str, Path]:
    """Write the model; returns {"gguf": file, "hf": folder} for what was written."""
    import gguf

    if quant not in QUANTS:
        raise VkEngineError(f"synth quant {quant!r} is not supported (choose from {', '.join(QUANTS)})")
    if c.n_embd % c.n_head or c.n_head % c.n_head_kv or c.head_dim % 2:
        raise VkEngineError("n_embd must divide into n_head heads of even size, and n_head by n_head_kv")
    tmeta = _tokenizer_meta(tokenizer_from)
    n_vocab = len(tmeta["tokenizer.ggml.tokens"])
    out_dir.mkdir(parents=True, exist_ok=True)
    want_hf = "hf" in formats
    plan = _tensor_plan(c, n_vocab)
    jobs = [(n, s, std, seed, quant, c.n_head, c.n_head_kv, want_hf) for n, s, std in plan]
    # the Hugging Face copy needs every tensor at once; GGUF alone streams
    results = make_tensors(_make_tensor, jobs, workers) if want_hf else None

    written: dict[str, Path] = {}
    if "gguf" in formats:
        path = out_dir / f"{name}-{quant}.gguf"
        tmp = path.with_suffix(".gguf.tmp")
        w = gguf.GGUFWriter(str(tmp), "llama")
        w.add_name(name)
        w.add_context_length(c.n_ctx)
        w.add_embedding_length(c.n_embd)
        w.add_block_count(c.n_layer)
        w.add_feed_forward_length(c.n_ff)
        w.add_head_count(c.n_head)
        w.add_head_count_kv(c.n_head_kv)
        w.add_rope_freq_base(c.rope_base)
        w.add_layer_norm_rms_eps(c.rms_eps)
        w.add_rope_dimension_count(c.head_dim)
        w.add_vocab_size(n_vocab)
        w.add_file_type({"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9,
                         "bf16": 32}[quant])
        w.add_string("vkengine.synth.seed", str(seed))
        w.add_string("vkengine.synth.config", json.dumps(asdict(c)))
        _add_meta(w, tmeta)
        specs = [(n, s, "f32" if std == 0.0 else quant) for n, s, std in plan]
        write_gguf_tensors(w, specs, (results[n] for n, _, _ in plan) if results is not None
                           else iter_tensors(_make_tensor, jobs, workers))
        os.replace(tmp, path)
        written["gguf"] = path
    if want_hf:
        from safetensors.numpy import save_file
        folder = out_dir / f"{name}-{quant}-hf"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {_hf_name(n): np.ascontiguousarray(results[n][3], np.float32) for n, _, _ in plan}
        save_file(tensors, str(folder / "model.safetensors"))
        cfg = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": n_vocab,
            "hidden_size": c.n_embd, "intermediate_size": c.n_ff, "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head, "num_key_value_heads": c.n_head_kv, "head_dim": c.head_dim,
            "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_base, "max_position_embeddings": c.n_ctx,
            "tie_word_embeddings": c.tied, "hidden_act": "silu", "torch_dtype": "float32",
            "bos_token_id": tmeta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": tmeta.get("tokenizer.ggml.eos_token_id"),
        }
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
        write_hf_tokenizer(folder, tmeta)
        written["hf"] = folder
    return written


def write_hf_tokenizer(folder: Path, tmeta: dict) -> None:
    """tokenizer.json and tokenizer_config.json of a Hugging Face folder, from
    the tokenizer fields of a GGUF (_tokenizer_meta)."""
    from .tokenizer import from_gguf
    tok = from_gguf(lambda k, d=None: tmeta.get(k, d))
    tok.hf.save(str(folder / "tokenizer.json"))
    toks = tmeta["tokenizer.ggml.tokens"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": toks[tmeta["tokenizer.ggml.bos_token_id"]],
        "eos_token": toks[tmeta["tokenizer.ggml.eos_token_id"]],
        "add_bos_token": bool(tmeta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": tmeta.get("tokenizer.chat_template"),
    }, indent=1))


def add_synth_args(p) -> None:
    p.add_argument("--arch", default="llama", choices=["llama", "qwen35", "qwen35moe"])
    p.add_argument("--shape", default="tiny", help=f"llama: one of {', '.join(SHAPES)}; qwen35: tiny, 0.8B, 4B; "
                   "qwen35moe: tiny, 35B-A3B")
    p.add_argument("--config", default=None, help="JSON (inline or a file) of SynthConfig fields instead of --shape")
    p.add_argument("--quant", default="q8_0", help=f"one of {', '.join(QUANTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", default=None, help="file name stem (default: <arch>-<shape>)")
    p.add_argument("--formats", default="gguf,hf", help="gguf, hf or both (comma separated)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--tokenizer-from", default=None,
                   help="GGUF whose tokenizer to copy (default: the embedded SmolLM2)")


def synth_main(args) -> int:
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    bad = set(formats) - {"gguf", "hf"}
    if bad or not formats:
        raise VkEngineError(f"--formats takes gguf and/or hf, got {args.formats!r}")
    name = args.name or f"{args.arch}-{args.shape if not args.config else 'custom'}"
    tok = Path(args.tokenizer_from) if args.tokenizer_from else None
    if args.arch in ("qwen35", "qwen35moe"):
        from . import synth_qwen35
        qc = synth_qwen35.config_for(args.arch, args.shape, args.config)
        out = synth_qwen35.synth_qwen35(qc, args.quant, args.seed, Path(args.out), name, formats, args.workers, tok)
    else:
        out = synth_llama(config_for(args.shape, args.config), args.quant, args.seed, Path(args.out), name, formats,
                          args.workers, tok)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0
