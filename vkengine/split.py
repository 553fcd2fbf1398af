"""One model split across several Vulkan devices by layers (`--devices 0,1
--tensor-split 3,2`; llama.cpp's `-sm layer -ts`).

Each device holds a contiguous block of layers with their weights, KV rows and
recurrent state (a Part, vkengine/models/base.py): an Engine of its own, built
from the model's args with `part` set. The first part embeds the tokens, the
last holds the final norm, the output head, the token choice on the device and
any MTP block. A step runs the parts in order: each leaves its rows' residual
stream (Architecture.handoff: x; the llama graph's also the next layer's norm
h and its sums of squares, computed as the whole model computes them) in a
host-visible buffer (Engine.handoff_out), which the host copies into the next
device's (handoff_in), where the next part's program starts. Vulkan devices
share no memory without external-memory extensions, so the host is the
bridge: 16-36 KiB a row of the 8B shape. A split model's logits are the whole
model's bit for bit.

SplitEngine offers the Engine's interface (step, submit, collect, prefill,
prepare_decode, profile, kv ...), so the runner, the server, generate, bench
and parity run on it unchanged. The parts before the last are run and waited
for inside submit; the last is left in flight, so the next step's first
parts run on their devices while the last part runs the step before
(pipelining between consecutive steps: Engine.prefill's chunks, the server's
lone prompts, Runner.ahead). A row's token cannot go from the last device to
the first without the host, so a chained step is chained on the host: submit
waits for the step before and takes its tokens (the runner then delivers that
step's text while this one runs, as with chaining on one device).

Per-sequence state splits the same way (SplitState): each part parks,
restores and copies its own share of a sequence, and a parked sequence is the
list of the parts' handles.
"""
from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .device import Device
from .engine import MAIN, Engine, EngineConfig, Pass, Readback
from .errors import VkEngineError
from .kernels import Caps
from .model import Model
from .models.base import Part


def parse_split(text: str | None, n_devices: int) -> list[float]:
    """--tensor-split proportions ("3,2"; default: equal), one per device."""
    if not text:
        return [1.0] * n_devices
    try:
        w = [float(x) for x in text.split(",")]
    except ValueError:
        raise VkEngineError(f"--tensor-split {text!r}: comma-separated proportions, e.g. 3,2") from None
    if len(w) != n_devices:
        raise VkEngineError(f"--tensor-split gives {len(w)} proportions for {n_devices} devices")
    if not all(np.isfinite(x) and x >= 0 for x in w) or sum(w) <= 0:
        raise VkEngineError(f"--tensor-split {text!r}: proportions are non-negative and not all zero")
    return w


def plan_parts(n_layer: int, weights: Sequence[float]) -> list[Part]:
    """Contiguous blocks of layers in proportion to weights (llama.cpp -ts: a
    device's share of the layers), every device at least one layer."""
    n = len(weights)
    if n < 2:
        raise VkEngineError("a split needs at least two devices")
    if n_layer < n:
        raise VkEngineError(f"{n_layer} layers cannot be split across {n} devices")
    total = float(sum(weights))
    cum = np.cumsum(np.asarray(weights, np.float64)) / total
    bounds = [0] + [int(round(c * n_layer)) for c in cum[:-1]] + [n_layer]
    for i in range(1, n):                     # at least a layer each, in order
        bounds[i] = min(max(bounds[i], bounds[i - 1] + 1), n_layer - (n - i))
    return [Part(bounds[i], bounds[i + 1], n_layer) for i in range(n)]


@dataclass
class SplitBuffer:
    """The parked buffers of one sequence, a part each (what the runner pools)."""
    parts: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.parts)


@dataclass
class SplitParked:
    """A parked sequence: each part's handle."""
    parts: list[Any]

    @property
    def length(self) -> int:
        return int(self.parts[0].length)

    @property
    def buffer(self) -> SplitBuffer:
        return SplitBuffer([p.buffer for p in self.parts])


