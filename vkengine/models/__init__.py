"""Architectures, looked up by the model file's `general.architecture` (GGUF) or
`architectures[0]` (Hugging Face config.json)."""
from __future__ import annotations

from types import ModuleType

from ..errors import VkEngineError
from . import llama, qwen35

ARCHITECTURES: dict[str, ModuleType] = {llama.ARCH: llama, **{a: qwen35 for a in qwen35.ARCHES}}
HF_ARCHITECTURES: dict[str, ModuleType] = {name: m for m in ARCHITECTURES.values() for name in m.HF_ARCHITECTURES}


def get(arch: str) -> ModuleType:
    m = ARCHITECTURES.get(arch) or HF_ARCHITECTURES.get(arch)
    if m is None:
        supported = ", ".join(sorted(ARCHITECTURES) + sorted(HF_ARCHITECTURES))
        raise VkEngineError(f"architecture {arch!r} is not supported (supported: {supported})")
    return m


def hf_name_map(hf_arch: str):
    return get(hf_arch).hf_to_gguf_name
