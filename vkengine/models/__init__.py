"""Architectures, found by name: every module or package here (but base and
loader) defines ARCHITECTURE, an instance of models.base.Architecture, and is
looked up by the model file's `general.architecture` (GGUF) or
`architectures[0]` (Hugging Face config.json)."""
from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

from ..errors import VkEngineError
from .base import Architecture, ModelArgs

__all__ = ["Architecture", "ModelArgs", "architectures", "get", "hf_name_map"]

_NOT_ARCHITECTURES = {"base", "loader"}


@lru_cache(maxsize=1)
def architectures() -> tuple[Architecture, ...]:
    found = []
    for m in pkgutil.iter_modules(__path__):
        if m.name not in _NOT_ARCHITECTURES:
            found.append(importlib.import_module(f"{__name__}.{m.name}").ARCHITECTURE)
    return tuple(found)


def get(name: str) -> Architecture:
    """The architecture of a GGUF `general.architecture` or a Hugging Face architecture name."""
    for a in architectures():
        if name in a.names or name in a.hf_architectures:
            return a
    supported = ", ".join(sorted(n for a in architectures() for n in (*a.names, *a.hf_architectures)))
    raise VkEngineError(f"architecture {name!r} is not supported (supported: {supported})")


def hf_name_map(hf_arch: str):
    return get(hf_arch).hf_to_gguf_name
