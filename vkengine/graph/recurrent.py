"""The ops of Gated DeltaNet linear attention (Qwen3.5's linear layers): the
short convolution, per-head L2 norms, the gated delta rule over each
sequence's recurrent state (vkengine/state.py HybridState), and the gated
RMSNorm. With snap_rows > 0 a step also keeps the state after each of its
first snap_rows rows (speculative decoding verifies drafts in such a step and
rolls back to the last accepted row)."""
from __future__ import annotations

from ..kernels import ConvOut, Matrix, Region
from ..kernels.delta_rule import GatedNorm
from ..state import HybridState
from .core import GraphBase


class RecurrentOps(GraphBase):
    @property
    def rec(self) -> HybridState:
        """The recurrent state (a model with linear layers makes a HybridState)."""
        if not isinstance(self.kv, HybridState):
            raise TypeError("linear-attention ops need a HybridState (Architecture.make_state)")
        return self.kv

    @property
    def n_groups(self) -> int:
        """Most sequences a step can hold: rows of a slot are contiguous."""
        return min(self.n, self.kv.n_slots)

    def l2_norm(self, name: str, head_dim: int, n_heads: int, col: int = 0, eps: float = 1e-6) -> None:
        """In place, over heads [col, col + n_heads*head_dim) of each row."""
        r = self._r(name, col)
        self.k.l2_norm(self.p, r, self.s.stride(name), r, self.s.stride(name), head_dim, n_heads,
                        self._rows(name), eps)

    def gated_rms_norm(self, x: str, z: str, z_col: int, w: Region, head_dim: int, n_heads: int) -> None:
        """x[r][h] = rms_norm(x[r][h]) * w * silu(z[r][z_col + h...]) (in place)."""
        self.k.gated_rms_norm(self.p, w, self._r(x), self.s.stride(x), self._r(z, z_col), self.s.stride(z),
                               self._r(x), self.s.stride(x), head_dim, n_heads, self._rows(x), self.eps)

    def matmul_conv(self, m: Matrix, x: str, lin: str, layer: int, out: str, w: Region, channels: int,
                    kernel: int) -> bool:
        """lin[r][:m.rows] = m @ x[r], then out = conv1d of its first `channels`
        columns (as conv1d below), in the matvec where it can (Kernels.fuses_conv:
        GPUs' decode steps; those columns of lin are then not written). Whether it
        did; else the caller runs the matmul and conv1d."""
        st = self.rec
        n = self._rows(x)
        conv = ConvOut(w, channels, kernel, self._r(out), self.s.stride(out), st.conv(layer),
                       st.conv_snap(layer) if self.snap_rows else None, self.snap_rows, self.params,
                       self.pl.positions, self.pl.slots)
        y, ys = self._r(lin), self.s.stride(lin)
        if not self.k.fuses_conv(m, n, y, conv):
            return False
        self.k.mul_mat(self.p, m, self._r(x), self.s.stride(x), y, ys, n, conv=conv,
                       label=f"mul_mat {lin}<-{x}+conv1d")
        return True

    def conv1d(self, layer: int, x: str, out: str, w: Region, channels: int, kernel: int) -> None:
        """out = silu(causal conv over each sequence of x[:, :channels]) with the
        layer's conv state."""
        st = self.rec
        self.k.conv1d(self.p, w, self._r(x), self.s.stride(x), self._r(out), self.s.stride(out), channels,
                      kernel, self.n, st.conv(layer), st.conv_snap(layer) if self.snap_rows else None,
                       self.snap_rows, self.params, self.pl.positions, self.pl.slots)

    def delta_rule(self, layer: int, conv: str, lin: str, a_col: int, b_col: int, out: str, a_log: Region,
                   dt_bias: Region, nk: int, nv: int, dk: int, dv: int, tiled: bool,
                   qk_norm_eps: float | None = None, gnorm: tuple[Region, str, int] | None = None) -> bool:
        """out = gated delta rule of conv's q, k, v with decay/beta inputs
        lin[:, a_col], lin[:, b_col], and the layer's state; q, k normalized
        already, or (qk_norm_eps) L2-normalized on the way (Kernels.delta_rule).
        gnorm = (weight, z, z_col): then out = gated_rms_norm(out) with the gate
        z[:, z_col:], taken by the kernel where it can (the scratch's zeroed
        `dr_sync` counters; decode steps): returns whether it did, else the
        caller runs gated_rms_norm."""
        st = self.rec
        c = self._r(conv)
        gn = None
        if gnorm is not None and "dr_sync" in self.s.widths:
            w, z, z_col = gnorm
            sync = Region(self.s.buf, self.s.offsets["dr_sync"], self.n_groups * nv)
            gn = GatedNorm(w, self._r(z, z_col), self.s.stride(z), self.eps, sync)
        return self.k.delta_rule(self.p, a_log, dt_bias, c, c.at(nk * dk, 0), c.at(2 * nk * dk, 0),
                                 self.s.stride(conv), self._r(lin, a_col), self._r(lin, b_col), self.s.stride(lin),
                                 self._r(out), self.s.stride(out), nk, nv, dk, dv, self.n, self.n_groups,
                                 st.ssm(layer), st.ssm_snap(layer) if self.snap_rows else None, self.snap_rows,
                                 self.params, self.pl.positions, self.pl.slots, tiled, dk ** -0.5,
                                 qk_norm_eps=qk_norm_eps, gnorm=gn)

