"""A GGUF file's header (metadata and tensor table) read straight from the
mapped file, for GGUFFile.

The `gguf` package's GGUFReader builds numpy views of every element of every
metadata array when it opens a file: SmolLM2's tokenizer (49k tokens, 48k
merges) took ~2.9 s to open on this project's CI machine, and a Llama 3
vocabulary (128k tokens, 280k merges) several times that, paid by every server
and every CLI run before anything else (issue 35, cold start). The format is
small (ggml's docs/gguf.md): a header, key/value pairs, a tensor table, aligned
data. Here a key's value is skipped over when the file opens (strings by their
lengths) and decoded when asked for, with the same Python values GGUFReader's
`contents()` gives (tests/test_gguf_read.py compares them on every file the
tests have); numeric arrays in one numpy view each. The `gguf` package still
writes files (vkengine synth) and names the tensor types' block sizes."""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = 0x46554747        # "GGUF" read as a little-endian uint32
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
# value type -> (struct format, numpy dtype) of the scalar types
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"), 5: ("<i", "<i4"),
    6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader takes (truncated, corrupt, big-endian, version 1)."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: int           # ggml type code
    shape: tuple[int, ...]     # GGUF order: ne0 (the contiguous dimension) first
    data_offset: int           # from the start of the file
    n_bytes: int


class GGUFHeader:
    """fields: key -> (value type, byte offset of the value); tensors: in file order;
    buf: the file mapped read-only (tensor bytes are views of it)."""

    def __init__(self, path: str | os.PathLike):
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise GGUFFormatError(f"{size} bytes: too short for a GGUF header")
            self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        b = self.buf
        try:
            magic, version = struct.unpack_from("<II", b, 0)
            if magic != GGUF_MAGIC:
                raise GGUFFormatError("no GGUF magic number")
            if version not in (2, 3):
                swapped = struct.unpack(">I", struct.pack("<I", version))[0]
                raise GGUFFormatError("a big-endian GGUF file: convert it to little-endian" if swapped in (2, 3)
                                      else f"GGUF version {version} (2 and 3 are read)")
            n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
            off = 24
            self.fields: dict[str, tuple[int, int]] = {}
            for _ in range(n_kv):
                key, off = self._string(off)
                (vtype,) = struct.unpack_from("<I", b, off)
                self.fields[key.decode("utf-8")] = (vtype, off + 4)
                off = self._skip(vtype, off + 4)
            infos: list[tuple[str, int, tuple[int, ...], int]] = []
            for _ in range(n_tensors):
                raw_name, off = self._string(off)
                (n_dims,) = struct.unpack_from("<I", b, off)
                dims = struct.unpack_from(f"<{n_dims}Q", b, off + 4)
                ttype, rel = struct.unpack_from("<IQ", b, off + 4 + 8 * n_dims)
                off += 4 + 8 * n_dims + 12
                infos.append((raw_name.decode("utf-8"), ttype, tuple(int(d) for d in dims), rel))
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise GGUFFormatError(f"the header is cut off or corrupt ({type(e).__name__}: {e})") from None
        align = int(self.value("general.alignment")) if "general.alignment" in self.fields else DEFAULT_ALIGNMENT
        if align <= 0:
            raise GGUFFormatError(f"general.alignment {align}")
        data_start = -(-off // align) * align
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        self.tensors: list[TensorInfo] = []
        for name, ttype, dims, rel in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {name} has the unknown type code {ttype}") from None
            n = int(np.prod(dims)) if dims else 1
            self.tensors.append(TensorInfo(name, ttype, dims, data_start + rel, n * type_size // block))

    def _string(self, off: int) -> tuple[bytes, int]:
        (n,) = struct.unpack_from("<Q", self.buf, off)
        end = off + 8 + n
        if end > len(self.buf):
            raise IndexError(f"a string of {n} bytes at byte {off} runs past the end of the file")
        return self.buf[off + 8:end], end

    def _skip(self, vtype: int, off: int) -> int:
        """The offset after a value of vtype at off."""
        if vtype in _SCALARS:
            return off + struct.calcsize(_SCALARS[vtype][0])
        if vtype == STRING:
            return off + 8 + struct.unpack_from("<Q", self.buf, off)[0]
        if vtype == ARRAY:
            etype, n = struct.unpack_from("<IQ", self.buf, off)
            off += 12
            if etype in _SCALARS:
                return off + n * struct.calcsize(_SCALARS[etype][0])
            unpack, b = struct.unpack_from, self.buf
            if etype == STRING:
                for _ in range(n):
                    off += 8 + unpack("<Q", b, off)[0]
                return off
            for _ in range(n):
                off = self._skip(etype, off)
            return off
        raise GGUFFormatError(f"unknown value type {vtype} at byte {off}")

    def value(self, key: str) -> Any:
        """A key's value as GGUFReader's ReaderField.contents() gives it: scalars as
        Python numbers and bools, strings as str, arrays as lists (nested arrays
        flattened, as there). KeyError where the key is missing."""
        vtype, off = self.fields[key]
        return self._value(vtype, off)[0]

    def _value(self, vtype: int, off: int) -> tuple[Any, int]:
        b = self.buf
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype][0]
            return struct.unpack_from(fmt, b, off)[0], off + struct.calcsize(fmt)
        if vtype == STRING:
            s, end = self._string(off)
            return s.decode("utf-8"), end
        if vtype != ARRAY:
            raise GGUFFormatError(f"unknown value type {vtype} at byte {off}")
        etype, n = struct.unpack_from("<IQ", b, off)
        off += 12
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][1])
            return np.frombuffer(b, dt, n, off).tolist(), off + n * dt.itemsize
        out: list[Any] = []
        if etype == STRING:
            unpack = struct.unpack_from
            for _ in range(n):
                ln = unpack("<Q", b, off)[0]
                out.append(b[off + 8:off + 8 + ln].decode("utf-8"))
                off += 8 + ln
            return out, off
        for _ in range(n):
            v, off = self._value(etype, off)
            out.extend(v if isinstance(v, list) else [v])
        return out, off

    def tensor_bytes(self, t: TensorInfo) -> np.ndarray:
        """A tensor's bytes as a read-only uint8 view of the mapped file."""
        return np.frombuffer(self.buf, np.uint8, t.n_bytes, t.data_offset)
