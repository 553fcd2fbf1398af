"""What the kernels may do on one device, decided once from the device and the
options (vkengine.options.Options) into one frozen object. Tests and probes
take a variant of it with dataclasses.replace (e.g. the GPU's split-K matvecs
on lavapipe); nothing changes it afterwards."""
from __future__ import annotations

from dataclasses import dataclass

from shaders.variants import (
    ATTN_MC,
    MC2_ENGINE_TYPES,
    MC2_F32_FROM_ROWS,
    MC2_FROM_ROWS,
    MC2H_TILES,
    MC2H_UNROLL,
    MM_GPU_COLS,
    MV_BFLY_LANES,
    MVID_MORE_ROWS,
    attn_mc_shared_bytes,
)

from ..device import Device
from ..errors import VkEngineError
from ..options import Options

# what mul_mc2 needs the device to have been created with (the kp patch enables them where present)
COOPMAT2_FEATURES = frozenset({"cooperativeMatrixWorkgroupScope", "cooperativeMatrixFlexibleDimensions",
                               "cooperativeMatrixTensorAddressing", "cooperativeMatrixBlockLoads",
                               "bufferDeviceAddress", "vulkanMemoryModel"})


def device_has_coopmat2(device: Device) -> bool:
    """Whether the device was created with everything mul_mc2 needs (whatever
    the options say: tests and probes ask the device)."""
    return COOPMAT2_FEATURES <= set(device.features)


def mc2_tiles(spec: str) -> tuple[tuple[int, tuple[int, int]], ...]:
    """Options.mc2_tiles ("ROWS:BMxBN,...", widest first, the last from 0 rows;
    each tile one MC2H_UNROLL has a variant for) as Caps.mc2h_tiles; "":
    MC2H_TILES."""
    if not spec:
        return MC2H_TILES
    out: list[tuple[int, tuple[int, int]]] = []
    try:
        for part in spec.split(","):
            rows, _, tile = part.partition(":")
            bm, _, bn = tile.partition("x")
            out.append((int(rows), (int(bm), int(bn))))
    except ValueError:
        raise VkEngineError(f"VKENGINE_MC2_TILES={spec!r}: ROWS:BMxBN,... (e.g. 16384:256x256,0:64x256)") from None
    bad = [t for _, t in out if t not in MC2H_UNROLL]
    if bad or not out or out[-1][0] != 0 or [r for r, _ in out] != sorted((r for r, _ in out), reverse=True):
        raise VkEngineError(f"VKENGINE_MC2_TILES={spec!r}: row floors in decreasing order down to 0, tiles among "
                            f"{sorted(MC2H_UNROLL)}")
    return tuple(out)


