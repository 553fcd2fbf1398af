"""Every kernel against a numpy reference: fresh random inputs, poisoned outputs
(unwritten elements are NaN and fail), sizes that are not multiples of the
workgroup or subgroup. Runs on whatever Vulkan device is present (lavapipe in
CI, the H200 through tests/gpu/run_on_gpu.sh)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from shaders.variants import (
    MC2_GLU_TILES,
    MC2_GLU_TYPES,
    MC2_K64,
    MC2_SC_F16_UNROLLS,
    MC2_TYPES,
    MC2H_TILES,
    MC2H_UNROLL,
    WEIGHT_TYPES,
)
from vkengine.kernels import KVTypes, Region, device_has_coopmat2

from . import kv_util
from . import reference as ref
from .conftest import Workspace, kernels_for, with_caps
from .quant_util import K_QUANTS, random_quantized, upload_matrix


def _cols(wt: str) -> int:
    return 512 if wt in K_QUANTS else 96


def _close(got, want, rtol=1e-4, atol_scale=1e-5):
    """float32 accumulation in a different order than the float64 reference."""
    atol = atol_scale * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


# -- readback, transfers, ordering ------------------------------------------------

def test_tiled_from_option(device):
    """Options.tiled_from (VKENGINE_TILED_FROM): the rows from which a GPU's
    steps take the tiled matmuls, 64 by default; CPUs never; 1 and below
    refused with the variable's name."""
    import types

    from vkengine.errors import VkEngineError
    from vkengine.kernels import Caps
    from vkengine.options import Options
    gpu = types.SimpleNamespace(info=dataclasses.replace(device.info, type="discrete"), features=device.features)
    assert Caps.detect(gpu).tiled_from == 64
    assert Caps.detect(gpu, Options(tiled_from=16)).tiled_from == 16
    assert Caps.detect(device, Options(tiled_from=16)).tiled_from == (None if device.info.type == "cpu" else 16)
    assert Options.from_env({"VKENGINE_TILED_FROM": "24"}).tiled_from == 24
    for bad in (1, -3):
        with pytest.raises(VkEngineError, match="VKENGINE_TILED_FROM"):
            Caps.detect(gpu, Options(tiled_from=bad))


def test_readback_host_buffer_is_a_correct_view(device):
    b = device.buffer(4 * 1000, "host", "t")
    a = b.array()
    assert a.strides == (4,) and a.shape == (1000,)
    a[:] = np.arange(1000, dtype=np.uint32)
    assert (b.array() == np.arange(1000)).all()
    device.free(b)


