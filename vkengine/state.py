"""Per-sequence state on the device: the attention KV cache, in slots.

Per layer, K and V each have a type (KVTypes: llama-server's --cache-type-k
and --cache-type-v) and a region [slot][...] whose slots hold `cap` positions
(ctx, rounded up to a multiple of 4 when a side is q8_0 so that every slot
starts 16-byte aligned). In 32-bit words, a slot of
  f16:  [position][kv_head][head_dim / 2 words of f16 pairs];
  q8_0: quants [position][kv_head][head_dim / 4 words of 4 int8], then at
        cap * n_kv * head_dim / 4 the scales [position][kv_head][head_dim / 64
        words of f16 pairs]: one f16 d per block of 32 values along head_dim
        (llama.cpp's q8_0: d = max|x| / 127, q = roundf(x / d)), 17/32 of the
        f16 bytes. shaders/kv.glsl reads and writes them.
The kernels take K's slot stride (`slot_stride`); V's and where the scales start
follow from it. Layers are spread over as few buffers as the device's
storage-buffer range allows; one layer's K and V always share a buffer (one
binding in the kernels).

Parking (slices mode, preemption) copies a slot's first `length` positions of
every layer (each side's quants and scales: `_slot_ranges`) to a host-visible
buffer and back; copying slot to slot serves the prefix cache.

Sliding-window layers (`rings`: Gemma's local layers) keep a ring of `ring`
positions a slot instead of the context (position t at row t % ring): the
window plus what a step can write past a row's position (its rows and pad
rows: 2 x max_batch), so that no row a step reads is overwritten by the same
step. Such a slot can continue at its last position, start again at 0, or go
back to a position whose window the ring still holds (`reusable_prefix`;
`begin_step` refuses the others); parking and prefix copies take the ring's
rows that hold anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arena import Arena, ArenaPlan
from .device import Buffer, Device, Program
from .errors import VkEngineError
from .kernels import KVTypes, Region


@dataclass
class Parked:
    """A sequence's KV rows in host memory (or on disk-backed numpy); ring_rows,
    ring_hi: rows of each ring layer parked, and the slot's written extent then."""
    length: int
    buffer: Buffer
    ring_rows: int = 0
    ring_hi: int = 0


