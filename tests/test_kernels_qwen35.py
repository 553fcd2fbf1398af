"""Kernels of the hybrid models against numpy (tests/reference_hybrid.py): fresh
random inputs, poisoned outputs (unwritten elements are NaN and fail), sizes
that are not multiples of the subgroup or workgroup, several sequences (slots)
in one step, fresh sequences (position 0) next to continuing ones."""
from __future__ import annotations

import numpy as np
import pytest

from vkengine.kernels import KVTypes, NormOut
from vkengine.rope import rope_table

from . import kv_util
from . import reference_hybrid as rh
from .quant_util import random_quantized, upload_matrix


@pytest.fixture(scope="module")
def hk(kernels):
    return kernels


@pytest.fixture(scope="module")
def mvk(device):
    """Kernels with the GPUs' split-K matvecs and their epilogue variants (forced on lavapipe)."""
    from .conftest import kernels_for
    return kernels_for(device, tiled_from=None, multi_column_from=2, split_k=True)


def _matrix(ws, rng, wt: str, rows: int, cols: int):
    """A random matrix of weight type wt uploaded: (Matrix, its float32 values)."""
    raw, wf = random_quantized(wt, rows, cols, rng)
    return upload_matrix(ws, wt, raw, rows, cols), wf


def _close(got, want, rtol=1e-4, atol_scale=1e-5):
    atol = atol_scale * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _rows_params(ws, slots, pos, slot_off=None, pos_off=0):
    n = len(slots)
    slot_off = max(128, n) if slot_off is None else slot_off
    ws.params.array()[pos_off:pos_off + n] = np.asarray(pos, np.uint32)
    ws.params.array()[slot_off:slot_off + n] = np.asarray(slots, np.uint32)
    return pos_off, slot_off


# A step with three sequences: slot 2 continues from its state (3 rows), slot 0
# starts fresh (5 rows from position 0), slot 3 decodes one row.
STEP_SLOTS = [2, 2, 2, 0, 0, 0, 0, 0, 3]
STEP_POS = [7, 8, 9, 0, 1, 2, 3, 4, 40]
# a prompt-sized step: runs longer than the kernels' groups of rows (conv1d loads 8 at a time,
# delta_rule finds a run's end a subgroup's width of rows at a time)
LONG_SLOTS = [1] * 45 + [3] * 20
LONG_POS = list(range(5, 50)) + list(range(20))


def _groups(slots, pos):
    out, r = [], 0
    while r < len(slots):
        e = r
        while e < len(slots) and slots[e] == slots[r]:
            e += 1
        out.append((slots[r], pos[r], r, e))
        r = e
    return out


# -- pure numpy: the two forms of the gated delta rule agree ------------------------

