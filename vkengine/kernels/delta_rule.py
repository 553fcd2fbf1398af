"""Gated DeltaNet linear attention (Qwen3.5's linear layers): the causal
depthwise convolution with its per-slot window (conv1d.comp) and the gated
delta rule over each sequence's recurrent state (delta_rule.comp); both can
also keep the state after each of a step's first rows (snapshots, for
speculative steps)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..device import Buffer, Program
from ..errors import VkEngineError
from .norm import NormKernels
from .types import Region, params_range, rows_range

CONV_KMAX = 8             # KMAX in conv1d.comp
CONV_ROWS_BLOCK = 16      # RB in conv1d_rows.comp
DELTA_MAX_PER_LANE = 16   # MAXE in delta_rule.comp
DELTA_E4 = 4              # ... in its "_e4" variants (fewer registers: taken where a key head fits)
DELTA_CHUNK = 32          # C in delta_chunk.comp / delta_scan.comp: rows a chunk
DELTA_CHUNK_DK = 128      # DKMAX there: the largest key head size of the chunked form
DELTA_SCAN_DVB = 16       # DVB in delta_scan.comp: state columns a workgroup
DELTA_CHUNK_WG = 128      # invocations a workgroup of both
DELTA_NORM_ROWS = 32      # the most rows of a step whose delta rule takes the gated norm (GNORM)


@dataclass(frozen=True)
class GatedNorm:
    """The gated RMSNorm after a delta rule (Kernels.delta_rule's gnorm): its
    weight (a head's width), the gate z (rows z_stride apart, a head's gate
    where its output is), eps, and zeroed counter words (sync, one per sequence
    and value head, left zero)."""
    weight: Region
    z: Region
    z_stride: int
    eps: float
    sync: Region


class DeltaRuleKernels(NormKernels):   # (its l2_norm before the chunked form)
    def _prompt_forms(self, n_rows: int, snap_rows: int) -> bool:
        """Whether a step takes the prompt forms of these kernels (conv1d_rows, the
        chunked delta rule): steps of caps.delta_chunk_from rows or more that keep
        no snapshots."""
        c = self.caps
        return c.delta_chunk_from > 0 and n_rows >= c.delta_chunk_from and not snap_rows

    def conv1d(self, prog: Program, w: Region, x: Region, x_stride: int, y: Region, y_stride: int,
               C: int, K: int, n_rows: int, state: Region, snap: Region | None, snap_rows: int,
               params: Buffer, pos_off: int, slot_off: int, label: str = "conv1d",
               by_rows: bool | None = None) -> None:
        """y = silu(causal depthwise conv(x)) with the last K-1 inputs per slot in `state`
        ([slot][K-1][C]); with snap_rows > 0 the window after row r goes to snap[r].
        by_rows: conv1d_rows.comp (row blocks in parallel, then the windows kept)
        rather than an invocation a channel walking every row; None: for steps
        that take the chunked delta rule (caps.delta_chunk_from), never with snapshots."""
        if not 1 <= K <= CONV_KMAX:
            raise VkEngineError(f"conv kernel size {K} is not supported (1..{CONV_KMAX})")
        act = self._same_buffer(x, y)
        if snap is not None and snap.buf is not state.buf:
            raise ValueError("conv state and its snapshots must share a buffer")
        snap_rows = snap_rows if snap is not None else 0
        if by_rows is None:
            by_rows = self._prompt_forms(n_rows, snap_rows)
        if by_rows:
            if snap_rows:
                raise ValueError("conv1d_rows keeps no snapshots")
            push = self._push("conv1d_rows", x_off=x.off, x_stride=x_stride, y_off=y.off, y_stride=y_stride,
                              w_off=w.off, C=C, K=K, n_rows=n_rows, state_off=state.off, slot_stride=(K - 1) * C,
                              pos_off=pos_off, slot_off=slot_off)
            wg = self.caps.ew_wg
            rows = [w.range, rows_range(x, n_rows, x_stride, C), state.range,
                    *params_range(params, (pos_off, n_rows), (slot_off, n_rows))]
            grid = self._grid(math.ceil(C / wg) * math.ceil(n_rows / CONV_ROWS_BLOCK))   # (channels, row blocks)
            alg = self._alg("conv1d_rows", [w.buf, act, params, state.buf], push, wg, 1)
            prog.dispatch(alg, push, grid, rows, [rows_range(y, n_rows, y_stride, C)], label)
            if K > 1:
                alg = self._alg("conv1d_rows_state", [w.buf, act, params, state.buf], push, wg, 1)
                prog.dispatch(alg, push, grid, rows, [state.range], label + "_state")
            return
        push = self._push("conv1d", x_off=x.off, x_stride=x_stride, y_off=y.off, y_stride=y_stride, w_off=w.off, C=C,
                          K=K, n_rows=n_rows, state_off=state.off, slot_stride=(K - 1) * C,
                          snap_off=snap.off if snap is not None else 0, snap_rows=snap_rows, pos_off=pos_off,
                          slot_off=slot_off)
        alg = self._alg("conv1d", [w.buf, act, params, state.buf], push, self.caps.ew_wg, 1)
        writes = [rows_range(y, n_rows, y_stride, C), state.range]
        if snap is not None and snap_rows:
            writes.append(snap.range)
        prog.dispatch(alg, push, self._grid(math.ceil(C / self.caps.ew_wg)),
                      [w.range, rows_range(x, n_rows, x_stride, C), state.range,
                       *params_range(params, (pos_off, n_rows), (slot_off, n_rows))], writes, label)

    def delta_rule(self, prog: Program, a_log: Region, dt_bias: Region, q: Region, k: Region, v: Region,
                   qkv_stride: int, alpha: Region, beta: Region, ab_stride: int, o: Region, o_stride: int,
                   nk: int, nv: int, dk: int, dv: int, n_rows: int, n_groups: int, state: Region,
                   snap: Region | None, snap_rows: int, params: Buffer, pos_off: int, slot_off: int,
                   tiled: bool, scale: float, label: str = "delta_rule", chunked: bool | None = None,
                   qk_norm_eps: float | None = None, gnorm: GatedNorm | None = None) -> bool:
        """Gated delta rule over the rows of up to n_groups sequences (runs of equal
        slots); state [slot][nv][dv][dk] fp32; `a_log` holds A = -exp(A_log).
        chunked: in chunks of DELTA_CHUNK rows (delta_chunk.comp, then
        delta_scan.comp) rather than a row at a time; None: where the device's
        caps say (steps of delta_chunk_from rows or more), never with snapshots.
        qk_norm_eps: q and k are raw, L2-normalize them first (l2_norm's form, eps
        inside the root): in the row-at-a-time kernel itself, in place by l2_norm
        before the chunked form (which leaves them normalized).
        gnorm: the gated RMSNorm that follows (gated_rms_norm of o in place), taken
        by the row-at-a-time kernel where it can (delta_rule.comp's GNORM, steps of
        up to DELTA_NORM_ROWS rows; o then holds its output): returns whether it
        did (else the caller runs it)."""
        c = self.caps
        snap_rows = snap_rows if snap is not None else 0
        if nv % nk:
            raise VkEngineError(f"{nv} value heads do not divide among {nk} key heads")
        if a_log.buf is not dt_bias.buf:
            raise ValueError("A and dt_bias must share a weight buffer")
        act = self._same_buffer(q, k, v, alpha, beta, o)
        if chunked is None:
            chunked = self._prompt_forms(n_rows, snap_rows) and dk <= DELTA_CHUNK_DK and dk % 8 == 0
        if chunked and qk_norm_eps is not None:
            if k.off == q.off + nk * dk:        # [q | k] adjacent: one dispatch
                self.l2_norm(prog, q, qkv_stride, q, qkv_stride, dk, 2 * nk, n_rows, qk_norm_eps)
            else:
                for r in (q, k):
                    self.l2_norm(prog, r, qkv_stride, r, qkv_stride, dk, nk, n_rows, qk_norm_eps)
        if chunked:
            if snap_rows:
                raise ValueError("the chunked delta rule keeps no snapshots")
            if dk > DELTA_CHUNK_DK or dk % 8:
                raise VkEngineError(f"the chunked delta rule takes key heads of at most {DELTA_CHUNK_DK} and a "
                                    f"multiple of 8, not {dk}")
            self._delta_chunked(prog, act, a_log, dt_bias, q, k, v, qkv_stride, alpha, beta, ab_stride, o, o_stride,
                                nk, nv, dk, dv, n_rows, n_groups, state, params, pos_off, slot_off, tiled, scale, label)
            return False
        if dk > DELTA_MAX_PER_LANE * c.sg:
            raise VkEngineError(f"linear-attention key head size {dk} is not supported on subgroups of "
                                f"{c.sg} (at most {DELTA_MAX_PER_LANE * c.sg})")
        if snap is not None and snap.buf is not state.buf:
            raise ValueError("recurrent state and its snapshots must share a buffer")
        # (the last subgroup of a sequence's head normalizes its rows one after another: steps of few rows)
        fused = gnorm is not None and n_rows <= DELTA_NORM_ROWS and self.delta_takes_norm(gnorm, a_log, act, nv,
                                                                                         n_groups)
        variant = ("delta_rule_gn" if fused else "delta_rule") + ("_e4" if dk <= DELTA_E4 * self.min_subgroup() else "")
        cols = c.delta_cols if dv % c.delta_cols == 0 else 1   # columns a subgroup (the same bits)
        if cols > 1:
            variant += f"_c{cols}"
        extra = {}
        if fused:
            assert gnorm is not None
            extra = dict(z_off=gnorm.z.off, z_stride=gnorm.z_stride, gw_off=gnorm.weight.off,
                         sync_off=gnorm.sync.off, g_eps=gnorm.eps)
        push = self._push(variant, q_off=q.off, k_off=k.off, v_off=v.off, qkv_stride=qkv_stride, a_off=alpha.off,
                          b_off=beta.off, ab_stride=ab_stride, o_off=o.off, o_stride=o_stride, nk=nk, nv=nv, dk=dk,
                          dv=dv, n_rows=n_rows, n_groups=n_groups, wa_off=a_log.off, wdt_off=dt_bias.off,
                          state_off=state.off, slot_stride=nv * dv * dk, snap_off=snap.off if snap is not None else 0,
                          snap_rows=snap_rows, pos_off=pos_off, slot_off=slot_off, tiled=int(tiled), scale=scale,
                          qk_norm=int(qk_norm_eps is not None), qk_eps=qk_norm_eps or 0.0, **extra)
        alg = self._alg(variant, [a_log.buf, act, params, state.buf] + ([act] if fused else []), push, c.wg)
        reads = [a_log.range, dt_bias.range, rows_range(q, n_rows, qkv_stride, nk * dk),
                 rows_range(k, n_rows, qkv_stride, nk * dk), rows_range(v, n_rows, qkv_stride, nv * dv),
                 rows_range(alpha, n_rows, ab_stride, nv), rows_range(beta, n_rows, ab_stride, nv),
                 state.range, *params_range(params, (pos_off, n_rows), (slot_off, n_rows))]
        writes = [rows_range(o, n_rows, o_stride, nv * dv), state.range]
        if snap is not None and snap_rows:
            writes.append(snap.range)
        if fused:
            assert gnorm is not None
            reads += [gnorm.weight.range, rows_range(gnorm.z, n_rows, gnorm.z_stride, nv * dv)]
            writes.append((gnorm.sync.buf, gnorm.sync.off * 4, (gnorm.sync.off + n_groups * nv) * 4))
            label += "+gated_rms_norm"
        prog.dispatch(alg, push, self._grid(math.ceil(n_groups * nv * dv // cols / c.items)), reads, writes, label)
        return fused

    def delta_takes_norm(self, gnorm: GatedNorm, a_log: Region, act: Buffer, nv: int, n_groups: int) -> bool:
        """Whether the row-at-a-time delta rule can take the gated RMSNorm after it
        (GNORM): its weight beside A's, the gate and the zeroed counters
        (n_groups * nv words) in the activations' buffer."""
        return (gnorm.weight.buf is a_log.buf and gnorm.z.buf is act and gnorm.sync.buf is act
                and gnorm.sync.words >= n_groups * nv)

    def _delta_chunked(self, prog: Program, act: Buffer, a_log: Region, dt_bias: Region, q: Region, k: Region,
                       v: Region, qkv_stride: int, alpha: Region, beta: Region, ab_stride: int, o: Region,
                       o_stride: int, nk: int, nv: int, dk: int, dv: int, n_rows: int, n_groups: int, state: Region,
                       params: Buffer, pos_off: int, slot_off: int, tiled: bool, scale: float, label: str) -> None:
        """The chunked form: delta_chunk.comp makes each chunk's G, W, U and Aqk in
        a scratch buffer (all chunks and heads at once), delta_scan.comp walks each
        sequence's chunks with its state (delta_rule() checked the operands)."""
        C = DELTA_CHUNK
        n_blocks = math.ceil(n_rows / C)
        g_words, w_words, u_words, a_words = n_rows * nv, n_rows * nv * dk, n_rows * nv * dv, n_rows * nv * C
        g_off = 0
        w_off = g_off + g_words
        u_off = w_off + w_words
        aq_off = u_off + u_words
        words = aq_off + a_words
        scr = self._scratch(self._dr, words, "delta")
        scr_range = (scr, 0, words * 4)
        push = self._push("delta_chunk", q_off=q.off, k_off=k.off, v_off=v.off, qkv_stride=qkv_stride,
                          a_off=alpha.off, b_off=beta.off, ab_stride=ab_stride, nk=nk, nv=nv, dk=dk, dv=dv,
                          n_rows=n_rows, wa_off=a_log.off, wdt_off=dt_bias.off, slot_off=slot_off, tiled=int(tiled),
                          g_off=g_off, w_off=w_off, u_off=u_off, aq_off=aq_off)
        alg = self._alg("delta_chunk", [a_log.buf, act, params, scr], push, DELTA_CHUNK_WG, 1)
        qk_reads = [rows_range(q, n_rows, qkv_stride, nk * dk), rows_range(k, n_rows, qkv_stride, nk * dk)]
        prog.dispatch(alg, push, self._grid(n_blocks * nv),
                      [a_log.range, dt_bias.range, *qk_reads, rows_range(v, n_rows, qkv_stride, nv * dv),
                       rows_range(alpha, n_rows, ab_stride, nv), rows_range(beta, n_rows, ab_stride, nv),
                       *params_range(params, (slot_off, n_rows))], [scr_range], label + "_chunk")
        push = self._push("delta_scan", q_off=q.off, k_off=k.off, qkv_stride=qkv_stride, o_off=o.off,
                          o_stride=o_stride, nk=nk, nv=nv, dk=dk, dv=dv, n_rows=n_rows, n_groups=n_groups,
                          state_off=state.off, slot_stride=nv * dv * dk, pos_off=pos_off, slot_off=slot_off,
                          tiled=int(tiled), g_off=g_off, w_off=w_off, u_off=u_off, aq_off=aq_off, scale=scale)
        alg = self._alg("delta_scan", [act, params, state.buf, scr], push, DELTA_CHUNK_WG, 1)
        prog.dispatch(alg, push, self._grid(n_groups * nv * math.ceil(dv / DELTA_SCAN_DVB)),
                      [*qk_reads, state.range, scr_range, *params_range(params, (pos_off, n_rows), (slot_off, n_rows))],
                      [rows_range(o, n_rows, o_stride, nv * dv), state.range], label + "_scan")