class KVCache:
    """Per-sequence state of an attention-only model, and the interface every
    state offers the engine and the scheduler (HybridState adds recurrent
    state behind the same methods).

    A step may start a slot at any position its rows cover (KV rows are
    simply overwritten), so every cached prefix is reusable, and pad rows past
    a sequence's end change nothing it reads."""
    rewindable = True
    snap_rows = 0      # rows of a speculative step whose state can be rolled back to

    def __init__(self, device: Device, n_layer: int, n_slots: int, ctx: int, n_kv: int, head_dim: int,
                 layers: list[int] | None = None, types: KVTypes = KVTypes(), rings: list[int] | None = None,
                 window: int = 0, max_step: int = 0):
        """rings: the sliding-window layers, whose slots hold ring_capacity(window,
        max_step) positions (max_step: the most rows a step takes)."""
        types.check_head_dim(head_dim)
        self.device = device
        self.n_slots, self.ctx, self.n_kv, self.head_dim = n_slots, ctx, n_kv, head_dim
        self.types = types
        self.cap = self.capacity(ctx, types)
        self.k_stride = self.cap * n_kv * KVTypes.pos_words(types.k, head_dim)
        self.v_stride = self.cap * n_kv * KVTypes.pos_words(types.v, head_dim)
        self.slot_stride = self.k_stride                # what the kernels take (shaders/kv.glsl)
        self.layers = list(range(n_layer)) if layers is None else list(layers)
        self.window, self.margin = window, max_step
        ring_cap = self.ring_capacity(window, max_step, ctx, types) if rings else self.cap
        self.ring_cap = ring_cap if ring_cap < self.cap else 0
        self._rings = set(rings or ()) if self.ring_cap else set()
        # per layer: positions a slot holds; per layer and side (K, V): (words into a slot where position 0
        # starts, words a position) of each of its parts: the f16 rows, or the q8_0 quants and scales
        self._cap = {layer: self.ring_cap if layer in self._rings else self.cap for layer in self.layers}
        self._parts = {layer: [self._side_parts(t, self._cap[layer]) for t in (types.k, types.v)]
                       for layer in self.layers}
        self._strides = {layer: tuple(self._cap[layer] * n_kv * KVTypes.pos_words(t, head_dim)
                                      for t in (types.k, types.v)) for layer in self.layers}
        plan = ArenaPlan(device.max_buffer_bytes // 4)
        self._groups = {layer: plan.add([n_slots * s for s in self._strides[layer]],
                                        f"KV cache of one layer ({n_slots} slots x {self._cap[layer]})")
                        for layer in self.layers}
        self.arena = Arena(device, plan, "device", "kv")
        self._regions = {layer: self.arena.regions(g) for layer, g in self._groups.items()}
        self.hi = np.zeros(n_slots, np.int64)   # (rings) per slot: 1 + the last position a step wrote

    @staticmethod
    def ring_capacity(window: int, max_step: int, ctx: int, types: KVTypes) -> int:
        """Positions a sliding-window layer's slot holds: its window and twice the
        rows of a step (a step's rows and its pad rows past them), at most the context."""
        return KVCache.capacity(min(ctx, window + 2 * max_step), types)

    def stride(self, layer: int) -> int:
        """K's slot stride of a layer (what the kernels take)."""
        return self._strides[layer][0]

    def ring(self, layer: int) -> int:
        """A sliding-window layer's ring (positions a slot holds), else 0."""
        return self.ring_cap if layer in self._rings else 0

    def _side_parts(self, t: str, cap: int) -> list[tuple[int, int]]:
        n_kv, hd = self.n_kv, self.head_dim
        if t == "q8_0":
            return [(0, n_kv * hd // 4), (cap * n_kv * hd // 4, n_kv * hd // 64)]
        return [(0, n_kv * hd // 2)]

    @staticmethod
    def capacity(ctx: int, types: KVTypes) -> int:
        """Positions a slot holds: ctx, rounded up to a multiple of 4 with a q8_0 side."""
        return -(-ctx // 4) * 4 if types.quantized else ctx

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    @staticmethod
    def position_bytes(n_layer: int, n_kv: int, head_dim: int, types: KVTypes = KVTypes()) -> int:
        """Device bytes of one position of one slot (K and V of n_layer layers)."""
        return n_layer * n_kv * (KVTypes.pos_words(types.k, head_dim) + KVTypes.pos_words(types.v, head_dim)) * 4

    @staticmethod
    def bytes_needed(n_layer: int, n_slots: int, ctx: int, n_kv: int, head_dim: int,
                     types: KVTypes = KVTypes()) -> int:
        """Device bytes of the K and V caches (before buffer alignment)."""
        return n_slots * KVCache.capacity(ctx, types) * KVCache.position_bytes(n_layer, n_kv, head_dim, types)

    def k(self, layer: int) -> Region:
        return self._regions[layer][0]

    def v(self, layer: int) -> Region:
        return self._regions[layer][1]

    def bytes_per_position(self) -> int:
        """Bytes a position of a slot's layers without a ring."""
        return self.position_bytes(len(self.layers) - len(self._rings), self.n_kv, self.head_dim, self.types)

    def ring_row_bytes(self) -> int:
        """Bytes a ring row of all the sliding-window layers."""
        return self.position_bytes(len(self._rings), self.n_kv, self.head_dim, self.types)

    def _slot_ranges(self, slot: int, start: int, length: int, ring_rows: int = 0):
        """(region, word offset, words) of positions [start, start+length) of a slot, per layer, K/V and part
        (a q8_0 side's quants and scales); of a ring layer, its rows [0, ring_rows)."""
        for layer in self.layers:
            a, n = (0, ring_rows) if layer in self._rings else (start, length)
            if n <= 0:
                continue
            for r, stride, parts in zip(self._regions[layer], self._strides[layer], self._parts[layer]):
                for off0, words in parts:
                    yield r, r.off + slot * stride + off0 + a * words, n * words

    def _ring_rows(self, slot: int) -> int:
        """A slot's ring rows that may hold anything of its sequence (0: no rings)."""
        return min(self.ring_cap, int(self.hi[slot]) + self.margin) if self._rings else 0

    def _window_kept(self, hi: int, length: int) -> bool:
        """Whether a ring written up to position hi - 1 (and pad rows past it)
        still holds the window before position `length`."""
        return length == 0 or not self._rings or max(0, length - self.window + 1) >= hi + self.margin - self.ring_cap

    def park_bytes(self, slot: int, length: int) -> int:
        """Bytes park(slot, length) copies (the size of a buffer it can reuse)."""
        return max(16, length * self.bytes_per_position() + self._ring_rows(slot) * self.ring_row_bytes())

    def park(self, slot: int, length: int, into: Buffer | None = None) -> Parked:
        """Copy positions [0, length) of a slot (a ring layer's rows that hold
        anything) into a host-visible buffer."""
        rows = self._ring_rows(slot)
        need = self.park_bytes(slot, length)
        if into is None or into.nbytes < need:
            into = self.device.buffer(need, "host", f"parked-slot{slot}")
        p = self.device.program()
        off = 0
        for r, w, n in self._slot_ranges(slot, 0, length, rows):
            p.copy(r.buf, into, w * 4, off, n * 4, "park")
            off += n * 4
        p.run()
        return Parked(length, into, rows, int(self.hi[slot]))

    def free(self, buffer: Buffer) -> None:
        """Free a parking buffer (park's `into`) that is no longer kept."""
        self.device.free(buffer)

    def restore(self, parked: Parked, slot: int, length: int | None = None) -> None:
        """Bring back positions [0, length) (default: all) of a parked sequence
        into any slot; a shorter length restores a prefix (prefix cache)."""
        length = parked.length if length is None else length
        if not 0 <= length <= parked.length:
            raise ValueError(f"cannot restore {length} of {parked.length} parked positions")
        if length == 0:
            return
        if not self._window_kept(parked.ring_hi, length):
            raise ValueError(f"the parked ring no longer holds the window before position {length}")
        p = self.device.program()
        off = 0
        # parked blocks are parked.length positions long (a ring layer's: parked.ring_rows)
        for (r, w, n), (_, _, n_parked) in zip(self._slot_ranges(slot, 0, length, parked.ring_rows),
                                               self._slot_ranges(slot, 0, parked.length, parked.ring_rows)):
            p.copy(parked.buffer, r.buf, off, w * 4, n * 4, "restore")
            off += n_parked * 4
        p.run()
        self.hi[slot] = parked.ring_hi

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Positions [0, length) of src_slot into dst_slot (prefix cache)."""
        if src_slot == dst_slot or length <= 0:
            return
        if not self._window_kept(int(self.hi[src_slot]), length):
            raise ValueError(f"slot {src_slot}'s ring no longer holds the window before position {length}")
        rows = self._ring_rows(src_slot)
        p = self.device.program()
        for (r, ws, n), (_, wd, _) in zip(self._slot_ranges(src_slot, 0, length, rows),
                                          self._slot_ranges(dst_slot, 0, length, rows)):
            p.copy(r.buf, r.buf, ws * 4, wd * 4, n * 4, "prefix")
        p.run()
        self.hi[dst_slot] = self.hi[src_slot]

    def begin_step(self, positions: np.ndarray, slots: np.ndarray) -> None:
        """Check and account for a step's rows before it is submitted: with
        rings, a slot may not go back to a position whose window its ring no
        longer holds (plain KV rows need nothing)."""
        if not self._rings:
            return
        pos, slt = np.asarray(positions, np.int64), np.asarray(slots, np.int64)
        ends = {}
        for s in np.unique(slt):
            mine = pos[slt == s]
            p0 = int(mine.min())
            if p0 < self.hi[s] and not self._window_kept(int(self.hi[s]), p0):
                raise VkEngineError(f"slot {s}: position {p0} is too far back for the sliding-window layers' "
                                    f"cache (it holds the last {self.ring_cap} positions of {int(self.hi[s])})")
            ends[int(s)] = int(mine.max()) + 1
        for s, e in ends.items():     # only once the whole step is valid
            self.hi[s] = e

    def reusable_prefix(self, src_slot: int, length: int) -> int:
        """How many of the first `length` positions of src_slot copy_prefix can reuse."""
        return length if self._window_kept(int(self.hi[src_slot]), length) else 0

    def reusable_parked(self, parked: Parked, length: int) -> int:
        """How many of the first `length` positions of a parked sequence restore can reuse."""
        length = min(length, parked.length)
        return length if self._window_kept(parked.ring_hi, length) else 0

    def read(self, layer: int, slot: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) float32 (length, n_kv, head_dim) of one slot, q8_0 dequantized (tests, debugging)."""
        if length > self._cap[layer]:
            raise ValueError(f"layer {layer} holds {self._cap[layer]} positions a slot")
        out = []
        for r, stride, parts in zip(self._regions[layer], self._strides[layer], self._parts[layer]):
            w = [self.device.download(r.buf, (r.off + slot * stride + off0) * 4, length * words * 4, np.uint32)
                 for off0, words in parts]
            if len(w) == 1:   # f16
                x = w[0].view(np.float16).astype(np.float32)
            else:             # q8_0: int8 values times their block's f16 scale
                d = w[1].view(np.float16).astype(np.float32)
                with np.errstate(invalid="ignore", over="ignore"):   # (rows never written hold anything)
                    x = w[0].view(np.int8).astype(np.float32) * np.repeat(d, 32)
            out.append(x.reshape(length, self.n_kv, self.head_dim))
        return out[0], out[1]


# -- hybrid models: KV rows plus recurrent state --------------------------------------

@dataclass
class HybridParked(Parked):
    """Parked KV rows plus the recurrent state, which covers `state_length` positions."""
    state_length: int = 0


class HybridState(KVCache):
    """Per-sequence state of a hybrid model (Qwen3.5: Gated DeltaNet layers mixed
    with full attention), in slots:
      - KV rows of the full-attention layers (`attn_layers`), as KVCache;
      - per linear-attention layer (`rec_layers`), a conv state ([slot][K-1][C]
        floats: the last K-1 inputs of the short convolution) and a recurrent
        state ([slot][head][dv][dk] fp32: the delta rule's S, transposed), plus
        `snap_rows` snapshot rows of each (the state after each of the first rows
        of a speculative step; `commit_snapshot` rolls a slot back to one).

    The recurrent state summarizes a whole prefix and cannot be cut shorter, so
    the state tracks, per slot, how many positions it covers (`length`; -1 when
    unknown). A step must continue a slot at exactly that position, or start it
    again at position 0 (which resets it); `begin_step` checks this.

    park/restore move a slot's KV rows and recurrent state to host memory and
    back. copy_prefix(src, dst, n) copies KV rows [0, n) and, when src's
    recurrent state covers exactly n positions, the recurrent state too (dst then
    continues at n); otherwise dst's recurrent state is marked unknown and dst
    must be refilled from position 0: a hybrid prefix is reusable only at the
    length where its state was taken (`reusable_prefix` says which).
    """

    rewindable = False

    def __init__(self, device: Device, n_slots: int, ctx: int, n_kv: int, head_dim: int,
                 attn_layers: list[int], rec_layers: list[int], conv_words: int, ssm_words: int,
                 snap_rows: int = 0, types: KVTypes = KVTypes()):
        super().__init__(device, 0, n_slots, ctx, n_kv, head_dim, layers=attn_layers, types=types)
        self.rec_layers = list(rec_layers)
        self._rollbacks: dict[tuple, Program] = {}   # commit_snapshots' programs, oldest first
        self.conv_words, self.ssm_words = conv_words, ssm_words
        self.snap_rows = snap_rows
        plan = ArenaPlan(device.max_buffer_bytes // 4)
        sizes = [n_slots * conv_words, n_slots * ssm_words, snap_rows * conv_words, snap_rows * ssm_words]
        self._rgroups = {layer: plan.add(sizes, f"recurrent state of one layer ({n_slots} slots)")
                         for layer in self.rec_layers}
        self.rec_arena = Arena(device, plan, "device", "recurrent") if self.rec_layers else None
        arena = self.rec_arena
        self._rregions = {layer: arena.regions(g) for layer, g in self._rgroups.items()} if arena is not None else {}
        self.length = np.full(n_slots, -1, np.int64)

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes + (self.rec_arena.nbytes if self.rec_arena else 0)

    def conv(self, layer: int) -> Region:
        return self._rregions[layer][0]

    def ssm(self, layer: int) -> Region:
        return self._rregions[layer][1]

    def conv_snap(self, layer: int) -> Region:
        return self._rregions[layer][2]

    def ssm_snap(self, layer: int) -> Region:
        return self._rregions[layer][3]

    def recurrent_bytes(self) -> int:
        """Bytes of one slot's recurrent state (all linear layers)."""
        return len(self.rec_layers) * (self.conv_words + self.ssm_words) * 4

    def _rec_ranges(self, slot: int):
        for layer in self.rec_layers:
            conv, ssm = self._rregions[layer][:2]
            yield conv, conv.off + slot * self.conv_words, self.conv_words
            yield ssm, ssm.off + slot * self.ssm_words, self.ssm_words

    # -- step bookkeeping ----------------------------------------------------------
    def begin_step(self, positions: np.ndarray, slots: np.ndarray) -> None:
        """Check that each slot's rows are contiguous and continue its state (or
        restart it at 0), then account for them. Raises VkEngineError otherwise."""
        n = len(slots)
        starts = [0] + [i for i in range(1, n) if slots[i] != slots[i - 1]]
        seen: set[int] = set()
        ends: dict[int, int] = {}
        for a, b in zip(starts, starts[1:] + [n]):
            s = int(slots[a])
            if s in seen:
                raise VkEngineError(f"rows of slot {s} must be contiguous in a step of a hybrid model")
            seen.add(s)
            p = positions[a:b]
            if (np.diff(p) != 1).any():
                raise VkEngineError(f"positions of slot {s} in a step must be consecutive")
            if p[0] != 0 and p[0] != self.length[s]:
                have = "unknown" if self.length[s] < 0 else f"{self.length[s]} positions"
                raise VkEngineError(
                    f"slot {s}: the recurrent state covers {have}, so a step must continue it at that "
                    f"position or restart at 0, not at {int(p[0])} (hybrid models cannot rewind; "
                    "see HybridState)")
            ends[s] = int(p[-1]) + 1
        for s, e in ends.items():     # only once the whole step is valid
            self.length[s] = e

    def reusable_prefix(self, src_slot: int, length: int) -> int:
        """How many of the first `length` positions of src_slot copy_prefix can reuse."""
        return length if self.length[src_slot] == length else 0

    def reusable_parked(self, parked: Parked, length: int) -> int:
        """How many of the first `length` positions of a parked sequence restore can reuse."""
        return length if isinstance(parked, HybridParked) and parked.state_length == length <= parked.length else 0

    def commit_snapshot(self, slot: int, row: int, length: int) -> None:
        """Roll slot's recurrent state back to the snapshot of row `row` of the last
        snapshot step (which then covers `length` positions)."""
        self.commit_snapshots([(slot, row, length)])

    def commit_snapshots(self, rollbacks, wait: bool = True) -> Program | None:
        """commit_snapshot for each (slot, row, length), in one device program
        (a server's verify step rolls back several sequences at once). wait=False:
        submitted, not waited for; returns the program, to wait() for before it
        is dropped (a step submitted after it sees the rolled-back state: each
        program starts with a barrier against the work before it)."""
        rollbacks = list(rollbacks)
        for _, row, _ in rollbacks:
            if not 0 <= row < self.snap_rows:
                raise ValueError(f"snapshot row {row} out of range 0..{self.snap_rows - 1}")
        if not rollbacks:
            return None
        # (recorded once per set of (slot, row): two copies a recurrent layer a sequence, ~13 us each to
        # record on a slow host, on the path from a verify step to the next)
        key = tuple((slot, row) for slot, row, _ in rollbacks)
        p = self._rollbacks.pop(key, None)
        if p is None:
            p = self.device.program()
            for slot, row, _ in rollbacks:
                for layer in self.rec_layers:
                    conv, ssm, conv_s, ssm_s = self._rregions[layer]
                    p.copy(conv.buf, conv.buf, (conv_s.off + row * self.conv_words) * 4,
                           (conv.off + slot * self.conv_words) * 4, self.conv_words * 4, "rollback")
                    p.copy(ssm.buf, ssm.buf, (ssm_s.off + row * self.ssm_words) * 4,
                           (ssm.off + slot * self.ssm_words) * 4, self.ssm_words * 4, "rollback")
        self._rollbacks[key] = p
        if len(self._rollbacks) > 256:
            self._rollbacks.pop(next(iter(self._rollbacks)))
        for slot, _, length in rollbacks:
            self.length[slot] = length
        if wait:
            p.run()
            return None
        p.submit()
        return p

    # -- parking and prefix copies ----------------------------------------------------
    def park_bytes(self, slot: int, length: int) -> int:
        return max(16, length * self.bytes_per_position() + self.recurrent_bytes())

    def park(self, slot: int, length: int, into: Buffer | None = None) -> HybridParked:
        need = self.park_bytes(slot, length)
        if into is None or into.nbytes < need:
            into = self.device.buffer(need, "host", f"parked-slot{slot}")
        p = self.device.program()
        off = 0
        for r, w, n in list(self._slot_ranges(slot, 0, length)) + list(self._rec_ranges(slot)):
            p.copy(r.buf, into, w * 4, off, n * 4, "park")
            off += n * 4
        p.run()
        return HybridParked(length, into, state_length=int(self.length[slot]))

    def restore(self, parked: Parked, slot: int, length: int | None = None) -> None:
        """Bring a parked sequence back into a slot: all of it (KV rows and the
        recurrent state), or (length < parked.length, a prefix-cache hit) only
        KV rows [0, length), which leaves the slot's recurrent state unknown
        unless the parked state covers exactly `length` positions (the
        scheduler asks `reusable_parked` first)."""
        if length is not None and length != parked.length:
            super().restore(parked, slot, length)
            self.length[slot] = -1
            return
        p = self.device.program()
        off = 0
        ranges = list(self._slot_ranges(slot, 0, parked.length))
        if isinstance(parked, HybridParked):
            ranges += list(self._rec_ranges(slot))
        for r, w, n in ranges:
            p.copy(parked.buffer, r.buf, off, w * 4, n * 4, "restore")
            off += n * 4
        p.run()
        self.length[slot] = parked.state_length if isinstance(parked, HybridParked) else -1

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        if src_slot == dst_slot or length <= 0:
            return
        super().copy_prefix(src_slot, dst_slot, length)
        if self.reusable_prefix(src_slot, length) == length:
            p = self.device.program()
            for (r, ws, n), (_, wd, _) in zip(self._rec_ranges(src_slot), self._rec_ranges(dst_slot)):
                p.copy(r.buf, r.buf, ws * 4, wd * 4, n * 4, "prefix")
            p.run()
            self.length[dst_slot] = length
        else:
            self.length[dst_slot] = -1