def test_reference_delta_rule_chunked_equals_recurrent(rng):
    T, H, dk, dv = 11, 3, 8, 6
    q = rh.l2_norm(rng.standard_normal((T, H, dk)))
    k = rh.l2_norm(rng.standard_normal((T, H, dk)))
    v = rng.standard_normal((T, H, dv))
    g = -rng.uniform(0.01, 1.0, (T, H))
    beta = rng.uniform(0.1, 0.9, (T, H))
    S0 = rng.standard_normal((H, dk, dv))
    o1, s1, _ = rh.delta_rule_recurrent(q, k, v, g, beta, S0, 0.3)
    o2, s2 = rh.delta_rule_chunked(q, k, v, g, beta, S0, 0.3, chunk=4)
    np.testing.assert_allclose(o1, o2, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(s1, s2, rtol=1e-9, atol=1e-9)


# -- conv1d --------------------------------------------------------------------------

# runs of 1 and 2 rows (shorter than the window), one across row blocks
SHORT_SLOTS = [1] + [2] * 2 + [0] * 19 + [3]
SHORT_POS = [9] + [4, 5] + list(range(19)) + [2]


@pytest.mark.parametrize("by_rows", [False, True])
@pytest.mark.parametrize("C,K,long", [(37, 4, False), (200, 2, False), (8, 1, False), (37, 4, True),
                                      (37, 4, "short"), (19, 6, "short")])
def test_conv1d(device, hk, ws, rng, C, K, long, by_rows):
    """long: a prompt-sized step (the kernel loads 8 rows at a time); by_rows:
    conv1d_rows.comp (no snapshots there)."""
    slots, positions = ((SHORT_SLOTS, SHORT_POS) if long == "short" else (LONG_SLOTS, LONG_POS) if long
                        else (STEP_SLOTS, STEP_POS))
    n, n_slots = len(slots), 4
    pos_off, slot_off = _rows_params(ws, slots, positions)
    w = rng.standard_normal((C, K)).astype(np.float32)
    x = rng.standard_normal((n, C)).astype(np.float32)
    xs, ys = C + 3, C + 5
    state0 = rng.standard_normal((n_slots, max(K - 1, 0), C)).astype(np.float32)
    wr = ws.weight_region(w)
    xr = ws.act_region(n * xs, np.pad(x, ((0, 0), (0, 3))))
    yr = ws.act_region(n * ys)
    st = ws.act_region(max(state0.size, 4), state0 if state0.size else None)
    snap_rows = 0 if by_rows else 4
    snap = ws.act_region(max(snap_rows * (K - 1) * C, 4)) if snap_rows else None
    prog = device.program()
    hk.conv1d(prog, wr, xr, xs, yr, ys, C, K, n, st, snap, snap_rows, ws.params, pos_off, slot_off, by_rows=by_rows)
    prog.run()
    got = ws.read(yr).reshape(n, ys)
    assert np.isnan(got[:, C:]).all()
    want_state = state0.copy()
    want_y = np.zeros((n, C))
    snaps = []
    for slot, p0, a, b in _groups(slots, positions):
        s = np.zeros_like(state0[slot]) if p0 == 0 else state0[slot]
        for r in range(a, b):
            want_y[r:r + 1], s = rh.conv1d(x[r:r + 1], w, s)
            snaps.append(s)
        want_state[slot] = s
    _close(got[:, :C], want_y)
    if K > 1:
        _close(ws.read(st)[: state0.size].reshape(state0.shape), want_state)
    if K > 1 and snap_rows:
        _close(ws.read(snap)[: snap_rows * (K - 1) * C].reshape(snap_rows, K - 1, C), np.stack(snaps[:snap_rows]))


# -- norms, gates ---------------------------------------------------------------------

def test_l2_norm_in_place(device, hk, ws, rng):
    rows, H, hd = 7, 5, 36
    x = rng.standard_normal((rows, H * hd)).astype(np.float32) * 3
    xr = ws.act_region(rows * H * hd, x)
    prog = device.program()
    hk.l2_norm(prog, xr, H * hd, xr, H * hd, hd, H, rows, 1e-6)
    prog.run()
    _close(ws.read(xr).reshape(rows, H, hd), rh.l2_norm(x.reshape(rows, H, hd)))


def test_gated_rms_norm(device, hk, ws, rng):
    rows, H, hd = 6, 3, 40
    x = rng.standard_normal((rows, H * hd)).astype(np.float32)
    z = rng.standard_normal((rows, H * hd + 8)).astype(np.float32) * 2
    w = rng.standard_normal(hd).astype(np.float32)
    xr, zr = ws.act_region(x.size, x), ws.act_region(z.size, z)
    yr = ws.act_region(rows * (H * hd + 4))
    prog = device.program()
    hk.gated_rms_norm(prog, ws.weight_region(w), xr, H * hd, zr.at(8, z.size - 8), H * hd + 8, yr,
                      H * hd + 4, hd, H, rows, 1e-6)
    prog.run()
    got = ws.read(yr).reshape(rows, H * hd + 4)
    want = rh.gated_rms_norm(x.reshape(rows, H, hd), z[:, 8:].reshape(rows, H, hd), w, 1e-6)
    _close(got[:, :H * hd].reshape(rows, H, hd), want)
    assert np.isnan(got[:, H * hd:]).all()


def test_sigmoid_mul_head_gates_and_row_gate(device, hk, ws, rng):
    rows, H, hd = 5, 3, 12
    x = rng.standard_normal((rows, H * hd)).astype(np.float32)
    qg = rng.standard_normal((rows, H * 2 * hd)).astype(np.float32) * 3   # per head [q | gate]
    xr, gr, yr = ws.act_region(x.size, x), ws.act_region(qg.size, qg), ws.act_region(x.size)
    prog = device.program()
    hk.sigmoid_mul(prog, xr, H * hd, gr.at(hd, qg.size - hd), 2 * H * hd, hd, 2 * hd, 1, yr, H * hd, H * hd, rows)
    prog.run()
    gate = qg.reshape(rows, H, 2, hd)[:, :, 1].reshape(rows, H * hd)
    _close(ws.read(yr).reshape(rows, H * hd), x * rh.sigmoid(gate))
    s = rng.standard_normal((rows, 4)).astype(np.float32)
    sr = ws.act_region(s.size, s)
    prog = device.program()
    hk.sigmoid_mul(prog, xr, H * hd, sr, 4, H * hd, 0, 0, xr, H * hd, H * hd, rows)   # in place
    prog.run()
    _close(ws.read(xr).reshape(rows, H * hd), x * rh.sigmoid(s[:, :1]))


# -- gated delta rule -------------------------------------------------------------------

# a step of three prompts: runs that start and end inside the chunked form's 32-row chunks
# and one that spans three of them
CHUNKY_SLOTS = [2] * 7 + [0] * 70 + [3] * 23
CHUNKY_POS = list(range(30, 37)) + list(range(70)) + list(range(5, 28))

DELTA_CASES = [(False, 2, 4, 16, 12, False), (True, 2, 4, 16, 12, False), (False, 3, 3, 24, 8, False),
               (True, 3, 3, 24, 8, False), (False, 1, 2, 128, 5, False), (True, 1, 2, 128, 5, False),
               (True, 2, 4, 32, 6, True)]


# more rows than delta_scan's run search takes at a time (128 invocations x 8 rows)
HUGE_SLOTS = [1] * 600 + [3] * 500 + [0] * 30
HUGE_POS = list(range(7, 607)) + list(range(500)) + list(range(30))


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("tiled,nk,nv,dk,dv,long,raw",
                         [(*c, raw) for c in DELTA_CASES + [(True, 2, 4, 128, 40, "chunky")] for raw in (False, True)]
                         + [(False, 1, 2, 16, 8, "huge", False)])
def test_delta_rule(device, hk, ws, rng, tiled, nk, nv, dk, dv, long, chunked, raw):
    """chunked: delta_chunk.comp + delta_scan.comp (no snapshots there). The
    grid covers min(rows, slots) sequences, as the engine's (Graph.n_groups):
    more than the step's runs, whose groups find none and do nothing.
    raw: q and k not normalized yet (qk_norm_eps: in the row kernel itself, by
    l2_norm before the chunked form)."""
    slots, positions = {"chunky": (CHUNKY_SLOTS, CHUNKY_POS), "huge": (HUGE_SLOTS, HUGE_POS),
                        True: (LONG_SLOTS, LONG_POS), False: (STEP_SLOTS, STEP_POS)}[long]
    n, n_slots, snap_rows = len(slots), 4, 0 if chunked else 6
    pos_off, slot_off = _rows_params(ws, slots, positions)
    qk_in = (rng.standard_normal((n, 2, nk, dk)) * (3.0 if raw else 1.0)).astype(np.float32)
    qk = rh.l2_norm(qk_in.astype(np.float64))
    if not raw:
        qk_in = qk = qk.astype(np.float32)
    v = rng.standard_normal((n, nv, dv)).astype(np.float32)
    conv = np.concatenate([qk_in.reshape(n, -1), v.reshape(n, -1), np.zeros((n, 3), np.float32)], 1)
    cs = conv.shape[1]
    ab = rng.standard_normal((n, 2 * nv + 1)).astype(np.float32)        # [alpha | beta | pad]
    A = -np.exp(rng.uniform(-1, 1, nv)).astype(np.float32)
    dt = rng.standard_normal(nv).astype(np.float32)
    S0 = (rng.standard_normal((n_slots, nv, dv, dk)) * 0.5).astype(np.float32)   # [slot][hv][j][i]
    wr = ws.weight_region(np.concatenate([A, dt]))
    cr = ws.act_region(conv.size, conv)
    abr = ws.act_region(ab.size, ab)
    os_ = nv * dv + 2
    orr = ws.act_region(n * os_)
    st = ws.act_region(S0.size, S0)
    snap = ws.act_region(snap_rows * nv * dv * dk) if snap_rows else None
    scale = dk ** -0.5
    prog = device.program()
    hk.delta_rule(prog, wr.at(0, nv), wr.at(nv, nv), cr, cr.at(nk * dk, 0), cr.at(2 * nk * dk, 0), cs,
                  abr, abr.at(nv, 0), 2 * nv + 1, orr, os_, nk, nv, dk, dv, n, min(n, n_slots),
                  st, snap, snap_rows,
                  ws.params, pos_off, slot_off, tiled, scale, chunked=chunked, qk_norm_eps=1e-6 if raw else None)
    prog.run()
    got = ws.read(orr).reshape(n, os_)
    assert np.isnan(got[:, nv * dv:]).all()
    hm = rh.head_map(nv, nk, tiled)
    g, beta = rh.gdn_gates(ab[:, :nv], ab[:, nv:2 * nv], A, dt)
    want_S = S0.astype(np.float64).copy()
    want_o = np.zeros((n, nv, dv))
    snaps = []
    for slot, p0, a, b in _groups(slots, positions):
        s = np.zeros((nv, dk, dv)) if p0 == 0 else S0[slot].transpose(0, 2, 1)
        o, s, states = rh.delta_rule_recurrent(qk[a:b, 0][:, hm], qk[a:b, 1][:, hm], v[a:b], g[a:b], beta[a:b],
                                               s, scale)
        want_o[a:b] = o
        want_S[slot] = s.transpose(0, 2, 1)
        snaps.extend(states)
    _close(got[:, :nv * dv].reshape(n, nv, dv), want_o, atol_scale=1e-5)
    _close(ws.read(st).reshape(S0.shape), want_S, atol_scale=1e-5)
    if not snap_rows:
        return
    got_snap = ws.read(snap).reshape(snap_rows, nv, dv, dk)
    _close(got_snap, np.stack(snaps[:snap_rows]).transpose(0, 1, 3, 2), atol_scale=1e-5)


def _gated_case(ws, rng, slots, positions, nk, nv, dk, dv):
    """The inputs of a delta rule step with its gated norm after it, on the
    device: raw q|k (rows of conv, then v), alpha|beta, the gate z (5 words
    in, rows nv * dv + 5 apart), A, dt_bias and the norm weight in one weight
    buffer, 4 slots' initial states S0, zeroed counters; gnorm() the GatedNorm."""
    from types import SimpleNamespace

    from vkengine.kernels.delta_rule import GatedNorm
    n = len(slots)
    c = SimpleNamespace(n=n, groups=len(list(_groups(slots, positions))))
    c.pos_off, c.slot_off = _rows_params(ws, slots, positions)
    c.qk = (rng.standard_normal((n, 2, nk, dk)) * 3.0).astype(np.float32)
    c.v = rng.standard_normal((n, nv, dv)).astype(np.float32)
    conv = np.concatenate([c.qk.reshape(n, -1), c.v.reshape(n, -1)], 1)
    c.cs = conv.shape[1]
    c.ab = rng.standard_normal((n, 2 * nv)).astype(np.float32)
    c.z = (rng.standard_normal((n, nv * dv + 5)) * 2).astype(np.float32)
    c.A = -np.exp(rng.uniform(-1, 1, nv)).astype(np.float32)
    c.dt = rng.standard_normal(nv).astype(np.float32)
    c.w = rng.standard_normal(dv).astype(np.float32)
    c.S0 = (rng.standard_normal((4, nv, dv, dk)) * 0.5).astype(np.float32)
    c.wr = ws.weight_region(np.concatenate([c.A, c.dt, c.w]))
    c.cr, c.abr, c.zr = ws.act_region(conv.size, conv), ws.act_region(c.ab.size, c.ab), ws.act_region(c.z.size, c.z)
    c.sync = ws.act_region(c.groups * nv, np.zeros(c.groups * nv, np.float32))
    c.gnorm = lambda: GatedNorm(c.wr.at(2 * nv, dv), c.zr.at(5, c.z.size - 5), nv * dv + 5, 1e-6, c.sync)
    return c


def _gated_want(c, slots, positions, nk, nv, dk, dv, tiled):
    """numpy's (gated norm of the delta rule's output [n][nv][dv], the slots'
    states after the step [slot][nv][dv][dk]) for a _gated_case."""
    n = c.n
    qkn = rh.l2_norm(c.qk.astype(np.float64))
    hm = rh.head_map(nv, nk, tiled)
    g, beta = rh.gdn_gates(c.ab[:, :nv], c.ab[:, nv:], c.A, c.dt)
    want_o, want_S = np.zeros((n, nv, dv)), c.S0.astype(np.float64)
    for slot, p0, a, b in _groups(slots, positions):
        s0 = np.zeros((nv, dk, dv)) if p0 == 0 else c.S0[slot].transpose(0, 2, 1)
        want_o[a:b], s1, _ = rh.delta_rule_recurrent(qkn[a:b, 0][:, hm], qkn[a:b, 1][:, hm], c.v[a:b], g[a:b],
                                                     beta[a:b], s0, dk ** -0.5)
        want_S[slot] = s1.transpose(0, 2, 1)
    return rh.gated_rms_norm(want_o, c.z[:, 5:].reshape(n, nv, dv), c.w, 1e-6), want_S


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("short", [0, 8])
def test_delta_rule_e4_equals_the_16_entry_form(device, hk, ws, rng, monkeypatch, fused, short):
    """The row kernel's "_e4" variants (4 state entries a lane, taken where a key
    head fits 4 x the subgroup: fewer registers) give the outputs, states and
    snapshots of the 16-entry form bit for bit, with the gated norm fused or
    not, at dk = 4 x subgroup and short of it."""
    from vkengine.kernels import delta_rule as dr
    dk = 4 * hk.min_subgroup() - short
    nk, nv, dv = 2, 4, 24
    c = _gated_case(ws, rng, STEP_SLOTS, STEP_POS, nk, nv, dk, dv)
    n, snap_rows = c.n, 6
    out = []
    for e4 in (True, False):
        monkeypatch.setattr(dr, "DELTA_E4", 4 if e4 else 0)
        orr, st = ws.act_region(n * nv * dv), ws.act_region(c.S0.size, c.S0)
        snap = ws.act_region(snap_rows * nv * dv * dk)
        prog = device.program()
        hk.delta_rule(prog, c.wr.at(0, nv), c.wr.at(nv, nv), c.cr, c.cr.at(nk * dk, 0), c.cr.at(2 * nk * dk, 0), c.cs,
                      c.abr, c.abr.at(nv, 0), 2 * nv, orr, nv * dv, nk, nv, dk, dv, n, c.groups, st, snap, snap_rows,
                      ws.params, c.pos_off, c.slot_off, False, dk ** -0.5, chunked=False, qk_norm_eps=1e-6,
                      gnorm=c.gnorm() if fused else None)
        cols = hk.caps.delta_cols if dv % hk.caps.delta_cols == 0 else 1   # (columns a subgroup: the same bits)
        assert any(k[0] == ("delta_rule_gn" if fused else "delta_rule") + ("_e4" if e4 else "")
                   + (f"_c{cols}" if cols > 1 else "") for k in device._algorithms)
        prog.run()
        out.append([ws.read(r) for r in (orr, st, snap)])
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("e4", [False, True])
def test_delta_rule_columns_a_subgroup_agree(device, hk, ws, rng, monkeypatch, fused, e4):
    """Caps.delta_cols: the row kernel's "_c2" / "_c4" variants (2 or 4
    columns of S a subgroup, the row's k and q loaded once for them) give the
    one-column kernel's outputs, states and snapshots, with the gated norm
    fused or not (its counter taking a subgroup's columns at once), in the
    16- and 4-entry forms; a head whose columns do not divide takes one column
    a subgroup. Bit for bit on CPUs (lavapipe); within rounding on GPUs, whose
    compilers schedule the forms' sums differently (the H100: 146 of 864
    outputs apart by at most 7.5e-9, explicit fma() notwithstanding; notes.md
    run 54; run 60: one of 864 2.6e-7 apart). A model takes one form for every step, so a row's bits still do
    not depend on what else a step runs."""
    from vkengine.kernels import delta_rule as dr

    from .conftest import with_caps
    monkeypatch.setattr(dr, "DELTA_E4", 4 if e4 else 0)
    nk, nv, dk = 2, 4, 4 * hk.min_subgroup()
    for dv, want_cols in ((24, (1, 2, 4)), (6, (1, 2, 1))):
        c = _gated_case(ws, rng, STEP_SLOTS, STEP_POS, nk, nv, dk, dv)
        n, snap_rows = c.n, 6
        out = []
        for cols, used in zip((1, 2, 4), want_cols):
            kn = with_caps(hk, delta_cols=cols)
            orr, st = ws.act_region(n * nv * dv), ws.act_region(c.S0.size, c.S0)
            snap = ws.act_region(snap_rows * nv * dv * dk)
            prog = device.program()
            kn.delta_rule(prog, c.wr.at(0, nv), c.wr.at(nv, nv), c.cr, c.cr.at(nk * dk, 0), c.cr.at(2 * nk * dk, 0),
                          c.cs, c.abr, c.abr.at(nv, 0), 2 * nv, orr, nv * dv, nk, nv, dk, dv, n, c.groups, st, snap,
                          snap_rows, ws.params, c.pos_off, c.slot_off, False, dk ** -0.5, chunked=False,
                          qk_norm_eps=1e-6, gnorm=c.gnorm() if fused else None)
            name = ("delta_rule_gn" if fused else "delta_rule") + ("_e4" if e4 else "") + (f"_c{used}" if used > 1
                                                                                          else "")
            assert any(k[0] == name for k in device._algorithms), name
            prog.run()
            out.append([ws.read(r) for r in (orr, st, snap)])
            if fused:
                assert not ws.read(c.sync, np.uint32).any()
        for other in out[1:]:
            for a, b in zip(out[0], other):
                if device.info.type == "cpu":
                    np.testing.assert_array_equal(a, b)
                else:   # (outputs of order 1: the H100 once put one of 864 2.6e-7 apart, 2.1e-5 of it)
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("step", ["decode", "short", "long"])
def test_delta_rule_decode_form_finds_its_runs(device, hk, ws, rng, monkeypatch, step):
    """The row kernel's decode form (gated norm, 4 entries a lane, 2 columns a
    subgroup) finds its group's run, first and last row, by ballots over a
    subgroup's width of rows, with the grid covering min(rows, slots)
    sequences as the engine's (groups past the step's runs do nothing): a
    decode step of 4 sequences a row each (one at position 0), 3 runs in 9
    rows, 2 runs of 30 rows (the second starts past lavapipe's subgroup of 8
    rows). Against numpy; its counters left zero."""
    from vkengine.kernels import delta_rule as dr

    from .conftest import with_caps
    monkeypatch.setattr(dr, "DELTA_E4", 4)
    slots, positions = {"decode": ([3, 0, 2, 1], [17, 0, 5, 9]), "short": (STEP_SLOTS, STEP_POS),
                        "long": ([1] * 20 + [3] * 10, list(range(5, 25)) + list(range(10)))}[step]
    nk, nv, dk, dv = 2, 4, 4 * hk.min_subgroup(), 8
    c = _gated_case(ws, rng, slots, positions, nk, nv, dk, dv)
    n, groups = c.n, min(c.n, 4)
    c.sync = ws.act_region(groups * nv, np.zeros(groups * nv, np.float32))
    kn = with_caps(hk, delta_cols=2)
    orr, st = ws.act_region(n * nv * dv), ws.act_region(c.S0.size, c.S0)
    prog = device.program()
    assert kn.delta_rule(prog, c.wr.at(0, nv), c.wr.at(nv, nv), c.cr, c.cr.at(nk * dk, 0), c.cr.at(2 * nk * dk, 0),
                         c.cs, c.abr, c.abr.at(nv, 0), 2 * nv, orr, nv * dv, nk, nv, dk, dv, n, groups, st, None, 0,
                         ws.params, c.pos_off, c.slot_off, False, dk ** -0.5, chunked=False, qk_norm_eps=1e-6,
                         gnorm=c.gnorm())
    assert any(k[0] == "delta_rule_gn_e4_c2" for k in device._algorithms)
    prog.run()
    assert not ws.read(c.sync, np.uint32).any()
    got = ws.read(orr)
    want, want_S = _gated_want(c, slots, positions, nk, nv, dk, dv, False)
    _close(got.reshape(n, nv, dv), want, atol_scale=1e-4)
    _close(ws.read(st).reshape(c.S0.shape), want_S, atol_scale=1e-5)   # (slot 0's state from zero: position 0)


@pytest.mark.parametrize("tiled,nk,nv,dk,dv,long", [(False, 2, 4, 16, 12, False), (True, 1, 2, 128, 40, False),
                                                     (True, 3, 3, 24, 8, True)])
def test_delta_rule_takes_the_gated_norm(device, hk, ws, rng, tiled, nk, nv, dk, dv, long):
    """delta_rule(gnorm=...): the row kernel's GNORM form writes the gated RMSNorm
    of its output in place, bit for bit what delta_rule then gated_rms_norm give
    (and numpy's within rounding), with snapshots; its counters are left zero
    (a second run gives the same); a norm weight outside A's buffer, or a step
    of more than DELTA_NORM_ROWS rows, is not fused. long: 30 rows, runs longer
    than a subgroup is wide."""
    from vkengine.kernels.delta_rule import DELTA_NORM_ROWS, GatedNorm
    slots, positions = ([1] * 20 + [3] * 10, list(range(5, 25)) + list(range(10))) if long else (STEP_SLOTS, STEP_POS)
    c = _gated_case(ws, rng, slots, positions, nk, nv, dk, dv)
    n, snap_rows, groups, cs = c.n, 6, c.groups, c.cs
    z, w, S0 = c.z, c.w, c.S0
    wr, cr, abr, zr, sync, pos_off, slot_off = c.wr, c.cr, c.abr, c.zr, c.sync, c.pos_off, c.slot_off
    os_ = nv * dv + 2
    outs, states, snaps = [], [], []
    for form in ("unfused", "fused", "fused"):
        orr, st = ws.act_region(n * os_), ws.act_region(S0.size, S0)
        snap = ws.act_region(snap_rows * nv * dv * dk)
        gn = c.gnorm()
        prog = device.program()
        fused = hk.delta_rule(prog, wr.at(0, nv), wr.at(nv, nv), cr, cr.at(nk * dk, 0), cr.at(2 * nk * dk, 0), cs,
                              abr, abr.at(nv, 0), 2 * nv, orr, os_, nk, nv, dk, dv, n, groups, st, snap, snap_rows,
                              ws.params, pos_off, slot_off, tiled, dk ** -0.5, chunked=False, qk_norm_eps=1e-6,
                              gnorm=gn if form == "fused" else None)
        assert fused == (form == "fused")
        if not fused:
            hk.gated_rms_norm(prog, wr.at(2 * nv, dv), orr, os_, zr.at(5, z.size - 5), nv * dv + 5, orr, os_, dv, nv,
                              n, 1e-6)
        prog.run()
        got = ws.read(orr).reshape(n, os_)
        assert np.isnan(got[:, nv * dv:]).all()
        outs.append(got[:, :nv * dv])
        states.append(ws.read(st))
        snaps.append(ws.read(snap))
        assert not ws.read(sync).view(np.uint32).any()
    for i in (1, 2):
        np.testing.assert_array_equal(outs[i], outs[0])
        np.testing.assert_array_equal(states[i], states[0])
        np.testing.assert_array_equal(snaps[i], snaps[0])
    want = _gated_want(c, slots, positions, nk, nv, dk, dv, tiled)[0]
    _close(outs[1].reshape(n, nv, dv), want, atol_scale=1e-4)
    # a weight in another buffer: not fused
    other = GatedNorm(ws.act_region(dv, w), zr.at(5, z.size - 5), nv * dv + 5, 1e-6, sync)
    assert not hk.delta_takes_norm(other, wr.at(0, nv), cr.buf, nv, groups)
    big = DELTA_NORM_ROWS + 1
    pos_off, slot_off = _rows_params(ws, [0] * big, range(big))
    prog = device.program()
    assert not hk.delta_rule(prog, wr.at(0, nv), wr.at(nv, nv), ws.act_region(big * cs), cr.at(nk * dk, 0),
                             cr.at(2 * nk * dk, 0), cs, abr, abr.at(nv, 0), 2 * nv, ws.act_region(big * os_), os_,
                             nk, nv, dk, dv, big, 1, ws.act_region(S0.size), None, 0, ws.params, pos_off, slot_off,
                             tiled, 1.0, chunked=False, gnorm=gn)


# -- gated attention prologue: q/k RMSNorm + partial NEOX RoPE + KV write -----------------

@pytest.mark.parametrize("hd,n_rot,k,v", [(32, 8, "f16", "f16"), (64, 16, "q8_0", "q8_0"), (128, 32, "q8_0", "f16"),
                                          (64, 16, "f16", "q8_0")])
def test_norm_rope_kv(device, hk, ws, rng, hd, n_rot, k, v):
    """q normed and rotated to q_out, k normed and rotated and v into the cache
    at each row's (slot, position): f16, or q8_0 blocks as llama.cpp's
    quantizer makes them of the same floats; nothing else of the cache written."""
    rows, H, Hkv, ctx, n_slots = 5, 4, 2, 30, 3
    types = KVTypes(k, v)
    table = rope_table(ctx, n_rot, 10000.0)
    wq = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    wk = (1 + 0.3 * rng.standard_normal(hd)).astype(np.float32)
    wreg = ws.weight_region(np.concatenate([table.reshape(-1), wq, wk]))
    tr, wqr, wkr = wreg.at(0, table.size), wreg.at(table.size, hd), wreg.at(table.size + hd, hd)
    width = 2 * H * hd + 2 * Hkv * hd
    qkv = (rng.standard_normal((rows, width)) * 2).astype(np.float32)
    slots = np.array([1, 1, 1, 0, 2], np.uint32)
    pos = np.array([4, 5, 6, 0, 29], np.uint32)
    pos_off, slot_off = _rows_params(ws, slots, pos)
    stride = width + 4
    qr = ws.act_region(rows * stride, np.pad(qkv, ((0, 0), (0, 4))))
    qo = ws.act_region(rows * H * hd)
    cap = kv_util.capacity(ctx, types)
    slot_stride = kv_util.slot_words(k, cap, Hkv, hd)
    kc = ws.act_region(n_slots * slot_stride)
    vc = ws.act_region(n_slots * kv_util.slot_words(v, cap, Hkv, hd))
    prog = device.program()
    hk.norm_rope_kv(prog, tr, wqr, wkr, qr, stride, 2 * hd, 2 * H * hd, 2 * H * hd + Hkv * hd, qo, H * hd, rows,
                    H, Hkv, hd, n_rot, kc, vc, slot_stride, ws.params, pos_off, slot_off, 1e-6, kv_types=types)
    prog.run()
    q = qkv[:, :2 * H * hd].reshape(rows, H, 2, hd)[:, :, 0]
    kk = qkv[:, 2 * H * hd: 2 * H * hd + Hkv * hd].reshape(rows, Hkv, hd)
    vv = qkv[:, 2 * H * hd + Hkv * hd:].reshape(rows, Hkv, hd)
    want_q = rh.rope_neox(rh.rms_norm(q, wq, 1e-6), pos[:, None], n_rot, table)
    want_k = rh.rope_neox(rh.rms_norm(kk, wk, 1e-6), pos[:, None], n_rot, table)
    _close(ws.read(qo).reshape(rows, H, hd), want_q)
    kv_util.check_written(ws.read(kc, np.uint32), k, want_k, slots, pos, n_slots, cap, Hkv, hd, tol=2e-3)
    kv_util.check_written(ws.read(vc, np.uint32), v, vv, slots, pos, n_slots, cap, Hkv, hd)


# -- MoE routing and experts ----------------------------------------------------------------

@pytest.mark.parametrize("fixed", [False, True])
@pytest.mark.parametrize("E, k", [(37, 5), (300, 10)])   # 300: more than 32 experts a lane on lavapipe's 8 lanes
def test_moe_router(device, hk, ws, rng, fixed, E, k):
    rows, D = 7, 24
    h = rng.standard_normal((rows, D)).astype(np.float32)
    w = rng.standard_normal((E, D)).astype(np.float32)
    if fixed:
        h[3] = 0.0                                   # row 3: every logit exactly 0, all tied
        logits = rh.router_logits_serial(h, w)
    else:
        logits = (h.astype(np.float64) @ w.T).astype(np.float32)
        logits[3, [10, 20, 30]] = logits[3].max() + 1.0   # a three-way tie at the top
    hr = ws.act_region(h.size, h)
    lr = ws.act_region(rows * E, None if fixed else logits)
    yr = ws.act_region(rows * 2 * k)
    rec = ws.act_region(rows * (k + 3))
    prog = device.program()
    fx = (ws.weight_region(w), hr, D, D) if fixed else None
    hk.moe_router(prog, lr, E, yr, 2 * k, E, k, rows, 1.5, rec, k + 3, fixed=fx)
    prog.run()
    out = ws.read(yr).reshape(rows, 2 * k)
    ids = out[:, :k].view(np.uint32)
    want_ids, want_w = rh.route(logits, k, 1.5)
    np.testing.assert_array_equal(ids, want_ids)
    _close(out[:, k:], want_w, atol_scale=1e-6)
    np.testing.assert_array_equal(ws.read(rec).reshape(rows, k + 3)[:, :k].view(np.uint32), want_ids)
    if fixed:   # the logits it computed are bit-exact against the serial float32 order
        np.testing.assert_array_equal(ws.read(lr).reshape(rows, E), logits)


@pytest.mark.parametrize("wt", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("E, k, n", [(37, 5, 1), (256, 8, 3), (300, 10, 4)])
def test_router_matvec_chooses_the_experts(device, mvk, ws, rng, wt, E, k, n):
    """mul_mat(route=...): the GPUs' split-K router matvec (lavapipe, their caps
    forced) writes the logits and, by its last workgroup, each row's experts and
    weights: bit for bit what the same matvec then moe_router give, for 1-4
    rows; its counter is left zero (a second run gives the same)."""
    from vkengine.kernels import RouteOut

    if E > 64 * mvk.min_subgroup():
        pytest.skip(f"{E} experts: more than this device's router takes")
    D = 64
    mat, _ = _matrix(ws, rng, wt, E, D)
    h = rng.standard_normal((n, D)).astype(np.float32)
    hr = ws.act_region(h.size, h)
    ls, rs = E + 3, 2 * k + 1
    sync = ws.act_region(1, np.zeros(1, np.float32))
    got = []
    for form in ("apart", "fused", "fused"):
        lr, rr = ws.act_region(n * ls), ws.act_region(n * rs)
        prog = device.program()
        rt = RouteOut(rr, rs, k, 1.5, sync)
        assert mvk.fuses_route(mat, n, lr, ls, rt)
        if form == "fused":
            mvk.mul_mat(prog, mat, hr, D, lr, ls, n, route=rt)
        else:
            mvk.mul_mat(prog, mat, hr, D, lr, ls, n)
            mvk.moe_router(prog, lr, ls, rr, rs, E, k, n, 1.5)
        prog.run()
        got.append((ws.read(lr).reshape(n, ls)[:, :E], ws.read(rr).reshape(n, rs)[:, :2 * k]))
        assert not ws.read(sync).view(np.uint32).any()
    for lg, rt_ in got[1:]:
        np.testing.assert_array_equal(lg, got[0][0])
        np.testing.assert_array_equal(rt_.view(np.uint32), got[0][1].view(np.uint32))
    want_ids, want_w = rh.route(got[0][0], k, 1.5)
    np.testing.assert_array_equal(got[1][1][:, :k].view(np.uint32), want_ids)
    _close(got[1][1][:, k:], want_w, atol_scale=1e-6)
    # not for 5 rows (no epilogue variant), nor a weight type without ROUTE variants
    assert not mvk.fuses_route(mat, 5, lr, ls, rt)
    assert not mvk.fuses_route(_matrix(ws, rng, "q4_0", E, D)[0], n, lr, ls, rt)


@pytest.mark.parametrize("wt", ["q4_0", "q8_0", "f16"])
@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_matvec_gated_by_a_sigmoid(device, mvk, ws, rng, wt, n):
    """mul_mat(gate=...) on the GPUs' split-K matvecs (lavapipe, their caps
    forced): y[c] += sigmoid(g[c]) * (W @ x[c]), within rounding of sigmoid_mul
    then the matvec (Qwen3.5's shared expert), and each column bit for bit what
    it gives alone (steps of any size below the tiled matmuls take it)."""
    M, K = 40, 64
    mat, wf = _matrix(ws, rng, wt, M, K)
    assert mvk.fuses_gate(mat, n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    g = rng.standard_normal((n, 3)).astype(np.float32) * 2
    y0 = rng.standard_normal((n, M + 4)).astype(np.float32)
    xr, gr = ws.act_region(x.size, x), ws.act_region(g.size, g)
    yf, yu = ws.act_region(y0.size, y0), ws.act_region(y0.size, y0)
    xu = ws.act_region(x.size, x)
    prog = device.program()
    mvk.mul_mat(prog, mat, xr, K, yf, M + 4, n, accumulate=True, gate=(gr, 3))
    mvk.sigmoid_mul(prog, xu, K, gr, 3, K, 0, 0, xu, K, K, n)
    mvk.mul_mat(prog, mat, xu, K, yu, M + 4, n, accumulate=True)
    prog.run()
    got, unfused = ws.read(yf).reshape(n, M + 4), ws.read(yu).reshape(n, M + 4)
    want = y0[:, :M] + rh.sigmoid(g[:, :1]) * (x.astype(np.float64) @ wf.astype(np.float64).T)
    _close(got[:, :M], want, atol_scale=1e-5)
    _close(got[:, :M], unfused[:, :M], atol_scale=1e-6)
    np.testing.assert_array_equal(got[:, M:], y0[:, M:])
    for c in range(n):   # each column alone
        y1 = ws.act_region(M + 4, y0[c])
        prog = device.program()
        mvk.mul_mat(prog, mat, xr.at(c * K, K), K, y1, M + 4, 1, accumulate=True, gate=(gr.at(c * 3, 3), 3))
        prog.run()
        np.testing.assert_array_equal(ws.read(y1)[:M], got[c, :M])


@pytest.mark.parametrize("wt", ["q4_0", "q8_0", "f16"])
@pytest.mark.parametrize("slots,pos", [([2], [7]), ([0, 3], [0, 40]), ([1, 1, 1], [5, 6, 7]),
                                       ([2, 2, 0, 3], [8, 9, 0, 12])])
def test_matvec_takes_the_conv1d(device, mvk, ws, rng, wt, slots, pos):
    """mul_mat(conv=...) on the GPUs' split-K matvecs (lavapipe, their caps
    forced): a Gated DeltaNet input projection's first C rows go through the
    causal conv1d + SiLU with each slot's window (rows of one slot in order,
    fresh at position 0) and snapshots; bit for bit what the matvec then
    conv1d.comp give (outputs, windows, snapshots); the other rows as the
    matvec writes them. With Caps.mv_cols 2 the step's columns stay in one
    workgroup's group (a slot's run of 3 rows would cross 2-column groups)."""
    from vkengine.kernels import ConvOut

    n, n_slots, C, extra, K, D = len(slots), 4, 24, 10, 4, 64
    M = C + extra
    mat, _ = _matrix(ws, rng, wt, M, D)
    x = rng.standard_normal((n, D)).astype(np.float32)
    xr = ws.act_region(x.size, x)
    cw = ws.weight_region(rng.standard_normal((C, K)).astype(np.float32))
    st0 = rng.standard_normal((n_slots, K - 1, C)).astype(np.float32)
    pos_off, slot_off = _rows_params(ws, slots, pos)
    from .conftest import with_caps
    outs = []
    for fused, pre, cols in ((False, False, 8), (True, False, 8), (True, True, 8), (True, True, 2)):
        kn = with_caps(mvk, conv_pre=pre, mv_cols=cols)   # pre: Caps.conv_pre (windows loaded first)
        lin, cout = ws.act_region(n * (M + 2)), ws.act_region(n * (C + 3))
        st, snap = ws.act_region(st0.size, st0), ws.act_region(n * (K - 1) * C)
        cv = ConvOut(cw, C, K, cout, C + 3, st, snap, n, ws.params, pos_off, slot_off)
        assert mvk.fuses_conv(mat, n, lin, cv)
        prog = device.program()
        if fused:
            kn.mul_mat(prog, mat, xr, D, lin, M + 2, n, conv=cv)
        else:
            mvk.mul_mat(prog, mat, xr, D, lin, M + 2, n)
            mvk.conv1d(prog, cw, lin, M + 2, cout, C + 3, C, K, n, st, snap, n, ws.params, pos_off, slot_off,
                      by_rows=False)
        prog.run()
        outs.append((ws.read(lin).reshape(n, M + 2)[:, C:M], ws.read(cout).reshape(n, C + 3)[:, :C], ws.read(st),
                     ws.read(snap)))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(b, a)
    assert not mvk.fuses_conv(mat, 5, lin, cv)


@pytest.mark.parametrize("wt", ["q4_0", "mxfp4", "f32"])
@pytest.mark.parametrize("n", [1, 3])
def test_matvec_takes_the_bias(device, mvk, ws, rng, wt, n):
    """mul_mat(bias=...) on the GPUs' split-K matvecs (lavapipe, their caps
    forced): y = W x + b bit for bit as the matvec then add_bias; and with the
    residual add and the RMSNorm after it (gpt-oss's output projection,
    matmul_norm's fused form) bit for bit as matvec, add_bias, add, rms_norm."""
    M, K = 40, 64
    mat, wf = _matrix(ws, rng, wt, M, K)
    assert mvk.fuses_bias(mat, n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    b = rng.standard_normal(M + 3).astype(np.float32)
    res = rng.standard_normal((n, M)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(M)).astype(np.float32)
    xr, br, nwr = ws.act_region(x.size, x), ws.weight_region(b), ws.weight_region(nw)
    yf, yu = ws.act_region(n * M), ws.act_region(n * M)
    prog = device.program()
    mvk.mul_mat(prog, mat, xr, K, yf, M, n, bias=br.at(3, M))
    mvk.mul_mat(prog, mat, xr, K, yu, M, n)
    mvk.add_bias(prog, br.at(3, M), yu, M, M, n)
    # the output projection's form: x += (W att + b), then h = rms_norm(x)
    xf, xu, t = ws.act_region(res.size, res), ws.act_region(res.size, res), ws.act_region(n * M)
    hf, hu = ws.act_region(n * M), ws.act_region(n * M)
    sync = ws.act_region(1, np.zeros(1, np.float32))
    norm = NormOut(nwr, hf, M, sync, 1e-6)
    assert mvk.fuses_norm(mat, n, xf, M, norm)
    mvk.mul_mat(prog, mat, xr, K, xf, M, n, accumulate=True, norm=norm, bias=br.at(3, M))
    mvk.mul_mat(prog, mat, xr, K, t, M, n)
    mvk.add_bias(prog, br.at(3, M), t, M, M, n)
    mvk.add(prog, xu, M, t, M, xu, M, M, n)
    mvk.rms_norm(prog, nwr, xu, M, hu, M, M, n, 1e-6, ws.params)
    prog.run()
    want = x.astype(np.float64) @ wf.astype(np.float64).T + b[3:]
    _close(ws.read(yf).reshape(n, M), want, atol_scale=1e-5)
    for a, c in ((yf, yu), (xf, xu), (hf, hu)):
        np.testing.assert_array_equal(ws.read(a), ws.read(c))
    assert ws.read(sync, np.uint32)[0] == 0


@pytest.mark.parametrize("wt", ["mxfp4", "q8_0"])
def test_fused_expert_matvecs_take_biases_and_the_clamped_swiglu(device, hk, ws, rng, wt):
    """gpt-oss's experts in the decode rows' fused expert matvecs: gate|up with
    each expert's bias and the clamped SwiGLU (GLU), down with its bias and the
    router-weighted sum into the residual (COMBINE), bit for bit what the plain
    matvecs, moe_bias, swiglu (OAI) and moe_combine give."""
    from .conftest import with_caps
    hk = with_caps(hk, mvid_splitk=False)   # mul_mv_id's epilogues (GPUs default to mul_mvk_id's: their own test)
    E, F, K, D, Kd, k, n = 5, 16, 64, 32, 32, 2, 3
    raw_gu, _ = random_quantized(wt, E * 2 * F, K, rng)
    raw_dn, _ = random_quantized(wt, E * D, Kd, rng)
    gu_m, dn_m = upload_matrix(ws, wt, raw_gu, E * 2 * F, K), upload_matrix(ws, wt, raw_dn, E * D, Kd)
    bgu = ws.weight_region(rng.standard_normal(E * 2 * F).astype(np.float32))
    bdn = ws.weight_region(rng.standard_normal(E * D).astype(np.float32))
    ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.uint32)
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    rs = 2 * k
    rr = ws.act_region(n * rs, np.concatenate([ids.view(np.float32), wts], 1))
    h = rng.standard_normal((n, K)).astype(np.float32) * 2
    hr = ws.act_region(h.size, h)
    oai = (1.702, 7.0)
    ff, ff_ref, gu = ws.act_region(n * k * F), ws.act_region(n * k * F), ws.act_region(n * k * 2 * F)
    prog = device.program()
    hk.mul_mat_id(prog, gu_m, 2 * F, hr, K, 0, rr, rs, k, ff, k * F, F, n, epilogue="glu", bias=bgu, oai=oai)
    hk.mul_mat_id(prog, gu_m, 2 * F, hr, K, 0, rr, rs, k, gu, k * 2 * F, 2 * F, n)
    hk.moe_bias(prog, bgu, 2 * F, rr, rs, k, gu, k * 2 * F, 2 * F, n)
    hk.swiglu(prog, gu, 2 * F, ff_ref, F, F, n * k, oai=oai)
    prog.run()
    np.testing.assert_array_equal(ws.read(ff), ws.read(ff_ref))
    # down: x per slot (Kd wide), bias, the weighted sum into the residual
    xs = rng.standard_normal((n, k, Kd)).astype(np.float32)
    xsr = ws.act_region(xs.size, xs)
    res = rng.standard_normal((n, D)).astype(np.float32)
    y, y_ref, dn = ws.act_region(res.size, res), ws.act_region(res.size, res), ws.act_region(n * k * D)
    prog = device.program()
    hk.mul_mat_id(prog, dn_m, D, xsr, k * Kd, Kd, rr, rs, k, y, D, 0, n, epilogue="combine", bias=bdn)
    hk.mul_mat_id(prog, dn_m, D, xsr, k * Kd, Kd, rr, rs, k, dn, k * D, D, n)
    hk.moe_bias(prog, bdn, D, rr, rs, k, dn, k * D, D, n)
    hk.moe_combine(prog, dn, k * D, D, rr, rs, k, y_ref, D, D, n)
    prog.run()
    np.testing.assert_array_equal(ws.read(y), ws.read(y_ref))


def test_moe_bias(device, hk, ws, rng):
    """Each routed expert's bias row (gpt-oss) added to its slot of a row's
    expert outputs, the expert id from the router's route words."""
    E, M, k, n = 6, 37, 3, 5
    b = rng.standard_normal((E, M)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.uint32)
    route = np.concatenate([ids.view(np.float32), rng.uniform(0.1, 1, (n, k)).astype(np.float32)], 1)
    y = rng.standard_normal((n, k * M + 3)).astype(np.float32)
    br, rr, yr = ws.weight_region(b), ws.act_region(route.size, route), ws.act_region(y.size, y)
    prog = device.program()
    hk.moe_bias(prog, br, M, rr, 2 * k, k, yr, k * M + 3, M, n)
    prog.run()
    want = y.copy()
    for r in range(n):
        for i in range(k):
            want[r, i * M:(i + 1) * M] += b[ids[r, i]]
    np.testing.assert_array_equal(ws.read(yr).reshape(n, -1), want)


@pytest.mark.parametrize("n, k, E, bn", [(1, 8, 256, 8), (5, 3, 9, 8), (300, 8, 37, 64), (700, 4, 130, 32)])
def test_moe_sort(device, hk, ws, rng, n, k, E, bn):
    """moe_sort's lists against numpy: each expert's pairs r*k + i in increasing
    order (runs of pairs longer than a subgroup's unrolled reads, experts of
    none, one and many pairs, more experts than a workgroup's subgroups), the
    counts, and the tiled matmuls' work list in (expert, block) order."""
    ids = np.stack([rng.choice(E - 2, k, replace=False) for _ in range(n)]).astype(np.uint32)  # last two: none
    ids[n // 2, 0] = E - 1                                                   # ... but the last gets one
    hot = min(5, E - 3)
    ids[:, k - 1] = np.where((ids[:, :k - 1] == hot).any(1), ids[:, k - 1], hot)   # one expert of ~every row
    rs = 2 * k + 1
    route = np.concatenate([ids.view(np.float32), np.ones((n, k + 1), np.float32)], 1)
    rr = ws.act_region(route.size, route)
    ls = E + 3
    lst, cnt = ws.act_region(n * k * ls), ws.act_region(E)
    blk = ws.act_region(1 + hk.expert_blocks(n * k, E, bn))
    prog = device.program()
    hk.moe_sort(prog, rr, rs, k, n, E, lst, ls, cnt, blocks=(blk, bn))
    prog.run()
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=E)
    np.testing.assert_array_equal(ws.read(cnt, np.uint32), counts)
    lists = ws.read(lst, np.uint32).reshape(n * k, ls)
    for e in range(E):
        np.testing.assert_array_equal(lists[:counts[e], e], np.flatnonzero(flat == e), err_msg=f"expert {e}")
    want = [(e << 16) | b for e in range(E) for b in range(-(-int(counts[e]) // bn))]
    words = ws.read(blk, np.uint32)
    assert words[0] == len(want)
    np.testing.assert_array_equal(words[1:1 + len(want)], want)


@pytest.mark.parametrize("wt", ["f32", "f16", "q8_0", "q4_0", "q4_k", "q6_k", "mxfp4", "iq4_nl", "iq4_xs"])
@pytest.mark.parametrize("batched", [False, True])
def test_expert_matmuls_and_combine(device, hk, ws, rng, wt, batched):
    """gate/up (x shared by a row's experts) and down (one x per pair) products,
    by one matvec per pair or expert-major over moe_sort's lists, then the
    weighted sum into a residual."""
    E, M, k, n = 6, 19, 3, 13
    K = 256 if wt in ("q4_k", "q6_k", "iq4_xs") else 64
    raw, wf = random_quantized(wt, E * M, K, rng)
    mat = upload_matrix(ws, wt, raw, E * M, K)
    W = wf.reshape(E, M, K).astype(np.float64)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.uint32)
    ids[3] = [5, 0, 2]                                     # expert 1 is used by some rows, 4 maybe by none
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    rs = 2 * k + 2
    route = np.concatenate([ids.view(np.float32), wts, np.zeros((n, 2), np.float32)], 1)
    rr = ws.act_region(route.size, route)
    lst, cnt = ws.act_region(n * (E + 1)), ws.act_region(E)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs = rng.standard_normal((n, k, K)).astype(np.float32)
    xr, xsr = ws.act_region(x.size, x), ws.act_region(xs.size, xs)
    ys = k * M + 4
    yr, y2 = ws.act_region(n * ys), ws.act_region(n * ys)
    prog = device.program()
    if batched:
        hk.moe_sort(prog, rr, rs, k, n, E, lst, E + 1, cnt)
        hk.mul_mm_id(prog, mat, M, E, xr, K, 0, lst, E + 1, cnt, k, yr, ys, M, n)
        hk.mul_mm_id(prog, mat, M, E, xsr, k * K, K, lst, E + 1, cnt, k, y2, ys, M, n)
    else:
        hk.mul_mat_id(prog, mat, M, xr, K, 0, rr, rs, k, yr, ys, M, n)
        hk.mul_mat_id(prog, mat, M, xsr, k * K, K, rr, rs, k, y2, ys, M, n)
    res = rng.standard_normal((n, M)).astype(np.float32)
    resr = ws.act_region(res.size, res)
    hk.moe_combine(prog, y2, ys, M, rr, rs, k, resr, M, M, n)
    prog.run()
    tol = 1e-5 * np.sqrt(K)
    got = ws.read(yr).reshape(n, ys)
    _close(got[:, :k * M].reshape(n, k, M), np.einsum("rimk,rk->rim", W[ids], x.astype(np.float64)), atol_scale=tol)
    assert np.isnan(got[:, k * M:]).all()
    down = np.einsum("rimk,rik->rim", W[ids], xs.astype(np.float64))
    _close(ws.read(y2).reshape(n, ys)[:, :k * M].reshape(n, k, M), down, atol_scale=tol)
    _close(ws.read(resr).reshape(n, M), res + np.einsum("ri,rim->rm", wts.astype(np.float64), down), atol_scale=tol)
    if batched:
        counts = ws.read(cnt, np.uint32)
        np.testing.assert_array_equal(counts, np.bincount(ids.reshape(-1), minlength=E))


@pytest.mark.parametrize("wt", ["f32", "q8_0", "q4_0", "q4_k", "mxfp4"])
def test_expert_matvec_epilogues(device, hk, ws, rng, wt):
    """Decode rows' routed experts with the fused epilogues: gate|up's matvec
    with the SwiGLU (each expert's rows gate over up) and down's with the
    router-weighted sum into the residual, against numpy and, bit for bit,
    against the unfused kernels (mul_mv_id, swiglu, moe_combine)."""
    from .conftest import with_caps
    hk = with_caps(hk, mvid_splitk=False)   # mul_mv_id's epilogues (GPUs default to mul_mvk_id's: their own test)
    E, F, D, k, n = 7, 24, 40, 3, 5
    K = 256 if wt == "q4_k" else 64
    raw_gu, wgu = random_quantized(wt, E * 2 * F, K, rng)
    Kd = K                                   # down's input width (its x is its own here: weight blocks need K)
    raw_dn, wdn = random_quantized(wt, E * D, Kd, rng)
    gu_m = upload_matrix(ws, wt, raw_gu, E * 2 * F, K)
    dn_m = upload_matrix(ws, wt, raw_dn, E * D, Kd)
    Wgu = wgu.reshape(E, 2 * F, K).astype(np.float64)
    Wdn = wdn.reshape(E, D, Kd).astype(np.float64)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.uint32)
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    rs = 2 * k + 1
    route = np.concatenate([ids.view(np.float32), wts, np.zeros((n, 1), np.float32)], 1)
    rr = ws.act_region(route.size, route)
    h = rng.standard_normal((n, K)).astype(np.float32)
    hr = ws.act_region(h.size, h)
    ff, ff_ref = ws.act_region(n * k * F), ws.act_region(n * k * F)
    gu = ws.act_region(n * k * 2 * F)
    xs = rng.standard_normal((n, k, Kd)).astype(np.float32)
    xsr = ws.act_region(xs.size, xs)
    res = rng.standard_normal((n, D)).astype(np.float32)
    y, y_ref, dn = ws.act_region(res.size, res), ws.act_region(res.size, res), ws.act_region(n * k * D)
    prog = device.program()
    hk.mul_mat_id(prog, gu_m, 2 * F, hr, K, 0, rr, rs, k, ff, k * F, F, n, epilogue="glu")
    hk.mul_mat_id(prog, dn_m, D, xsr, k * Kd, Kd, rr, rs, k, y, D, 0, n, epilogue="combine")
    hk.mul_mat_id(prog, gu_m, 2 * F, hr, K, 0, rr, rs, k, gu, k * 2 * F, 2 * F, n)
    hk.swiglu(prog, gu, 2 * F, ff_ref, F, F, n * k)
    hk.mul_mat_id(prog, dn_m, D, xsr, k * Kd, Kd, rr, rs, k, dn, k * D, D, n)
    hk.moe_combine(prog, dn, k * D, D, rr, rs, k, y_ref, D, D, n)
    # and with the RMSNorm after the residual add (the next layer's input) by its last workgroup, twice (the
    # counter left zero for the next dispatch), on kernels whose rms_norm is a workgroup a row (GPUs'; forced
    # here), which it must equal bit for bit
    from .conftest import kernels_for
    kn = kernels_for(device, split_k=True, mvid_splitk=False)
    nw = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    ynorm, hs = ws.act_region(res.size, res), D + 4
    h_out, h_ref = ws.act_region(n * hs), ws.act_region(n * hs)
    sync = ws.act_region(n, np.zeros(n, np.float32))   # (a counter a row)
    nwr = ws.weight_region(nw)
    norm = NormOut(nwr, h_out, hs, sync, 1e-6)
    assert kn.combine_takes_norm(D, ynorm, D, norm)
    assert hk.combine_takes_norm(D, ynorm, D, norm) == hk.caps.split_k   # (a subgroup a row elsewhere: not fused)
    for _ in range(2):
        kn.mul_mat_id(prog, dn_m, D, xsr, k * Kd, Kd, rr, rs, k, ynorm, D, 0, n, epilogue="combine", norm=norm)
    kn.rms_norm(prog, nwr, ynorm, D, h_ref, hs, D, n, 1e-6, ws.params)
    prog.run()
    g = np.einsum("rifk,rk->rif", Wgu[ids][:, :, :F], h.astype(np.float64))
    u = np.einsum("rifk,rk->rif", Wgu[ids][:, :, F:], h.astype(np.float64))
    tol = 1e-5 * np.sqrt(K)
    _close(ws.read(ff).reshape(n, k, F), g / (1 + np.exp(-g)) * u, atol_scale=tol)
    want = res + np.einsum("ri,rim->rm", wts.astype(np.float64), np.einsum("rimk,rik->rim", Wdn[ids], xs))
    _close(ws.read(y).reshape(n, D), want, atol_scale=tol)
    # bit for bit as the unfused kernels (a server's rows equal whatever path their step took)
    np.testing.assert_array_equal(ws.read(ff), ws.read(ff_ref))
    np.testing.assert_array_equal(ws.read(y), ws.read(y_ref))
    y2 = ws.read(ynorm).reshape(n, D).astype(np.float64)
    _close(y2, res + 2 * (want - res), atol_scale=2 * tol)
    hn = y2 / np.sqrt((y2 * y2).mean(1, keepdims=True) + 1e-6) * nw
    _close(ws.read(h_out).reshape(n, hs)[:, :D], hn, atol_scale=1e-5)
    np.testing.assert_array_equal(ws.read(h_out).reshape(n, hs)[:, :D], ws.read(h_ref).reshape(n, hs)[:, :D])
    assert not ws.read(sync, np.uint32).any()


@pytest.mark.parametrize("wt,bfly,D,cn_rows", [("q4_0", True, 36, True), ("q4_0", True, 36, False),
                                               ("q4_0", False, 38, True), ("q8_0", True, 36, True),
                                               ("f16", False, 36, True), ("q4_k", True, 38, True),
                                               ("mxfp4", True, 36, True)])
def test_splitk_expert_matvecs(device, ws, rng, wt, bfly, D, cn_rows):
    """Caps.mvid_splitk (mul_mvk_id.comp: the fused expert matvecs in mul_mvk's
    split-K form): gate|up with the SwiGLU and down with the weighted sum into
    the residual against numpy, with gpt-oss's biases and clamped SwiGLU, the
    RMSNorm after the sum (D a multiple of 4; D = 38 without it; by each row's
    last workgroup, or with Caps.cn_rows off by the last of all), output rows
    that end part way through a workgroup's RPS, and each row of a batch bit
    for bit what it gives alone."""
    from .conftest import kernels_for
    kn = kernels_for(device, split_k=True, mvid_splitk=True, bfly=bfly, cn_rows=cn_rows)
    E, F, k, n = 7, 21, 3, 4
    with_norm = D % 4 == 0
    K = 512 if wt == "q4_k" else 416
    raw_gu, wgu = random_quantized(wt, E * 2 * F, K, rng)
    Kd = 256 if wt == "q4_k" else 96   # down's input width (its x is its own here: weight blocks need K)
    raw_dn, wdn = random_quantized(wt, E * D, Kd, rng)
    gu_m, dn_m = upload_matrix(ws, wt, raw_gu, E * 2 * F, K), upload_matrix(ws, wt, raw_dn, E * D, Kd)
    Wgu = wgu.reshape(E, 2 * F, K).astype(np.float64)
    Wdn = wdn.reshape(E, D, Kd).astype(np.float64)
    bgu = rng.standard_normal(E * 2 * F).astype(np.float32)
    bdn = rng.standard_normal(E * D).astype(np.float32)
    bgur, bdnr = ws.weight_region(bgu), ws.weight_region(bdn)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.uint32)
    wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
    rs = 2 * k
    h = rng.standard_normal((n, K)).astype(np.float32)
    xs = rng.standard_normal((n, k, Kd)).astype(np.float32)
    res = rng.standard_normal((n, D)).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(D)).astype(np.float32)
    nwr = ws.weight_region(nw)
    oai = (1.702, 7.0)
    hs = D + 4

    def run(rows: list[int], bias: bool):
        """(ff, y, h) of these rows run as one step."""
        m = len(rows)
        sub = lambda a: np.ascontiguousarray(a[rows])   # noqa: E731
        rr_ = ws.act_region(m * rs, np.concatenate([sub(ids).view(np.float32), sub(wts)], 1))
        hr_, xsr_ = ws.act_region(m * K, sub(h)), ws.act_region(m * k * Kd, sub(xs))
        ff, y = ws.act_region(m * k * F), ws.act_region(m * D, sub(res))
        h_out, sync = ws.act_region(m * hs), ws.act_region(m, np.zeros(m, np.float32))
        norm = NormOut(nwr, h_out, hs, sync, 1e-6) if with_norm else None
        assert norm is None or kn.combine_takes_norm(D, y, D, norm)
        prog = device.program()
        kn.mul_mat_id(prog, gu_m, 2 * F, hr_, K, 0, rr_, rs, k, ff, k * F, F, m, epilogue="glu",
                      bias=bgur if bias else None, oai=oai if bias else None)
        kn.mul_mat_id(prog, dn_m, D, xsr_, k * Kd, Kd, rr_, rs, k, y, D, 0, m, epilogue="combine",
                      bias=bdnr if bias else None, norm=norm)
        prog.run()
        assert not ws.read(sync, np.uint32).any()
        return (ws.read(ff).reshape(m, k, F), ws.read(y).reshape(m, D), ws.read(h_out).reshape(m, hs)[:, :D])

    for bias in (False, True):
        ff, y, hn = run(list(range(n)), bias)
        g = np.einsum("rifk,rk->rif", Wgu[ids][:, :, :F], h.astype(np.float64))
        u = np.einsum("rifk,rk->rif", Wgu[ids][:, :, F:], h.astype(np.float64))
        dn = np.einsum("rimk,rik->rim", Wdn[ids], xs)
        if bias:
            g, u = g + bgu.reshape(E, 2 * F)[ids][:, :, :F], u + bgu.reshape(E, 2 * F)[ids][:, :, F:]
            g, u = np.minimum(g, oai[1]), np.clip(u, -oai[1], oai[1])
            want_ff = g / (1 + np.exp(-oai[0] * g)) * (u + 1)
            dn = dn + bdn.reshape(E, D)[ids]
        else:
            want_ff = g / (1 + np.exp(-g)) * u
        tol = 1e-5 * np.sqrt(K)
        _close(ff, want_ff, atol_scale=tol)
        want = res + np.einsum("ri,rim->rm", wts.astype(np.float64), dn)
        _close(y, want, atol_scale=tol)
        y64 = y.astype(np.float64)
        if with_norm:
            _close(hn, y64 / np.sqrt((y64 * y64).mean(1, keepdims=True) + 1e-6) * nw, atol_scale=1e-5)
        # a row alone gives what it gives in the batch (a server's rows do not depend on their step)
        for r in (0, n - 1):
            for a, b in zip(run([r], bias), (ff, y, hn)):
                np.testing.assert_array_equal(a[0], b[r])
    from .conftest import with_caps
    want_all = run(list(range(n)), True)
    base_kn = kn
    # the gate|up's workgroup of one or two subgroups (Caps.mvid_glu_wg): its lanes split the units otherwise,
    # so its sums are rounded otherwise; the down projection's bits are unchanged; a row alone as in the batch
    sg = base_kn.caps.sg
    for wg in (sg, 2 * sg):
        kn = with_caps(base_kn, mvid_glu_wg=wg)
        got = run(list(range(n)), True)
        _close(got[0], want_all[0], atol_scale=1e-5 * np.sqrt(K))
        np.testing.assert_array_equal(got[1], want_all[1])
        np.testing.assert_array_equal(got[2], want_all[2])
        for a, b in zip(run([n - 1], True), got):
            np.testing.assert_array_equal(a[0], b[n - 1])
        assert any(k[0].startswith("mul_mvk") and "_idg" in k[0] and k[2][0] == wg for k in device._algorithms)
    # 8 or 16 weight rows a workgroup (Caps.mvid_glu_rows, mvid_combine_rows): each row's sum is the same lanes'
    # units in the same order, reduced over the same lanes, so the same bits; a row alone as in the batch (with the
    # butterfly, more rows than a subgroup's lanes keep the default's)
    for rows in (8, 16):
        for kw in (dict(mvid_glu_rows=rows), dict(mvid_combine_rows=rows)):
            kn = with_caps(base_kn, **kw)
            for a, b in zip(run(list(range(n)), True), want_all):
                np.testing.assert_array_equal(a, b)
            for a, b in zip(run([0], True), want_all):
                np.testing.assert_array_equal(a[0], b[0])
            kind = "idg" if "mvid_glu_rows" in kw else "idc"
            used = any(k[0] == f"mul_mvk{'b' if bfly else ''}_{kind}r{rows}_{wt}" for k in device._algorithms)
            assert used == (not bfly or rows <= sg), (rows, kind)


@pytest.mark.parametrize("wt", ["f32", "f16", "q8_0", "q4_0", "q4_k", "iq4_xs", "mxfp4"])
def test_unrolled_expert_matvecs_equal_the_plain(device, hk, ws, rng, wt):
    """Caps.mvid_unroll (mul_mv_id's "4" variants: 4 units a lane in flight,
    gate and up together): the plain, GLU and COMBINE expert matvecs give bit
    for bit what the one-unit loop gives, with rows whose units end part way
    through a round of the subgroup (a tail) and rows shorter than one round."""
    from .conftest import with_caps
    E, F, D, k, n = 6, 20, 36, 3, 4
    Ks = (768, 256) if wt in ("q4_k", "iq4_xs") else (416, 32)
    hk = with_caps(hk, mvid_splitk=False)   # (the unrolled variants are mul_mv_id's)
    k4 = with_caps(hk, mvid_unroll=True)
    assert not hk.caps.mvid_unroll
    for K in Ks:
        raw_gu, _ = random_quantized(wt, E * 2 * F, K, rng)
        raw_dn, _ = random_quantized(wt, E * D, K, rng)
        gu_m, dn_m = upload_matrix(ws, wt, raw_gu, E * 2 * F, K), upload_matrix(ws, wt, raw_dn, E * D, K)
        ids = np.stack([rng.permutation(E)[:k] for _ in range(n)]).astype(np.uint32)
        wts = rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)
        rs = 2 * k
        rr = ws.act_region(n * rs, np.concatenate([ids.view(np.float32), wts], 1))
        hr = ws.act_region(n * K, rng.standard_normal((n, K)).astype(np.float32))
        xsr = ws.act_region(n * k * K, rng.standard_normal((n, k, K)).astype(np.float32))
        res = rng.standard_normal((n, D)).astype(np.float32)
        out = {}
        prog = device.program()
        for name, kern in (("plain", hk), ("unrolled", k4)):
            ff, gu, y = ws.act_region(n * k * F), ws.act_region(n * k * 2 * F), ws.act_region(res.size, res)
            kern.mul_mat_id(prog, gu_m, 2 * F, hr, K, 0, rr, rs, k, ff, k * F, F, n, epilogue="glu")
            kern.mul_mat_id(prog, gu_m, 2 * F, hr, K, 0, rr, rs, k, gu, k * 2 * F, 2 * F, n)
            kern.mul_mat_id(prog, dn_m, D, xsr, k * K, K, rr, rs, k, y, D, 0, n, epilogue="combine")
            out[name] = (ff, gu, y)
        prog.run()
        for a, b in zip(out["plain"], out["unrolled"]):
            got, want = ws.read(b), ws.read(a)
            assert np.isfinite(want).all()
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["mt", "mc"])
@pytest.mark.parametrize("wt", ["q4_0", "q8_0", "f16", "q4_k", "mxfp4"])
def test_tiled_expert_matmuls(device, ws, rng, wt, kind):
    """The experts' matmuls of a prompt step in tiles (mul_mt_id; mul_mc_id on
    cooperative matrices, the GPU kit runs it) over moe_sort's work list:
    gate/up (x shared by a row's experts) and down (one x per pair) against
    numpy, with experts of more pairs than a block, of one, and of none; the
    work list holds each expert's blocks once."""
    from .conftest import kernels_for
    kn = kernels_for(device, tiled_from=2, expert_tiles=True, **({} if kind == "mc" else {"coopmat": False}))
    if kind == "mc" and not kn.caps.coopmat:
        pytest.skip("the device has no 16x16x16 f16 cooperative matrices (the GPU kernel tests run these)")
    E, M, k, n = 7, 70, 3, 150
    K = 256 if wt == "q4_k" else 96
    raw, wf = random_quantized(wt, E * M, K, rng)
    mat = upload_matrix(ws, wt, raw, E * M, K)
    W = wf.reshape(E, M, K).astype(np.float64)
    ids = np.stack([rng.permutation(5)[:k] for _ in range(n)]).astype(np.uint32)   # experts 5, 6: none
    ids[7] = [6, 0, 2]                                     # ... but 6 gets one pair
    rs = 2 * k
    route = np.concatenate([ids.view(np.float32), rng.uniform(0.1, 1.0, (n, k)).astype(np.float32)], 1)
    rr = ws.act_region(route.size, route)
    lst, cnt, blk = ws.act_region(n * (E + 1)), ws.act_region(E), ws.act_region(n * k)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs = rng.standard_normal((n, k, K)).astype(np.float32)
    xr, xsr = ws.act_region(x.size, x), ws.act_region(xs.size, xs)
    ys = k * M + 4
    yr, y2 = ws.act_region(n * ys), ws.act_region(n * ys)
    variant, _, bn = kn.expert_tile(mat)
    assert variant.startswith(f"mul_{kind}_id_")
    prog = device.program()
    kn.moe_sort(prog, rr, rs, k, n, E, lst, E + 1, cnt, blocks=(blk, bn))
    kn.mul_tiled_id(prog, mat, M, E, xr, K, 0, lst, E + 1, cnt, blk, k, yr, ys, M, n)
    kn.mul_tiled_id(prog, mat, M, E, xsr, k * K, K, lst, E + 1, cnt, blk, k, y2, ys, M, n)
    prog.run()
    counts = np.bincount(ids.reshape(-1), minlength=E)
    np.testing.assert_array_equal(ws.read(cnt, np.uint32), counts)
    words = ws.read(blk, np.uint32)
    want_blocks = sorted((e << 16) | b for e in range(E) for b in range(-(-int(counts[e]) // bn)))
    assert words[0] == len(want_blocks) and sorted(words[1:1 + words[0]]) == want_blocks
    assert max(counts) > bn                               # an expert's pairs span blocks
    # fp16 operands on the cooperative matrices (W and x rounded to 11 bits), fp32 in mul_mt
    tol = (2e-3 if kind == "mc" else 1e-5) * np.sqrt(K)
    got = ws.read(yr).reshape(n, ys)
    _close(got[:, :k * M].reshape(n, k, M), np.einsum("rimk,rk->rim", W[ids], x.astype(np.float64)), atol_scale=tol)
    assert np.isnan(got[:, k * M:]).all()
    down = np.einsum("rimk,rik->rim", W[ids], xs.astype(np.float64))
    _close(ws.read(y2).reshape(n, ys)[:, :k * M].reshape(n, k, M), down, atol_scale=tol)


@pytest.mark.parametrize("wt", ["q4_0", "q8_0", "f16", "q4_k", "mxfp4"])
@pytest.mark.parametrize("n", [2, 4, 16])
def test_expert_union_equals_per_pair(device, hk, ws, rng, wt, n):
    """Decode rows of several sequences with Caps.expert_union: mul_mm_id over
    moe_sort's work list of (expert, block of 8 pairs), each expert the rows
    share read once, gives every pair's sum bit for bit as mul_mv_id's one
    matvec per pair (a server's batched rows equal each row alone)."""
    E, M, k = 9, 37, 3
    K = 256 if wt == "q4_k" else 64
    raw, _ = random_quantized(wt, E * M, K, rng)
    mat = upload_matrix(ws, wt, raw, E * M, K)
    ids = np.stack([rng.permutation(4 if n == 16 else E)[:k] for _ in range(n)]).astype(np.uint32)  # shared
    rs = 2 * k
    route = np.concatenate([ids.view(np.float32), np.ones((n, k), np.float32)], 1)
    rr = ws.act_region(route.size, route)
    lst, cnt, blk = ws.act_region(n * (E + 1)), ws.act_region(E), ws.act_region(n * (2 * k + 1))
    xs = rng.standard_normal((n, k, K)).astype(np.float32)
    xsr = ws.act_region(xs.size, xs)
    ys = k * M
    y_pair, y_union = ws.act_region(n * ys), ws.act_region(n * ys)
    prog = device.program()
    hk.mul_mat_id(prog, mat, M, xsr, k * K, K, rr, rs, k, y_pair, ys, M, n)
    hk.moe_sort(prog, rr, rs, k, n, E, lst, E + 1, cnt, blocks=(blk, 8))
    hk.mul_mm_id(prog, mat, M, E, xsr, k * K, K, lst, E + 1, cnt, k, y_union, ys, M, n, blocks=blk)
    prog.run()
    np.testing.assert_array_equal(ws.read(y_union), ws.read(y_pair))
    words = ws.read(blk, np.uint32)
    counts = np.bincount(ids.reshape(-1), minlength=E)
    assert words[0] == sum(-(-int(c) // 8) for c in counts)
