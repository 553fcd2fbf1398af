"""What every synthetic family shares: per-tensor generators, tensor jobs run in
worker processes, the GGUF tensor writer, and the tokenizer copied from a real
GGUF (SmolLM2's by default) into GGUF metadata or a Hugging Face folder."""
from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from ...errors import VkEngineError

QUANTS = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4")
# general.file_type of a file whose matrices are of that type (llama.cpp's LLAMA_FTYPE)
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "bf16": 32, "mxfp4": 38}

TOKENIZER_KEYS = [
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.scores", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template"]


def check_quant(quant: str) -> None:
    if quant not in QUANTS:
        raise VkEngineError(f"synth quant {quant!r} is not supported (choose from {', '.join(QUANTS)})")


# Models of at least this many weights (the bench shapes: 0.8B, 1B, 8B, 30B-A3B, 35B-A3B, gpt-oss-20b; never
# the tiny and small test models) draw their q4_0 / q8_0 matrices as random blocks (random_blocks), not as
# Gaussian weights quantized: ~15x less work a weight (a 35B-A3B file took 184 s on the GPU machine's 16
# cores, where every session writes it again). A benchmark reads the same bytes either way.
BLOCKS_FROM = 1 << 28
# a symmetric code distribution: nibble 0 (-8) read as 8 (0), int8 -128 as 0; their std in units of d
_Q4_LUT = np.array([((b & 15) or 8) | (((b >> 4) or 8) << 4) for b in range(256)], np.uint8)
_Q8_LUT = np.array([0 if b == 128 else b for b in range(256)], np.uint8)
_CODE_STD = {"q4_0": float(np.sqrt(2 * sum(k * k for k in range(1, 8)) / 16)),
             "q8_0": float(np.sqrt(2 * sum(k * k for k in range(1, 128)) / 256))}


def draws_blocks(shapes) -> bool:
    """Whether a model of tensors of these shapes is bench-sized (BLOCKS_FROM
    weights or more): its q4_0 / q8_0 matrices then come from random_blocks."""
    return sum(int(np.prod(s)) for s in shapes) >= BLOCKS_FROM


def random_blocks(rng: np.random.Generator, quant: str, n: int, std: float) -> np.ndarray | None:
    """n weights (a multiple of 32) of type quant as raw GGUF blocks drawn at
    random: codes symmetric about 0 and each block's scale d within 25% of the
    one that gives the weights a standard deviation of std (about what a
    Gaussian of that std quantized gives); None for the other types."""
    if quant not in _CODE_STD or n % 32:
        return None
    nb = n // 32
    d = (np.float32(std / _CODE_STD[quant]) * rng.uniform(0.75, 1.25, nb).astype(np.float32)).astype(np.float16)
    width = 16 if quant == "q4_0" else 32
    out = np.empty((nb, 2 + width), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:] = (_Q4_LUT if quant == "q4_0" else _Q8_LUT)[rng.integers(0, 256, (nb, width), np.uint8)]
    return out.reshape(-1)


def rng_for(seed: int, name: str) -> np.random.Generator:
    """The generator of one tensor: seeded by (seed, its GGUF name), so a tensor
    does not depend on the order or the number of worker processes."""
    h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, h])


def iter_tensors(fn, jobs: list, workers: int | None = None):
    """Yield fn(job) -> (name, ...) for every job, in job order, from worker
    processes when there are several; at most 2 x workers results are pending,
    so a model larger than memory streams through."""
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

    from ...quant import BY_NAME
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


def tokenizer_meta(source: Path | None = None) -> dict:
    """Tokenizer fields of a GGUF (default: the embedded SmolLM2)."""
    from ...gguf_file import GGUFFile
    from ...model import default_model_path
    src = GGUFFile(source or default_model_path())
    return {k: src.meta(k) for k in TOKENIZER_KEYS if src.meta(k, None) is not None}


def add_meta(w, meta: dict) -> None:
    """Add metadata fields to a GGUFWriter, typed by their Python values."""
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
    add_meta(w, tokenizer_meta(source))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf_tokenizer(folder: Path, tmeta: dict) -> None:
    """tokenizer.json and tokenizer_config.json of a Hugging Face folder, from
    the tokenizer fields of a GGUF (tokenizer_meta)."""
    from ...tokenizer import from_gguf
    tok = from_gguf(lambda k, d=None: tmeta.get(k, d))
    tok.hf.save(str(folder / "tokenizer.json"))
    toks = tmeta["tokenizer.ggml.tokens"]
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": toks[tmeta["tokenizer.ggml.bos_token_id"]],
        "eos_token": toks[tmeta["tokenizer.ggml.eos_token_id"]],
        "add_bos_token": bool(tmeta.get("tokenizer.ggml.add_bos_token", False)),
        "chat_template": tmeta.get("tokenizer.chat_template"),
    }, indent=1))


def config_json(text: str) -> dict:
    """The fields of a family's config dataclass given to --config: inline JSON or a file."""
    try:
        d = json.loads(Path(text).read_text()) if os.path.exists(text) else json.loads(text)
    except json.JSONDecodeError as e:
        raise VkEngineError(f"--config: {e}") from e
    if not isinstance(d, dict):
        raise VkEngineError("--config: a JSON object of config fields is expected")
    return d
