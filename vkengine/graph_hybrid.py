"""Named ops of the hybrid models (vkengine/models/qwen35.py) over the engine's
scratch activations, on top of Graph's (vkengine/graph.py).

The per-sequence state these ops read and write lives in a HybridState
(vkengine/state.py): KV rows of the full-attention layers and the conv and
recurrent states of the linear-attention layers, in slots. `snap_rows` > 0
records a step whose linear layers also keep the state after each of its first
snap_rows rows (speculative decoding verifies drafts in such a step and rolls
back to the last accepted row).
"""
from __future__ import annotations

from .graph import Graph
from .kernels import Matrix, Region
from .kernels_hybrid import HybridKernels


class HybridGraph(Graph):
    def __init__(self, *args, snap_rows: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.hk = HybridKernels.like(self.k)
        self.snap_rows = snap_rows

    def _r(self, name: str, col: int = 0) -> Region:
        return self.s.region(name, col)

    @property
    def n_groups(self) -> int:
        """Most sequences a step can hold: rows of a slot are contiguous."""
        return min(self.n, self.kv.n_slots)

    # -- norms ------------------------------------------------------------------
    def rms_norm_into(self, x: str, w: Region, out: str, col: int = 0, rows: int | None = None,
                      map_off: int | None = None) -> None:
        """out[r][col : col + width(x)] = rms_norm(x[src]) * w, src = r or params[map_off + r]."""
        rows = self._rows(out) if rows is None else rows
        self.k.rms_norm(self.p, w, self._r(x), self.s.stride(x), self._r(out, col), self.s.stride(out),
                        self.s.widths[x], rows, self.eps, self.params, map_off)

    def l2_norm(self, name: str, head_dim: int, n_heads: int, col: int = 0, eps: float = 1e-6) -> None:
        """In place, over heads [col, col + n_heads*head_dim) of each row."""
        r = self._r(name, col)
        self.hk.l2_norm(self.p, r, self.s.stride(name), r, self.s.stride(name), head_dim, n_heads,
                        self._rows(name), eps)

    def gated_rms_norm(self, x: str, z: str, z_col: int, w: Region, head_dim: int, n_heads: int) -> None:
        """x[r][h] = rms_norm(x[r][h]) * w * silu(z[r][z_col + h...]) (in place)."""
        self.hk.gated_rms_norm(self.p, w, self._r(x), self.s.stride(x), self._r(z, z_col), self.s.stride(z),
                               self._r(x), self.s.stride(x), head_dim, n_heads, self._rows(x), self.eps)

    # -- linear attention (Gated DeltaNet) ----------------------------------------
    def conv1d(self, layer: int, x: str, out: str, w: Region, channels: int, kernel: int) -> None:
        """out = silu(causal conv over each sequence of x[:, :channels]) with the
        layer's conv state."""
        st = self.kv
        self.hk.conv1d(self.p, w, self._r(x), self.s.stride(x), self._r(out), self.s.stride(out), channels,
                       kernel, self.n, st.conv(layer), st.conv_snap(layer) if self.snap_rows else None,
                       self.snap_rows, self.params, self.pl.positions, self.pl.slots)

    def delta_rule(self, layer: int, conv: str, lin: str, a_col: int, b_col: int, out: str, a_log: Region,
                   dt_bias: Region, nk: int, nv: int, dk: int, dv: int, tiled: bool) -> None:
        """out = gated delta rule of conv's q, k, v (q, k normalized already) with
        decay/beta inputs lin[:, a_col], lin[:, b_col], and the layer's state."""
        st = self.kv
        c = self._r(conv)
        self.hk.delta_rule(self.p, a_log, dt_bias, c, c.at(nk * dk, 0), c.at(2 * nk * dk, 0), self.s.stride(conv),
                           self._r(lin, a_col), self._r(lin, b_col), self.s.stride(lin), self._r(out),
                           self.s.stride(out), nk, nv, dk, dv, self.n, self.n_groups, st.ssm(layer),
                           st.ssm_snap(layer) if self.snap_rows else None, self.snap_rows, self.params,
                           self.pl.positions, self.pl.slots, tiled, dk ** -0.5)

    # -- gated full attention ---------------------------------------------------------
    def norm_rope_kv(self, layer: int, qkv: str, q_out: str, table: Region, wq: Region, wk: Region, n_head: int,
                     n_kv: int, head_dim: int, n_rot: int) -> None:
        """q/k RMSNorm + RoPE; q -> q_out, k, v -> the layer's KV cache. qkv rows are
        [q0 g0 q1 g1 ... | k | v] (each head's gate after its query)."""
        qc = 2 * n_head * head_dim
        self.hk.norm_rope_kv(self.p, table, wq, wk, self._r(qkv), self.s.stride(qkv), 2 * head_dim, qc,
                             qc + n_kv * head_dim, self._r(q_out), self.s.stride(q_out), self.n, n_head, n_kv,
                             head_dim, n_rot, self.kv.k(layer), self.kv.v(layer), self.kv.slot_stride,
                             self.params, self.pl.positions, self.pl.slots, self.eps)

    def head_gate(self, x: str, qkv: str, head_dim: int) -> None:
        """x[r][h*hd + d] *= sigmoid(gate of head h), gates interleaved after each query in qkv."""
        n = self.s.widths[x]
        self.hk.sigmoid_mul(self.p, self._r(x), self.s.stride(x), self._r(qkv, head_dim), self.s.stride(qkv),
                            head_dim, 2 * head_dim, 1, self._r(x), self.s.stride(x), n, self._rows(x))

    def row_gate(self, x: str, g: str) -> None:
        """x[r] *= sigmoid(g[r][0])."""
        n = self.s.widths[x]
        self.hk.sigmoid_mul(self.p, self._r(x), self.s.stride(x), self._r(g), self.s.stride(g), n, 0, 0,
                            self._r(x), self.s.stride(x), n, self._rows(x))

    # -- mixture of experts ---------------------------------------------------------------
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
        self.hk.moe_router(self.p, self._r(logits), self.s.stride(logits), self._r(route), self.s.stride(route),
                           n_expert, k, self._rows(route), w_scale, rec, rec_stride, fx)

    def moe_sort(self, route: str, k: int, n_expert: int) -> None:
        """Group the step's (row, slot) pairs by expert into `elist` / `ecnt`."""
        self.hk.moe_sort(self.p, self._r(route), self.s.stride(route), k, self._rows(route), n_expert,
                         self._r("elist"), self.s.stride("elist"), self._r("ecnt"))

    def experts(self, w: Matrix, rows_per_expert: int, x: str, route: str, k: int, out: str,
                per_slot_input: bool, batched_experts: int = 0) -> None:
        """out[r][i] = W[e_ri] @ x[r] (x shared by the k experts) or @ x[r][i].
        batched_experts = E: expert-major over moe_sort's lists (prefill); 0: one
        matvec per pair (decode)."""
        xs = w.cols if per_slot_input else 0
        if batched_experts:
            self.hk.mul_mm_id(self.p, w, rows_per_expert, batched_experts, self._r(x), self.s.stride(x), xs,
                              self._r("elist"), self.s.stride("elist"), self._r("ecnt"), k, self._r(out),
                              self.s.stride(out), rows_per_expert, self._rows(x), label=f"mul_mm_id {out}<-{x}")
        else:
            self.hk.mul_mat_id(self.p, w, rows_per_expert, self._r(x), self.s.stride(x), xs, self._r(route),
                               self.s.stride(route), k, self._r(out), self.s.stride(out), rows_per_expert,
                               self._rows(x), label=f"mul_mat_id {out}<-{x}")

    def moe_combine(self, e: str, route: str, k: int, out: str) -> None:
        """out[r] += sum_i weight_ri * e[r][i]."""
        D = self.s.widths[out]
        self.hk.moe_combine(self.p, self._r(e), self.s.stride(e), D, self._r(route), self.s.stride(route), k,
                            self._r(out), self.s.stride(out), D, self._rows(out))

    def swiglu_split(self, gu: str, out: str, F: int, parts: int) -> None:
        """out[r][i] = swiglu of gu[r][i] for i < parts (gu rows hold parts blocks of [gate F | up F])."""
        if self.s.stride(gu) != parts * 2 * F or self.s.stride(out) != parts * F:
            raise ValueError("swiglu_split needs packed rows")
        self.k.swiglu(self.p, self._r(gu), 2 * F, self._r(out), F, F, self._rows(gu) * parts)
