"""The step's buffers as a model sees them: named activation arrays in one
scratch buffer (Scratch), the per-row values of the params buffer
(ParamsLayout), and GraphBase, which the op families (dense.py, recurrent.py,
moe.py) extend into Graph."""
from __future__ import annotations

from dataclasses import dataclass

from ..device import Buffer, Program
from ..kernels import Kernels, NormOut, Region
from ..kernels.sample import SampleKernels
from ..state import KVCache


@dataclass(frozen=True)
class ParamsLayout:
    """Word offsets in the params buffer (written before each run): per row its
    token, position and slot; the output rows; per output row its sampling
    params and the token chosen on the device (read back); per row the row of
    a hidden-state array an MTP step reads (hmap); per output row its token
    mask (mask_words words, a bit a token: constrained decoding on the device).
    A step copies [0, argmax) to the device (an MTP step also hmap, a masked
    step's pick its masks). drafts: draft_words words on the device only, where
    MTP steps leave their tokens (Pass.drafts_at) for a verify step submitted
    behind them to read (Engine.submit's draft_rows)."""
    max_rows: int
    max_out: int
    mask_words: int = 0
    draft_words: int = 0

    @property
    def tokens(self) -> int: return 0
    @property
    def positions(self) -> int: return self.max_rows
    @property
    def slots(self) -> int: return 2 * self.max_rows
    @property
    def out_rows(self) -> int: return 3 * self.max_rows
    @property
    def sampling(self) -> int: return 3 * self.max_rows + self.max_out   # SAMPLE_WORDS an output row
    @property
    def argmax(self) -> int: return self.sampling + SampleKernels.SAMPLE_WORDS * self.max_out
    @property
    def drafts(self) -> int: return self.argmax + self.max_out
    @property
    def hmap(self) -> int: return self.drafts + self.draft_words
    @property
    def masks(self) -> int: return self.hmap + self.max_rows
    @property
    def words(self) -> int: return self.masks + self.max_out * self.mask_words


class Scratch:
    """Activation arrays in one device buffer: each `name` of width w holds
    `max_rows` rows of stride w rounded up to 4 floats (16-byte aligned rows for
    vec4 reads); names starting with `out_` hold `max_out` rows."""

    def __init__(self, buf: Buffer, widths: dict[str, int], max_rows: int, max_out: int):
        self.widths = dict(widths)
        self.strides, self.offsets, self.words = self._place(widths, max_rows, max_out)
        self.buf = buf
        self.max_rows, self.max_out = max_rows, max_out

    @staticmethod
    def _place(widths: dict[str, int], max_rows: int, max_out: int) -> tuple[dict[str, int], dict[str, int], int]:
        """(stride, offset) of every array and the words of them all."""
        strides = {k: (w + 3) // 4 * 4 for k, w in widths.items()}
        offsets: dict[str, int] = {}
        off = 0
        for k, st in strides.items():
            offsets[k] = off
            off += st * (max_out if k.startswith("out_") else max_rows)
        return strides, offsets, off

    @staticmethod
    def words_needed(widths: dict[str, int], max_rows: int, max_out: int) -> int:
        return Scratch._place(widths, max_rows, max_out)[2]

    def region(self, name: str, col: int = 0) -> Region:
        return Region(self.buf, self.offsets[name] + col, self.strides[name])

    def stride(self, name: str) -> int:
        return self.strides[name]


class GraphBase:
    def __init__(self, kernels: Kernels, prog: Program, scratch: Scratch, params: Buffer, layout: ParamsLayout,
                 kv: KVCache, n_rows: int, n_out: int, rope_table: Region, eps: float, snap_rows: int = 0):
        self.k, self.p, self.s = kernels, prog, scratch
        self.params, self.pl, self.kv = params, layout, kv
        self.n, self.n_out = n_rows, n_out
        self.rope_table = rope_table
        self.eps = eps
        self.snap_rows = snap_rows   # rows whose recurrent state a speculative step keeps
        # a split model's later part: the part before handed over h as NormParts' h' (Graph.handed_norm_in)
        self.norm_handed = False

    def _rows(self, name: str) -> int:
        return self.n_out if name.startswith("out_") else self.n

    def _norm_out(self, norm_w: Region, h: str, sync: str = "out_sync", words: int = 1) -> NormOut | None:
        """What a residual add's matvec needs to take the RMSNorm after it into h
        (its counters: `words` words of the scratch's zeroed `sync`, out_sync's
        one word, or cn_sync's word a row for the combined expert matvec), or
        None without that array."""
        if sync not in self.s.widths:
            return None
        return NormOut(norm_w, self.s.region(h), self.s.stride(h), Region(self.s.buf, self.s.offsets[sync], words),
                       self.eps)

    def _r(self, name: str, col: int = 0) -> Region:
        return self.s.region(name, col)
