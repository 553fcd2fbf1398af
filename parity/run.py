"""`parity run`: llama.cpp's two modes and our engine on the same prompt ids,
the figures of shared/notes/parity.md, and one JSON artifact.

The artifact is written to a temporary file in the target folder and renamed
over the target only when complete, so a run that dies never leaves half an
artifact in place of a good one.
"""
from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import vkengine
from vkengine.device import Device
from vkengine.engine import Engine
from vkengine.errors import VkEngineError
from vkengine.kernels import KVTypes
from vkengine.model import load_model
from vkengine.options import Options

from . import figures, reference
from .engine_side import engine_config, eog_ids, run_case
from .llamacpp import Log
from .prompts import load_prompt_set

SCHEMA = "vkengine-parity/1"
DEFINITIONS = {
    "strict": "positions where the engine's free-run token equals llama.cpp mode A's",
    "either_mode": "positions where the engine's token equals mode A's or mode B's",
    "self_agreement": "positions where mode A equals mode B (the ceiling numerics allow)",
    "mode_x_repeat": "positions where a mode's second run equals its first (determinism)",
    "excluded_from_greedy": "end-of-generation ids neither side may pick: llama-server's ignore_eos gives "
                            "them a -inf logit bias, and the engine's greedy picks mirror that",
    "probs_refetched": "positions where llama-server withheld mode A's top-N (the text ended inside a "
                       "UTF-8 character) and the harness asked for them again with that prefix as the prompt",
    "first_divergence": "first position where the engine's free run differs from mode A (null: none)",
    "classification": "IDENTICAL: no divergence; TIE-BREAK: at the first divergence and at every "
                      "re-anchored disagreement after it (engine fed mode A's tokens), the engine's token is "
                      f"within {figures.NEAR_TIE_NATS} nats of llama.cpp's top-1 logprob; DIVERGED otherwise",
    "teacher_forced_top1": "positions where the engine's argmax, given the prompt and mode A's earlier "
                           "tokens, is mode A's token",
    "teacher_forced_near": "teacher-forced positions where the engine's pick is mode A's token or within "
                           "near_tie_nats of it by mode A's logprobs (not a bar; it shows what the misses are)",
    "mean_kl_topn": "mean over positions of KL(llama.cpp mode A || engine) over mode A's top-N ids plus "
                    "one bucket for the rest of the vocabulary, along mode A's tokens (nats)",
}


@dataclass
class RunConfig:
    model: str | None
    prompts: str = "default"
    n_predict: int = 32
    n_probs: int = 8
    endpoint: str | None = None       # None / "auto": the harness starts llama-server
    endpoint_b: str | None = None
    out: str | None = None
    note: str | None = None
    device: int | None = None
    devices: tuple[int, ...] | None = None   # our side split across these devices (vkengine.split)
    tensor_split: str | None = None          # their shares of the layers
    repeats: int = 2
    cache: Path | None = None         # llama.cpp build cache (default: ~/.cache/vkengine/...)
    server: Path | None = None        # another llama-server binary (e.g. a Vulkan build)
    server_args: tuple[str, ...] = () # extra llama-server arguments for both modes (e.g. -ngl 99)
    cache_type_k: str = "f16"         # the KV cache's types, ours and llama-server's (-ctk, -ctv)
    cache_type_v: str = "f16"


def stderr_log(msg: str) -> None:
    print(f"[parity] {msg}", file=sys.stderr, flush=True)


def git_commit(repo: Path) -> tuple[str | None, bool]:
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip() != ""
        return head, dirty
    except (OSError, subprocess.CalledProcessError):
        # a copy of the tree without .git (the GPU machine): the caller may say
        env = os.environ.get("VKENGINE_GIT_COMMIT")
        return (env, False) if env else (None, False)


