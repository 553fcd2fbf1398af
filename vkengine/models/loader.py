"""Loading weights: plan an arena from the model file's header, allocate it
once, upload every tensor. Matrices stay quantized on the device (repacked
into shaders/quant.glsl's layouts); a matrix larger than one storage buffer is
held in parts of whole rows (or whole experts). Every architecture's
load_weights plans through WeightPlanner."""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np

from ..arena import Arena, ArenaPlan, packed_words, row_parts, split_limit_words
from ..errors import VkEngineError
from ..gguf_file import ModelFile, SafetensorsFolder
from ..kernels import Matrix
from ..quant import check_shape, dequantize, repack_streams, row_bytes, row_slice


def _rows(produce: Callable[[], np.ndarray], type_: str, cols: int, r0: int, r1: int) -> Callable[[], np.ndarray]:
    """A producer of rows [r0, r1) of what `produce` gives."""
    def rows():
        raw = produce()
        return row_slice(np.concatenate([np.asarray(p).reshape(-1).view(np.uint8) for p in raw])
                         if isinstance(raw, list) else raw, type_, cols, r0, r1)
    return rows


class WeightPlanner:
    """Reserve arena space from tensor headers (each call returns a handle);
    `build` allocates the arena once, uploads every tensor and returns the
    Matrix or Region of every handle. Tensors a kernel binds together share a
    buffer (vectors(), and the matrices of one fused()).
    hf_value(name, values): an architecture's conversion of a Hugging Face
    vector to GGUF's convention (e.g. Qwen3.5's RMSNorm weights hold the +1 in
    GGUF only)."""

    def __init__(self, mf: ModelFile, device, hf_value: Callable[[str, np.ndarray], np.ndarray] | None = None):
        self.mf = mf
        self.hf = isinstance(mf, SafetensorsFolder)
        self.hf_value = hf_value
        self.plan = ArenaPlan(device.max_buffer_bytes // 4)
        self.jobs: list[tuple] = []      # (group, kind, payload)
        self.handles: list[tuple[int, int]] = []   # handle -> (job, index inside the job)

    def _shape(self, name: str) -> tuple[str, tuple[int, ...]]:
        return self.mf.tensor_info(name)

    def _job(self, group: int, kind: str, payload, n: int) -> list[int]:
        self.jobs.append((group, kind, payload))
        first = len(self.handles)
        self.handles += [(len(self.jobs) - 1, i) for i in range(n)]
        return list(range(first, first + n))

    def matrix_raw(self, type_: str, rows: int, cols: int, produce: Callable[[], np.ndarray], what: str,
                   unit: int = 1) -> int:
        """A matrix; split by rows into parts of whole `unit`s of rows (an expert's
        rows in a stack of experts) when one storage buffer cannot hold it."""
        check_shape(type_, rows, cols, what)
        spans = row_parts(type_, rows, cols, split_limit_words(self.plan), unit, what)
        parts = []
        for r0, r1 in spans:
            vw, sw = packed_words(type_, r1 - r0, cols)
            g = self.plan.add([vw, sw] if sw else [vw], what if len(spans) == 1 else f"{what}[{r0}:{r1}]")
            rows_of = produce if len(spans) == 1 else _rows(produce, type_, cols, r0, r1)
            parts.append((r0, self._job(g, "matrix", (type_, r1 - r0, cols, rows_of), 1)[0]))
        if len(parts) == 1:
            return parts[0][1]
        return self._job(-1, "split", (type_, rows, cols, parts), 1)[0]

    def matrix(self, names: list[str], rows_each: list[int], cols: int) -> int:
        types = set()
        for n, r in zip(names, rows_each):
            t, s = self._shape(n)
            if int(np.prod(s[:-1])) != r or s[-1] != cols:
                raise VkEngineError(f"{self.mf.path.name}: tensor {n} has shape {s}, expected ({r}, {cols})")
            types.add(t)
        if len(types) != 1:
            raise VkEngineError(f"internal: mixed types fused: {names}")

        def produce():   # fused tensors as a list of parts (uploaded one after another, never concatenated)
            return [self.mf.tensor(n).raw for n in names] if len(names) > 1 else self.mf.tensor(names[0]).raw
        return self.matrix_raw(types.pop(), sum(rows_each), cols, produce, names[0])

    def fused(self, names: list[str], rows_each: list[int], cols: int) -> list[tuple[int, int]]:
        """One matmul when the parts share a type, else one each (with column offsets)."""
        if len({self._shape(n)[0] for n in names}) == 1:
            return [(self.matrix(names, rows_each, cols), 0)]
        out, col = [], 0
        for n, r in zip(names, rows_each):
            out.append((self.matrix([n], [r], cols), col))
            col += r
        return out

    def value(self, name: str, n: int) -> Callable[[], np.ndarray]:
        """f32 values of a tensor (produced at build time), with the architecture's
        HF -> GGUF value conventions applied."""
        _, s = self._shape(name)
        if int(np.prod(s)) != n:
            raise VkEngineError(f"{self.mf.path.name}: tensor {name} has shape {s}, expected {n} values")

        def produce():
            v = self.mf.tensor(name).as_f32().astype(np.float32).reshape(-1)
            if self.hf and self.hf_value is not None:
                v = self.hf_value(name, v)
            return v.astype(np.float32)
        return produce

    def vectors(self, entries: list[tuple[str, Callable[[], np.ndarray], int]]) -> list[int]:
        """f32 arrays placed in one buffer: (what, produce, length)."""
        g = self.plan.add([n for _, _, n in entries], entries[0][0])
        return self._job(g, "vectors", entries, len(entries))

    def vector(self, name: str, n: int) -> int:
        return self.vectors([(name, self.value(name, n), n)])[0]

    def build(self, device) -> tuple[list, Arena]:
        """Allocate the weights' buffers and upload every tensor into them; with
        `device.defer_fills` set (EngineConfig.defer_fill) the uploads are left to
        the device (Device.fill_weights: by Engine.prepare_decode while the steps'
        pipelines compile, or before the device's first submit), and only the
        regions are built here."""
        arena = Arena(device, self.plan, "device", "weights")
        built: list[list] = []
        fills: list[Callable[[], None]] = []
        for g, kind, payload in self.jobs:
            if kind == "split":            # its parts were built before it
                t, rows, cols, parts = payload
                built.append([Matrix(t, rows, cols, None, None,
                                     tuple((r0, built[self.handles[h][0]][self.handles[h][1]]) for r0, h in parts))])
                continue
            regs = arena.regions(g)
            if kind == "vectors":
                built.append(regs[:len(payload)])
                fills.append(functools.partial(_fill_vectors, arena, regs, payload))
                continue
            t, rows, cols, _produce = payload
            streams = repack_streams(t, rows, cols)   # (values, scales or None)
            built.append([Matrix(t, rows, cols, regs[0], regs[1] if streams[1] is not None else None)])
            fills.append(functools.partial(_fill_matrix, device, regs, payload, streams))

        def fill() -> None:
            for f in fills:
                f()
        if getattr(device, "defer_fills", False):
            device.defer_fill(arena, fill)
        else:
            fill()
        return [built[j][i] for j, i in self.handles], arena


def _fill_vectors(arena: Arena, regs: list, payload: list) -> None:
    for r, (what, produce, n) in zip(regs, payload):
        arr = np.ascontiguousarray(produce(), np.float32).reshape(-1)
        if arr.size != n:
            raise VkEngineError(f"internal: {what} has {arr.size} values, expected {n}")
        arena.write(r, arr)


def _fill_matrix(device, regs: list, payload: tuple, streams: tuple) -> None:
    t, rows, cols, produce = payload
    raw = produce()
    parts = raw if isinstance(raw, list) else [raw]
    expected = rows * row_bytes(t, cols)
    nbytes = sum(np.asarray(p).nbytes for p in parts)
    if nbytes != expected:
        raise VkEngineError(f"{t} tensor of {rows}x{cols} should hold {expected} bytes, it holds {nbytes}")
    # repacked on the way into the staging buffer (quant.repack_streams: the same bytes as repack)
    vs, ss = streams
    for reg, st in zip(regs, (vs,) if ss is None else (vs, ss)):
        if (nbytes // st.block * st.out + 3) // 4 > reg.words:
            raise VkEngineError(f"internal: {t} {rows}x{cols} does not fit its region")
        device.upload_blocks(reg.buf, reg.off * 4, parts, st)


def expert_raw(p: WeightPlanner, prefix: str, which: str, E: int, rows: int, cols: int) -> tuple[str, Callable]:
    """(type, produce) of a layer's stacked expert matrices: GGUF ffn_<which>_exps
    (E, rows, cols), or HF per-expert tensors (stacked here)."""
    mf = p.mf
    name = f"{prefix}ffn_{which}_exps.weight"
    if mf.has(name):
        t, s = mf.tensor_info(name)
        if tuple(s) != (E, rows, cols):
            raise VkEngineError(f"{mf.path.name}: {name} has shape {s}, expected {(E, rows, cols)}")
        return t, lambda: mf.tensor(name).raw
    names = [f"{prefix}ffn_{which}_exp.{e}.weight" for e in range(E)]
    types = set()
    for n in names:
        t, s = mf.tensor_info(n)
        if tuple(s) != (rows, cols):
            raise VkEngineError(f"{mf.path.name}: {n} has shape {s}, expected {(rows, cols)}")
        types.add(t)
    if len(types) != 1:
        raise VkEngineError(f"{mf.path.name}: experts of {prefix} mix tensor types")
    return types.pop(), lambda: np.concatenate([mf.tensor(n).raw for n in names])


def gate_up_experts(p: WeightPlanner, prefix: str, E: int, F: int, D: int) -> int:
    """E x (2F) x D, per expert [gate | up] (GGUF ffn_gate_up_exps has this layout)."""
    mf = p.mf
    if mf.has(f"{prefix}ffn_gate_up_exps.weight"):
        t, produce = expert_raw(p, prefix, "gate_up", E, 2 * F, D)
        return p.matrix_raw(t, E * 2 * F, D, produce, f"{prefix}ffn_gate_up_exps", unit=2 * F)
    tg, pg = expert_raw(p, prefix, "gate", E, F, D)
    tu, pu = expert_raw(p, prefix, "up", E, F, D)
    t = tg if tg == tu else "f32"

    def stacked() -> np.ndarray:
        if tg == tu:
            rb = row_bytes(t, D)
            return np.concatenate([pg().reshape(E, F, rb), pu().reshape(E, F, rb)], axis=1).reshape(-1)
        g = dequantize(tg, pg(), E * F, D).reshape(E, F, D)
        u = dequantize(tu, pu(), E * F, D).reshape(E, F, D)
        return np.ascontiguousarray(np.concatenate([g, u], axis=1)).view(np.uint8).reshape(-1)
    return p.matrix_raw(t, E * 2 * F, D, stacked, f"{prefix}ffn_gate_up_exps", unit=2 * F)


def plan_ends(p: WeightPlanner, mf: ModelFile, a, embed_on_last: bool = False
              ) -> tuple[int | None, int | None, int | None]:
    """(token embedding, final norm, output head) handles of a model's part
    (ModelArgs.part; the whole model: all three): the embedding on the first
    part and, where the head (or, embed_on_last, another block of the last
    part) reuses it, the last; the norm and head on the last. None: a tensor
    this part does not load."""
    D = a.n_embd
    tied = not mf.has("output.weight")
    on_last = a.last_part and (tied or embed_on_last)
    i_embd = p.matrix(["token_embd.weight"], [a.n_vocab], D) if a.first_part or on_last else None
    if not a.last_part:
        return i_embd, None, None
    return i_embd, p.vector("output_norm.weight", D), i_embd if tied else p.matrix(["output.weight"], [a.n_vocab], D)


def built(b: list, handle: int | None):
    """What build made of a handle (None: not loaded)."""
    return b[handle] if handle is not None else None
