"""Per-sequence state on the device: the attention KV cache, in slots.

Layout per layer: K and V each [slot][position][kv_head][head_dim / 2 words],
f16 pairs packed into 32-bit words (storage buffers are 32-bit). Layers are
spread over as few buffers as the device's storage-buffer range allows; one
layer's K and V always share a buffer (one binding in the kernels).

Parking (slices mode, preemption) copies a slot's first `length` positions of
every layer to a host-visible buffer and back; copying slot to slot serves the
prefix cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arena import Arena, ArenaPlan
from .device import Buffer, Device
from .kernels import Region


@dataclass
class Parked:
    """A sequence's KV rows in host memory (or on disk-backed numpy)."""
    length: int
    buffer: Buffer


class KVCache:
    def __init__(self, device: Device, n_layer: int, n_slots: int, ctx: int, n_kv: int, head_dim: int,
                 layers: list[int] | None = None):
        self.device = device
        self.n_slots, self.ctx, self.n_kv, self.head_dim = n_slots, ctx, n_kv, head_dim
        self.row_words = n_kv * head_dim // 2           # one position of one layer
        self.slot_stride = ctx * self.row_words
        self.layers = list(range(n_layer)) if layers is None else list(layers)
        words = n_slots * self.slot_stride
        plan = ArenaPlan(device.max_buffer_bytes // 4)
        self._groups = {layer: plan.add([words, words], f"KV cache of one layer ({n_slots} slots x {ctx})")
                        for layer in self.layers}
        self.arena = Arena(device, plan, "device", "kv")
        self._regions = {layer: self.arena.regions(g) for layer, g in self._groups.items()}

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes

    @staticmethod
    def bytes_needed(n_layer: int, n_slots: int, ctx: int, n_kv: int, head_dim: int) -> int:
        """Device bytes of the K and V caches (before buffer alignment)."""
        return 2 * n_layer * n_slots * ctx * (n_kv * head_dim // 2) * 4

    def k(self, layer: int) -> Region:
        return self._regions[layer][0]

    def v(self, layer: int) -> Region:
        return self._regions[layer][1]

    def bytes_per_position(self) -> int:
        return 2 * len(self.layers) * self.row_words * 4

    def _slot_ranges(self, slot: int, start: int, length: int):
        """(region, word offset, words) of positions [start, start+length) of a slot, per layer and K/V."""
        for layer in self.layers:
            for r in self._regions[layer]:
                yield r, r.off + slot * self.slot_stride + start * self.row_words, length * self.row_words

    def park(self, slot: int, length: int, into: Buffer | None = None) -> Parked:
        """Copy positions [0, length) of a slot into a host-visible buffer."""
        need = max(16, length * self.bytes_per_position())
        if into is None or into.nbytes < need:
            into = self.device.buffer(need, "host", f"parked-slot{slot}")
        p = self.device.program()
        off = 0
        for r, w, n in self._slot_ranges(slot, 0, length):
            p.copy(r.buf, into, w * 4, off, n * 4, "park")
            off += n * 4
        p.run()
        return Parked(length, into)

    def restore(self, parked: Parked, slot: int, length: int | None = None) -> None:
        """Bring back positions [0, length) (default: all) of a parked sequence
        into any slot; a shorter length restores a prefix (prefix cache)."""
        length = parked.length if length is None else length
        if not 0 <= length <= parked.length:
            raise ValueError(f"cannot restore {length} of {parked.length} parked positions")
        if length == 0:
            return
        p = self.device.program()
        off = 0
        for r, w, n in self._slot_ranges(slot, 0, length):
            p.copy(parked.buffer, r.buf, off, w * 4, n * 4, "restore")
            off += parked.length * self.row_words * 4     # parked blocks are parked.length rows long
        p.run()

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Positions [0, length) of src_slot into dst_slot (prefix cache)."""
        if src_slot == dst_slot or length <= 0:
            return
        p = self.device.program()
        for (r, ws, n), (_, wd, _) in zip(self._slot_ranges(src_slot, 0, length),
                                          self._slot_ranges(dst_slot, 0, length)):
            p.copy(r.buf, r.buf, ws * 4, wd * 4, n * 4, "prefix")
        p.run()

    def read(self, layer: int, slot: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(K, V) float32 (length, n_kv, head_dim) of one slot (tests, debugging)."""
        out = []
        for r in self._regions[layer]:
            w = self.device.download(r.buf, (r.off + slot * self.slot_stride) * 4, length * self.row_words * 4)
            out.append(w.view(np.float16).astype(np.float32).reshape(length, self.n_kv, self.head_dim))
        return out[0], out[1]