@dataclass(frozen=True)
class Caps:
    sg: int                       # subgroup size
    items: int                    # items (rows, subgroups' worth of work) per workgroup
    ew_wg: int                    # workgroup size of the elementwise kernels
    max_x: int                    # largest grid x
    # batch size (rows) from which matmuls take the shared-memory tiled kernels;
    # None never (lavapipe: barrier() is slow there). Below it the multi-column
    # matvecs, whose per-row arithmetic does not depend on the batch
    tiled_from: int | None
    # decode attention split across position slices (flash-decoding): GPUs run
    # many subgroups at once; lavapipe a handful, and each dispatch costs it more
    split_attention: bool
    # rows from which matvecs take the multi-column variant: it reuses each
    # dequantized weight for 8 columns, which pays on GPUs (bandwidth); on
    # lavapipe its accumulators spill (2 rows cost 6x one) until 8 rows. Both
    # walk a row in the same order, so results do not depend on which one ran
    multi_column_from: int
    # the GPUs' split-K matvecs (mul_mvk.comp) and their fused epilogues
    split_k: bool
    # their butterfly-reduced twins where every subgroup has a lane for each of
    # a workgroup's sums (both the 1- and the n-column variants, so a row sums
    # in one order batched or alone)
    bfly: bool
    # tiled matmuls whose 128 x 128 grid has fewer workgroups take 64 x 64 tiles
    small_tiles_below: int
    # tiled matmuls on 16 x 16 x 16 f16 cooperative matrices (mul_mc: fp16 tiles, fp32 sums)
    coopmat: bool
    # mul_mc2 (workgroup-scope matrices, VK_NV_cooperative_matrix2) for the types and sizes below
    coopmat2: bool
    mc2_types: tuple[str, ...]
    mc2_f16acc: bool
    mc2_from_rows: int
    mc2_k64: bool                  # mul_mc2's 64-deep slices where they measured faster (MC2_K64)
    mc2_unroll: int                # Q4_0 on mul_mc2h: scales as halves in chunks of this many slices (0: pairs)
    mc2h_tiles: tuple[tuple[int, tuple[int, int]], ...]   # (from rows, tile), widest first
    mc2_big_from: int              # steps of at least this many rows on MC2H_BIG_TILES (Options.mc2_big_from; 0: never)
    # split K of tiled matmuls whose tile grid has fewer workgroups than this
    # (a GPU runs ~100+ at once), parts of at least split_k_min columns; 0: off
    split_k_wgs: int
    split_k_min: int
    # XQ8: Q8_0 and Q4_0 matvecs on integer dot products, x quantized to 8-bit blocks
    # first (a dispatch); only matrices that never fuse a norm or RoPE take it
    xq8: bool
    # the RMSNorm after a residual add split between the add's matvec and the
    # matvecs that read it (decode steps), instead of the add's fused norm
    norm_in: bool
    # ... with the add's matvec also writing h' as 8-bit blocks for a Q8_0 gate|up
    xq8_in: bool
    # prompt attention on cooperative matrices (attention_mc.comp, 24-48 KB of
    # shared memory): (head size, 16-row blocks a workgroup) of the variants
    # the device's shared memory holds
    attention_mc: bool
    attention_mc_layouts: tuple[tuple[int, int], ...]
    mc2_glu: bool = True           # gate|up's SwiGLU in mul_mc2h's epilogue, as halves for down (Options.mc2_glu)
    mc2_small: bool = True         # prompt steps of few rows on mul_mc2h's narrower token tiles (Options.mc2_small)
    # prompt attention of f16 caches that do not wrap on NVIDIA's workgroup-scope
    # matrices (attention_mc2.comp) where the device has them (coopmat2)
    attention_mc2: bool = False
    # (with xq8_in) a Q4_0 gate|up reads those blocks too (Options.xq8_q4)
    xq8_q4: bool = False
    attn_mc2_of16: bool = True       # attention_mc2's O in halves (the "_of16" variants; Options.attn_mc2_of16)
    attn_mc2_narrow: bool = True     # ... with each row's m and l over 16 columns ("_of16nr"; Options.attn_mc2_narrow)
    # prompt rows at depth on attention_mc: steps whose row blocks make fewer
    # workgroups than this take its split form (AttentionKernels.attn_mc_parts); 0: never
    attn_mc_split: int = 0
    attention_mc_variant: str = "attention_mc_d{hd}"   # by head size (bench/attn_probe.py swaps in others)
    # split decode attention as attention_dec.comp (K/V read once per KV head,
    # parts following each row's position) instead of attention.comp's
    # 64-position slices of each query head; attn_items: the work items a row
    # aims at (KV heads x head groups x parts, parts clamped to 8..256), a
    # function of the model only, so a row's arithmetic is the same alone or batched
    attention_dec: bool = False
    attn_items: int = 2048
    # attention_dec: an item takes the query heads (of one KV head) of at most
    # this many dims (heads x head size), at least one; a KV head with more
    # has several items, each reading its K/V rows (Options.attn_group)
    attn_group: int = 256
    # attention_dec scores a position with several lanes (16 dims each, q in
    # registers) instead of a lane a position (AttentionKernels.dec_lanes), for
    # heads of this many dims (0: none; Options.attn_lp)
    attn_lp: int = 0
    # attention_dec keeps the next tile's K rows in registers (AttentionKernels.dec_kpf)
    attn_kpf: bool = False
    attn_khoist: bool = False      # Options.attn_khoist (attention_dec KH)
    attn_vb: int = 0               # Options.attn_vb (attention_dec VB; 0: the kernel's default)
    attn_vpre: bool = False        # Options.attn_vpre (attention_dec VPRE)
    attn_qsh: bool = False         # Options.attn_qsh (attention_dec QSH)
    attn_vwide: bool = False       # Options.attn_vwide (attention_dec VW)
    attn_combine: bool = False     # Options.attn_combine (attention_dec CMB where its slots fit)
    attn_merge: int = 0            # Options.attn_merge (attention_dec MB)
    attn_parts_down: bool = False  # Options.attn_parts_down (attention_dec PD)

    # steps of at least this many rows run the gated delta rule in chunks
    # (delta_chunk.comp + delta_scan.comp) instead of a row at a time; 0: never
    delta_chunk_from: int = 0
    cn_rows: bool = False          # Options.cn_rows
    mv_cols: int = 8               # Options.mv_cols: the widest split-K matvec (variants.py MM_GPU_COLS)
    conv_pre: bool = False         # Options.conv_pre
    # the row-at-a-time delta rule's columns a subgroup (Options.delta_cols; its "_c2" / "_c4" variants)
    delta_cols: int = 1
    # prompt steps' expert matmuls in tiles over moe_sort's work list (mul_mc_id /
    # mul_mt_id, MoeKernels.expert_tile) instead of mul_mm_id
    expert_tiles: bool = False
    # decode steps of several rows: their experts' products over moe_sort's work
    # list (mul_mm_idb: an expert the rows share read once) instead of mul_mv_id
    expert_union: bool = False
    mvid_unroll: bool = False    # mul_mv_id's "4" variants (Options.mvid_unroll)
    mvid_glu_wg: int = 0         # mul_mvk_id's gate|up workgroup size (Options.mvid_glu_wg; 0: wg)
    mvid_glu_rows: int = 0       # ... its weight rows a workgroup (Options.mvid_glu_rows; 0: MVID_ROWS's)
    mvid_combine_rows: int = 0   # ... the down projection's (Options.mvid_combine_rows)
    mvid_splitk: bool = False    # the fused expert matvecs in split-K form (mul_mvk_id.comp; Options.mvid_splitk)

    @property
    def wg(self) -> int:
        """Workgroup size of the row kernels: a subgroup per item."""
        return self.sg * self.items

    @classmethod
    def detect(cls, device: Device, options: Options = Options(), tiled_from: int | None = -1,
               items_per_wg: int = 4, elementwise_wg: int = 64) -> Caps:
        """tiled_from -1: Options.tiled_from on GPUs (0: 64), None on CPUs."""
        info = device.info
        gpu = info.type != "cpu"
        sg = info.subgroup_size
        features = set(device.features)
        if options.mvid_glu_wg and (options.mvid_glu_wg % sg or not 0 < options.mvid_glu_wg <= 1024):
            raise VkEngineError(f"VKENGINE_MVID_GLU_WG={options.mvid_glu_wg}: 0 or a multiple of the subgroup "
                                f"size {sg} up to 1024")
        for name in ("mvid_glu_rows", "mvid_combine_rows"):
            if getattr(options, name) not in (0, *MVID_MORE_ROWS):
                raise VkEngineError(f"VKENGINE_{name.upper()}={getattr(options, name)}: 0 or one of {MVID_MORE_ROWS}")
        if options.mv_cols not in MM_GPU_COLS:
            raise VkEngineError(f"VKENGINE_MV_COLS={options.mv_cols}: one of {MM_GPU_COLS}")
        if options.delta_cols not in (1, 2, 4):
            raise VkEngineError(f"VKENGINE_DELTA_COLS={options.delta_cols}: 1, 2 or 4")
        if options.mc2_big_from < 0:
            raise VkEngineError(f"VKENGINE_MC2_BIG_FROM={options.mc2_big_from}: 0 (never) or a number of rows")
        if tiled_from == -1:
            if options.tiled_from < 0 or options.tiled_from == 1:
                raise VkEngineError(f"VKENGINE_TILED_FROM={options.tiled_from}: 0 (the default) or at least 2 rows")
            tiled_from = (options.tiled_from or 64) if gpu else None
        coopmat = (tiled_from is not None and options.coopmat
                   and {"cooperativeMatrix", "shaderFloat16"} <= features
                   and info.COOPMAT_F16 in info.cooperative_matrix
                   and info.subgroups_fixed and sg == 32 and info.max_shared_memory >= 32 * 1024)
        int_dot = "shaderIntegerDotProduct" in features
        norm_in = gpu and options.norm_in
        return cls(
            sg=sg, items=items_per_wg, ew_wg=max(elementwise_wg, sg), max_x=info.max_workgroup_count[0],
            tiled_from=tiled_from, split_attention=gpu, attention_dec=gpu and options.attn_dec,
            attn_items=options.attn_items, attn_group=options.attn_group, attn_lp=options.attn_lp,
            attn_kpf=options.attn_kpf, attn_khoist=options.attn_khoist, attn_vb=options.attn_vb,
            attn_vpre=options.attn_vpre, attn_qsh=options.attn_qsh,
            attn_vwide=options.attn_vwide, attn_combine=options.attn_combine, attn_merge=options.attn_merge,
            attn_parts_down=options.attn_parts_down,
            multi_column_from=2 if gpu else 8, split_k=gpu,
            bfly=info.subgroups_fixed and sg >= MV_BFLY_LANES, small_tiles_below=256,
            coopmat=coopmat, coopmat2=coopmat and options.coopmat2 and device_has_coopmat2(device),
            mc2_types=MC2_ENGINE_TYPES, mc2_f16acc=options.mc2_f16acc,
            mc2_from_rows=(options.mc2_from_rows if options.mc2_from_rows is not None
                           else MC2_FROM_ROWS if options.mc2_f16acc else MC2_F32_FROM_ROWS),
            mc2_k64=options.mc2_bk == 64, mc2_unroll=options.mc2_unroll, mc2_glu=options.mc2_glu,
            mc2_small=options.mc2_small,
            mc2h_tiles=mc2_tiles(options.mc2_tiles), mc2_big_from=options.mc2_big_from,
            split_k_wgs=options.splitk_wgs, split_k_min=options.splitk_min,
            xq8=gpu and int_dot and options.xq8, norm_in=norm_in, xq8_in=norm_in and int_dot and options.xq8_in,
            xq8_q4=options.xq8_q4,
            delta_chunk_from=(options.delta_chunk if options.delta_chunk >= 0 else 64 if gpu else 0)
            if info.max_workgroup_invocations >= 128 and info.max_shared_memory >= 32 * 1024 else 0,
            delta_cols=options.delta_cols, cn_rows=options.cn_rows, conv_pre=options.conv_pre, mv_cols=options.mv_cols,
            attn_mc_split=options.attn_mc_split, expert_tiles=tiled_from is not None and options.expert_tiles,
            expert_union=options.expert_union, mvid_unroll=options.mvid_unroll,
            mvid_glu_wg=options.mvid_glu_wg, mvid_glu_rows=options.mvid_glu_rows,
            mvid_combine_rows=options.mvid_combine_rows,
            mvid_splitk=gpu and options.mvid_splitk,
            attention_mc2=coopmat and options.attn_mc and options.attn_mc2 and device_has_coopmat2(device),
            attn_mc2_of16=options.attn_mc2_of16,
            attn_mc2_narrow=options.attn_mc2_narrow,
            attention_mc=options.attn_mc,
            attention_mc_layouts=tuple((hd, nsg // ds) for hd, (nsg, ds, bc) in ATTN_MC.items()
                                       if attn_mc_shared_bytes(hd, nsg, bc) <= info.max_shared_memory))
