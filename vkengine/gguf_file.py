"""Reading GGUF model files (their headers by vkengine.gguf_read) and Hugging Face
safetensors folders behind one interface: metadata, and tensors as raw bytes of
a known GGML type, kept quantized."""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import VkEngineError
from .quant import row_bytes, type_name

_REQUIRED = object()


@dataclass(frozen=True)
class TensorData:
    name: str
    type: str            # device type name (f32, q4_0, ...)
    shape: tuple[int, ...]   # numpy order: (rows, cols) for matrices, (n,) for vectors
    raw: np.ndarray      # uint8, GGUF bytes

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1

    @property
    def cols(self) -> int:
        return int(self.shape[-1])

    def as_f32(self) -> np.ndarray:
        from .quant import dequantize
        return dequantize(self.type, self.raw, self.rows, self.cols).reshape(self.shape)


class ModelFile(ABC):
    """Common interface of GGUFFile and SafetensorsFolder."""
    path: Path
    arch: str

    @abstractmethod
    def meta(self, key: str, default: Any = _REQUIRED) -> Any: ...
    @abstractmethod
    def has(self, name: str) -> bool: ...
    @abstractmethod
    def tensor(self, name: str) -> TensorData: ...
    @abstractmethod
    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]: ...
    @abstractmethod
    def tensor_names(self) -> list[str]: ...

    def tensor_bytes(self, name: str) -> int:
        """Bytes of a tensor as stored (what it takes on the device, near enough)."""
        t, s = self.tensor_info(name)
        return (int(np.prod(s[:-1])) if len(s) > 1 else 1) * row_bytes(t, int(s[-1]))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.tensor_info(name)[1]