class SplitState:
    """The per-sequence state of a split model: each part's KVCache or
    HybridState behind the interface the scheduler, the runner and the
    speculator use (each call goes to every part; a prefix is reusable as far
    as every part can reuse it)."""

    def __init__(self, states: list[Any]):
        self.states = states
        self.types = states[0].types
        self.rewindable = all(s.rewindable for s in states)
        self.snap_rows = min(s.snap_rows for s in states)

    def park_bytes(self, slot: int, length: int) -> int:
        return sum(s.park_bytes(slot, length) for s in self.states)

    def park(self, slot: int, length: int, into: SplitBuffer | None = None) -> SplitParked:
        """Each part parks its share into its buffer of `into` (one too small for
        it is freed, and the part takes a new one)."""
        bufs: list[Any] = into.parts if into is not None else [None] * len(self.states)
        for i, (s, b) in enumerate(zip(self.states, bufs)):
            if b is not None and b.nbytes < s.park_bytes(slot, length):
                s.free(b)
                bufs[i] = None
        return SplitParked([s.park(slot, length, into=b) for s, b in zip(self.states, bufs)])

    def restore(self, parked: SplitParked, slot: int, length: int | None = None) -> None:
        for s, p in zip(self.states, parked.parts):
            s.restore(p, slot, length)

    def free(self, buffer: SplitBuffer) -> None:
        for s, b in zip(self.states, buffer.parts):
            s.free(b)

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        for s in self.states:
            s.copy_prefix(src_slot, dst_slot, length)

    def reusable_prefix(self, src_slot: int, length: int) -> int:
        return min(s.reusable_prefix(src_slot, length) for s in self.states)

    def reusable_parked(self, parked: SplitParked, length: int) -> int:
        return min(s.reusable_parked(p, length) for s, p in zip(self.states, parked.parts))

    def commit_snapshots(self, rollbacks) -> None:
        rollbacks = list(rollbacks)
        for s in self.states:
            s.commit_snapshots(rollbacks)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states)


