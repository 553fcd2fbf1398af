"""The ops of decoder layers with attention: embeddings, norms, matmuls (with
the fused epilogues the GPUs' decode steps take), RoPE and the KV cache,
attention, the gated FFN, and the head's argmax or sampling."""
from __future__ import annotations

from dataclasses import replace

from ..kernels import Halves, Matrix, NormIn, NormParts, Q8Out, Region, RopeOut
from .core import GraphBase


class DenseOps(GraphBase):
    def embed(self, w: Matrix, out: str, scale: float = 1.0) -> None:
        """out[r] = scale * w[token r]"""
        self.k.get_rows(self.p, w, self.params, self.pl.tokens, self.s.region(out), self.s.stride(out), self.n,
                        scale=scale)

    def rms_norm(self, x: str, w: Region, out: str, gather: bool = False) -> None:
        """out[r] = rms_norm(x[r]) * w; gather=True takes x's rows from the
        batch's output-row list (out has n_out rows)."""
        rows = self.n_out if gather else self._rows(out)
        self.k.rms_norm(self.p, w, self.s.region(x), self.s.stride(x), self.s.region(out), self.s.stride(out),
                        self.s.widths[x], rows, self.eps, self.params,
                        self.pl.out_rows if gather else None)

    def matmul(self, w: Matrix, x: str, out: str, accumulate: bool = False, col: int = 0,
               no_epilogues: bool = False, norm_in: NormIn | None = None, x_halves: Halves | None = None) -> None:
        """out[r][col : col + w.rows] (+)= w @ x[r]; no_epilogues: w never takes
        a fused norm or RoPE (Kernels.mul_mat: the XQ8 matvecs may take it);
        norm_in: x is an h' of residual_norm, which returned this; x_halves: x
        is only there, as halves (gate_up_swiglu's, which returned them)"""
        self.k.mul_mat(self.p, w, self.s.region(x), self.s.stride(x), self.s.region(out, col), self.s.stride(out),
                       self._rows(x), accumulate, label=f"mul_mat {out}<-{x}" + ("+rms_norm" if norm_in else "")
                       + ("(halves)" if x_halves is not None else ""),
                       no_epilogues=no_epilogues, norm_in=self._plain(norm_in), x_halves=x_halves)

    @staticmethod
    def _plain(norm_in: NormIn | None) -> NormIn | None:
        """norm_in without the 8-bit blocks (for readers that take h' as floats)"""
        return NormIn(norm_in.slots, norm_in.eps) if norm_in is not None else None

    def residual_norm(self, w: Matrix, x: str, out: str, norm_w: Region, h: str,
                      readers: list[list[tuple[Matrix, int]]], glu_reader: bool = False,
                      x_halves: Halves | None = None) -> NormIn | None:
        """out[r] += w @ x[r] (the residual stream), then the RMSNorm of out
        (weight norm_w) into h for the matrices `readers` (their pieces). Where
        this matvec and all of them can (decode-sized steps on GPUs: Kernels.
        fuses_norm_parts, fuses_norm_in) the norm is split between them: h gets
        out * norm_w, and the returned NormIn (its sums of squares) goes to
        the readers as norm_in; where the only reader is a gate|up with the
        SwiGLU (glu_reader: gate_up_swiglu) that takes h' as 8-bit blocks
        (Kernels.takes_q8_in) the producer writes those too (in `norm_q8`).
        Else matmul_norm, and None: h is the norm. x_halves: as matmul's (a
        prompt step's: the matvecs' split norm never meets it)."""
        n = self._rows(x)
        parts = self._norm_parts(w, x, out, norm_w, h, readers)
        if parts is not None and x_halves is not None:
            raise ValueError("residual_norm: x as halves is a tiled matmul's, which splits no norm")
        if parts is not None:
            q8 = self._q8_out(w.rows)
            if not (q8 is not None and glu_reader and len(readers) == 1 and len(readers[0]) == 1
                    and self.k.takes_q8_in(readers[0][0][0], n) and self.k.fuses_norm_parts_q8(w, n, q8)):
                q8 = None
            self.k.mul_mat(self.p, w, self.s.region(x), self.s.stride(x), self.s.region(out),
                           self.s.stride(out), n, accumulate=True,
                           norm_parts=replace(parts, q8=q8),
                           label=f"mul_mat {out}<-{x}+rms_norm_parts" + ("+q8" if q8 else ""))
            return NormIn(parts.slots, self.eps, q8)
        self.matmul_norm(w, x, out, norm_w, h, x_halves=x_halves)
        return None

    def splits_norm(self, w: Matrix, x: str, out: str, norm_w: Region, h: str,
                    readers: list[list[tuple[Matrix, int]]]) -> bool:
        """Whether residual_norm with these arguments splits the norm (returns a NormIn)."""
        return self._norm_parts(w, x, out, norm_w, h, readers) is not None

    def _norm_parts(self, w: Matrix, x: str, out: str, norm_w: Region, h: str,
                    readers: list[list[tuple[Matrix, int]]]) -> NormParts | None:
        """residual_norm's choice: the NormParts its matvec writes where the
        norm is split between it and the readers, else None. Records nothing."""
        if "norm_slots" not in self.s.widths:
            return None
        n = self._rows(x)
        parts = NormParts(norm_w, self.s.region(h), self.s.stride(h), self._norm_slots(), w.rows // 4)
        if (self.k.fuses_norm_parts(w, n, self.s.region(out), parts)
                and all(self.k.fuses_norm_in(m, n, parts.slots) for pieces in readers for m, _ in pieces)):
            return parts
        return None

    def _norm_slots(self) -> Region:
        """The sums of squares of every row (NormParts.slots, NormIn.slots)."""
        return Region(self.s.buf, self.s.offsets["norm_slots"], self.s.strides["norm_slots"] * self.s.max_rows)

    def handed_norm_in(self) -> NormIn | None:
        """A split model's later part: the NormIn of the h' the part before
        handed over with its residual stream (norm_handed: its last layer split
        the next layer's norm, as residual_norm does in the whole model), else
        None (h is the norm)."""
        return NormIn(self._norm_slots(), self.eps) if self.norm_handed else None

    def _q8_out(self, rows: int) -> Q8Out | None:
        """Where a producer of `rows`-value rows of h' writes their 8-bit blocks
        (the scratch's norm_q8: both planes' int8 words of every row, then the
        scales, then the sums of squares a block)."""
        if "norm_q8" not in self.s.widths or rows % 32 or rows // 2 + rows // 16 > self.s.widths["norm_q8"]:
            return None
        mr = self.s.max_rows
        base = self.s.offsets["norm_q8"]
        sync = Region(self.s.buf, self.s.offsets["norm_q8_sync"], self.s.strides["norm_q8_sync"] * mr)
        q2 = base + mr * rows // 4
        d = q2 + mr * rows // 4
        return Q8Out(Region(self.s.buf, base, mr * rows // 4), q2, d, d + mr * rows // 32, sync)

    def matmul_norm(self, w: Matrix, x: str, out: str, norm_w: Region, h: str, bias: Region | None = None,
                    tmp: str = "", x_halves: Halves | None = None) -> None:
        """out[r] += w @ x[r] (the residual stream), then h[r] = rms_norm(out[r])
        * norm_w: one dispatch where the matvec can take the norm (decode-sized
        steps on GPUs, kernels.fuses_norm), else matmul and rms_norm. bias: out[r]
        += (w @ x[r] + bias), in the matvec too where it can (fuses_bias), else
        through `tmp` (matmul, add_bias, add: the same sums). x_halves: as
        matmul's (no bias then)."""
        n = self._rows(x)
        if x_halves is not None and bias is not None:
            raise ValueError("matmul_norm: x as halves with a bias")
        norm = self._norm_out(norm_w, h) if x_halves is None else None   # (x as halves: a tiled matmul, no norm)
        if norm is not None and self.k.fuses_norm(w, n, self.s.region(out), self.s.stride(out), norm) and \
                (bias is None or self.k.fuses_bias(w, n)):
            self.k.mul_mat(self.p, w, self.s.region(x), self.s.stride(x), self.s.region(out), self.s.stride(out),
                           n, accumulate=True, norm=norm, bias=bias,
                           label=f"mul_mat {out}<-{x}" + ("+bias" if bias is not None else "") + "+rms_norm")
            return
        if bias is not None:
            if not tmp:
                raise ValueError("matmul_norm with a bias needs a tmp array where it runs apart")
            self.matmul(w, x, tmp)
            self.add_bias(tmp, bias, self.s.widths[out])
            self.add(out, tmp, out)
        else:
            self.matmul(w, x, out, accumulate=True, x_halves=x_halves)
        self.rms_norm(out, norm_w, h)

    def matmuls_bias(self, pieces: list[tuple[Matrix, int]], x: str, out: str, bias: Region, width: int,
                     norm_in: NormIn | None = None) -> None:
        """out[r][col:] = m @ x[r] for each piece (m, col), then out[r][:width] +=
        bias: the bias in each piece's matvec where all can take it (fuses_bias:
        GPUs' decode steps; the same sums), else add_bias after them. norm_in:
        as matmul's."""
        n = self._rows(x)
        if all(self.k.fuses_bias(m, n) for m, _ in pieces) and sum(m.rows for m, _ in pieces) == width:
            for m, col in pieces:
                self.k.mul_mat(self.p, m, self.s.region(x), self.s.stride(x), self.s.region(out, col),
                               self.s.stride(out), n, bias=bias.at(col, m.rows), norm_in=self._plain(norm_in),
                               label=f"mul_mat {out}<-{x}+bias" + ("+rms_norm" if norm_in else ""))
            return
        for m, col in pieces:
            self.matmul(m, x, out, col=col, norm_in=norm_in)
        self.add_bias(out, bias, width)

    def qkv_rope(self, layer: int, pieces: list[tuple[Matrix, int]], x: str, qkv: str, q_out: str, n_head: int,
                 n_kv: int, head_dim: int, n_rot: int, neox: bool, norm_in: NormIn | None = None,
                 table: Region | None = None) -> None:
        """qkv[r] = the q|k|v matrix (or its pieces at their columns of qkv) @
        x[r], then rope_kv; where the matvecs can take RoPE and the cache write
        (decode-sized steps on GPUs into an f16 cache, kernels.fuses_rope) they
        do, and qkv is not written. norm_in: x is an h' of residual_norm, these its sums of
        squares (the product is then with the normalized rows). table: the
        layer's RoPE table where it is not the model's (Gemma's local layers)."""
        n = self._rows(x)
        table = table or self.rope_table
        ropes = [RopeOut(col, neox, n_head, n_kv, head_dim, n_rot, table, self.s.region(q_out),
                         self.s.stride(q_out), self.kv.k(layer), self.kv.v(layer), self.kv.stride(layer),
                         self.params, self.pl.positions, self.pl.slots, self.kv.types) for _, col in pieces]
        # (the matvecs' fused cache write has no ring: sliding-window layers' bounded caches take rope_kv)
        if not self.kv.ring(layer) and all(self.k.fuses_rope(m, n, r) for (m, _), r in zip(pieces, ropes)):
            for (m, col), r in zip(pieces, ropes):
                self.k.mul_mat(self.p, m, self.s.region(x), self.s.stride(x), self.s.region(qkv, col),
                               self.s.stride(qkv), n, rope=r, norm_in=self._plain(norm_in),
                               label=f"mul_mat {qkv}<-{x}" + ("+rms_norm" if norm_in else "") + "+rope_kv")
            return
        for m, col in pieces:
            self.matmul(m, x, qkv, col=col, norm_in=norm_in)
        self.rope_kv(layer, qkv, q_out, n_head, n_kv, head_dim, n_rot, neox, table)

    def rope_kv(self, layer: int, qkv: str, q_out: str, n_head: int, n_kv: int, head_dim: int, n_rot: int,
                neox: bool, table: Region | None = None) -> None:
        """RoPE on q and k of qkv (the model's table, or `table`); k, v stored in
        the cache at each row's (slot, position)."""
        self.k.rope_kv(self.p, table or self.rope_table, self.s.region(qkv), self.s.stride(qkv), self.s.region(q_out),
                       self.s.stride(q_out), self.n, n_head, n_kv, head_dim, n_rot, neox,
                       self.kv.k(layer), self.kv.v(layer), self.kv.stride(layer), self.params,
                       self.pl.positions, self.pl.slots, kv_types=self.kv.types, ring=self.kv.ring(layer))

    def attention(self, layer: int, q: str, out: str, n_head: int, n_kv: int, head_dim: int, scale: float,
                  window: int = 0, softcap: float = 0.0, sinks: Region | None = None,
                  gate: tuple[str, int, int] | None = None) -> bool:
        """Causal attention of each row over its slot's cache (window > 0: its
        last `window` positions; softcap, sinks: AttentionKernels.attention). Steps of few rows
        (decode) split the positions across subgroups when the scratch has room
        (`out_attn_split`, sized for max_out rows) and the device profits.
        gate = (array, col, blk): out's head h times sigmoid(array[r][col + h *
        blk + d]) where the split decode attention takes it: returns whether
        it did (else the caller gates: head_gate)."""
        split = sync = None
        if self.k.caps.split_attention and "out_attn_split" in self.s.widths and self.n <= self.s.max_out:
            need = self.k.attention_tmp_words(self.n, n_head, n_kv, head_dim, self.kv.ctx)
            counters = self.k.attention_sync_words(self.n, n_head)
            if need <= self.s.strides["out_attn_split"] * self.s.max_out and \
                    counters <= self.s.strides["out_attn_sync"] * self.s.max_out:
                split = Region(self.s.buf, self.s.offsets["out_attn_split"], need)
                sync = Region(self.s.buf, self.s.offsets["out_attn_sync"], counters)
        g = (self._r(gate[0], gate[1]), self.s.stride(gate[0]), gate[2]) if gate is not None else None
        return self.k.attention(self.p, self.s.region(q), self.s.stride(q), self.s.region(out), self.s.stride(out),
                                self.n, n_head, n_kv, head_dim, self.kv.k(layer), self.kv.v(layer),
                                self.kv.stride(layer), self.params, self.pl.positions, self.pl.slots, scale, split,
                                self.kv.ctx, sync, kv_types=self.kv.types, window=window, softcap=softcap,
                                ring=self.kv.ring(layer), sinks=sinks, gate=g)

    def gate_up_swiglu(self, pieces: list[tuple[Matrix, int]], x: str, gu: str, out: str,
                       norm_in: NormIn | None = None, down: Matrix | None = None) -> Halves | None:
        """out[r] = silu(gate @ x[r]) * (up @ x[r]) for the gate|up matrix (or its
        pieces at their columns of gu): one dispatch where the matvec can take the
        SwiGLU (decode-sized steps on GPUs, kernels.fuses_glu), else the matmuls
        into gu and a swiglu. norm_in: as in qkv_rope (with 8-bit blocks of h':
        the XQ8 variants take those). down: out's only reader, the down
        projection: where the prompt step's tiled matmul can give it the product
        as halves (Kernels.glu_halves) it does, out is not written, and the
        halves are returned for down's matmul (x_halves); else None."""
        n = self._rows(x)
        if down is not None and len(pieces) == 1 and norm_in is None and self.k.glu_halves(pieces[0][0], down, n):
            return self.k.mul_mat_glu_halves(self.p, pieces[0][0], self.s.region(x), self.s.stride(x), n,
                                             label=f"mul_mat {gu}+swiglu<-{x} (halves)")
        if len(pieces) == 1 and self.k.fuses_glu(pieces[0][0], n):
            q8 = norm_in is not None and norm_in.q8 is not None
            self.k.mul_mat(self.p, pieces[0][0], self.s.region(x), self.s.stride(x), self.s.region(out),
                           self.s.stride(out), n, glu=True, norm_in=norm_in,
                           label=f"mul_mat {gu}+swiglu<-{x}" + ("+rms_norm" if norm_in else "") + ("+q8" if q8 else ""))
            return None
        for m, col in pieces:
            self.matmul(m, x, gu, col=col, norm_in=norm_in)
        self.swiglu(gu, out)
        return None

    def swiglu(self, gu: str, out: str, gelu: bool = False) -> None:
        """out[r][i] = silu(gu[r][i]) * gu[r][F + i] (gelu: GELU for silu)"""
        self.k.swiglu(self.p, self.s.region(gu), self.s.stride(gu), self.s.region(out), self.s.stride(out),
                      self.s.widths[out], self._rows(out), gelu=gelu)

    def softcap(self, x: str, cap: float) -> None:
        """x[r] = cap * tanh(x[r] / cap), in place"""
        self.k.softcap(self.p, self.s.region(x), self.s.stride(x), self.s.widths[x], self._rows(x), cap)

    def add_bias(self, x: str, b: Region, n: int) -> None:
        """x[r][:n] += b for every row (a weight vector: Qwen2's q|k|v biases)."""
        self.k.add_bias(self.p, b, self.s.region(x), self.s.stride(x), n, self._rows(x))

    def add(self, a: str, b: str, out: str) -> None:
        self.k.add(self.p, self.s.region(a), self.s.stride(a), self.s.region(b), self.s.stride(b),
                   self.s.region(out), self.s.stride(out), self.s.widths[out], self._rows(out))

    def sample(self, logits: str, tmp: str = "out_sample") -> None:
        """each output row's token drawn with its sampling params (the params
        buffer's sampling words), into the params buffer where argmax puts it"""
        self.k.sample(self.p, self.s.region(logits), self.s.stride(logits), self.s.widths[logits], self.n_out,
                      self.params, self.pl.sampling, self.pl.argmax,
                      Region(self.s.buf, self.s.offsets[tmp], self.s.stride(tmp) * self.n_out))

    def argmax(self, logits: str, tmp: str = "out_argmax") -> None:
        """greedy token of each output row, into the params buffer"""
        self.k.argmax(self.p, self.s.region(logits), self.s.stride(logits), self.s.widths[logits], self.n_out,
                      self.params, self.pl.argmax, Region(self.s.buf, self.s.offsets[tmp],
                                                          self.s.stride(tmp) * self.n_out))

    def rms_norm_into(self, x: str, w: Region, out: str, col: int = 0, rows: int | None = None,
                      map_off: int | None = None) -> None:
        """out[r][col : col + width(x)] = rms_norm(x[src]) * w, src = r or params[map_off + r]."""
        rows = self._rows(out) if rows is None else rows
        self.k.rms_norm(self.p, w, self._r(x), self.s.stride(x), self._r(out, col), self.s.stride(out),
                        self.s.widths[x], rows, self.eps, self.params, map_off)

    def norm_rope_kv(self, layer: int, qkv: str, q_out: str, table: Region, wq: Region, wk: Region, n_head: int,
                     n_kv: int, head_dim: int, n_rot: int, gated: bool = True) -> None:
        """q/k RMSNorm + RoPE; q -> q_out, k, v -> the layer's KV cache. qkv rows are
        [q0 g0 q1 g1 ... | k | v] (gated: each head's gate after its query, Qwen3.5)
        or [q0 q1 ... | k | v] (Qwen3)."""
        qh = (2 if gated else 1) * head_dim
        qc = n_head * qh
        self.k.norm_rope_kv(self.p, table, wq, wk, self._r(qkv), self.s.stride(qkv), qh, qc,
                             qc + n_kv * head_dim, self._r(q_out), self.s.stride(q_out), self.n, n_head, n_kv,
                             head_dim, n_rot, self.kv.k(layer), self.kv.v(layer), self.kv.stride(layer),
                             self.params, self.pl.positions, self.pl.slots, self.eps, kv_types=self.kv.types,
                             ring=self.kv.ring(layer))

    def head_gate(self, x: str, qkv: str, head_dim: int) -> None:
        """x[r][h*hd + d] *= sigmoid(gate of head h), gates interleaved after each query in qkv."""
        n = self.s.widths[x]
        self.k.sigmoid_mul(self.p, self._r(x), self.s.stride(x), self._r(qkv, head_dim), self.s.stride(qkv),
                            head_dim, 2 * head_dim, 1, self._r(x), self.s.stride(x), n, self._rows(x))

    def matmul_gated(self, w: Matrix, x: str, out: str, g: str) -> None:
        """out[r] += sigmoid(g[r][0]) * (w @ x[r]): by the matvec where it can
        (Kernels.fuses_gate: GPUs' decode steps), else row_gate of x then matmul."""
        n = self._rows(x)
        if self.k.fuses_gate(w, n):
            self.k.mul_mat(self.p, w, self.s.region(x), self.s.stride(x), self.s.region(out), self.s.stride(out), n,
                           accumulate=True, gate=(self._r(g), self.s.stride(g)),
                           label=f"mul_mat {out}<-{x}*sigmoid({g})")
            return
        self.row_gate(x, g)
        self.matmul(w, x, out, accumulate=True)

    def row_gate(self, x: str, g: str) -> None:
        """x[r] *= sigmoid(g[r][0])."""
        n = self.s.widths[x]
        self.k.sigmoid_mul(self.p, self._r(x), self.s.stride(x), self._r(g), self.s.stride(g), n, 0, 0,
                            self._r(x), self.s.stride(x), n, self._rows(x))