class GGUFFile(ModelFile):
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise VkEngineError(f"model file {self.path} does not exist")
        from .gguf_read import GGUFFormatError, GGUFHeader
        try:
            self._h = GGUFHeader(self.path)
        except (GGUFFormatError, OSError, ValueError) as e:
            raise VkEngineError(f"{self.path} is not a readable GGUF file: truncated or corrupt "
                                f"({type(e).__name__}: {e})") from e
        self._tensors = {t.name: t for t in self._h.tensors}
        size = self.path.stat().st_size
        for t in self._h.tensors:
            end = t.data_offset + t.n_bytes
            if end > size:
                raise VkEngineError(f"{self.path} is truncated: tensor {t.name} ends at byte {end}, "
                                    f"the file has {size}")
        self.arch = str(self.meta("general.architecture"))

    def meta(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self._h.fields:
            if default is _REQUIRED:
                raise VkEngineError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        try:
            return self._h.value(key)
        except Exception as e:
            raise VkEngineError(f"{self.path.name}: metadata key {key!r} is unreadable ({e})") from e

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        t = self._get(name)
        return type_name(t.tensor_type), tuple(reversed(t.shape))

    def _get(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise VkEngineError(f"{self.path.name}: tensor {name!r} is missing")
        return t

    def tensor(self, name: str) -> TensorData:
        t = self._get(name)
        tname, shape = self.tensor_info(name)
        raw = self._h.tensor_bytes(t)
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        if raw.size != rows * row_bytes(tname, shape[-1]):
            raise VkEngineError(f"{self.path.name}: tensor {name} has {raw.size} bytes, expected "
                                f"{rows * row_bytes(tname, shape[-1])} for {tname} {shape}")
        return TensorData(name, tname, shape, raw)


_ST_TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
_ST_ITEM = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
            "I8": 1, "U8": 1, "BOOL": 1}


class SafetensorsFolder(ModelFile):
    """A Hugging Face checkpoint folder: config.json + *.safetensors. Tensor names
    are mapped to GGUF names by the architecture's HF_NAMES table (data, next to
    the graph); metadata keys are answered from config.json by the architecture."""

    def __init__(self, path: str | os.PathLike, name_map):
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise VkEngineError(f"{self.path} has no config.json (a Hugging Face model folder is expected)")
        try:
            self.config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise VkEngineError(f"{cfg} is not valid JSON: {e}") from e
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise VkEngineError(f"{self.path} has no .safetensors files")
        from safetensors import safe_open
        self._handles = []
        self._where: dict[str, tuple[Any, str]] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="numpy")
            except Exception as e:
                raise VkEngineError(f"{f} is not a readable safetensors file ({e})") from e
            self._handles.append(h)
            for hf_name in h.keys():
                g = name_map(hf_name)
                if g is not None:
                    self._where[g] = (h, hf_name)
        archs = self.config.get("architectures") or [self.config.get("model_type", "?")]
        self.arch = str(archs[0])

    def meta(self, key: str, default: Any = _REQUIRED) -> Any:
        if key in self.config:
            return self.config[key]
        if default is _REQUIRED:
            raise VkEngineError(f"{self.path}/config.json: key {key!r} is missing")
        return default

    def has(self, name: str) -> bool:
        return name in self._where

    def tensor_names(self) -> list[str]:
        return list(self._where)

    def _slice(self, name: str):
        if name not in self._where:
            raise VkEngineError(f"{self.path}: tensor for {name!r} is missing")
        h, hf = self._where[name]
        return h.get_slice(hf), hf

    def tensor_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        sl, hf = self._slice(name)
        dt = sl.get_dtype()
        if dt not in _ST_TYPES:
            raise VkEngineError(f"{self.path}: tensor {hf} has dtype {dt}; supported: F32, F16, BF16")
        return _ST_TYPES[dt], tuple(int(d) for d in sl.get_shape())

    def array_info(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype, shape) of any tensor, packed ones included (gpt-oss's
        U8 MXFP4 blocks and scales)."""
        sl, _ = self._slice(name)
        return str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape())

    def tensor_bytes(self, name: str) -> int:
        dt, s = self.array_info(name)
        return _ST_ITEM.get(dt, 4) * int(np.prod(s))

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.array_info(name)[1]

    def array(self, name: str) -> np.ndarray:
        """A U8/I8/U16/I16/U32/I32 tensor as numpy holds it (F32, F16 and BF16 tensors: tensor())."""
        dt, _ = self.array_info(name)
        if dt not in ("U8", "I8", "U16", "I16", "U32", "I32"):
            raise VkEngineError(f"internal: {name} is {dt}, not an integer tensor")
        h, hf = self._where[name]
        return np.asarray(h.get_tensor(hf))

    def tensor(self, name: str) -> TensorData:
        tname, shape = self.tensor_info(name)
        h, hf = self._where[name]
        if tname == "bf16":
            # numpy has no bfloat16: read the raw bytes through the safetensors header
            raw = _raw_bf16(h, hf, self.path)
        else:
            raw = np.ascontiguousarray(h.get_tensor(hf)).reshape(-1).view(np.uint8)
        return TensorData(name, tname, shape, raw)


def _raw_bf16(handle, hf_name: str, folder: Path) -> np.ndarray:
    # safe_open(framework="numpy") refuses bf16; read the header and slice the file
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        if hf_name in header:
            a, b = header[hf_name]["data_offsets"]
            mm = np.memmap(f, np.uint8, "r")
            return np.asarray(mm[8 + n + a: 8 + n + b])
    raise VkEngineError(f"{folder}: tensor {hf_name} not found")


def open_model_file(path: str | os.PathLike, hf_name_map_for_arch=None) -> ModelFile:
    """A .gguf file, or a Hugging Face folder (config.json + safetensors)."""
    p = Path(path)
    if p.is_dir():
        if hf_name_map_for_arch is None:
            raise VkEngineError("internal: no HF name map")
        try:
            arch = json.loads((p / "config.json").read_text()).get("architectures", ["?"])[0]
        except (OSError, json.JSONDecodeError) as e:
            raise VkEngineError(f"{p}/config.json is missing or invalid ({e})") from e
        return SafetensorsFolder(p, hf_name_map_for_arch(arch))
    if not p.exists():
        raise VkEngineError(f"model path {p} does not exist")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise VkEngineError(f"{p} is not a GGUF file (magic {magic!r}); give a .gguf file or a Hugging Face folder")
    return GGUFFile(p)