class SplitEngine:
    """Engine's interface over one Engine a part (the module's docstring)."""

    can_chain = True        # on the host (submit): the step before is waited for, its tokens taken
    overlaps_steps = True   # a step submitted with one in flight runs its first parts beside it (Runner.ahead)

    def __init__(self, model: Model, devices: Sequence[Device], cfg: EngineConfig = EngineConfig(),
                 split: Sequence[float] | None = None, caps: Sequence[Caps] | None = None):
        """devices: one a part, in layer order; split: their shares of the
        layers (default equal); caps: each part's kernel abilities (default:
        decided from its device)."""
        if not model.arch.splittable:
            raise VkEngineError(f"{model.name}: {type(model.arch).__name__} models cannot be split across devices "
                                "yet; run it on one (--device)")
        if model.args.fixed_experts:
            raise VkEngineError("--fixed-experts records expert choices on one device; run it unsplit")
        parts = plan_parts(model.args.n_layer, split if split is not None else [1.0] * len(devices))
        if len(devices) != len(parts):
            raise VkEngineError(f"{len(devices)} devices for {len(parts)} parts")
        self.model, self.cfg, self.split = model, cfg, parts
        self.args, self.arch = model.args, model.arch
        self.parts: list[Engine] = []
        try:
            for i, (p, dev) in enumerate(zip(parts, devices)):
                m = dataclasses.replace(model, args=dataclasses.replace(model.args, part=p))
                self.parts.append(Engine(m, dev, cfg, caps[i] if caps is not None else None))
        except BaseException:
            for e in self.parts:
                e.close()
            raise
        last = self.parts[-1]
        self.last = last
        self.n_ctx = last.n_ctx
        self.max_batch = min(e.max_batch for e in self.parts)
        self.kv = SplitState([e.kv for e in self.parts])
        # what the speculator, embeddings and device sampling read: the last part's
        self.weights, self.scratch, self.layout = last.weights, last.scratch, last.layout
        self.hidden_host, self.can_sample = last.hidden_host, last.can_sample
        self.device = last.device
        self.devices = [e.device for e in self.parts]
        self.kernels = last.kernels
        self.max_out = last.max_out
        # two: the step on the last device and the one whose first parts run beside it (a third would only
        # make the host wait a step longer inside a host-chained submit before it delivers the oldest)
        self.max_in_flight = min(2, last.max_in_flight)
        for before, after in zip(self.parts, self.parts[1:]):
            after.takes_norm = before.hands_norm
        for e in self.parts:
            e.device_chains = False   # (chained on the host: prepare_decode records no chained steps)
        self._modes: deque[Readback] = deque()   # the readback of each step submitted and not yet collected
        self._done: deque[Any] = deque()         # the oldest of them, collected early (a chained submit)

    def describe(self) -> str:
        """Which layers each device holds, for logs: "split across 2 devices: layers 0-14 on [0] ..."."""
        return f"split across {len(self.parts)} devices: " + ", ".join(
            f"layers {p.start}-{p.stop - 1} on [{e.device.info.index}] {e.device.info.name}"
            for p, e in zip(self.split, self.parts))

    # -- what the callers read ------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.cfg.n_slots

    @property
    def n_vocab(self) -> int:
        return self.args.n_vocab

    @property
    def n_programs(self) -> int:
        return sum(e.n_programs for e in self.parts)

    @property
    def in_flight(self) -> int:
        return len(self._modes)

    # MTP steps share the main steps' limit here (Engine.reserve_mtp: not on a split model's parts)
    mtp_depth = 0

    def reserve_mtp(self, depth: int) -> None:
        pass

    def restart_mtp_ring(self) -> None:
        pass

    def has_room(self, pass_=None) -> bool:
        return self.in_flight < self.max_in_flight

    @property
    def tiled_prompts(self) -> bool:
        return self.last.tiled_prompts

    @property
    def prompt_granule(self) -> int:
        return self.last.prompt_granule

    @property
    def exact_rows(self) -> int:
        return min(e.exact_rows for e in self.parts)

    def prompt_cost_rows(self, n: int) -> int:
        return self.last.prompt_cost_rows(n)

    def step_rows(self, n: int, prompt: bool = False) -> int:
        return self.last.step_rows(n, prompt)

    # -- steps ------------------------------------------------------------------------------
    step = Engine.step
    prefill = Engine.prefill

    def submit(self, tokens, positions, slots, out_rows=(), readback: Readback = Readback.ARGMAX,
               chain: Sequence[int] | None = None, sampling=None, prompt: bool = False, pass_: Pass = MAIN,
               hmap=None, masked: bool = False, masks=None) -> None:
        """Engine.submit: the parts before the last run now (the host waits for
        each and hands its rows' residual stream on), the last is left in
        flight. An MTP pass runs on the last part alone (its block and the
        hidden states it reads live there; chained, on the last part's device).

        chain (Engine.submit's): the token of the step before cannot reach the
        first device without the host, so the host takes it: the steps on the
        device are waited for (their results kept for collect()), then this
        step runs with their newest's tokens. The caller still gets the GPU
        working on this step while it handles the step before's tokens."""
        last = self.last
        if pass_.mtp:
            last.submit(tokens, positions, slots, out_rows, readback, chain=chain, sampling=sampling,
                        prompt=prompt, pass_=pass_, hmap=hmap, masked=masked, masks=masks)
            self._modes.append(readback)
            return
        if chain is not None:
            if not self._modes or self._modes[-1] not in (Readback.ARGMAX, Readback.SAMPLE):
                raise RuntimeError("a chained step needs a step in flight that reads its tokens back")
            while last.in_flight:
                self._done.append(last.collect())
            prev = self._done[-1]
            if any(not 0 <= int(j) < len(prev) for j in chain) or len(chain) != len(tokens):
                raise ValueError(f"chain must give, for each of the {len(tokens)} rows, an output row of the step "
                                 "in flight")
            tokens = [int(prev[int(j)]) for j in chain]
        # every check the last part makes, before any part's state moves; every part runs the rows (pad rows
        # too) the last part would run alone
        tok, pos, slt, outs, mode, _, _ = last.check_submit(tokens, positions, slots, out_rows, readback, None,
                                                            sampling, pass_, hmap, masked)
        rows = last.pad_rows(len(tok), len(outs), mode, (), pass_, prompt, pos, slt)
        for e, nxt in zip(self.parts, self.parts[1:]):
            e.submit(tokens, positions, slots, (), Readback.NONE, prompt=prompt, pass_=pass_, rows=rows)
            e.collect()
            assert e.handoff_out is not None and nxt.handoff_in is not None
            words = e.handoff_words(e.last_rows)
            nxt.handoff_in.array()[:words] = e.handoff_out.array()[:words]
        last.submit(tokens, positions, slots, out_rows, readback, sampling=sampling, prompt=prompt, pass_=pass_,
                    hmap=hmap, masked=masked, masks=masks, rows=rows)
        self._modes.append(readback)

    def submit_masks(self, masks) -> None:
        self.last.submit_masks(masks)

    def collect(self) -> Any:
        if not self._modes:
            raise RuntimeError("no step in flight")
        out = self._done.popleft() if self._done else self.last.collect()
        self._modes.popleft()
        return out

    # -- recording ahead, profiles, teardown --------------------------------------------------
    def prepare_decode(self, max_rows: int, prompt_rows: int = 0, defer: bool = False) -> int:
        return sum(e.prepare_decode(max_rows, prompt_rows, defer) for e in self.parts)

    @property
    def deferred(self) -> list[tuple]:
        return [k for e in self.parts for k in e.deferred]

    @property
    def programs_evicted(self) -> int:
        return sum(e.programs_evicted for e in self.parts)

    def record_deferred(self) -> bool:
        return any(e.record_deferred() for e in self.parts)

    def drop_deferred(self) -> None:
        for e in self.parts:
            e.drop_deferred()

    def profile(self, n: int, n_out: int = 1, runs: int = 5, start_pos: int = 0, batched: bool = False,
                readback: Readback = Readback.ARGMAX, pass_: Pass = MAIN, hmap=None) -> list[tuple[str, float, int]]:
        """Engine.profile over every part (labels summed across them; the handoffs are the parts' `handoff`
        copies, the host's copy between them is not timed); an MTP pass runs on the last part alone, as
        submit runs it."""
        if pass_.mtp:
            return self.last.profile(n, n_out, runs, start_pos, batched, readback, pass_, hmap)
        us: dict[str, float] = {}
        counts: dict[str, int] = {}
        for e in self.parts:
            own = e is self.last
            for label, t, c in e.profile(n, n_out if own else 0, runs, start_pos, batched,
                                         readback if own else Readback.NONE, pass_):
                us[label] = us.get(label, 0.0) + t
                counts[label] = counts.get(label, 0) + c
        return sorted(((k, v, counts[k]) for k, v in us.items()), key=lambda r: -r[1])

    def close(self) -> None:
        self._done.clear()
        self._modes.clear()
        for e in self.parts:
            e.close()


def open_split(model: Model, indices: Sequence[int], tensor_split: str | None, cfg: EngineConfig,
               caps: Sequence[Caps] | None = None) -> SplitEngine:
    """A SplitEngine over the Vulkan devices of these indices (a repeated index:
    another Vulkan device on the same physical one), each keeping the pipelines
    it compiles for the next process."""
    shares = parse_split(tensor_split, len(indices))
    devices = [Device(i) for i in indices]
    for d in devices:
        d.save_at_exit()
    return SplitEngine(model, devices, cfg, shares, caps)
