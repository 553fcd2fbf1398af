"""The ops of mixture-of-experts FFNs: routing, the experts' products (one
matvec per pair in decode steps, expert-major in prompt steps), their
weighted sum, and the SwiGLU of each routed expert."""
from __future__ import annotations

from ..kernels import Matrix, NormOut, Region, RouteOut
from ..kernels.moe import MM_ID_COLS
from .core import GraphBase


class MoeOps(GraphBase):
    def moe_route(self, logits: str, route: str, n_expert: int, k: int, w_scale: float = 1.0,
                  fixed: tuple[Region, str] | None = None, record: tuple[str, int] | None = None) -> None:
        """route[r] = (top-k ids, weights) from logits[r]; fixed = (f32 router weights,
        hidden name): compute the logits in the fixed order (parity mode);
        record = (name, col): also store the ids at name[r][col:col + k]."""
        fx = None
        if fixed is not None:
            w, h = fixed
            fx = (w, self._r(h), self.s.stride(h), self.s.widths[h])
        rec, rec_stride = (None, 0) if record is None else (self._r(*record), self.s.stride(record[0]))
        self.k.moe_router(self.p, self._r(logits), self.s.stride(logits), self._r(route), self.s.stride(route),
                           n_expert, k, self._rows(route), w_scale, rec, rec_stride, fx)

    def router(self, w: Matrix, h: str, logits: str, route: str, n_expert: int, k: int,
               w_scale: float = 1.0, bias: Region | None = None) -> None:
        """The router's logits of h into `logits`, then (moe_route) each row's
        top-k experts and weights into `route`: by the matvec's last workgroup
        where it can (Kernels.fuses_route: GPUs' decode steps; the scratch's
        zeroed `rt_sync` word), else a moe_router dispatch after it. bias: the
        router's bias (gpt-oss) added to the logits first (in the matvec there:
        Kernels.fuses_bias; else add_bias)."""
        if "rt_sync" in self.s.widths:
            rt = RouteOut(self._r(route), self.s.stride(route), k, w_scale,
                          Region(self.s.buf, self.s.offsets["rt_sync"], 1))
            y, ys, n = self._r(logits), self.s.stride(logits), self._rows(h)
            if w.rows == n_expert and self.k.fuses_route(w, n, y, ys, rt) and \
                    (bias is None or self.k.fuses_bias(w, n)):
                self.k.mul_mat(self.p, w, self._r(h), self.s.stride(h), y, ys, n, route=rt, bias=bias,
                               label=f"mul_mat {logits}<-{h}" + ("+bias" if bias is not None else "") + "+moe_router")
                return
        self.k.mul_mat(self.p, w, self._r(h), self.s.stride(h), self._r(logits), self.s.stride(logits),
                       self._rows(h), label=f"mul_mat {logits}<-{h}")
        if bias is not None:
            self.k.add_bias(self.p, bias, self._r(logits), self.s.stride(logits), n_expert, self._rows(h))
        self.moe_route(logits, route, n_expert, k, w_scale)

    def moe_sort(self, route: str, k: int, n_expert: int, bn: int = 0) -> None:
        """Group the step's (row, slot) pairs by expert into `elist` / `ecnt`
        (bn: and the work list of blocks of bn pairs into `eblk`, 2k + 1 words a row)."""
        blocks = None
        if bn:
            n = self._rows(route)
            if 1 + self.k.expert_blocks(n * k, n_expert, bn) > n * self.s.stride("eblk"):
                raise ValueError("the expert work list does not fit eblk: too few rows for tiled expert matmuls")
            blocks = (self._r("eblk"), bn)
        self.k.moe_sort(self.p, self._r(route), self.s.stride(route), k, self._rows(route), n_expert,
                         self._r("elist"), self.s.stride("elist"), self._r("ecnt"), blocks)

    def experts(self, w: Matrix, rows_per_expert: int, x: str, route: str, k: int, out: str,
                per_slot_input: bool, batched_experts: int = 0, tiled: bool = False, union: bool = False,
                epilogue: str = "", norm: NormOut | None = None, bias: Region | None = None,
                oai: tuple[float, float] | None = None) -> None:
        """out[r][i] = W[e_ri] @ x[r] (x shared by the k experts) or @ x[r][i].
        batched_experts = E: expert-major over moe_sort's lists (prefill; tiled:
        the tiled matmuls over its work list; union: mul_mm_id over its work
        list, decode rows); 0: one matvec per pair (decode), with its epilogue
        and norm if given (Kernels.mul_mat_id: "glu" writes out[r][i] as the
        SwiGLU of the expert's gate|up, "combine" adds the weighted sum to out[r])."""
        xs = w.cols if per_slot_input else 0
        if tiled:
            self.k.mul_tiled_id(self.p, w, rows_per_expert, batched_experts, self._r(x), self.s.stride(x), xs,
                                 self._r("elist"), self.s.stride("elist"), self._r("ecnt"), self._r("eblk"), k,
                                 self._r(out), self.s.stride(out), rows_per_expert, self._rows(x),
                                 label=f"mul_tiled_id {out}<-{x}")
        elif batched_experts:
            self.k.mul_mm_id(self.p, w, rows_per_expert, batched_experts, self._r(x), self.s.stride(x), xs,
                              self._r("elist"), self.s.stride("elist"), self._r("ecnt"), k, self._r(out),
                              self.s.stride(out), rows_per_expert, self._rows(x), label=f"mul_mm_id {out}<-{x}",
                              blocks=self._r("eblk") if union else None)
        else:
            tag = {"": "", "glu": "+swiglu", "combine": "+=moe"}[epilogue]
            self.k.mul_mat_id(self.p, w, rows_per_expert, self._r(x), self.s.stride(x), xs, self._r(route),
                               self.s.stride(route), k, self._r(out), self.s.stride(out),
                               rows_per_expert // 2 if epilogue == "glu" else rows_per_expert, self._rows(x),
                               label=f"mul_mat_id {out}{tag}<-{x}" + ("+bias" if bias is not None else "")
                               + ("+rms_norm" if norm else ""), epilogue=epilogue, norm=norm, bias=bias, oai=oai)

    def routed_experts(self, gate_up: Matrix, down: Matrix, n_expert: int, k: int, n_ff_exp: int,
                       out: str = "x", biases: tuple[Region, Region] | None = None,
                       oai: tuple[float, float] | None = None, norm: tuple[Region, str] | None = None) -> bool:
        """out[r] += the SwiGLU FFNs of h[r] through its k routed experts (route,
        after moe_route), weighted: one matvec per pair in decode steps,
        expert-major batched matmuls once a step routes several rows to each
        expert on average. biases = (gate|up E x 2F, down E x D): each expert's
        (gpt-oss); oai = (alpha, limit): gpt-oss's clamped SwiGLU. norm = (weight,
        h): the RMSNorm that follows into h, taken by the down projection's
        matvec where it runs fused (decode rows); returns whether it did (else
        the caller norms)."""
        batched = n_expert if self.n * k >= 4 * n_expert else 0
        # tiles where the device has them for both stacks (one work list, one block width)
        tile_gu, tile_dn = (self.k.expert_tile(gate_up), self.k.expert_tile(down)) if batched else (None, None)
        tiled = tile_gu is not None and tile_dn is not None and tile_gu[2] == tile_dn[2] and "eblk" in self.s.widths
        # decode rows of several sequences: each expert they share read once (Caps.expert_union; its sums are
        # mul_mv_id's, so not beside the split-K form, whose single rows would then differ from batched ones)
        union = (not batched and self.n > 1 and self.k.caps.expert_union and not self.k.caps.mvid_splitk
                 and not gate_up.parts and not down.parts and "eblk" in self.s.widths)
        if union:
            batched = n_expert
            self.moe_sort("route", k, n_expert, bn=MM_ID_COLS)
        elif batched:
            self.moe_sort("route", k, n_expert, bn=tile_gu[2] if tiled and tile_gu else 0)
        elif not gate_up.parts and not down.parts:
            # decode rows, one matvec per pair: the SwiGLU in gate|up's matvec, the weighted sum in down's (and
            # gpt-oss's expert biases and clamped SwiGLU there too)
            if self.s.stride("ff_e") != k * n_ff_exp:
                raise ValueError("the fused expert matvecs need packed ff_e rows")
            self.experts(gate_up, 2 * n_ff_exp, "h", "route", k, "ff_e", per_slot_input=False, epilogue="glu",
                         bias=biases[0] if biases else None, oai=oai)
            # (a counter a row: each row's last workgroup normalizes it)
            nout = self._norm_out(*norm, sync="cn_sync", words=self.n) if norm is not None else None
            if nout is not None and not self.k.combine_takes_norm(self.s.widths[out], self._r(out),
                                                                  self.s.stride(out), nout):
                nout = None
            self.experts(down, self.s.widths[out], "ff_e", "route", k, out, per_slot_input=True, epilogue="combine",
                         norm=nout, bias=biases[1] if biases else None)
            return nout is not None
        self.experts(gate_up, 2 * n_ff_exp, "h", "route", k, "gu_e", per_slot_input=False, batched_experts=batched,
                     tiled=tiled, union=union)
        if biases is not None:
            self.expert_bias(biases[0], 2 * n_ff_exp, "route", k, "gu_e")
        self.swiglu_split("gu_e", "ff_e", n_ff_exp, k, oai)
        self.experts(down, self.s.widths[out], "ff_e", "route", k, "dn_e", per_slot_input=True,
                     batched_experts=batched, tiled=tiled, union=union)
        if biases is not None:
            self.expert_bias(biases[1], self.s.widths[out], "route", k, "dn_e")
        self.moe_combine("dn_e", "route", k, out)
        return False

    def expert_bias(self, b: Region, M: int, route: str, k: int, y: str) -> None:
        """y[r][i][:M] += b[expert of route[r][i]] (y rows hold k slots of M)."""
        self.k.moe_bias(self.p, b, M, self._r(route), self.s.stride(route), k, self._r(y), self.s.stride(y), M,
                        self._rows(y))

    def moe_combine(self, e: str, route: str, k: int, out: str) -> None:
        """out[r] += sum_i weight_ri * e[r][i]."""
        D = self.s.widths[out]
        self.k.moe_combine(self.p, self._r(e), self.s.stride(e), D, self._r(route), self.s.stride(route), k,
                            self._r(out), self.s.stride(out), D, self._rows(out))

    def swiglu_split(self, gu: str, out: str, F: int, parts: int, oai: tuple[float, float] | None = None) -> None:
        """out[r][i] = swiglu of gu[r][i] for i < parts (gu rows hold parts blocks of [gate F | up F])."""
        if self.s.stride(gu) != parts * 2 * F or self.s.stride(out) != parts * F:
            raise ValueError("swiglu_split needs packed rows")
        self.k.swiglu(self.p, self._r(gu), 2 * F, self._r(out), F, F, self._rows(gu) * parts, oai=oai)