def run_parity(cfg: RunConfig, log: Log = stderr_log, engine: Engine | None = None) -> dict:
    """Run everything and return the artifact (also written to cfg.out).
    `engine` lets a caller that already holds one (a test session) reuse it."""
    if cfg.n_predict <= 0 or cfg.n_probs < 2:
        raise VkEngineError("--n-predict must be >= 1 and --n-probs >= 2")
    kv_types = KVTypes(cfg.cache_type_k, cfg.cache_type_v)
    kv_cache = (kv_types.k, kv_types.v)
    if engine is not None and engine.kv.types != kv_types:
        raise VkEngineError(f"the engine's KV cache is {engine.kv.types}, the run asks for {kv_types}")
    t0 = time.monotonic()
    # the commit of the code that runs, taken before anything can change the tree
    commit, dirty = git_commit(Path(vkengine.__file__).resolve().parents[1])
    model = engine.model if engine else load_model(cfg.model)
    pset = load_prompt_set(cfg.prompts)
    texts = [p.render(model.tokenizer) for p in pset.prompts]
    labels = [p.id for p in pset.prompts]
    with reference.mode_endpoints(cfg.endpoint, cfg.endpoint_b, model.path, log, cfg.cache,
                                  cfg.server, tuple(cfg.server_args), kv_cache) as modes:
        ids, (mode_a, mode_b) = reference.collect(modes, model, texts, labels, cfg.n_predict, cfg.n_probs,
                                                  cfg.repeats, log, kv_cache)
    t_ref = time.monotonic() - t0
    if engine is None:
        ecfg = engine_config(max(map(len, ids)), cfg.n_predict, model.args.n_ctx_train, Options.from_env(), kv_types)
        if cfg.devices:
            from vkengine.split import open_split
            engine = open_split(model, cfg.devices, cfg.tensor_split, ecfg)
        else:
            engine = Engine(model, Device(cfg.device), ecfg)
    need = max(map(len, ids)) + cfg.n_predict
    if need > engine.n_ctx:
        raise VkEngineError(f"the longest prompt plus N needs {need} positions; the engine has {engine.n_ctx}")
    banned = sorted(eog_ids(model.tokenizer))
    cases, figs = [], []
    t1 = time.monotonic()
    for i, (pid, p) in enumerate(zip(labels, ids)):
        a, a2 = mode_a.runs[0][i], mode_a.runs[-1][i]
        b, b2 = mode_b.runs[0][i], mode_b.runs[-1][i]
        ec = run_case(engine, p, a.tokens, a.top, banned)
        cf = figures.case_figures(ec.tokens, a.tokens, a2.tokens, b.tokens, b2.tokens, a.top,
                                  ec.tf_top1, ec.tf_logprobs)
        log(f"[{i + 1}/{len(ids)}] {pid}: strict {cf.strict}/{cf.n}, teacher-forced {cf.teacher_forced_top1}/"
            f"{cf.n}, {cf.classification}")
        figs.append(cf)
        tok = model.tokenizer
        cases.append({
            "id": pid, "chat": pset.prompts[i].chat, "prompt_ids": p,
            "engine": ec.tokens, "mode_a": a.tokens, "mode_b": b.tokens,
            "mode_a_run2": a2.tokens, "mode_b_run2": b2.tokens, "probs_refetched": a.filled,
            "text": {"engine": tok.decode(ec.tokens), "mode_a": tok.decode(a.tokens)},
            **cf.to_json()})
    t_eng = time.monotonic() - t1
    totals = figures.summarize(figs, cfg.note)
    info = engine.device.info
    art = {
        "schema": SCHEMA,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "engine": {"name": "vkengine", "version": vkengine.__version__, "git_commit": commit, "git_dirty": dirty},
        "device": {"name": info.name, "type": info.type, "driver": info.driver_name,
                   "driver_info": info.driver_info, "vulkan_api": info.api_version,
                   **({"split": engine.describe()} if hasattr(engine, "describe") else {})},
        "llama_cpp": {"modes": {m.name: m.describe() for m in (mode_a, mode_b)}},
        "model": {"file": model.path.name, "sha256": model.sha256(), "architecture": model.file.arch},
        "kv_cache": {"k": kv_types.k, "v": kv_types.v},   # both sides' (llama-server: -ctk, -ctv)
        "prompts": {"name": pset.name, "sha256": pset.sha256, "count": len(pset.prompts)},
        "n_predict": cfg.n_predict, "n_probs": cfg.n_probs, "repeats": cfg.repeats,
        "near_tie_nats": figures.NEAR_TIE_NATS, "excluded_from_greedy": banned, "definitions": DEFINITIONS,
        "seconds": {"llama_cpp": round(t_ref, 1), "engine": round(t_eng, 1)},
        **totals,
        "cases": cases,
    }
    log(f"{figures.summary_line(totals['summary'])}; verdict {totals['verdict']}")
    if cfg.out:
        write_atomic(Path(cfg.out), art)
        log(f"wrote {cfg.out}")
    return art


def write_atomic(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(to_json(doc))
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)                 # mkstemp makes it private; an artifact is for reading
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def to_json(doc: dict) -> str:
    """Indented JSON with lists of numbers on one line (token ids stay readable)."""
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    # only arrays that json.dumps broke over lines: a string never holds a raw newline
    return re.sub(r"\[\n\s*(-?[\d.eE+-]+(?:,\n\s*-?[\d.eE+-]+)*)\n\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
