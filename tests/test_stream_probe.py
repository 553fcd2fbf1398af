"""bench/stream_probe.py (the decode step's dispatch structure run with the
copy shader): its dispatches, bytes and barriers per mode, and that the copies
it times move the bytes it says (on the device, a tiny llama GGUF)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from .serving import tiny_gguf  # noqa: F401  (fixture)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import stream_probe  # noqa: E402


def test_step_ops_follow_the_gguf(tiny_gguf):
    from gguf import GGUFReader
    r = GGUFReader(str(tiny_gguf), "r")
    sizes = {t.name: int(t.n_bytes) for t in r.tensors}
    n_layer = sum(1 for n in sizes if n.endswith(".attn_output.weight"))
    ops = stream_probe.step_ops(tiny_gguf, position=64)
    assert len(ops) == 5 * n_layer + 1 and ops[-1][0] == "head"
    assert [lab.split(".")[0] for lab, _ in ops[:5]] == ["qkv", "attention", "o", "gate|up", "down"]
    assert ops[0][1] == sum(sizes[f"blk.0.attn_{m}.weight"] for m in "qkv")
    assert ops[3][1] == sizes["blk.0.ffn_gate.weight"] + sizes["blk.0.ffn_up.weight"]
    matrices = sum(b for n, b in sizes.items() if n.startswith("blk.") and n.endswith(".weight") and "norm" not in n)
    assert sum(b for lab, b in ops if not lab.startswith(("attention", "head"))) == matrices
    assert ops[1][1] > 0   # K and V rows at position 64


def test_modes_record_the_step_structure(device, kernels, tiny_gguf):
    ops = stream_probe.step_ops(tiny_gguf, position=64)
    n_layer = (len(ops) - 1) // 5
    arena = stream_probe.Arena(device, sum(b for _, b in ops) // 2, 4 << 20)
    try:
        want = {"step": (len(ops), 2 * len(ops) - 1), "no-barrier": (len(ops), 1),
                "per-layer": (n_layer + 1, 2 * (n_layer + 1) - 1)}
        for mode, (groups, barriers) in want.items():
            prog, n = stream_probe.build(device, kernels, arena, ops, mode, repeat=2)
            assert n == groups and prog.n_dispatches == 2 * groups
            assert prog.n_barriers == barriers, mode
        # every byte moves: a source pattern arrives in the destinations
        prog, _ = stream_probe.build(device, kernels, arena, ops, "step", repeat=1)
        used = arena.pair + 1
        pattern = [np.arange(arena.chunk // 4, dtype=np.uint32) + 7 * i for i in range(used)]
        for (src, dst), pat in zip(arena.pairs, pattern):
            device.upload(src, pat)
            device.upload(dst, np.zeros_like(pat))
        prog.run()
        arena.reset()
        for _, b in ops:
            s, d = arena.take(b // 2)
            got = device.download(d.buf, d.off * 4, d.words * 4, np.uint32)
            np.testing.assert_array_equal(got, pattern[arena.pair][d.off:d.off + d.words])
    finally:
        arena.free()