@pytest.mark.parametrize("nbytes", [4, 1000, 4099 * 4, 3 << 20])
def test_upload_download_roundtrip(device, rng, nbytes):
    b = device.buffer(nbytes + 64, "device", "t")
    data = rng.integers(0, 2**32, nbytes // 4, dtype=np.uint32)
    device.upload(b, data, 16)
    got = device.download(b, 16, data.size * 4, np.uint32)
    assert (got == data).all()
    device.free(b)


def test_upload_spans_staging_chunks(device, rng):
    n = device._staging.nbytes // 4 * 2 + 123
    b = device.buffer(n * 4, "device", "t")
    data = rng.integers(0, 2**32, n, dtype=np.uint32)
    device.upload(b, data)
    assert (device.download(b, 0, n * 4, np.uint32) == data).all()
    device.free(b)


def _ping_pong(device, kernels, ws, n: int, pairs: int):
    """A program of 2 x pairs dependent dispatches over n floats from zeros
    (b <- a + 1, then a <- b + 1, in turn): each run adds 2 x pairs to b.
    Returns (program, b)."""
    a = ws.act_region(n, np.zeros(n, np.float32))
    b = ws.act_region(n, np.zeros(n, np.float32))
    c = ws.act_region(n, np.ones(n, np.float32))
    prog = device.program()
    for _ in range(pairs):
        kernels.add(prog, b, n, c, n, a, n, n, 1)
        kernels.add(prog, a, n, c, n, b, n, n, 1)
    return prog, b


def test_dependent_dispatch_chain_is_ordered(device, kernels, ws, rng):
    """200 dispatches, each reading what the previous one wrote (ping-pong
    a <- b + c, b <- a + c over 1M floats): exact only if every dependency is
    ordered. The program must have recorded a barrier between each pair."""
    prog, b = _ping_pong(device, kernels, ws, 1 << 20, 100)
    assert prog.n_barriers == 199
    prog.run()
    assert (ws.read(b) == 200).all()
    prog.run()   # replay continues from the buffers' state
    assert (ws.read(b) == 400).all()


def test_fence_spin_waits_for_the_whole_program(device, kernels, ws, monkeypatch):
    """VKENGINE_FENCE_SPIN_US (patches/kp 0003): run() and submit() + wait()
    poll the fence for that long, then wait as before: a program longer than
    the spin (a dependent chain on lavapipe) and one within it both finish
    before their results are read; a bad value names the variable."""
    from vkengine.device import fence_spin_ns
    from vkengine.errors import VkEngineError
    monkeypatch.setenv("VKENGINE_FENCE_SPIN_US", "250")
    assert fence_spin_ns() == 250_000
    for bad in ("-5", "1.5", "x"):
        monkeypatch.setenv("VKENGINE_FENCE_SPIN_US", bad)
        with pytest.raises(VkEngineError, match="VKENGINE_FENCE_SPIN_US"):
            fence_spin_ns()
    monkeypatch.delenv("VKENGINE_FENCE_SPIN_US")
    assert fence_spin_ns() == 0
    if not device.can_spin:
        pytest.fail("kp lacks patches/kp/0003-fence-spin.patch: run scripts/setup.sh")
    prog, b = _ping_pong(device, kernels, ws, 1 << 18, 20)
    saved = device.fence_spin_ns
    try:
        for spin in (1_000, 10_000_000_000):   # 1 us (the chain outlasts it) and 10 s (it ends within)
            device.fence_spin_ns = spin
            prog.run()
            prog.submit()
            prog.wait()
    finally:
        device.fence_spin_ns = saved
    assert (ws.read(b) == 160).all()   # four runs of 40 additions


def test_independent_dispatches_get_no_barrier(device, kernels, ws):
    n = 1000
    x = ws.act_region(n, np.ones(n, np.float32))
    outs = [ws.act_region(n) for _ in range(4)]
    prog = device.program()
    for o in outs:
        kernels.add(prog, x, n, x, n, o, n, n, 1)
    assert prog.n_barriers == 0
    kernels.add(prog, outs[0], n, outs[1], n, x, n, n, 1)   # reads outs: RAW, and writes x: WAR
    assert prog.n_barriers == 1
    prog.run()
    assert (ws.read(x) == 4).all()


def test_timestamps(device, kernels, ws):
    n = 4096
    x = ws.act_region(n, np.ones(n, np.float32))
    y = ws.act_region(n)
    prog = device.program(timestamps=True)
    kernels.add(prog, x, n, x, n, y, n, n, 1, label="add")
    prog.run()
    t = dict(prog.timings())
    assert t["add"] >= 0


# -- matmul -------------------------------------------------------------------

@pytest.mark.parametrize("wt", WEIGHT_TYPES)
@pytest.mark.parametrize("n", [1, 3, 8, 13])
def test_mul_mat(device, kernels, ws, rng, wt, n):
    M, K = 37, _cols(wt)
    _check_mul_mat(device, kernels, ws, rng, wt, n, M, K)


@pytest.fixture(scope="module")
def tiled_kernels(device):
    """Kernels that use the shared-memory tiled fp32 matmul (mul_mt) for every
    batch size (by default only GPUs use it, from 64 tokens, and those with
    cooperative matrices take mul_mc instead)."""
    return kernels_for(device, tiled_from=2, coopmat=False)


@pytest.fixture(scope="module")
def coopmat_kernels(device):
    """Kernels whose tiled matmuls run on cooperative matrices (mul_mc) for
    every batch size: GPUs with 16 x 16 x 16 f16 matrices (lavapipe has none)."""
    kn = kernels_for(device, tiled_from=2)
    if not kn.caps.coopmat:
        pytest.skip("the device has no 16x16x16 f16 cooperative matrices (the GPU kernel tests run these)")
    return kn


@pytest.fixture(scope="module")
def coopmat_kernels_or_none(device):
    """coopmat_kernels, or None where the device has none (lavapipe)"""
    kn = kernels_for(device, tiled_from=2)
    return kn if kn.caps.coopmat else None


@pytest.mark.parametrize("wt", WEIGHT_TYPES)
@pytest.mark.parametrize("n,M", [(3, 37), (130, 131)])
@pytest.mark.parametrize("tile", ["128", "64"])
def test_mul_mat_tiled(device, tiled_kernels, ws, rng, wt, n, M, tile):
    kn = with_caps(tiled_kernels, small_tiles_below=0 if tile == "128" else 1 << 30)
    _check_mul_mat(device, kn, ws, rng, wt, n, M, 512 if wt in K_QUANTS else 96)


@pytest.mark.parametrize("wt", ["f32", "f16", "q8_0", "q4_0", "q4_k"])
@pytest.mark.parametrize("n,M,K,min_cols", [(3, 37, 1280, 256), (70, 131, 2304, 1024)])
def test_mul_mat_split_k(device, tiled_kernels, ws, rng, wt, n, M, K, min_cols):
    """K split across grid z (parts of klen columns, the last one shorter:
    1280 = 5 x 256; 2304 = 1280 + 1024) and the parts added by reduce_k, into
    y (the 70-row case adds to it). mul_mt here; the cooperative-matrix
    kernels take the same parameters (test_mul_mat_coopmat's long case)."""
    kn = with_caps(tiled_kernels, split_k_wgs=1 << 30, split_k_min=min_cols, small_tiles_below=0)
    assert kn.split_k_parts(1, K, n, M)[0] == (5 if K == 1280 else 2)
    _check_mul_mat(device, kn, ws, rng, wt, n, M, K, accumulate=n == 70)


def test_split_k_parts_rule(device, kernels):
    """Split only grids below split_k_wgs workgroups, into parts of at least
    split_k_min columns (multiples of 256) that together reach about
    split_k_wgs workgroups; never beyond the scratch cap."""
    kn = with_caps(kernels, split_k_wgs=256, split_k_min=512)
    assert kn.split_k_parts(32, 8192, 64, 2048) == (8, 1024)     # a 1B model's down projection, 64 rows
    assert kn.split_k_parts(32, 2048, 64, 2048) == (4, 512)      # its o projection
    assert kn.split_k_parts(64, 14336, 64, 4096) == (4, 3584)    # an 8B's down projection
    assert kn.split_k_parts(256, 2048, 64, 16384) == (1, 0)      # grid big enough
    assert kn.split_k_parts(8, 768, 64, 512) == (1, 0)           # K too short for two parts
    parts, klen = kn.split_k_parts(1, 1 << 20, 4096, 4096)       # capped by the scratch
    assert parts * 4 * 4096 * 4096 <= kn.SPLIT_K_SCRATCH and klen % 256 == 0
    assert with_caps(kn, split_k_wgs=0).split_k_parts(1, 8192, 64, 2048) == (1, 0)


# mul_mc for every weight type; mul_mc2, with fp32 sums and with fp16 sums in
# each of its tiles (mul_mc2h_<BM>x<BN>), for the types it loads
MC2_KERNELS = ["mul_mc2"] + [f"mul_mc2h_{bm}x{bn}" for bm, bn in MC2H_UNROLL]
# and its 64-deep slices where the engine takes them (MC2_K64; K = 96 falls back
# to 32-deep, 2240 is whole slices but not whole chunks of 4)
COOPMAT_SHAPES = [(3, 37, 96), (130, 131, 96), (200, 200, 2304)]
COOPMAT_CASES = ([(wt, "mul_mc", *s) for wt in WEIGHT_TYPES for s in COOPMAT_SHAPES]
                 + [(wt, k, *s) for wt in MC2_TYPES for k in MC2_KERNELS for s in COOPMAT_SHAPES]
                 + [(wt, f"mul_mc2hk64_{bm}x{bn}", *s) for wt in MC2_K64["types"] for bm, bn in MC2_K64["tiles"]
                    for s in COOPMAT_SHAPES + [(70, 300, 2240)]]
                 # Q4_0's scales staged as halves in chunks of U slices (Options.mc2_unroll)
                 + [("q4_0", f"mul_mc2h{k}_u{u}_{bm}x{bn}", *s) for u in MC2_SC_F16_UNROLLS
                    for bm, bn in MC2H_UNROLL for k in ("", "k64")[:1 + ((bm, bn) in MC2_K64["tiles"])]
                    for s in COOPMAT_SHAPES + [(70, 300, 2240)]])


@pytest.mark.parametrize("wt,kernel,n,M,K", COOPMAT_CASES)
def test_mul_mat_coopmat(device, coopmat_kernels, ws, rng, wt, n, M, K, kernel):
    """Edges of the tile (rows past M, tokens past N, K not a multiple of the
    slice or of mul_mc2's chunk of 8 slices), a long K (mul_mc splits it in two
    parts, 1280 + 1024 columns added by reduce_k; mul_mc2 does not split), and
    adding to y (the residual projections of a prefill: the 130-token case).
    mul_mc2 where the device has VK_NV_cooperative_matrix2."""
    if kernel != "mul_mc" and not device_has_coopmat2(device):
        pytest.skip("mul_mc2: VK_NV_cooperative_matrix2 devices")
    f16acc = kernel.startswith("mul_mc2h")
    tiles = ((0, tuple(int(v) for v in kernel.split("_")[-1].split("x"))),) if f16acc else MC2H_TILES
    wgs, kmin = (1 << 30, 1024) if K > 1024 else (0, 512)
    kn = with_caps(coopmat_kernels, coopmat2=kernel != "mul_mc", mc2_types=MC2_TYPES, mc2_from_rows=0,
                   split_k_wgs=wgs, split_k_min=kmin, mc2_f16acc=f16acc, mc2h_tiles=tiles, mc2_k64="k64" in kernel,
                   mc2_unroll=int(kernel.split("_u")[1].split("_")[0]) if "_u" in kernel else 0)
    _check_mul_mat(device, kn, ws, rng, wt, n, M, max(K, 512) if wt in K_QUANTS else K, accumulate=n == 130)


def test_mc2_small_token_tiles(kernels):
    """Caps.mc2_small: a step of at most 64 / 128 rows takes mul_mc2h's tile of
    the table's weight rows with 64 / 128 tokens (MC2H_SMALL_BN), a variant the
    table compiles; more rows, fp32 sums or the option off keep the table's
    256-token tiles; such rows never take the GLU epilogue (its tiles are
    256 tokens wide)."""
    import types

    from shaders.variants import VARIANTS
    kn = with_caps(kernels, coopmat2=True, mc2_f16acc=True, mc2h_tiles=MC2H_TILES, mc2_k64=True, mc2_unroll=0,
                   mc2_small=True)
    got = {}
    for rows in (28672, 6144, 4096):
        w = types.SimpleNamespace(rows=rows, cols=4096, type="q4_0")
        got[rows] = [kn.mc2_variant(w, n) for n in (1, 64, 65, 128, 129, 512, None)]
    assert [bn for _, bn, _ in got[28672]] == [64, 64, 128, 128, 256, 256, 256]
    assert got[28672][0] == (256, 64, "mul_mc2h_256x64_q4_0")
    assert got[6144][2] == (128, 128, "mul_mc2h_128x128_q4_0")
    assert got[4096][1] == (64, 64, "mul_mc2h_64x64_q4_0") and got[4096][4][2] == "mul_mc2hk64_64x256_q4_0"
    assert all(v in VARIANTS for vs in got.values() for _, _, v in vs)
    assert not any((bm, bn) in MC2_GLU_TILES for vs in got.values() for bm, bn, _ in vs if bn < 256)
    w = types.SimpleNamespace(rows=4096, cols=4096, type="q4_0")
    assert with_caps(kn, mc2_small=False).mc2_variant(w, 32)[1] == 256
    assert with_caps(kn, mc2_f16acc=False).mc2_variant(w, 32)[1] == 128   # (fp32 sums: MC2_TILES' 128 x 128)


def test_mc2_big_steps_take_the_big_tiles(kernels):
    """Caps.mc2_big_from: a prompt step of at least that many rows takes
    MC2H_BIG_TILES (matrices of 4096+ rows on 256 x 256 tiles: the 8B's qkv, o
    and down projections), a smaller one the table (MC2H_TILES: 128 x 256, 64 x
    256 with 64-deep slices); 0 never; fp32 sums keep MC2_TILES; the tiles are
    compiled variants, and a big step's gate|up and down still meet for the
    GLU epilogue (a GLU tile, the same token width). Options.mc2_tiles
    (opt-in) replaces the table and says what is wrong with a bad one."""
    import types

    from shaders.variants import MC2H_BIG_TILES, VARIANTS
    from vkengine.errors import VkEngineError
    from vkengine.kernels import Caps
    from vkengine.kernels.caps import mc2_tiles
    from vkengine.options import Options
    kn = with_caps(kernels, coopmat2=True, mc2_f16acc=True, mc2h_tiles=MC2H_TILES, mc2_k64=True, mc2_unroll=0,
                   mc2_small=True, mc2_big_from=2048)
    w = {r: types.SimpleNamespace(rows=r, cols=4096, type="q4_0") for r in (28672, 6144, 4096, 2048)}
    assert [kn.mc2_variant(w[r], 2048)[2] for r in w] == ["mul_mc2h_256x256_q4_0"] * 3 + ["mul_mc2hk64_64x256_q4_0"]
    assert [kn.mc2_variant(w[r], 2047)[2] for r in w] == ["mul_mc2h_256x256_q4_0", "mul_mc2h_128x256_q4_0",
                                                          "mul_mc2hk64_64x256_q4_0", "mul_mc2hk64_64x256_q4_0"]
    assert kn.mc2_variant(w[4096], None)[2] == "mul_mc2hk64_64x256_q4_0"
    assert with_caps(kn, mc2_big_from=0).mc2_variant(w[4096], 4096)[2] == "mul_mc2hk64_64x256_q4_0"
    assert with_caps(kn, mc2_f16acc=False).mc2_variant(w[4096], 4096)[:2] == (128, 128)
    assert all((tile in MC2H_UNROLL and f"mul_mc2h_{tile[0]}x{tile[1]}_q4_0" in VARIANTS) for _, tile in MC2H_BIG_TILES)
    gu = kn._glu_variant(w[28672], 4096)
    assert gu[:2] in MC2_GLU_TILES and gu[1] == kn.mc2_variant(types.SimpleNamespace(rows=4096, cols=14336,
                                                                                       type="q4_0"), 4096)[1]
    env = Options.from_env({"VKENGINE_MC2_TILES": "4096:256x256,0:64x256", "VKENGINE_MC2_BIG_FROM": "0"})
    assert (env.mc2_tiles, env.mc2_big_from, Options().mc2_big_from) == ("4096:256x256,0:64x256", 0, 2048)
    assert mc2_tiles("") == MC2H_TILES
    # (the widest token tile a step's rows are padded to counts the big steps' tiles too)
    assert with_caps(kn, mc2h_tiles=mc2_tiles("0:128x128")).prompt_granule == 256
    assert with_caps(kn, mc2h_tiles=mc2_tiles("0:128x128"), mc2_big_from=0).prompt_granule == 128
    gpu = types.SimpleNamespace(info=dataclasses.replace(kernels.device.info, type="discrete"),
                             features=kernels.device.features)
    with pytest.raises(VkEngineError, match="VKENGINE_MC2_BIG_FROM"):
        Caps.detect(gpu, Options(mc2_big_from=-1))
    with pytest.raises(VkEngineError, match="VKENGINE_MC2_TILES"):
        Caps.detect(gpu, Options(mc2_tiles="0:3x3"))
    assert mc2_tiles("4096:256x256,0:64x256") == ((4096, (256, 256)), (0, (64, 256)))
    for bad in ("0:32x32", "4096:256x256", "x", "0:64x256,100:128x256"):
        with pytest.raises(VkEngineError, match="VKENGINE_MC2_TILES"):
            mc2_tiles(bad)


@pytest.mark.parametrize("wt", MC2_GLU_TYPES)
@pytest.mark.parametrize("tile", MC2_GLU_TILES)
@pytest.mark.parametrize("n,F,K", [(3, 224, 96), (130, 288, 2304)])
def test_mul_mat_glu_halves(device, coopmat_kernels, ws, rng, wt, tile, n, F, K):
    """Caps.mc2_glu: gate|up (gate over up, 2F rows) with the SwiGLU in
    mul_mc2's epilogue, written as halves for the down projection: each half
    within fp16 sums' bound of numpy's silu(g) * u, zeros in the rows padded to
    the token tile; the down projection reading those halves (mul_mat's
    x_halves) within its own bound of numpy's product of them. F past a whole
    number of gate-row tiles (224, 288 on 128 or 64 rows: the clamped loads;
    a multiple of 32, as the down projection's tiled matmul needs: Kernels.tiled)
    and tokens past a tile (3, 130)."""
    if not device_has_coopmat2(device):
        pytest.skip("mul_mc2: VK_NV_cooperative_matrix2 devices")
    kn = with_caps(coopmat_kernels, coopmat2=True, mc2_types=MC2_TYPES, mc2_from_rows=0, mc2_f16acc=True,
                   mc2h_tiles=((0, tile),), mc2_k64=False, mc2_unroll=0, mc2_glu=True)
    # weights of a real layer's scale (1 / sqrt of the sums' depth): unit ones put the 130 x 2304 case's down
    # projection past the fp16 sums' range (|y| ~ 4e4; the H100 run of 2026-12-06 failed it so)
    raw, w = random_quantized(wt, 2 * F, K, rng, scale=K ** -0.5)
    gu = upload_matrix(ws, wt, raw, 2 * F, K)
    M = 70
    raw_d, wd = random_quantized("f16", M, F, rng, scale=F ** -0.5)
    down = upload_matrix(ws, "f16", raw_d, M, F)
    assert kn.glu_halves(gu, down, n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs, ys = K + 4, M + 3
    xr = ws.act_region(n * xs, np.pad(x, ((0, 0), (0, 4))))
    yr = ws.act_region(n * ys, np.full((n, ys), np.nan, np.float32))
    prog = device.program()
    h = kn.mul_mat_glu_halves(prog, gu, xr, xs, n)
    kn.mul_mat(prog, down, xr, xs, yr, ys, n, x_halves=h)   # (x's floats unread: the halves stand for them)
    prog.run()
    assert h.n == n and h.n_pad % tile[1] == 0 and h.n_pad >= n and h.stride == F
    got = device.download(h.buf, 0, h.n_pad * F * 2, np.uint8).view(np.float16).reshape(h.n_pad, F)
    xh = x.astype(np.float16).astype(np.float64)
    wh = w.astype(np.float16).astype(np.float64)
    g, u = xh @ wh[:F].T, xh @ wh[F:].T
    bg, bu = _f16_sums_bound(xh, wh[:F]), _f16_sums_bound(xh, wh[F:])
    sig = 1 / (1 + np.exp(-g))
    want = g * sig * u
    # |d silu(g)| <= 1.1 |dg|; then the product, and its rounding to a half (half an ulp)
    bound = 1.1 * bg * (np.abs(u) + bu) + np.abs(g * sig) * bu + 2.0 ** -11 * np.abs(want) + 1e-6
    assert (np.abs(got[:n].astype(np.float64) - want) <= bound).all()
    assert (got[n:] == 0).all(), "rows past n: zeros (the padded tokens' x)"
    y = ws.read(yr).reshape(n, ys)
    wdh = wd.astype(np.float16).astype(np.float64)
    hd = got[:n].astype(np.float64)
    want_y = hd @ wdh.T
    bound_y = _f16_sums_bound(hd, wdh) + 1e-5
    assert (np.abs(y[:, :M] - want_y) <= bound_y).all()
    assert np.isnan(y[:, M:]).all()


@pytest.mark.parametrize("n,cols,n_pad", [(3, 96, 128), (130, 100, 256)])
def test_to_f16(device, kernels, ws, rng, n, cols, n_pad):
    """mul_mc2's x: halves in rows of a multiple of 8, zeros past the columns
    and in the padding rows; numpy's rounding (nearest even) or one ulp off."""
    x = rng.standard_normal((n, cols)).astype(np.float32) * 100
    xs = cols + 4
    xr = ws.act_region(n * xs, np.pad(x, ((0, 0), (0, 4))))
    stride = -(-cols // 8) * 8
    out = device.buffer(n_pad * stride * 2 + 64, "device", "h")
    try:
        device.upload(out, np.full(n_pad * stride // 2, 0xFFFFFFFF, np.uint32))
        prog = device.program()
        kernels.to_f16(prog, xr, xs, cols, n, n_pad, out)
        prog.run()
        got = device.download(out, 0, n_pad * stride * 2, np.uint8).view(np.float16).reshape(n_pad, stride)
    finally:
        device.free(out)
    want = np.zeros((n_pad, stride), np.float16)
    want[:n, :cols] = x.astype(np.float16)
    ulps = np.abs(got.view(np.int16).astype(np.int32) - want.view(np.int16).astype(np.int32))
    assert ulps.max() <= 1
    assert (got[n:] == 0).all() and (got[:, cols:] == 0).all()


def _f16_sums_bound(x, w):
    """How far a product x @ w.T with fp16 sums may be from numpy's of the
    same operands: one half-ulp rounding of each operand, at most one a
    16-deep k step (as _check_mul_mat's bound for mul_mc2h)."""
    return 2.0 ** -10 * (np.abs(x) @ np.abs(w).T) * (1 + math.ceil(x.shape[1] / 16))


def _check_mul_mat(device, kernels, ws, rng, wt, n, M, K, accumulate=False):
    raw, w = random_quantized(wt, M, K, rng)
    mat = upload_matrix(ws, wt, raw, M, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xs, ys = K + 4, M + 3                  # padded strides
    xr = ws.act_region(n * xs, np.pad(x, ((0, 0), (0, 4))))
    y0 = np.pad(rng.standard_normal((n, M)).astype(np.float32), ((0, 0), (0, 3)), constant_values=np.nan)
    yr = ws.act_region(n * ys, y0 if accumulate else None)
    prog = device.program()
    kernels.mul_mat(prog, mat, xr, xs, yr, ys, n, accumulate=accumulate)
    prog.run()
    got = ws.read(yr).reshape(n, ys)[:, :M]
    if accumulate:
        got = got.astype(np.float64) - y0[:, :M]
    if kernels.caps.coopmat and kernels.tiled(mat, n):
        # fp16 operands (x and the dequantized W rounded to halves), fp32 sums;
        # a device may round to half differently than numpy: one half ulp per operand
        want = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).T.astype(np.float64)
        bound = 2.0 ** -10 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
        if kernels.caps.coopmat2 and kernels.caps.mc2_f16acc and kernels.on_coopmat2(mat):
            # fp16 sums: at most one rounding (half an ulp) a 16-deep k step
            bound *= 1 + math.ceil(K / 16)
        assert (np.abs(got - want) <= bound + 1e-5 * np.sqrt(K) * max(1.0, float(np.abs(want).max()))).all()
    else:
        want = x.astype(np.float64) @ w.T.astype(np.float64)
        _close(got, want, atol_scale=1e-5 * np.sqrt(K))
    assert np.isnan(ws.read(yr).reshape(n, ys)[:, M:]).all(), "wrote outside its rows"


@pytest.fixture(scope="module")
def column_kernels(device):
    """Kernels that take matvecs through the GPU's split-K variants (mul_mvk,
    and mul_mm{2,4,8} for 2..63 rows), whatever the device (lavapipe uses the
    subgroup kernels by default)."""
    return kernels_for(device, tiled_from=None, multi_column_from=2, split_k=True, norm_in=True)


def _split_k_rows(device, kernels, wt: str, n: int, reduce: str):
    """The split-K kernels with that reduction, and the rows to test: n, or 2
    where the butterfly has no lane for every sum of n rows' variant
    (lavapipe's 8 lanes: only the 1- and 2-column variants), the widest
    variant it can reduce so."""
    from shaders.variants import mv_gpu_config
    kn = with_caps(kernels, bfly=reduce == "butterfly")
    ncols = kn.split_k_columns(n)
    return kn, 2 if kn.caps.bfly and mv_gpu_config(wt, ncols)[0] * ncols > device.info.subgroup_size else n


def _assert_columns_equal_single(device, kernels, ws, mat, xr, K, got, rows, n, **kw):
    """Each of the n columns of a batched mul_mat (got[c][:rows]) is bit for
    bit what the matvec gives that column's x alone."""
    for c in range(n):
        one = ws.act_region(rows)
        prog = device.program()
        kernels.mul_mat(prog, mat, xr.at(c * K, K), K, one, rows, 1, **kw)
        prog.run()
        np.testing.assert_array_equal(got[c][:rows], ws.read(one), err_msg=f"column {c} of {n}")


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wt", ["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k", "iq4_nl", "iq4_xs",
                                "mxfp4"])
@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 13])
def test_mul_mat_columns_equal_single_rows(device, column_kernels, ws, rng, wt, n, reduce):
    """Batched decode on GPUs: each column of the 2/4/8-column split-K variants
    is right and is bit for bit what the split-K matvec gives that row alone, so
    a sequence's tokens do not depend on which others share its step. Both
    reductions (the butterfly needs a lane per sum: on lavapipe's 8 lanes only
    the 1- and 2-column variants can run it)."""
    kn, n = _split_k_rows(device, column_kernels, wt, n, reduce)
    M, K = 37, _cols(wt)
    raw, w = random_quantized(wt, M, K, rng)
    mat = upload_matrix(ws, wt, raw, M, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xr = ws.act_region(n * K, x)
    yr = ws.act_region(n * M)
    prog = device.program()
    kn.mul_mat(prog, mat, xr, K, yr, M, n)
    prog.run()
    got = ws.read(yr).reshape(n, M)
    _close(got, x.astype(np.float64) @ w.T.astype(np.float64), atol_scale=1e-5 * np.sqrt(K))
    _assert_columns_equal_single(device, kn, ws, mat, xr, K, got, M, n)


@pytest.fixture(scope="module")
def xq8_kernels(device):
    """column_kernels with the XQ8 matvecs: Q8_0 matrices take x as 8-bit
    blocks through integer dot products (lavapipe and the H200 both have them)."""
    assert "shaderIntegerDotProduct" in device.features, "the XQ8 tests need integer dot products"
    return kernels_for(device, tiled_from=None, multi_column_from=2, split_k=True, xq8=True)


def test_quantize_q8(device, xq8_kernels, ws, rng):
    """x rows -> 8-bit blocks and scales as numpy computes them (a block of
    zeros gives zeros; a value may round one step differently where the
    device's 1/d is not numpy's)."""
    n, K, xs = 3, 128, 132
    x = rng.standard_normal((n, K)).astype(np.float32) * np.array([1.0, 40.0, 1e-3], np.float32)[:, None]
    x[1, 32:64] = 0.0
    xr = ws.act_region(n * xs, np.pad(x, ((0, 0), (0, 4))))
    out = device.buffer(n * (K // 4 + K // 32) * 4, "device", "xq-test")
    prog = device.program()
    xq8_kernels.quantize_q8(prog, xr, xs, K, n, out)
    prog.run()
    raw = device.download(out, 0, n * (K // 4 + K // 32) * 4).view(np.uint32)
    q = raw[: n * K // 4].view(np.int8).reshape(n, K)
    d = raw[n * K // 4:].view(np.float32).reshape(n, K // 32)
    want_q, want_d = ref.quantize_q8(x)
    np.testing.assert_allclose(d, want_d, rtol=1e-6)
    assert np.abs(q.astype(np.int32) - want_q).max() <= 1 and (q == want_q).mean() > 0.99
    assert (q[1, 32:64] == 0).all() and d[1, 1] == 0.0


def _run_xq8(device, kn, mat, xr, K, yr, ys, n, **kw):
    """Run mul_mat(**kw) and check it took the XQ8 path: quantize_q8, then an
    XQ8 variant."""
    prog = device.program()
    kn.mul_mat(prog, mat, xr, K, yr, ys, n, **kw)
    labels = [op.label for op in prog.ops if op.kind == "dispatch"]
    assert labels[0] == "quantize_q8" and labels[1].endswith(f"x_{mat.type}"), labels
    prog.run()


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 13])
def test_mul_mat_xq8(device, xq8_kernels, ws, rng, wt, n, reduce):
    """The XQ8 matvecs (Q8_0 or Q4_0 weights, x quantized by quantize_q8; matrices
    marked no_epilogues): within the 8-bit rounding of x of the float product
    (every value off by at most 1.5 steps of its block), and each column of the
    2/4/8-column variants bit for bit what the 1-column one gives that row
    alone. An unmarked matrix (it may take a norm or RoPE at some step size)
    stays on the float kernel."""
    kn, n = _split_k_rows(device, xq8_kernels, wt, n, reduce)
    M, K = 37, 256
    raw, w = random_quantized(wt, M, K, rng)
    mat = upload_matrix(ws, wt, raw, M, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xr = ws.act_region(n * K, x)
    yr = ws.act_region(n * M)
    prog = device.program()
    kn.mul_mat(prog, mat, xr, K, yr, M, n)
    assert [op.label for op in prog.ops if op.kind == "dispatch"] == [f"mul_mvk{'b' * kn.caps.bfly}_{wt}" if n == 1
                                                                     else f"mul_mm{'b' * kn.caps.bfly}"
                                                                     f"{kn.split_k_columns(n)}_{wt}"]
    _run_xq8(device, kn, mat, xr, K, yr, M, n, no_epilogues=True)
    got = ws.read(yr).reshape(n, M)
    _, d = ref.quantize_q8(x)
    step = np.repeat(d, 32, axis=1).astype(np.float64)          # each value's quantization step
    bound = 1.5 * step @ np.abs(w).T.astype(np.float64) + 1e-5 * np.sqrt(K)
    assert (np.abs(got - x.astype(np.float64) @ w.T.astype(np.float64)) <= bound).all()
    _close(got, ref.dequantize_q8(x).astype(np.float64) @ w.T.astype(np.float64), rtol=1e-3, atol_scale=1e-3)
    _assert_columns_equal_single(device, kn, ws, mat, xr, K, got, M, n, no_epilogues=True)


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_mul_mat_xq8_glu(device, xq8_kernels, ws, rng, wt, n, reduce):
    """gate|up with the fused SwiGLU takes the XQ8 variants: silu(gate) * up of
    x rounded to 8-bit blocks, each column bit for bit the row alone."""
    kn, n = _split_k_rows(device, xq8_kernels, wt, n, reduce)
    F, K = 37, 256
    raw, w = random_quantized(wt, 2 * F, K, rng)
    mat = upload_matrix(ws, wt, raw, 2 * F, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xr, yr = ws.act_region(n * K, x), ws.act_region(n * F)
    _run_xq8(device, kn, mat, xr, K, yr, F, n, glu=True)
    out = ws.read(yr).reshape(n, F)
    gu = ref.dequantize_q8(x).astype(np.float64) @ w.T.astype(np.float64)
    _close(out, ref.silu(gu[:, :F]) * gu[:, F:], rtol=1e-3, atol_scale=1e-3)
    _assert_columns_equal_single(device, kn, ws, mat, xr, K, out, F, n, glu=True)


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wt", ["q4_0", "q4_1", "q8_0", "f16"])
@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_mul_mat_glu(device, column_kernels, ws, rng, wt, n, reduce):
    """The split-K matvecs' fused SwiGLU (gate over up in one matrix): right,
    each column bit for bit the row alone, and only F values a row written."""
    kn, n = _split_k_rows(device, column_kernels, wt, n, reduce)
    F, K = 37, _cols(wt)
    raw, w = random_quantized(wt, 2 * F, K, rng)
    mat = upload_matrix(ws, wt, raw, 2 * F, K)
    assert kn.fuses_glu(mat, n)
    x = rng.standard_normal((n, K)).astype(np.float32)
    xr = ws.act_region(n * K, x)
    ys = F + 3
    yr = ws.act_region(n * ys)
    prog = device.program()
    kn.mul_mat(prog, mat, xr, K, yr, ys, n, glu=True)
    prog.run()
    out = ws.read(yr).reshape(n, ys)
    assert np.isnan(out[:, F:]).all(), "wrote outside its rows"
    gu = x.astype(np.float64) @ w.T.astype(np.float64)
    _close(out[:, :F], ref.silu(gu[:, :F]) * gu[:, F:], atol_scale=1e-5 * np.sqrt(K))
    _assert_columns_equal_single(device, kn, ws, mat, xr, K, out, F, n, glu=True)


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wp,wt", [("q8_0", "f32"), ("q4_0", "f16"), ("q4_1", "q8_0"), ("q8_0", "q4_0"),
                                   ("q4_0", "q4_1"), ("q8_0", "q4_k"), ("q4_1", "q6_k")])
@pytest.mark.parametrize("n", [1, 3, 4, 8, 13])
def test_mul_mat_norm_split(device, column_kernels, ws, rng, wp, wt, n, reduce):
    """The RMSNorm split between a residual add and its readers: the add's "p"
    variant (weight type wp) writes y, h' = y * w and the sums of 4 squares;
    a reader's "n" variant (wt), plain and with the fused SwiGLU, gives W @
    rms_norm(y) * w, close to numpy's. Every column of both is bit for bit what
    the matvec gives that column alone."""
    from vkengine.kernels import NormIn, NormParts
    kn, n1 = _split_k_rows(device, column_kernels, wp, n, reduce)
    n = min(n1, _split_k_rows(device, column_kernels, wt, n, reduce)[1])
    D, Kp, M, eps = 512, _cols(wp), 38, 1e-5
    rawp, wpm = random_quantized(wp, D, Kp, rng)
    pm = upload_matrix(ws, wp, rawp, D, Kp)
    raw, w = random_quantized(wt, M, D, rng)
    mat = upload_matrix(ws, wt, raw, M, D)
    xp = rng.standard_normal((n, Kp)).astype(np.float32)
    y0 = (rng.standard_normal((n, D)) * rng.uniform(0.1, 10.0, (n, 1))).astype(np.float32)
    nwv = rng.uniform(0.5, 1.5, D).astype(np.float32)
    nw = ws.weight_region(nwv)
    xpr = ws.act_region(n * Kp, xp)

    def produce(cols: int, c0: int):
        yr, hr, sr = ws.act_region(cols * D, y0[c0:c0 + cols]), ws.act_region(cols * D), ws.act_region(cols * D // 4)
        parts = NormParts(nw, hr, D, sr, D // 4)
        assert kn.fuses_norm_parts(pm, cols, yr, parts)
        prog = device.program()
        kn.mul_mat(prog, pm, xpr.at(c0 * Kp, cols * Kp), Kp, yr, D, cols, accumulate=True, norm_parts=parts)
        assert [op.label for op in prog.ops if op.kind == "dispatch"][0].endswith(f"p_{wp}")
        prog.run()
        return yr, hr, sr

    yr, hr, sr = produce(n, 0)
    y = ws.read(yr).reshape(n, D)
    _close(y, y0 + xp.astype(np.float64) @ wpm.T, atol_scale=1e-4)
    np.testing.assert_array_equal(ws.read(hr).reshape(n, D), y * nwv)
    sq = (y.astype(np.float64) ** 2).reshape(n, D // 4, 4).sum(axis=2)
    _close(ws.read(sr).reshape(n, D // 4), sq)
    for c in range(n):   # the producer's columns alone
        y1, h1, s1 = (ws.read(r) for r in produce(1, c))
        np.testing.assert_array_equal(y1, y[c])
        np.testing.assert_array_equal(h1, ws.read(hr).reshape(n, D)[c])
        np.testing.assert_array_equal(s1, ws.read(sr).reshape(n, D // 4)[c])

    y64 = y.astype(np.float64)
    want = (y64 / np.sqrt((y64 ** 2).mean(axis=1, keepdims=True) + eps) * nwv) @ w.T.astype(np.float64)
    for glu in (False, True):
        rows = M // 2 if glu else M
        if glu and not kn.fuses_glu(mat, n):
            continue
        ys = rows + 3

        def consume(cols: int, c0: int):
            norm = NormIn(sr.at(c0 * D // 4, cols * D // 4), eps)
            assert kn.fuses_norm_in(mat, cols, norm.slots)
            out = ws.act_region(cols * ys)
            prog = device.program()
            kn.mul_mat(prog, mat, hr.at(c0 * D, cols * D), D, out, ys, cols, glu=glu, norm_in=norm)
            tag = "b" * kn.caps.bfly
            assert [op.label for op in prog.ops if op.kind == "dispatch"] == [
                f"mul_mvk{tag}n_{wt}" if cols == 1 else f"mul_mm{tag}{kn.split_k_columns(cols)}n_{wt}"]
            prog.run()
            return ws.read(out).reshape(cols, ys)

        got = consume(n, 0)
        assert np.isnan(got[:, rows:]).all(), "wrote outside its rows"
        exp = ref.silu(want[:, :rows]) * want[:, rows:] if glu else want
        _close(got[:, :rows], exp, atol_scale=1e-5 * np.sqrt(D))
        for c in range(n):
            np.testing.assert_array_equal(consume(1, c)[0, :rows], got[c, :rows], err_msg=f"column {c} of {n}")


@pytest.fixture(scope="module")
def xq8_in_kernels(device):
    """column_kernels with the split norm's 8-bit blocks (Kernels.xq8_in): a
    "pq" producer writes h' as blocks, a Q8_0 or Q4_0 gate|up reads them ("nx")."""
    assert "shaderIntegerDotProduct" in device.features, "the XQ8 tests need integer dot products"
    return kernels_for(device, tiled_from=None, multi_column_from=2, split_k=True, norm_in=True, xq8_in=True,
                       xq8_q4=True)


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wp,wc", [("q8_0", "q8_0"), ("q4_0", "q8_0"), ("q4_1", "q8_0"), ("q8_0", "q4_0")])
@pytest.mark.parametrize("n", [1, 3, 4, 8, 13])
def test_mul_mat_norm_split_q8(device, xq8_in_kernels, ws, rng, wp, wc, n, reduce):
    """The split norm with h' as 8-bit blocks: the "pq" producer (weight type
    wp) writes what the "p" variant writes and h' as blocks bit for bit what
    quantize_q8 makes of that h', twice in a row (its counters are left
    zero); a gate|up of type wc (Q8_0 or Q4_0; "nx": the fused SwiGLU on
    integer dot products) gives silu(gate) * up of the blocks times the norm's
    scale, each column bit for bit what it gives that column alone."""
    from vkengine.kernels import NormIn, NormParts, Q8Out
    kn, n1 = _split_k_rows(device, xq8_in_kernels, wp, n, reduce)
    n = min(n1, _split_k_rows(device, xq8_in_kernels, wc, n, reduce)[1])
    D, Kp, F, eps = 512, _cols(wp), 37, 1e-5
    rawp, wpm = random_quantized(wp, D, Kp, rng)
    pm = upload_matrix(ws, wp, rawp, D, Kp)
    raw, w = random_quantized(wc, 2 * F, D, rng)
    mat = upload_matrix(ws, wc, raw, 2 * F, D)
    xp = rng.standard_normal((n, Kp)).astype(np.float32)
    y0 = (rng.standard_normal((n, D)) * rng.uniform(0.1, 10.0, (n, 1))).astype(np.float32)
    nwv = rng.uniform(0.5, 1.5, D).astype(np.float32)
    nw = ws.weight_region(nwv)
    xpr = ws.act_region(n * Kp, xp)
    qwords = n * D // 4
    qr = ws.act_region(qwords + n * D // 32)
    q2r = ws.act_region(qwords)
    blk_sums = ws.act_region(n * D // 32)
    sync = ws.act_region(n * D // 32, np.zeros(n * D // 32, np.uint32))

    def produce(cols: int, c0: int, q8: bool):
        yr, hr, sr = ws.act_region(cols * D, y0[c0:c0 + cols]), ws.act_region(cols * D), ws.act_region(cols * D // 4)
        q = Q8Out(qr.at(c0 * D // 4, cols * D // 4), q2r.off + c0 * D // 4, qr.off + qwords + c0 * D // 32,
                  blk_sums.off + c0 * D // 32, sync) if q8 else None
        parts = NormParts(nw, hr, D, sr, D // 4, q)
        assert kn.fuses_norm_parts(pm, cols, yr, parts) and (not q8 or kn.fuses_norm_parts_q8(pm, cols, q))
        prog = device.program()
        kn.mul_mat(prog, pm, xpr.at(c0 * Kp, cols * Kp), Kp, yr, D, cols, accumulate=True, norm_parts=parts)
        assert [op.label for op in prog.ops if op.kind == "dispatch"][0].endswith(f"{'pq' if q8 else 'p'}_{wp}")
        prog.run()
        return [ws.read(r) for r in (yr, hr, sr)]

    plain = produce(n, 0, False)
    for _ in range(2):
        qr_init = np.full(qwords + n * D // 32, np.nan, np.float32)
        device.upload(qr.buf, qr_init.view(np.uint32), qr.off * 4)
        got = produce(n, 0, True)
        for a, b in zip(got, plain):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ws.read(sync, np.uint32), 0)
        h = got[1].reshape(n, D)
        want = device.buffer(n * (D // 4 + D // 32) * 4, "device", "q8-want")
        prog = device.program()
        kn.quantize_q8(prog, ws.act_region(n * D, h), D, D, n, want)
        prog.run()
        want_words = device.download(want, 0, n * (D // 4 + D // 32) * 4, np.uint8).view(np.uint32)
        np.testing.assert_array_equal(ws.read(qr, np.uint32), want_words)
        # the second plane: what the first leaves, in 254ths of the scale
        q1, q2, d = ref.quantize_q8x2(h)
        g2 = ws.read(q2r, np.int8).reshape(n, D)
        assert (g2 == q2).mean() > 0.99   # (where the first plane rounds the other way, q2 moves by 254)
        dr = np.repeat(ws.read(qr)[qwords:].reshape(n, D // 32), 32, axis=1).astype(np.float64)
        back = ws.read(qr, np.int8)[:4 * qwords].reshape(n, D) * dr + g2 * dr / 254
        assert (np.abs(back - h) <= dr / 508 * 1.01 + 1e-30).all()
        sq = (got[0].reshape(n, D).astype(np.float64) ** 2).reshape(n, D // 32, 32).sum(axis=2)
        _close(ws.read(blk_sums).reshape(n, D // 32), sq)
    bs, b2 = ws.read(blk_sums), ws.read(q2r, np.uint32)
    for c in range(n):   # a column alone writes the same blocks
        produce(1, c, True)
    np.testing.assert_array_equal(ws.read(qr, np.uint32), want_words)
    np.testing.assert_array_equal(ws.read(blk_sums), bs)
    np.testing.assert_array_equal(ws.read(q2r, np.uint32), b2)

    y, sr = got[0].reshape(n, D), ws.act_region(n * D // 4, got[2])
    y64 = y.astype(np.float64)
    scale = 1.0 / np.sqrt((y64 ** 2).mean(axis=1, keepdims=True) + eps)
    hq = back * scale
    gu = hq @ w.T.astype(np.float64)
    exp = ref.silu(gu[:, :F]) * gu[:, F:]
    ys = F + 3

    def consume(cols: int, c0: int):
        q = Q8Out(qr.at(c0 * D // 4, cols * D // 4), q2r.off + c0 * D // 4, qr.off + qwords + c0 * D // 32,
                  blk_sums.off + c0 * D // 32, sync)
        norm = NormIn(sr.at(c0 * D // 4, cols * D // 4), eps, q)
        assert kn.takes_q8_in(mat, cols)
        assert with_caps(kn, xq8_q4=False).takes_q8_in(mat, cols) == (wc == "q8_0")   # Q4_0's: opt-in
        out = ws.act_region(cols * ys)
        prog = device.program()
        kn.mul_mat(prog, mat, ws.act_region(cols * D), D, out, ys, cols, glu=True, norm_in=norm)
        tag = "b" * kn.caps.bfly
        assert [op.label for op in prog.ops if op.kind == "dispatch"] == [
            f"mul_mvk{tag}nx_{wc}" if cols == 1 else f"mul_mm{tag}{kn.split_k_columns(cols)}nx_{wc}"]
        prog.run()
        return ws.read(out).reshape(cols, ys)

    out = consume(n, 0)
    assert np.isnan(out[:, F:]).all(), "wrote outside its rows"
    _close(out[:, :F], exp, rtol=1e-3, atol_scale=1e-3)
    for c in range(n):
        np.testing.assert_array_equal(consume(1, c)[0, :F], out[c, :F], err_msg=f"column {c} of {n}")


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_mul_mat_norm(device, column_kernels, ws, rng, wt, n, reduce):
    """The split-K matvecs' fused RMSNorm (the workgroup that finishes last
    normalizes every column): y as the plain accumulate gives it, h bit for bit
    what rms_norm gives on that y, twice in a row (the counter is reset)."""
    from vkengine.kernels import NormOut
    kn, n = _split_k_rows(device, column_kernels, wt, n, reduce)
    M, K, eps = 1036, _cols(wt), 1e-5
    raw, w = random_quantized(wt, M, K, rng)
    mat = upload_matrix(ws, wt, raw, M, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    y0 = rng.standard_normal((n, M)).astype(np.float32)
    nw = ws.weight_region(rng.uniform(0.5, 1.5, M).astype(np.float32))
    sync = ws.act_region(4, np.zeros(4, np.uint32))
    xr, hs = ws.act_region(n * K, x), M + 4
    for _ in range(2):
        yr, hr, href = ws.act_region(n * M, y0), ws.act_region(n * hs), ws.act_region(n * hs)
        norm = NormOut(nw, hr, hs, sync, eps)
        assert kn.fuses_norm(mat, n, yr, M, norm)
        assert not kn.fuses_norm(mat, kn.NORM_MAX_ROWS + 1, yr, M, norm)
        prog = device.program()
        kn.mul_mat(prog, mat, xr, K, yr, M, n, accumulate=True, norm=norm)
        prog.run()
        y = ws.read(yr).reshape(n, M)
        _close(y, y0 + x.astype(np.float64) @ w.T, atol_scale=1e-4)
        prog = device.program()
        kn.rms_norm(prog, nw, yr, M, href, hs, M, n, eps, ws.params)
        prog.run()
        h = ws.read(hr).reshape(n, hs)
        assert np.isnan(h[:, M:]).all(), "wrote outside its rows"
        np.testing.assert_array_equal(h[:, :M], ws.read(href).reshape(n, hs)[:, :M])
        assert ws.read(sync, np.uint32)[0] == 0


@pytest.mark.parametrize("reduce", ["subgroupAdd", "butterfly"])
@pytest.mark.parametrize("wt", ["q4_0", "q8_0"])
@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("pieces", [1, 2])
def test_mul_mat_rope(device, column_kernels, ws, rng, wt, n, reduce, pieces):
    """The split-K matvecs' fused RoPE and KV-cache write (decode steps):
    q_out and the caches bit for bit what the matvec into qkv followed by
    rope_kv gives, with the q|k|v matrix whole or as a q piece and a k|v piece
    (partial rotary dims, rows of different slots), and right against numpy."""
    from vkengine.kernels import RopeOut
    from vkengine.rope import rope_table
    kn, n = _split_k_rows(device, column_kernels, wt, n, reduce)
    n_head, n_kv, hd, n_rot, ctx, n_slots = 4, 2, 32, 16, 40, 3
    K = _cols(wt)
    M = (n_head + 2 * n_kv) * hd
    raw, w = random_quantized(wt, M, K, rng)
    cuts = [(0, M)] if pieces == 1 else [(0, n_head * hd), (n_head * hd, M)]
    mats = []
    for a, b in cuts:
        rows = raw[a:b]
        mats.append((upload_matrix(ws, wt, rows, b - a, K), a))
    x = rng.standard_normal((n, K)).astype(np.float32)
    xr = ws.act_region(n * K, x)
    table = ws.weight_region(rope_table(ctx, n_rot, 10000.0))
    pos = np.array([5, 39, 0, 17][:n], np.uint32)
    slots = np.array([0, 2, 1, 2][:n], np.uint32)
    ws.params.array()[0:n] = pos
    ws.params.array()[50:50 + n] = slots
    outs = []
    for fused in (True, False):
        kc, vc, ss = _kv_setup(ws, n_slots, ctx, n_kv, hd)
        for c in (kc, vc):
            ws.device.upload(c.buf, np.zeros(c.words, np.uint32), c.off * 4)
        qkv = ws.act_region(n * M)
        qo = ws.act_region(n * n_head * hd)
        prog = device.program()
        for m, col in mats:
            rope = RopeOut(col, False, n_head, n_kv, hd, n_rot, table, qo, n_head * hd, kc, vc, ss, ws.params, 0, 50)
            if fused:
                assert kn.fuses_rope(m, n, rope)
                assert not kn.fuses_rope(m, n, dataclasses.replace(rope, neox=True))
                kn.mul_mat(prog, m, xr, K, qkv.at(col, qkv.words - col), M, n, rope=rope)
            else:
                kn.mul_mat(prog, m, xr, K, qkv.at(col, qkv.words - col), M, n)
        if not fused:
            prog.barrier()
            kn.rope_kv(prog, table, qkv, M, qo, n_head * hd, n, n_head, n_kv, hd, n_rot, False,
                       kc, vc, ss, ws.params, 0, 50)
        prog.run()
        outs.append((ws.read(qo).reshape(n, n_head, hd), _read_cache(ws, kc, n_slots, ctx, n_kv, hd),
                     _read_cache(ws, vc, n_slots, ctx, n_kv, hd)))
    for a, b in zip(outs[0], outs[1]):
        np.testing.assert_array_equal(a, b)
    y = x.astype(np.float64) @ w.T
    q = y[:, :n_head * hd].reshape(n, n_head, hd)
    k = y[:, n_head * hd:(n_head + n_kv) * hd].reshape(n, n_kv, hd)
    v = y[:, (n_head + n_kv) * hd:].reshape(n, n_kv, hd)
    _close(outs[0][0], ref.rope(q, pos, n_rot, 10000.0, False), atol_scale=1e-4)
    for r in range(n):
        np.testing.assert_allclose(outs[0][1][slots[r], pos[r]], ref.rope(k, pos, n_rot, 10000.0, False)[r],
                                   rtol=2e-3, atol=2e-3 * max(1.0, np.abs(k).max()))
        np.testing.assert_allclose(outs[0][2][slots[r], pos[r]], v[r], rtol=2e-3, atol=2e-3 * max(1.0, np.abs(v).max()))


@pytest.mark.parametrize("wt", ["q4_0", "q8_0", "f16"])
def test_mul_mat_accumulate(device, kernels, ws, rng, wt):
    M, K, n = 70, 64, 5
    raw, w = random_quantized(wt, M, K, rng)
    mat = upload_matrix(ws, wt, raw, M, K)
    x = rng.standard_normal((n, K)).astype(np.float32)
    y0 = rng.standard_normal((n, M)).astype(np.float32)
    xr = ws.act_region(n * K, x)
    yr = ws.act_region(n * M, y0)
    prog = device.program()
    kernels.mul_mat(prog, mat, xr, K, yr, M, n, accumulate=True)
    prog.run()
    _close(ws.read(yr).reshape(n, M), y0 + x.astype(np.float64) @ w.T, atol_scale=1e-4)


def test_grids_fold_into_two_dimensions(device, ws, rng):
    """Grids beyond maxComputeWorkGroupCount[0] are folded into (x, y); a tiny
    limit forces the fold here for a matmul, an elementwise op and argmax."""
    kn = kernels_for(device, max_x=3)
    M, K = 70, 32
    raw, w = random_quantized("q4_0", M, K, rng)
    mat = upload_matrix(ws, "q4_0", raw, M, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    xr, yr = ws.act_region(K, x), ws.act_region(M)
    a = rng.standard_normal(1000).astype(np.float32)
    ar, br = ws.act_region(1000, a), ws.act_region(1000)
    tmp = ws.act_region(kn.argmax_tmp_words(1000, 1))
    prog = device.program()
    kn.mul_mat(prog, mat, xr, K, yr, M, 1)
    kn.add(prog, ar, 1000, ar, 1000, br, 1000, 1000, 1)
    kn.argmax(prog, ar, 1000, 1000, 1, ws.params, 300, tmp)
    prog.run()
    _close(ws.read(yr), (x.astype(np.float64) @ w.T)[0], atol_scale=1e-4)
    np.testing.assert_array_equal(ws.read(br), 2 * a)
    assert ws.params.array()[300] == a.argmax()


# -- embedding ----------------------------------------------------------------

@pytest.mark.parametrize("wt", WEIGHT_TYPES)
def test_get_rows(device, kernels, ws, rng, wt):
    V, K, n = 50, _cols(wt), 7
    raw, w = random_quantized(wt, V, K, rng)
    mat = upload_matrix(ws, wt, raw, V, K)
    ids = rng.integers(0, V, n).astype(np.uint32)
    ws.params.array()[10:10 + n] = ids
    ys = K + 8
    yr = ws.act_region(2 * n * ys)
    prog = device.program()
    kernels.get_rows(prog, mat, ws.params, 10, yr, ys, n)
    kernels.get_rows(prog, mat, ws.params, 10, Region(yr.buf, yr.off + n * ys, n * ys), ys, n, scale=25.3)
    prog.run()
    got = ws.read(Region(yr.buf, yr.off, 2 * n * ys)).reshape(2 * n, ys)
    np.testing.assert_array_equal(got[:n, :K], w[ids])
    # scaled (Gemma's embeddings times sqrt(n_embd)): one float32 product a value
    np.testing.assert_array_equal(got[n:, :K], w[ids] * np.float32(25.3))
    assert np.isnan(got[:, K:]).all()


# -- norms, elementwise ---------------------------------------------------------

@pytest.fixture(params=["device-default", "gpu-variants"])
def norm_kernels(request):
    """The device's own choice, and the GPUs' workgroup-per-row RMSNorm (rms_norm_wg) whatever the device."""
    return request.getfixturevalue("kernels" if request.param == "device-default" else "column_kernels")


def test_rms_norm(device, norm_kernels, ws, rng):
    kernels = norm_kernels
    rows, n, eps = 11, 576, 1e-5
    x = (rng.standard_normal((rows, n)) * 3).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    wr = ws.weight_region(w)
    xr = ws.act_region(rows * n, x)
    yr = ws.act_region(rows * n)
    prog = device.program()
    kernels.rms_norm(prog, wr, xr, n, yr, n, n, rows, eps, ws.params)
    prog.run()
    _close(ws.read(yr).reshape(rows, n), ref.rms_norm(x, w, eps))


def test_rms_norm_gathers_rows(device, norm_kernels, ws, rng):
    kernels = norm_kernels
    rows, n, eps = 9, 100, 1e-6  # n not a multiple of the subgroup
    x = rng.standard_normal((rows, n)).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    pick = np.array([8, 0, 5], np.uint32)
    ws.params.array()[100:103] = pick
    wr = ws.weight_region(w)
    xr = ws.act_region(rows * n, x)
    yr = ws.act_region(3 * n)
    prog = device.program()
    kernels.rms_norm(prog, wr, xr, n, yr, n, n, 3, eps, ws.params, map_off=100)
    prog.run()
    _close(ws.read(yr).reshape(3, n), ref.rms_norm(x[pick], w, eps))


@pytest.mark.parametrize("F", [1537, 1536])
def test_swiglu(device, kernels, ws, rng, F):
    """scalar (F odd) and vec4 (F, offsets and strides multiples of 4) kernels:
    the same expression per element, so the same bits"""
    rows = 5
    gu = rng.standard_normal((rows, 2 * F)).astype(np.float32) * 4
    gr = ws.act_region(rows * 2 * F, gu)
    yr = ws.act_region(rows * F)
    assert (gr.off % 4 == 0 and yr.off % 4 == 0) or F % 4
    prog = device.program()
    kernels.swiglu(prog, gr, 2 * F, yr, F, F, rows)
    prog.run()
    _close(ws.read(yr).reshape(rows, F), ref.silu(gu[:, :F]) * gu[:, F:])
    # GeGLU (Gemma): GELU's tanh form for silu; gates up to 24 reach the clamp of tanh's argument
    prog = device.program()
    kernels.swiglu(prog, gr, 2 * F, yr, F, F, rows, gelu=True)
    prog.run()
    g = gu[:, :F].astype(np.float64) * 1.0
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    _close(ws.read(yr).reshape(rows, F), (gelu * gu[:, F:]).astype(np.float32))
    # gpt-oss's clamped SwiGLU (ggml's swiglu_oai): gates above 7 and ups past +-7 clamped
    prog = device.program()
    kernels.swiglu(prog, gr, 2 * F, yr, F, F, rows, oai=(1.702, 7.0))
    prog.run()
    x = np.minimum(gu[:, :F].astype(np.float64), 7.0)
    want = x / (1 + np.exp(-1.702 * x)) * (np.clip(gu[:, F:].astype(np.float64), -7.0, 7.0) + 1)
    assert (np.abs(gu) > 7).any()
    _close(ws.read(yr).reshape(rows, F), want.astype(np.float32))


def test_softcap(device, kernels, ws, rng):
    """x = cap * tanh(x / cap) in place (Gemma 2's logits), rows of a stride
    wider than the row, large values at +-cap"""
    rows, n, stride, cap = 3, 1001, 1004, 30.0
    x = (rng.standard_normal((rows, stride)) * 40).astype(np.float32)
    x[0, :4] = [1e30, -1e30, 600.0, -600.0]
    xr = ws.act_region(rows * stride, x)
    prog = device.program()
    kernels.softcap(prog, xr, stride, n, rows, cap)
    prog.run()
    got = ws.read(xr).reshape(rows, stride)
    _close(got[:, :n], (cap * np.tanh(x[:, :n].astype(np.float64) / cap)).astype(np.float32))
    np.testing.assert_array_equal(got[:, n:], x[:, n:])
    assert (got[0, :4] == [cap, -cap, cap, -cap]).all()


def test_add(device, kernels, ws, rng):
    rows, n = 3, 999
    a = rng.standard_normal((rows, n)).astype(np.float32)
    b = rng.standard_normal((rows, n)).astype(np.float32)
    ar, br, yr = ws.act_region(rows * n, a), ws.act_region(rows * n, b), ws.act_region(rows * n)
    prog = device.program()
    kernels.add(prog, ar, n, br, n, yr, n, n, rows)
    prog.run()
    np.testing.assert_array_equal(ws.read(yr).reshape(rows, n), a + b)


def test_add_bias(device, kernels, ws, rng):
    """A weight vector added to the first n values of each strided row; the rest untouched."""
    rows, n, stride = 5, 1001, 1040
    y = rng.standard_normal((rows, stride)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    yr, br = ws.act_region(rows * stride, y), ws.weight_region(b)
    prog = device.program()
    kernels.add_bias(prog, br, yr, stride, n, rows)
    prog.run()
    want = y.copy()
    want[:, :n] += b
    np.testing.assert_array_equal(ws.read(yr).reshape(rows, stride), want)


def test_softmax(device, kernels, ws, rng):
    rows, n = 6, 4099
    x = rng.standard_normal((rows, n)).astype(np.float32) * 5
    xr, yr = ws.act_region(rows * n, x), ws.act_region(rows * n)
    prog = device.program()
    kernels.softmax(prog, xr, n, yr, n, n, rows, scale=0.7)
    prog.run()
    _close(ws.read(yr).reshape(rows, n), ref.softmax(x * 0.7), rtol=1e-4, atol_scale=1e-7)


def test_argmax(device, kernels, ws, rng):
    rows, n = 7, 49157
    x = np.zeros((rows, n + 3), np.float32)
    x[:, :n] = rng.standard_normal((rows, n))
    x[:, n:] = 1e9                       # beyond n: must be ignored
    x[2, 100] = x[2, 40000] = 50.0       # tie: lowest index wins, as numpy
    x[5, :] = -3.0                       # all equal
    xr = ws.act_region(rows * (n + 3), x)   # n odd: a scalar tail after the vec4s
    tmp = ws.act_region(kernels.argmax_tmp_words(n, rows))
    prog = device.program()
    kernels.argmax(prog, xr, n + 3, n, rows, ws.params, 200, tmp)
    prog.run()
    np.testing.assert_array_equal(ws.params.array()[200:200 + rows], x[:, :n].argmax(1))


# -- RoPE + KV cache, attention ----------------------------------------------------

def _kv_setup(ws, n_slots, ctx, n_kv, hd, kv=KVTypes()):
    """K and V regions of a cache of kv's types (kv_util's layouts) and K's slot stride (what the kernels take)"""
    cap = kv_util.capacity(ctx, kv)
    k = ws.act_region(n_slots * kv_util.slot_words(kv.k, cap, n_kv, hd))
    v = ws.act_region(n_slots * kv_util.slot_words(kv.v, cap, n_kv, hd))
    return k, v, kv_util.slot_words(kv.k, cap, n_kv, hd)


def _read_cache(ws, r, n_slots, ctx, n_kv, hd):
    return ws.read(r, np.uint32).view(np.float16).astype(np.float32).reshape(n_slots, ctx, n_kv, hd)


KV_Q8 = {"k": KVTypes("q8_0", "f16"), "v": KVTypes("f16", "q8_0"), "kv": KVTypes("q8_0", "q8_0")}


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n_rot_frac", [1, 2])
@pytest.mark.parametrize("kv", ["f16", *KV_Q8])
def test_rope_kv(device, kernels, ws, rng, neox, n_rot_frac, kv):
    """q rotated to q_out, k rotated and v into the cache at each row's (slot,
    position): f16, or q8_0 blocks (kv: which side) as llama.cpp's quantizer
    makes them of the same floats; nothing else of the cache written."""
    types = KV_Q8.get(kv, KVTypes())
    # q8_0: a context that is not a multiple of 4 (the slots' positions are rounded up), and 1 or 2 scale words a head
    rows, n_head, n_kv, hd, ctx, n_slots = 5, 6, 2, 128 if kv in ("k", "v") else 64, 40 if kv == "f16" else 39, 3
    n_rot = hd // n_rot_frac
    base = 10000.0
    from vkengine.rope import rope_table
    table = ws.weight_region(rope_table(ctx, n_rot, base))
    width = (n_head + 2 * n_kv) * hd
    qkv = rng.standard_normal((rows, width)).astype(np.float32)
    pos = rng.integers(0, ctx, rows).astype(np.uint32)
    slots = rng.permutation(np.repeat(np.arange(n_slots), 2))[:rows].astype(np.uint32)
    # distinct (slot, pos) for every slot: two rows writing one KV row would make
    # the test depend on write order (it failed ~1 run in 5 before)
    for s in np.unique(slots):
        pos[slots == s] = rng.choice(ctx, (slots == s).sum(), replace=False)
    pos[slots == slots[0]] = np.arange((slots == slots[0]).sum()) + 3
    ws.params.array()[0:rows] = pos
    ws.params.array()[50:50 + rows] = slots
    qr = ws.act_region(rows * width, qkv)
    qo = ws.act_region(rows * n_head * hd)
    kc, vc, ss = _kv_setup(ws, n_slots, ctx, n_kv, hd, types)
    prog = device.program()
    kernels.rope_kv(prog, table, qr, width, qo, n_head * hd, rows, n_head, n_kv, hd, n_rot, neox,
                    kc, vc, ss, ws.params, 0, 50, kv_types=types)
    prog.run()
    q = qkv[:, : n_head * hd].reshape(rows, n_head, hd)
    k = qkv[:, n_head * hd: (n_head + n_kv) * hd].reshape(rows, n_kv, hd)
    v = qkv[:, (n_head + n_kv) * hd:].reshape(rows, n_kv, hd)
    _close(ws.read(qo).reshape(rows, n_head, hd), ref.rope(q, pos, n_rot, base, neox), atol_scale=1e-6)
    cap = kv_util.capacity(ctx, types)
    kv_util.check_written(ws.read(kc, np.uint32), types.k, ref.rope(k, pos, n_rot, base, neox), slots, pos,
                          n_slots, cap, n_kv, hd, tol=1e-3)
    kv_util.check_written(ws.read(vc, np.uint32), types.v, v, slots, pos, n_slots, cap, n_kv, hd)




class _AttentionCase:
    """A filled KV cache (kv's types: f16 values or random q8_0 blocks), rows'
    positions and slots in params (positions at word 0, slots at slot_off),
    random q and an output region. kvals, vvals: the cache's values as floats."""

    def __init__(self, ws, rng, n_slots, ctx, n_head, n_kv, hd, slots, pos, slot_off, kv=KVTypes(), grow=None):
        self.kc, self.vc, self.ss = _kv_setup(ws, n_slots, ctx, n_kv, hd, kv)
        self.kv = kv
        shape = (n_slots, kv_util.capacity(ctx, kv), n_kv, hd)
        kw, self.kvals = kv_util.random_side(rng, kv.k, shape, grow)
        vw, self.vvals = kv_util.random_side(rng, kv.v, shape)
        ws.device.upload(self.kc.buf, kw, self.kc.off * 4)
        ws.device.upload(self.vc.buf, vw, self.vc.off * 4)
        rows = len(slots)
        ws.params.array()[0:rows] = pos
        ws.params.array()[slot_off:slot_off + rows] = slots
        self.slots, self.pos, self.shape = slots, pos, (rows, n_head, hd)
        self.q = rng.standard_normal(self.shape).astype(np.float32)
        self.qr = ws.act_region(self.q.size, self.q)
        self.orr = ws.act_region(self.q.size)
        self.scale = 1 / np.sqrt(hd)

    def check(self, got, q, window=0, softcap=0.0, ring=0, sinks=None, **tol):
        """got (the output region's floats) against numpy attention of q
        (window > 0: each row over its last `window` positions; ring > 0: the
        cache a ring of that many positions, position t at row t % ring)"""
        got = got.reshape(self.shape)
        for r, (s, p) in enumerate(zip(self.slots, self.pos)):
            lo = max(0, int(p) + 1 - window) if window else 0
            rows = np.arange(lo, p + 1) % ring if ring else np.arange(lo, p + 1)
            want = ref.attention(q[r], self.kvals[s, rows], self.vvals[s, rows], self.scale, softcap, sinks)
            _close(got[r], want, **tol)


@pytest.mark.parametrize("split", ["none", "slices", "dec"])
@pytest.mark.parametrize("hd,n_head,n_kv,kv", [(64, 9, 3, "f16"), (128, 4, 4, "f16"), (32, 8, 1, "f16"),
                                               (64, 9, 3, "kv"), (128, 4, 4, "k"), (64, 4, 2, "v")])
def test_attention_mixed_batch(device, kernels, ws, rng, hd, n_head, n_kv, kv, split):
    """A prefill chunk of one slot (causal) and decode rows of two others in one
    dispatch, against numpy on the same cache contents (split: rows within
    one slice or part and rows over several, merged; "slices": attention.comp's
    64-position slices, "dec": attention_dec.comp's parts by KV-head group; kv:
    f16, or which sides are q8_0 blocks, dequantized by the reference)."""
    kernels = with_caps(kernels, attention_dec=split == "dec", attn_items=16)
    slots = np.array([0, 0, 0, 0, 0, 2, 1, 1], np.uint32)
    pos = np.array([0, 1, 2, 3, 4, 229, 33, 150], np.uint32)
    ctx, rows = 230, len(slots)
    types = KV_Q8.get(kv, KVTypes())
    c = _AttentionCase(ws, rng, 3, ctx, n_head, n_kv, hd, slots, pos, 20, types)
    kc, vc, ss, qr, orr, scale = c.kc, c.vc, c.ss, c.qr, c.orr, c.scale
    on = split != "none"
    tmp = ws.act_region(kernels.attention_tmp_words(rows, n_head, n_kv, hd, ctx)) if on else None
    n_sync = kernels.attention_sync_words(rows, n_head)
    sync = ws.act_region(n_sync, np.zeros(n_sync, np.uint32)) if on else None
    prog = device.program()
    kernels.attention(prog, qr, n_head * hd, orr, n_head * hd, rows, n_head, n_kv, hd, kc, vc, ss,
                      ws.params, 0, 20, scale, tmp, ctx, sync, kv_types=types)
    # twice: split-K's slices merge through counters that must be left zero
    for _ in range(2):
        ws.device.upload(orr.buf, np.full(orr.words, 0x7FC00000, np.uint32), orr.off * 4)
        prog.run()
        c.check(ws.read(orr), c.q, atol_scale=1e-5)
        if on:
            assert (ws.read(sync, np.uint32) == 0).all()


@pytest.mark.parametrize("hd,n_head,n_kv,kv", [(64, 9, 3, "f16"), (256, 4, 2, "f16"), (64, 4, 2, "kv")])
def test_attention_dec_takes_the_heads_gates(device, kernels, ws, rng, hd, n_head, n_kv, kv):
    """attention(gate=...) on attention_dec.comp (Qwen3.5's gated attention):
    each head's output times sigmoid of its gate (interleaved after each head's
    query), bit for bit what the attention then sigmoid_mul give, for rows whose
    positions one workgroup takes and rows merged from several."""
    kernels = with_caps(kernels, split_attention=True, attention_dec=True, attn_items=16)
    slots = np.array([0, 2, 1, 1], np.uint32)
    pos = np.array([3, 229, 33, 150], np.uint32)
    ctx, rows = 230, len(slots)
    types = KV_Q8.get(kv, KVTypes())
    c = _AttentionCase(ws, rng, 3, ctx, n_head, n_kv, hd, slots, pos, 20, types)
    qg = (rng.standard_normal((rows, n_head, 2, hd)) * 2).astype(np.float32)   # [q0 g0 q1 g1 ...]
    gr = ws.act_region(qg.size, qg)
    tmp = ws.act_region(kernels.attention_tmp_words(rows, n_head, n_kv, hd, ctx))
    n_sync = kernels.attention_sync_words(rows, n_head)
    sync = ws.act_region(n_sync, np.zeros(n_sync, np.uint32))
    outs = []
    for fused in (False, True):
        orr = ws.act_region(rows * n_head * hd)
        prog = device.program()
        took = kernels.attention(prog, c.qr, n_head * hd, orr, n_head * hd, rows, n_head, n_kv, hd, c.kc, c.vc,
                                 c.ss, ws.params, 0, 20, c.scale, tmp, ctx, sync, kv_types=types,
                                 gate=(gr.at(hd, qg.size - hd), 2 * n_head * hd, 2 * hd) if fused else None)
        assert took == fused
        if not fused:
            kernels.sigmoid_mul(prog, orr, n_head * hd, gr.at(hd, qg.size - hd), 2 * n_head * hd, hd, 2 * hd, 1,
                                orr, n_head * hd, n_head * hd, rows)
        prog.run()
        outs.append(ws.read(orr))
        assert (ws.read(sync, np.uint32) == 0).all()
    np.testing.assert_array_equal(outs[1], outs[0])
    plain = outs[0].reshape(rows, n_head, hd) * (1 + np.exp(-qg[:, :, 1].astype(np.float64)))   # (ungated)
    c.check(plain.reshape(-1).astype(np.float32), c.q, atol_scale=1e-4)


@pytest.mark.parametrize("hd,n_head,n_kv,items,kv,lp,kpf,group,vw,cmb", [c + (False, True)[len(c) - 8:] for c in [
    *[(hd, nh, nkv, items, "f16", False, True, 8) for hd, nh, nkv in [(64, 8, 2), (128, 20, 1), (256, 6, 3)]
      for items in (16, 1024)],
    (64, 8, 2, 1024, "kv", False, True, 8), (128, 20, 1, 1024, "k", False, True, 8),
    (256, 6, 3, 1024, "v", False, True, 8),
    *[(hd, nh, nkv, 1024, "f16", True, True, 8) for hd, nh, nkv in [(64, 8, 2), (128, 20, 1), (256, 6, 3)]],
    (128, 8, 2, 16, "v", True, True, 8), (128, 8, 2, 1024, "f16", False, False, 8),
    (64, 8, 2, 16, "v", False, False, 8),
    # items of at most 2 query heads (Caps.attn_group): 20 heads as 10 items, 6 as 3, 5 as 2 + 2 + 1
    (128, 20, 1, 1024, "f16", False, True, 2), (256, 6, 3, 16, "f16", True, True, 2),
    (64, 10, 2, 1024, "kv", False, True, 2), (256, 16, 2, 1024, "f16", False, False, 1),
    # V rows in uvec4s (Caps.attn_vwide): K f16 or q8_0, lanes a position or one, 1-8 heads an item; 96-wide heads
    # keep an f16 pair a lane
    *[(hd, nh, nkv, items, kv, lp, False, group, True) for hd, nh, nkv, items, kv, lp, group in [
        (64, 8, 2, 1024, "f16", False, 8), (128, 8, 2, 1024, "f16", True, 2), (128, 8, 2, 16, "f16", True, 4),
        (128, 20, 1, 1024, "k", False, 8), (256, 6, 3, 1024, "f16", True, 1), (256, 6, 3, 16, "k", False, 2),
        (96, 8, 2, 1024, "f16", False, 4)]],
    # a workgroup's subgroups one after another (Caps.attn_combine off; the cases above combine them in one round):
    # wide V rows or narrow, q8_0 V, a KV head's heads in several items, items 16 (parts of several subgroups'
    # positions); 16 heads of 128 an item: one round's slots (33 KB) past lavapipe's 32 KB of shared memory, the
    # serial combine there, one round on NVIDIA's 48 KB
    (128, 8, 2, 1024, "f16", True, False, 2, True, False), (64, 8, 2, 16, "v", False, True, 8, False, False),
    (256, 6, 3, 1024, "f16", True, False, 1, True, False), (96, 8, 2, 16, "f16", False, True, 4, False, False),
    (128, 16, 1, 1024, "f16", False, False, 16)]])
def test_attention_decode_depth(device, kernels, rng, hd, n_head, n_kv, items, kv, lp, kpf, group, vw, cmb):
    """attention_dec at depth: decode rows of four slots at positions far below
    and near the context's end, on and beside part boundaries (parts of 32
    positions and more), in one step, against numpy; each row's output equals
    the same row decoded alone, bit for bit (a part's size follows only its
    row's position). (128, 20, 1): 20 query heads of one KV head, as three
    items of at most 8; items 16: the fewest parts (8), long parts. kv: f16,
    or which sides are q8_0 blocks. lp: positions scored by several lanes
    (Caps.attn_lp). kpf: the next tile's K rows loaded during the tile before
    (Caps.attn_kpf; heads of up to 128, f16 K, a lane a position). group:
    the most query heads an item takes (Caps.attn_group: their dims). vw:
    V rows read in uvec4s by groups of lanes (Caps.attn_vwide). cmb: a
    workgroup's subgroups combined in one round where their slots fit the
    device's shared memory (Caps.attn_combine), else one after another."""
    kernels = with_caps(kernels, split_attention=True, attention_dec=True, attn_items=items, attn_lp=hd if lp else 0,
                        attn_kpf=kpf, attn_group=group * hd, attn_khoist=lp, attn_vwide=vw, attn_combine=cmb)
    gq = kernels.dec_layout(n_head, n_kv, hd)[0]
    slots = (kernels.caps.items * gq * (hd + 2) + hd + 3) * 4
    assert kernels.dec_combine(gq, hd) == int(cmb and slots <= device.info.max_shared_memory)
    n4 = hd // 8   # (uvec4s a row: wide V rows where they are a power of two, Phi-3's 96-wide heads not)
    assert kernels.dec_vwide(hd, KV_Q8.get(kv, KVTypes()).tag) == (kernels.min_subgroup() if vw and not n4 & (n4 - 1)
                                                                   else 0)
    assert kernels.dec_kpf(hd, kernels.dec_lanes(hd), KV_Q8.get(kv, KVTypes()).tag) == (
        hd // 8 if kpf and not lp and hd <= 128 and kv in ("f16", "v") else 0)
    assert kernels.dec_lanes(hd) == (1 if not lp else min(hd // 16, 8 if not device.info.subgroups_fixed
                                                          else kernels.caps.sg))
    ws = Workspace(device, act_words=12 << 20)
    ctx = 2600
    slots = np.array([0, 1, 2, 3, 1, 0], np.uint32)
    pos = np.array([2599, 31, 1024, 255, 32, 1999], np.uint32)
    rows = len(slots)
    types = KV_Q8.get(kv, KVTypes())
    c = _AttentionCase(ws, rng, 4, ctx, n_head, n_kv, hd, slots, pos, 20, types)
    tmp = ws.act_region(kernels.attention_tmp_words(rows, n_head, n_kv, hd, ctx))
    n_sync = kernels.attention_sync_words(rows, n_head)
    sync = ws.act_region(n_sync, np.zeros(n_sync, np.uint32))
    prog = device.program()
    kernels.attention(prog, c.qr, n_head * hd, c.orr, n_head * hd, rows, n_head, n_kv, hd, c.kc, c.vc, c.ss,
                      ws.params, 0, 20, c.scale, tmp, ctx, sync, kv_types=types)
    ws.device.upload(c.orr.buf, np.full(c.orr.words, 0x7FC00000, np.uint32), c.orr.off * 4)
    prog.run()
    got = ws.read(c.orr).copy()
    c.check(got, c.q, atol_scale=1e-5)
    assert (ws.read(sync, np.uint32) == 0).all()
    # row 2 alone (its q first, its position and slot in params' first words)
    q1 = ws.act_region(n_head * hd, c.q[2].reshape(-1))
    o1 = ws.act_region(n_head * hd)
    saved = ws.params.array()[:32].copy()
    ws.params.array()[0], ws.params.array()[20] = pos[2], slots[2]
    prog = device.program()
    kernels.attention(prog, q1, n_head * hd, o1, n_head * hd, 1, n_head, n_kv, hd, c.kc, c.vc, c.ss,
                      ws.params, 0, 20, c.scale, tmp, ctx, sync, kv_types=types)
    prog.run()
    ws.params.array()[:32] = saved
    np.testing.assert_array_equal(ws.read(o1), got.reshape(rows, -1)[2])
    ws.close()


@pytest.mark.parametrize("hd,n_head,n_kv,items,kv,lp,group,vw,cmb,mb,pd", [
    (128, 8, 2, 1024, "f16", True, 2, True, True, 8, False), (64, 8, 2, 1024, "kv", False, 8, False, False, 3, False),
    (256, 6, 3, 1024, "f16", True, 1, True, True, 16, False), (128, 20, 1, 16, "v", False, 8, False, True, 0, False),
    (128, 8, 2, 16, "f16", True, 2, True, True, 0, True), (64, 8, 2, 16, "k", False, 8, False, False, 8, True),
    (128, 8, 2, 1024, "f16", True, 2, True, True, 8, True)])
def test_attention_decode_depth_merge_and_parts(device, kernels, rng, hd, n_head, n_kv, items, kv, lp, group, vw,
                                                cmb, mb, pd):
    """The depth test's checks (numpy; a row alone equals the row batched,
    bit for bit) with Caps.attn_merge (mb > 0: the last workgroup merges a
    row's partials in one pass of rounds of mb, the sums rescaled to the
    running max; rows of many partials with items 1024, parts of 32 positions
    up to 2,600, and of few with items 16; rounds of 3 split them unevenly;
    0: in two passes, the maxima first)
    and Caps.attn_parts_down (pd: parts of whole tiles rounded down on a grid
    of twice the parts; items 16: 16 parts, a row at 2,600 positions in 9 of
    320)."""
    test_attention_decode_depth(device, with_caps(kernels, attn_merge=mb, attn_parts_down=pd), rng, hd, n_head, n_kv,
                                items, kv, lp, False, group, vw, cmb)


@pytest.mark.parametrize("group", [2, 4])
def test_attention_dec_k_hoist_and_v_rows_give_the_same_bits(device, kernels, rng, group):
    """Caps.attn_khoist (lanes a position: a tile's K segments for all passes
    loaded before its dot products, past the row's end its last row scored
    and masked), Caps.attn_vb (V rows a lane loads ahead), Caps.attn_vpre (a
    tile's first V loads before its scores; wide V rows or an f16 pair a lane)
    and Caps.attn_qsh (q read from shared memory, not a lane's registers) move
    loads, not arithmetic: decode rows at depth give the default kernel's
    outputs bit for bit (and numpy's within rounding; the f16-pair forms, whose
    sums are in another order, each other's)."""
    hd, n_head, n_kv = 128, 8, 2
    ws = Workspace(device, act_words=12 << 20)
    ctx = 1100
    slots = np.array([0, 1, 2, 1], np.uint32)
    pos = np.array([1099, 31, 517, 40], np.uint32)
    rows = len(slots)
    c = _AttentionCase(ws, rng, 3, ctx, n_head, n_kv, hd, slots, pos, 20, KVTypes())
    outs, wide = [], []
    for kh, vb, vpre, qsh, vw in ((False, 0, False, False, True), (True, 0, False, False, True),
                                  (True, 32, False, False, True), (False, 8, False, False, True),
                                  (True, 0, True, False, True), (True, 0, True, True, True),
                                  (True, 0, False, False, False), (True, 0, True, True, False)):
        kn = with_caps(kernels, split_attention=True, attention_dec=True, attn_items=256, attn_lp=hd,
                       attn_group=group * hd, attn_khoist=kh, attn_vb=vb, attn_combine=False, attn_vpre=vpre,
                       attn_qsh=qsh, attn_vwide=vw)
        assert kn.dec_lanes(hd) > 1
        wide.append(bool(kn.dec_vwide(hd, "")))
        tmp = ws.act_region(kn.attention_tmp_words(rows, n_head, n_kv, hd, ctx))
        n_sync = kn.attention_sync_words(rows, n_head)
        sync = ws.act_region(n_sync, np.zeros(n_sync, np.uint32))
        prog = device.program()
        kn.attention(prog, c.qr, n_head * hd, c.orr, n_head * hd, rows, n_head, n_kv, hd, c.kc, c.vc, c.ss,
                     ws.params, 0, 20, c.scale, tmp, ctx, sync, kv_types=KVTypes())
        ws.device.upload(c.orr.buf, np.full(c.orr.words, 0x7FC00000, np.uint32), c.orr.off * 4)
        prog.run()
        outs.append(ws.read(c.orr).copy())
        assert (ws.read(sync, np.uint32) == 0).all()
    c.check(outs[0], c.q, atol_scale=1e-5)
    c.check(outs[-1], c.q, atol_scale=1e-5)
    assert wide == [True] * 6 + [False] * 2
    for o, w in zip(outs[1:], wide[1:]):
        np.testing.assert_array_equal(o, outs[0] if w else outs[-2])
    ws.close()


_MC_CASES = [(64, 8, 2, False, "f16"), (128, 4, 1, True, "f16"), (128, 3, 3, True, "f16"), (64, 8, 1, False, "f16"),
             (128, 6, 3, False, "f16"), (64, 8, 2, False, "kv"), (128, 4, 1, True, "kv"), (128, 6, 3, False, "k"),
             (64, 8, 1, True, "v"), (256, 8, 2, True, "f16"), (256, 3, 3, False, "f16"), (256, 5, 1, False, "f16"),
             (256, 8, 2, True, "kv")]


@pytest.mark.parametrize("hd,n_head,n_kv,grow,kv,form", [(*c, "mc") for c in _MC_CASES]
                         + [(*c, f) for c in _MC_CASES if c[4] == "f16" for f in ("mc2", "mc2of16", "mc2of16nr")])
@pytest.mark.parametrize("parts", [1, 3, 16])
def test_attention_coopmat(device, coopmat_kernels, ws, rng, hd, n_head, n_kv, grow, kv, form, parts):
    """attention_mc (cooperative matrices, prompt-sized steps): two prefill
    chunks of different slots (positions past several 32-position blocks) and
    decode rows of a third in one dispatch, so that 16-row blocks mix slots
    (and a workgroup's subgroups: KV groups of 1, 2, 4 and 8 heads; 256-wide
    heads: two subgroups a row block, half the dims each); against
    numpy with q rounded to halves as the kernel does (its fp16 probabilities
    are what the tolerance allows for). grow: keys larger with the position,
    so that later blocks raise a row's running max past the kernel's slack and
    its output is rescaled. kv: f16, or which sides are q8_0 blocks (the
    kernel dequantizes them to halves as it stages them). parts 3, 16: the
    split form (each workgroup's positions cut into pieces of whole 32-position
    blocks across workgroups, then merged: attention_merge.comp), as prompt
    rows at depth take it; 16 leaves pieces that hold none of a row's
    positions. form mc2: attention_mc2.comp (NVIDIA's workgroup-scope
    matrices, f16 caches; 64-row blocks, so all three slots share one);
    mc2of16: the same with O accumulated in halves (twice the tolerance);
    mc2of16nr: and each row's m and l over 16 columns (Caps.attn_mc2_narrow)."""
    mc2 = form.startswith("mc2")
    of16 = form.startswith("mc2of16")
    kn = with_caps(coopmat_kernels, attention_mc2=mc2, attn_mc2_of16=of16, attn_mc2_narrow=form == "mc2of16nr")
    if mc2 and not device_has_coopmat2(device):
        pytest.skip("the device has no VK_NV_cooperative_matrix2 (attention_mc2: NVIDIA GPUs)")
    assert kn.attention_on_coopmat(62, hd)
    assert kn.attention_on_coopmat2(62, hd) == mc2
    slots = np.array([0] * 40 + [2, 2] + [1] * 20, np.uint32)
    pos = np.array(list(range(40)) + [99, 64] + list(range(50, 70)), np.uint32)
    types = KV_Q8.get(kv, KVTypes())
    ctx = 100
    growth = 1 + 0.15 * np.arange(kv_util.capacity(ctx, types)) if grow else None
    c = _AttentionCase(ws, rng, 3, ctx, n_head, n_kv, hd, slots, pos, 100, types, grow=growth)
    # the kernel stages dequantized q8_0 values as halves (as llama.cpp's coopmat flash attention does): the
    # reference takes them rounded so too (with growing 256-wide keys the rounding alone moved outputs past
    # the tolerance: the H200 run of 2026-12-03 failed (256, 8, 2, True, "kv") against exact values, and
    # numpy's attention of the values rounded to halves is 1.6e-3 outside that tolerance of the exact one)
    c.kvals = c.kvals.astype(np.float16).astype(np.float32)
    c.vvals = c.vvals.astype(np.float16).astype(np.float32)
    prog = device.program()
    kn.attention(prog, c.qr, n_head * hd, c.orr, n_head * hd, len(slots), n_head, n_kv, hd, c.kc, c.vc,
                 c.ss, ws.params, 0, 100, c.scale, n_ctx=ctx, kv_types=types, mc_parts=parts)
    assert any(op.label.endswith("_merge") for op in prog.ops) == (parts > 1)
    prog.run()
    tol = 4e-3 if of16 else 2e-3
    # attention_mc2 rounds q already scaled to halves (as llama.cpp's flash_attn_cm2), attention_mc q itself: the
    # reference takes q so rounded (the H100 run of 2026-12-06 failed the growing keys of 128-wide heads against
    # q rounded unscaled: their scores are large enough for the two roundings to part by more than the tolerance)
    qh = ((c.q * c.scale).astype(np.float16).astype(np.float64) / c.scale if mc2
          else c.q.astype(np.float16)).astype(np.float32)
    c.check(ws.read(c.orr), qh, rtol=tol, atol_scale=tol)


@pytest.mark.parametrize("window,sink", [(0, False), (40, False), (0, True), (40, True)])
def test_attention_merge(device, kernels, ws, rng, window, sink):
    """attention_merge.comp (the split form of attention_mc, combined): each
    row's visible positions cut into 5 pieces at random points (some pieces
    empty: m = -inf, l = 0, as the kernel leaves them), whose (O, m, l) numpy
    computes with m above the piece's true max (the kernel's m may lag its
    rows' max), against numpy attention over the row's whole range."""
    n_head, hd, n_parts, ctx = 3, 40, 5, 130
    pos = np.array([0, 31, 32, 100, 129, 77], np.uint32)
    rows = len(pos)
    scores = rng.standard_normal((rows, n_head, ctx)).astype(np.float64) * 3
    vals = rng.standard_normal((rows, n_head, ctx, hd))
    sinks = rng.standard_normal(n_head) * 2 if sink else None
    parts = np.zeros((n_parts, rows, n_head, hd + 2), np.float32)
    parts[:, :, :, hd] = -np.inf
    want = np.zeros((rows, n_head, hd))
    for r, p in enumerate(pos):
        lo = max(0, int(p) + 1 - window) if window else 0
        for h in range(n_head):
            sc, v = scores[r, h, lo:p + 1], vals[r, h, lo:p + 1]
            e = np.exp(sc - sc.max())
            den = e.sum() + (np.exp(sinks[h] - sc.max()) if sink else 0.0)
            want[r, h] = e @ v / den
            cuts = np.sort(rng.integers(lo, int(p) + 2, n_parts - 1))
            for z, (a, b) in enumerate(zip([lo, *cuts], [*cuts, int(p) + 1])):
                if a == b:
                    continue
                m = scores[r, h, a:b].max() + rng.uniform(0, 3)   # a running max that lags
                ez = np.exp(scores[r, h, a:b] - m)
                parts[z, r, h, :hd] = ez @ vals[r, h, a:b]
                parts[z, r, h, hd], parts[z, r, h, hd + 1] = m, ez.sum()
    assert (parts[:, :, :, hd] == -np.inf).any()
    pr = ws.act_region(parts.size, parts.reshape(-1))
    orr = ws.act_region(rows * n_head * hd, np.full(rows * n_head * hd, np.nan, np.float32))
    sr = ws.weight_region(sinks.astype(np.float32)) if sink else None
    c = kernels.caps
    push = kernels._push("attention_merge", o_off=orr.off, o_stride=n_head * hd, n_rows=rows, n_head=n_head,
                         head_dim=hd, n_parts=n_parts, part_off=pr.off,
                         sink_off=sr.off if sr is not None else 0xFFFFFFFF)
    alg = kernels._alg("attention_merge", [orr.buf, pr.buf, sr.buf if sr is not None else pr.buf], push, c.wg)
    prog = device.program()
    prog.dispatch(alg, push, kernels._grid(-(-rows * n_head // c.items)), [pr.range], [orr.range], "merge")
    prog.run()
    _close(ws.read(orr).reshape(rows, n_head, hd), want, rtol=1e-4, atol_scale=1e-5)


@pytest.mark.parametrize("path", ["none", "slices", "dec", "mc", "mc64", "mc_split", "mc64_split", "mc2", "mc2_split"])
@pytest.mark.parametrize("window,softcap,kv,ring,sink", [
    (40, 0.0, "f16", 0, False), (7, 0.0, "kv", 0, False), (40, 2.0, "f16", 0, False), (0, 1.5, "f16", 0, False),
    (64, 0.0, "f16", 0, False), (40, 0.0, "f16", 100, False), (40, 2.0, "kv", 100, False),
    (0, 0.0, "f16", 0, True), (40, 0.0, "kv", 100, True)])
def test_attention_window_softcap(device, kernels, coopmat_kernels_or_none, ws, rng, path, window, softcap, kv,
                                  ring, sink):
    """Sliding-window layers (each row sees its last `window` positions: Gemma's
    local layers) and Gemma 2's score soft-cap, on every attention path: one
    pass, attention.comp's 64-position slices, attention_dec's parts and
    attention_mc's cooperative matrices (GPUs; 256-wide heads: two subgroups a
    row block, "mc64": 64-wide, one; "_split": its split form, each
    workgroup's positions in 5 parts across workgroups, then merged;
    "mc2": attention_mc2 (NVIDIA's workgroup-scope matrices) with 64-wide heads,
    "mc2_split" with 256-wide ones, where the cache is f16 and does not wrap
    (attention_mc otherwise)): a prefill chunk of 40 rows that
    crosses the window (and the 32-position blocks), decode rows of two other
    slots far past it and just inside it, against numpy. Large q so that the
    cap changes the result. ring: the cache a ring of 100 positions
    (sliding-window layers' bounded caches), the decode row at 130 reading a
    window that wraps. sink: gpt-oss's attention sinks (a logit per head,
    some above every score, some below)."""
    mc = path.startswith("mc")
    if mc:
        if coopmat_kernels_or_none is None:
            pytest.skip("the device has no 16x16x16 f16 cooperative matrices (the GPU kernel tests run these)")
        kn = with_caps(coopmat_kernels_or_none, attention_mc2=path.startswith("mc2"))
        if path.startswith("mc2") and not device_has_coopmat2(device):
            pytest.skip("the device has no VK_NV_cooperative_matrix2 (attention_mc2: NVIDIA GPUs)")
    else:
        # (43 rows would take attention_mc on GPUs: "none" is the one-pass kernel)
        kn = with_caps(kernels, attention_dec=path == "dec", attn_items=16, attention_mc=False)
    hd, n_head, n_kv = (256, 4, 2) if path in ("mc", "mc_split", "mc2_split") else (64, 6, 2)
    slots = np.array([0] * 40 + [2, 1, 2], np.uint32)
    pos = np.array(list(range(20, 60)) + [299, window - 1 if window else 5, 130], np.uint32)
    types = KV_Q8.get(kv, KVTypes())
    ctx, rows = 300, len(slots)
    c = _AttentionCase(ws, rng, 3, ring or ctx, n_head, n_kv, hd, slots, pos, 60, types)
    c.q *= 4.0
    ws.device.upload(c.qr.buf, np.ascontiguousarray(c.q).reshape(-1).view(np.uint32), c.qr.off * 4)
    on = path in ("slices", "dec")
    tmp = ws.act_region(kn.attention_tmp_words(rows, n_head, n_kv, hd, ctx)) if on else None
    n_sync = kn.attention_sync_words(rows, n_head)
    sync = ws.act_region(n_sync, np.zeros(n_sync, np.uint32)) if on else None
    if mc:
        assert kn.attention_on_coopmat(rows, hd)
        c.kvals = c.kvals.astype(np.float16).astype(np.float32)
        c.vvals = c.vvals.astype(np.float16).astype(np.float32)
    sinks = (rng.standard_normal(n_head) * 4).astype(np.float32) if sink else None
    sr = ws.weight_region(sinks) if sink else None
    prog = device.program()
    kn.attention(prog, c.qr, n_head * hd, c.orr, n_head * hd, rows, n_head, n_kv, hd, c.kc, c.vc, c.ss,
                 ws.params, 0, 60, c.scale, tmp, ctx, sync, kv_types=types, window=window, softcap=softcap,
                 ring=kv_util.capacity(ring, types) if ring else 0, sinks=sr,
                 mc_parts=5 if path.endswith("_split") else 1)
    assert any(op.label.endswith("_merge") for op in prog.ops) == path.endswith("_split")
    if mc:
        assert kn.attention_on_coopmat2(rows, hd, types, ring) == (path.startswith("mc2") and not ring and kv == "f16")
    ws.device.upload(c.orr.buf, np.full(c.orr.words, 0x7FC00000, np.uint32), c.orr.off * 4)
    prog.run()
    if mc:
        c.check(ws.read(c.orr), c.q.astype(np.float16).astype(np.float32), window, softcap, ring, sinks, rtol=2e-3,
                atol_scale=2e-3)
    else:
        c.check(ws.read(c.orr), c.q, window, softcap, ring, sinks, atol_scale=1e-5)
    if on:
        assert (ws.read(sync, np.uint32) == 0).all()


def test_copy(device, kernels, rng):
    n = 4 * 100003
    a = device.buffer(n * 4 + 64, "device", "src")
    b = device.buffer(n * 4 + 64, "device", "dst")
    data = rng.integers(0, 2**32, n, dtype=np.uint32)
    device.upload(a, data, 16)
    device.upload(b, np.full(n + 16, 7, np.uint32))
    prog = device.program()
    kernels.copy(prog, Region(a, 4, n), Region(b, 8, n))
    prog.run()
    got = device.download(b, 0, (n + 16) * 4, np.uint32)
    assert (got[8:8 + n] == data).all() and (got[:8] == 7).all() and (got[8 + n:] == 7).all()
    device.free(a)
    device.free(b)


# -- sampling on the device (topk_part.comp + sample.comp) ------------------------

def _sample_ref(x: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float, u: float):
    """Sampler's draw (vkengine/sampling.py) with the uniform u given: the token,
    and the candidates' cdf (to keep u away from a boundary)."""
    from vkengine.serving.sampling import top_order
    idx = top_order(x, top_k)
    if temp <= 0:
        return int(idx[0]), None
    lg = x[idx].astype(np.float64)
    probs = np.exp(lg - lg[0])
    probs /= probs.sum()
    if top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), top_p) + 1)
        idx, lg, probs = idx[:keep], lg[:keep], probs[:keep]
    if min_p > 0.0:
        keep = probs >= min_p * probs[0]
        idx, lg = idx[keep], lg[keep]
    pr = np.exp(lg / temp - (lg / temp).max())
    cdf = np.cumsum(pr / pr.sum())
    cdf /= cdf[-1]
    return int(idx[np.searchsorted(cdf, u, side="right")]), cdf


def _run_sample(device, kernels, ws, x, n, stride, rows_params, tmp=None):
    rows = len(rows_params)
    xr = ws.act_region(rows * stride, x)
    tmp = tmp or ws.act_region(kernels.sample_tmp_words(n, rows))
    samp_off, out_off = 1000, 600
    words = np.zeros(kernels.SAMPLE_WORDS * rows, np.uint32)
    for r, (t, k, tp, mp, u) in enumerate(rows_params):
        w = words[r * kernels.SAMPLE_WORDS:]
        w[0], w[2], w[3], w[4] = (np.float32(v).view(np.uint32) for v in (t, tp, mp, u))
        w[1] = k
    ws.params.array()[samp_off:samp_off + words.size] = words
    prog = device.program()
    kernels.sample(prog, xr, stride, n, rows, ws.params, samp_off, out_off, tmp)
    prog.run()
    return ws.params.array()[out_off:out_off + rows].astype(np.int64)


def test_sample_greedy_and_top_k(device, kernels, ws, rng):
    """temperature 0: the argmax (ties: lowest index, NaN skipped); a tiny
    top_p keeps only the best; top_k 1 the best."""
    n, stride = 49157, 49160
    rows = 6
    x = np.zeros((rows, stride), np.float32)
    x[:, :n] = rng.standard_normal((rows, n)) * 3
    x[:, n:] = 1e9                                   # beyond n: ignored
    x[1, 777] = x[1, 30000] = 40.0                   # tie: lowest index
    x[2, :n] = -2.0                                  # all equal
    x[3, 5:n:7] = np.nan                             # NaN never taken
    params = [(0.0, 40, 0.95, 0.05, 0.5), (0.0, 40, 0.95, 0.05, 0.5), (0.0, 40, 0.95, 0.05, 0.5),
              (0.0, 40, 0.95, 0.05, 0.5), (1.0, 64, 1e-6, 0.0, 0.99), (0.7, 1, 1.0, 0.0, 0.99)]
    got = _run_sample(device, kernels, ws, x, n, stride, params)
    xs = np.where(np.isnan(x[:, :n]), -np.inf, x[:, :n])
    assert list(got) == [int(r.argmax()) for r in xs]


def test_sample_draw_matches_sampler(device, kernels, ws, rng):
    """Sampled rows (temperature, top-k, top-p, min-p) draw Sampler's token for
    the same u; u is put mid-way between two cdf values so that float32 and
    float64 sums cannot disagree."""
    from vkengine.kernels import Kernels
    n = 49152
    cases = [(0.8, 40, 0.95, 0.05), (1.0, 64, 1.0, 0.0), (0.3, 10, 0.9, 0.0), (1.5, 50, 1.0, 0.1),
             (2.0, 64, 0.5, 0.0), (1e-30, 40, 0.95, 0.05), (1.0, 3, 1.0, 0.0), (0.9, 64, 0.99, 0.01)]
    rows = len(cases)
    x = (rng.standard_normal((rows, n)) * 2.5).astype(np.float32)
    x[:, rng.integers(0, n, 20)] += 6.0              # a few strong candidates, spread over the slices
    x[1] = np.round(x[1] * 2) / 2                    # ties everywhere: equal values by lowest index
    params, want = [], []
    for r, (t, k, tp, mp) in enumerate(cases):
        _, cdf = _sample_ref(x[r], t, k, tp, mp, 0.0)
        width = np.diff(cdf, prepend=0.0)
        ok = np.flatnonzero(width > 1e-4)             # intervals float32 cannot blur
        j = int(ok[rng.integers(0, ok.size)])
        u = cdf[j] - width[j] / 2                    # inside candidate j's interval
        params.append((t, k, tp, mp, u))
        want.append(_sample_ref(x[r], t, k, tp, mp, u)[0])
    assert Kernels.SAMPLE_K == 64
    got = _run_sample(device, kernels, ws, x, n, n, params)
    assert list(got) == want


def test_sample_reads_only_its_rows_top_k(device, kernels, ws, rng):
    """The first pass writes a row's top_k pairs a slice and the second reads
    no more: a step with smaller top_k than the last one's, on the same
    scratch, draws what a fresh scratch gives (the stale pairs past top_k,
    here better than every logit, are never read)."""
    n, rows = 20000, 3
    tmp = ws.act_region(kernels.sample_tmp_words(n, rows))
    high = np.full((rows, n), 50.0, np.float32)
    _run_sample(device, kernels, ws, high, n, n, [(1.0, 64, 1.0, 0.0, 0.5)] * rows, tmp)
    x = (rng.standard_normal((rows, n)) * 2).astype(np.float32)
    params = [(1.0, 5, 1.0, 0.0, 0.7), (0.0, 64, 1.0, 0.0, 0.5), (0.5, 1, 1.0, 0.0, 0.2)]
    got = _run_sample(device, kernels, ws, x, n, n, params, tmp)
    want = [_sample_ref(x[r], *params[r])[0] for r in range(rows)]
    assert list(got) == want == list(_run_sample(device, kernels, ws, x, n, n, params))


def test_topk_part_lists(device, kernels, ws, rng):
    """The first pass's list of each slice: the row's top_k best of the
    slice's 4,096 logits (ties among them: lowest index first), in numpy's
    stable order of -x; a greedy row's list is its slice's best alone."""
    n, rows = 49152, 3
    x = (rng.standard_normal((rows, n)) * 2.5).astype(np.float32)
    x[2] = np.round(x[2] * 4) / 4                    # ties everywhere
    tmp = ws.act_region(kernels.sample_tmp_words(n, rows))
    params = [(1.0, 64, 1.0, 0.0, 0.5), (0.0, 40, 1.0, 0.0, 0.5), (1.0, 40, 1.0, 0.0, 0.5)]
    _run_sample(device, kernels, ws, x, n, n, params, tmp)
    lists = ws.read(tmp).reshape(rows, kernels.sample_slices(n), kernels.SAMPLE_K, 2)
    chunk = kernels.SAMPLE_WG * kernels.SAMPLE_VPL
    for r, (t, k, *_rest) in enumerate(params):
        R = k if t > 0 else 1
        for s in range(lists.shape[1]):
            sl = x[r, s * chunk:(s + 1) * chunk]
            want = np.argsort(-sl, kind="stable")[:R]
            np.testing.assert_array_equal(lists[r, s, :R, 1].view(np.uint32), want + s * chunk,
                                          err_msg=f"row {r} slice {s}")
            np.testing.assert_array_equal(lists[r, s, :R, 0], sl[want])


def test_attention_while_attention_mc2_compiles(device, kernels, ws, rng, monkeypatch):
    """A prompt step whose attention would run on attention_mc2 while that pipeline is still compiling
    (Device.settle marked it slow) is recorded on the plain attention kernel, not attention_mc (whose own
    compile took longer than attention_mc2's on a fresh NVIDIA driver), counted as a stand-in, with numpy's
    result."""
    kn = with_caps(kernels)
    monkeypatch.setattr(kn, "attention_on_coopmat2", lambda *a, **k: True)
    monkeypatch.setattr(kn, "attention_on_coopmat", lambda *a, **k: True)   # (never taken for the stand-in)
    hd, n_head, n_kv = 64, 4, 2
    monkeypatch.setattr(device, "_slow", {f"attention_mc2_d{hd}{sp}{of}" for sp in ("", "_split")
                                          for of in ("", "_of16", "_of16nr")})   # (Caps.attn_mc2_of16, _narrow)
    slots = np.zeros(24, np.uint32)
    pos = np.arange(24, dtype=np.uint32)
    c = _AttentionCase(ws, rng, 1, 64, n_head, n_kv, hd, slots, pos, 40)
    before, algs = kn.substituted, set(device._algorithms)
    prog = device.program()
    kn.attention(prog, c.qr, n_head * hd, c.orr, n_head * hd, len(slots), n_head, n_kv, hd, c.kc, c.vc, c.ss,
                 ws.params, 0, 40, c.scale)
    assert kn.substituted == before + 1
    assert not any(k[0].startswith("attention_mc") for k in set(device._algorithms) - algs)
    assert any(k[0] == "attention" for k in device._algorithms)
    prog.run()
    c.check(ws.read(c.orr), c.q, atol_scale=1e-5)
