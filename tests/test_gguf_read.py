"""vkengine.gguf_read (the GGUF header read from the mapped file, GGUFFile's
reader) against the `gguf` package's GGUFReader: every metadata value as its
ReaderField.contents() gives it, and every tensor's type, shape, place and
bytes: a file of every value and tensor type, the embedded SmolLM2, llama.cpp's
test vocabularies of each tokenizer kind (Llama 3's 128k tokens the largest);
and the errors of cut or foreign files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vkengine.errors import VkEngineError
from vkengine.gguf_file import GGUFFile
from vkengine.gguf_read import GGUFFormatError, GGUFHeader

from .serving import tiny_gguf  # noqa: F401  (fixture)


def assert_same_as_gguf_reader(path: Path) -> None:
    from gguf import GGUFReader
    r = GGUFReader(str(path), "r")
    h = GGUFHeader(path)
    keys = [k for k in r.fields if not k.startswith("GGUF.")]   # (the reader's own header fields)
    assert list(h.fields) == keys
    for k in keys:
        assert h.value(k) == r.fields[k].contents(), k
    assert [t.name for t in h.tensors] == [t.name for t in r.tensors]
    for a, b in zip(h.tensors, r.tensors):
        assert (a.tensor_type, a.shape, a.data_offset, a.n_bytes) == \
            (int(b.tensor_type), tuple(int(d) for d in b.shape), int(b.data_offset), int(b.n_bytes)), a.name
        assert np.array_equal(h.tensor_bytes(a), np.asarray(b.data).reshape(-1).view(np.uint8)), a.name


def test_every_value_and_tensor_type(tmp_path):
    """A file written by gguf's GGUFWriter with a key of every value type
    (arrays of each, empty ones, strings with multi-byte characters, a custom
    alignment) and a tensor of every type the engine loads, rows not a multiple
    of anything."""
    import gguf
    from gguf.quants import quant_shape_to_byte_shape

    from vkengine.quant import BY_NAME
    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1 / 3)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "naïve café 日本 😀")
    w.add_string("t.empty", "")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.25, 3.0e-7])
    w.add_array("t.bools", [True, False])
    w.add_array("t.strs", ["a", "", "ü", "<0x0A>", "Ġthe"])
    w.add_array("t.none", [])
    rng = np.random.default_rng(0)
    specs = [("f32", (3, 5)), ("f16", (7, 40)), ("bf16", (2, 64)), ("q8_0", (5, 64)), ("q4_0", (3, 96)),
             ("q4_1", (2, 32)), ("q5_0", (1, 64)), ("q5_1", (3, 32)), ("mxfp4", (2, 64)), ("q4_k", (2, 256)),
             ("q6_k", (1, 512)), ("iq4_nl", (3, 32)), ("f32", (11,))]
    blobs = []
    for i, (t, shape) in enumerate(specs):
        qt = BY_NAME[t]
        nbytes = int(np.prod(quant_shape_to_byte_shape(shape, qt)))
        blobs.append(rng.integers(0, 256, nbytes, dtype=np.uint8))
        w.add_tensor_info(f"w{i}", shape, np.dtype(np.float32), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for b in blobs:
        w.write_tensor_data(b)
    w.close()
    assert_same_as_gguf_reader(path)
    h = GGUFHeader(path)
    assert h.value("t.str") == "naïve café 日本 😀" and h.value("t.u64") == 2**63 + 5
    assert all(t.data_offset % 64 == 0 for t in h.tensors)


def test_the_embedded_model():
    from vkengine.model import default_model_path
    assert_same_as_gguf_reader(default_model_path())


@pytest.mark.slow
def test_llama_cpp_vocabularies(llama_server_exe):
    from parity import llamacpp
    # (GGUFReader takes seconds for each: a vocabulary of each tokenizer kind, Llama 3's the largest)
    for name in ("llama-bpe", "phi-3", "bert-bge"):
        assert_same_as_gguf_reader(llamacpp.source_tree() / "models" / f"ggml-vocab-{name}.gguf")


def test_cut_and_foreign_files_are_clear_errors(tiny_gguf, tmp_path):  # noqa: F811
    data = Path(tiny_gguf).read_bytes()
    for name, blob in [("cut-header.gguf", data[:3000]), ("cut-data.gguf", data[:len(data) // 2]),
                       ("not.gguf", b"PK\x03\x04" + data[4:]), ("v1.gguf", data[:4] + b"\x01\x00\x00\x00" + data[8:]),
                       ("big-endian.gguf", data[:4] + b"\x00\x00\x00\x03" + data[8:]), ("short.gguf", data[:10])]:
        p = tmp_path / name
        p.write_bytes(blob)
        with pytest.raises(VkEngineError, match="not a readable GGUF file|is truncated") as e:
            GGUFFile(p)
        if name == "big-endian.gguf":
            assert "big-endian" in str(e.value)
    with pytest.raises(GGUFFormatError, match="magic"):
        GGUFHeader(tmp_path / "not.gguf")
