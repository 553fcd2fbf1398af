"""Choosing a row's token on the device: the greedy argmax (argmax_part.comp +
argmax.comp), and sampling (topk_part.comp: the SAMPLE_K best of each slice;
sample.comp: a row's merge, top-k, top-p, min-p, temperature and the draw with
the request's uniform, as vkengine.serving.sampling.Sampler draws)."""
from __future__ import annotations

import math

from ..device import Buffer, Program
from .base import KernelBase
from .types import Region, rows_range


class SampleKernels(KernelBase):
    ARGMAX_CHUNK = 2048
    # slices of SAMPLE_WG * SAMPLE_VPL logits, the SAMPLE_K best of each, merged per
    # row by one workgroup that holds SAMPLE_WG * SAMPLE_VPL candidates
    SAMPLE_WG, SAMPLE_VPL, SAMPLE_K = 256, 16, 64
    SAMPLE_WORDS = 8        # params words a row: temperature, top_k, top_p, min_p, u

    @classmethod
    def argmax_tmp_words(cls, n: int, rows: int) -> int:
        return 2 * rows * -(-n // cls.ARGMAX_CHUNK)

    @classmethod
    def sample_slices(cls, n: int) -> int:
        return -(-n // (cls.SAMPLE_WG * cls.SAMPLE_VPL))

    @classmethod
    def sample_tmp_words(cls, n: int, rows: int) -> int:
        return 2 * rows * cls.sample_slices(n) * cls.SAMPLE_K

    def argmax(self, prog: Program, x: Region, x_stride: int, n: int, rows: int, params: Buffer, out_off: int,
               tmp: Region, label: str = "argmax") -> None:
        """params[out_off + r] = argmax(x[r][:n]): per-slice winners into tmp
        (argmax_tmp_words), then one reduction per row."""
        act = self._same_buffer(x, tmp)
        if x.off % 4 or x_stride % 4 or tmp.words < self.argmax_tmp_words(n, rows):
            raise ValueError("argmax needs 16-byte aligned rows and a large enough tmp region")
        c = self.caps
        n_chunks = -(-n // self.ARGMAX_CHUNK)
        push = self._push("argmax_part", x_off=x.off, x_stride=x_stride, n=n, rows=rows, tmp_off=tmp.off,
                          chunk=self.ARGMAX_CHUNK)
        alg = self._alg("argmax_part", [act], push, c.wg)
        tmp_range = (tmp.buf, tmp.off * 4, (tmp.off + self.argmax_tmp_words(n, rows)) * 4)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * n_chunks / c.items)),
                      [rows_range(x, rows, x_stride, n)], [tmp_range], label)
        push = self._push("argmax", tmp_off=tmp.off, n_chunks=n_chunks, rows=rows, out_off=out_off)
        alg = self._alg("argmax", [act, params], push, c.wg)
        prog.dispatch(alg, push, self._grid(math.ceil(rows / c.items)), [tmp_range],
                      [(params, out_off * 4, (out_off + rows) * 4)], label)

    @staticmethod
    def mask_words(n: int) -> int:
        """Words of one row's token mask (a bit a token)."""
        return -(-n // 32)

    def mask_logits(self, prog: Program, x: Region, x_stride: int, n: int, rows: int, params: Buffer,
                    mask_off: int, label: str = "mask") -> None:
        """x[r][i] = -inf where bit i of row r's mask (params words mask_off +
        r * mask_words(n) ..) is clear: a grammar's allowed tokens, before
        argmax() or sample() choose."""
        W = self.mask_words(n)
        push = self._push("mask_logits", x_off=x.off, x_stride=x_stride, n=n, rows=rows, mask_off=mask_off, words=W)
        alg = self._alg("mask_logits", [x.buf, params], push, self.caps.ew_wg, 1)
        prog.dispatch(alg, push, self._grid(math.ceil(rows * W / self.caps.ew_wg)),
                      [rows_range(x, rows, x_stride, n), (params, mask_off * 4, (mask_off + rows * W) * 4)],
                      [rows_range(x, rows, x_stride, n)], label)

    def can_sample(self, n: int) -> bool:
        """Whether rows of n logits can be sampled on this device (sample())."""
        # (topk.glsl's merge: at most 32 subgroups a workgroup, 4 lists a lane)
        return (self.device.info.max_workgroup_invocations >= self.SAMPLE_WG and self.caps.sg >= 8
                and self.sample_slices(n) * self.SAMPLE_K <= self.SAMPLE_WG * self.SAMPLE_VPL)

    def sample(self, prog: Program, x: Region, x_stride: int, n: int, rows: int, params: Buffer, samp_off: int,
               out_off: int, tmp: Region, label: str = "sample") -> None:
        """params[out_off + r] = the token drawn from x[r][:n] with row r's
        sampling params (params words samp_off + SAMPLE_WORDS * r: temperature,
        top_k in 1..SAMPLE_K, top_p, min_p, uniform u), as Sampler draws it;
        temperature <= 0: the argmax. The K best of each slice into tmp
        (sample_tmp_words), then one workgroup per row."""
        act = self._same_buffer(x, tmp)
        if not self.can_sample(n):
            raise ValueError(f"rows of {n} values cannot be sampled on this device")
        samp_range = (params, samp_off * 4, (samp_off + self.SAMPLE_WORDS * rows) * 4)
        if tmp.words < self.sample_tmp_words(n, rows):
            raise ValueError("sample needs a large enough tmp region")
        n_sl, K = self.sample_slices(n), self.SAMPLE_K
        push = self._push("topk_part", x_off=x.off, x_stride=x_stride, n=n, rows=rows, tmp_off=tmp.off, k=K,
                          samp_off=samp_off)
        alg = self._alg("topk_part", [act, params], push, self.SAMPLE_WG, 1)
        tmp_range = (tmp.buf, tmp.off * 4, (tmp.off + self.sample_tmp_words(n, rows)) * 4)
        prog.dispatch(alg, push, self._grid(rows * n_sl), [rows_range(x, rows, x_stride, n), samp_range],
                      [tmp_range], f"{label} top-k")
        push = self._push("sample", tmp_off=tmp.off, n_cand=n_sl * K, rows=rows, samp_off=samp_off, out_off=out_off)
        alg = self._alg("sample", [act, params], push, self.SAMPLE_WG, 1)
        prog.dispatch(alg, push, self._grid(rows), [tmp_range, samp_range],
                      [(params, out_off * 4, (out_off + rows) * 4)], f"{label} draw")
