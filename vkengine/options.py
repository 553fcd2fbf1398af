"""Configuration at the edge: the command-line options every front end shares
(`vkengine generate/bench/serve`, `python -m server`: the model, context,
KV cache types, device) and the environment variables that choose a device. Whatever is read here is passed down; no
module below reads the environment."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from shaders.variants import KV_TYPES

from .errors import VkEngineError


def add_model_args(p, model: bool = True) -> None:
    """--model, --ctx, --batch, the KV cache's types (with model) and --device."""
    if model:
        p.add_argument("--model", "-m", default=None,
                       help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct Q4_1)")
        p.add_argument("--ctx", type=int, default=None, help="context length per sequence (default min(train, 4096))")
        p.add_argument("--batch", type=int, default=256, help="tokens per prefill step")
        add_cache_args(p)
    p.add_argument("--device", type=int, default=None, help="Vulkan device index (see `vkengine devices`); "
                   "VKENGINE_DEVICE also works")
    if model:
        p.add_argument("--devices", type=device_list, default=None, metavar="I,J[,...]",
                       help="split the model's layers across these Vulkan devices, in order (llama.cpp's -sm layer); "
                            "an index may repeat (parts on one device, each its own Vulkan device)")
        p.add_argument("--tensor-split", "-ts", default=None, metavar="P,Q[,...]",
                       help="with --devices: each device's share of the layers (default equal; llama.cpp's -ts)")


def cache_type(value: str) -> str:
    """A --cache-type-k/-v value (llama-server's names): one vkengine keeps."""
    if value not in KV_TYPES:
        raise argparse.ArgumentTypeError(f"{value!r}: the KV cache can be {' or '.join(KV_TYPES)} "
                                         "(llama-server's other cache types, such as q4_0, are not supported)")
    return value


def add_cache_args(p) -> None:
    """--cache-type-k and --cache-type-v (-ctk, -ctv), as llama-server takes them."""
    for side, short in (("k", "-ctk"), ("v", "-ctv")):
        p.add_argument(f"--cache-type-{side}", short, type=cache_type, default="f16", metavar="|".join(KV_TYPES),
                       help=f"{side.upper()} cache type: f16 (default) or q8_0 (blocks of 32 values with an f16 "
                            "scale, as llama.cpp's; 0.53x the bytes, heads a multiple of 64)")


def device_list(value: str) -> list[int]:
    """A --devices value: two or more comma-separated device indices."""
    try:
        out = [int(x) for x in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: comma-separated Vulkan device indices, e.g. 0,1") from None
    if len(out) < 2 or min(out) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: two or more device indices (>= 0); one device is --device")
    return out


def split_devices(args) -> list[int] | None:
    """The devices a split model runs on (--devices), or None: one device
    (--device); --tensor-split checked here too, before any model loads."""
    devs = getattr(args, "devices", None)
    if devs is None:
        if getattr(args, "tensor_split", None):
            raise VkEngineError("--tensor-split needs --devices")
        return None
    if getattr(args, "device", None) is not None:
        raise VkEngineError("give --device (one device) or --devices (a split), not both")
    from .split import parse_split  # (its errors)
    parse_split(getattr(args, "tensor_split", None), len(devs))
    return list(devs)


def device_index(args) -> int | None:
    """The device the user asked for: --device, else VKENGINE_DEVICE, else None (the best one)."""
    if getattr(args, "device", None) is not None:
        return args.device
    env = os.environ.get("VKENGINE_DEVICE")
    if env:
        try:
            return int(env)
        except ValueError:
            raise VkEngineError(f"VKENGINE_DEVICE={env!r} is not a device index") from None
    return None


@dataclass(frozen=True)
class Options:
    """Switches that choose between kernel paths, each to measure one path
    against its alternative (docs/bench/notes.md); the defaults are what
    measured fastest. `from_env()` reads them, at the edge, from
    VKENGINE_<NAME> (0/1, or a number)."""
    coopmat: bool = True          # tiled matmuls and prompt attention on cooperative matrices where the device can
    coopmat2: bool = True         # mul_mc2 (VK_NV_cooperative_matrix2) where the device can
    mc2_f16acc: bool = True       # mul_mc2 with fp16 sums (llama.cpp's default there); 0: fp32 sums
    mc2_from_rows: int | None = None   # matrices of at least this many rows on mul_mc2 (None: the table's)
    mc2_bk: int = 64              # mul_mc2's slice depth with fp16 sums: 64 where it measured faster
                                  # (shaders/variants.py MC2_K64) and K allows, else 32
    mc2_unroll: int = 0           # mul_mc2 (fp16 sums) of Q4_0: scales staged as halves in chunks of this many
                                  # slices (shaders/variants.py MC2_SC_F16_UNROLLS); 0: as (d, m) pairs, MC2H_UNROLL's
    mc2_glu: bool = True          # prefill's gate|up on mul_mc2 with the SwiGLU in its epilogue, written as halves
                                  # straight into the down projection's x (no gate|up floats, swiglu or to_f16;
                                  # shaders/mul_mc2.comp GLU; H100, 8B: pp4096 9,667 / 9,614 against 9,416 /
                                  # 9,375 tok/s, pp512 step 57.8 / 57.4 against 58.9 / 59.0 ms; notes.md run 50)
    mc2_tiles: str = ""           # mul_mc2's tiles with fp16 sums by matrix rows, "ROWS:BMxBN,..." widest first, the
                                  # last from 0 (opt-in, to measure; "": shaders/variants.py MC2H_TILES)
    mc2_big_from: int = 2048      # prompt steps of at least this many rows on shaders/variants.py MC2H_BIG_TILES
                                  # (0: never; H100, 8B Q4_0: pp2048 / pp4096 11,178 / 11,174 against 10,397-10,436 /
                                  # 10,132-10,239 tok/s, pp16384 / pp32768 9,289 / 7,556 against 8,627-8,642 /
                                  # 7,090-7,104; from 1,024 rows pp1024 loses 12%: notes.md run 59)
    mc2_small: bool = True        # steps of at most 64 / 128 rows on mul_mc2's 64- / 128-token tiles rather than its
                                  # 256-token ones (shaders/variants.py MC2H_SMALL_BN; H100, 8B Q4_0: pp64 2,126 /
                                  # 2,106 against 1,545 / 1,529 tok/s, pp128 3,537 / 3,555 against 3,006 / 3,030;
                                  # notes.md run 51)
    attn_mc: bool = True          # prompt attention on cooperative matrices (attention_mc.comp)
    attn_mc2: bool = True         # ... on NVIDIA's workgroup-scope matrices where it can (attention_mc2.comp)
    attn_mc2_of16: bool = True    # ... its output accumulated in halves, as llama.cpp's flash_attn_cm2 (H200:
                                  # 8B pp512 at depth 16k +4.8%, pp16384 +3.5%; qwen35 0.8B +12%, +13%; run 49)
    attn_mc2_narrow: bool = True  # ... (with O in halves) each row's m and l over 16 columns rather than a block's
                                  # (attention_mc2.comp NARROW; H100, 8B pp512 at depth 16k: attention 29.2 / 29.1
                                  # against 30.5 / 30.5 ms a step, qwen35 0.8B +1.8%; notes.md run 50)
    attn_mc_split: int = 1024     # prompt rows at depth: a step whose rows make fewer attention_mc workgroups
                                  # than this cuts each one's positions into parts (its split form, then a
                                  # merge) to reach it; 0: never (notes.md run 36)
    attn_dec: bool = True         # decode attention by KV-head group, parts following the position (attention_dec)
    attn_items: int = 2048        # ... its target of work items a step's row (KV heads x groups x parts)
    attn_group: int = 256         # ... an item's query heads (of one KV head): at most this many dims (heads x
                                  # head size), at least one head; a KV head with more has several items, each
                                  # reading its K/V (H100: 8B decode +6% at depth 0, same at 4k/16k; qwen35 0.8B
                                  # +8-14%; 35B-A3B +20%: notes.md run 46; 8 heads of any size before)
    attn_lp: int = 128            # ... a position scored by several lanes, q in registers (dec_lanes), for heads of
                                  # this many dims (0: none; H100, 8B's 128: +2.4% / +4.1% at depth 4k / 16k, the
                                  # same at 0; qwen35 0.8B's 256: -1%; 64 not measured; notes.md run 46)
    attn_kpf: bool = False        # ... the next tile's K rows loaded during this one's softmax and V (dec_kpf)
    attn_khoist: bool = True      # ... (lanes a position) a tile's K segments for all passes loaded first (KH;
                                  # H100, 8B decode at depth 0 / 4k / 16k: 303.1 / 262.2 / 212.3 against 297.0 /
                                  # 252.5 / 199.2 tok/s; notes.md run 53)
    attn_vb: int = 0              # ... V rows a lane loads ahead (VB; 0: 32 / the words a lane owns, at least 8)
    attn_vpre: bool = False       # ... a tile's first V loads issued with its K loads, before the scores (VPRE; with
                                  # the wide V rows alone slower on the H100: 256.6 against 270.1 tok/s at depth 4k,
                                  # notes.md run 59)
    attn_qsh: bool = False        # ... (lanes a position) the item's q in shared memory, not a lane's registers (QSH;
                                  # slower on the H100: 268.4 / 268.7 against 271.5 / 271.8 tok/s at depth 4k,
                                  # notes.md run 60)
    attn_vwide: bool = True       # ... (f16 V) V rows read in uvec4s, 8 dims a lane, several rows a load instruction
                                  # and the lane groups' sums added at the end (VW) rather than an f16 pair a lane
                                  # of every row (other rounding; H100, 8B tg64 at depth 0 / 4k / 16k / 32k: 302.4 /
                                  # 262.0 / 218.6 / 184.9 tok/s against 304.3 / 262.3 / 214.5 / 175.8; qwen35 0.8B
                                  # 851.2 / 780.8 / 687.2 / 608.4 against 844.0 / 777.0 / 681.7 / 607.8; run 54)
    attn_combine: bool = True     # ... a workgroup's subgroups combined in one round, a shared slot each (CMB), not one
                                  # subgroup after another with a barrier each, where the slots fit the device's
                                  # shared memory (other rounding; H100, 8B tg64 at depth 0 / 4k / 16k: 303.4 / 265.7
                                  # / 220.3 and 303.7 / 265.8 / 219.4 tok/s against 301.6 / 261.1 / 216.9 and 300.4 /
                                  # 260.8 / 217.0; notes.md run 56)
    attn_merge: int = 8           # ... the last workgroup's merge of a row's partials in one pass of rounds of this
                                  # many partials (MB: each round's maxima, sums and output words loaded together,
                                  # the sums rescaled to the running max) rather than two passes (0: the maxima
                                  # first, then 8 partials' words a round; other rounding; H100, 8B with the parts
                                  # below, decode attention alone at 16k: 48.9 against 49.9 us; notes.md run 57)
    attn_parts_down: bool = True  # ... a row's positions cut into parts of whole tiles rounded down from its position
                                  # over attn_items' parts, on a grid of twice those (PD: 4,097 positions in 129
                                  # parts of 32 rather than 65 of 64; H100, 8B tg64 at depth 0 / 4k / 16k with the
                                  # one-pass merge: 304.3 / 272.3 / 228.6 tok/s against 305.6 / 267.6 / 220.0;
                                  # notes.md run 57)
    delta_chunk: int = -1         # steps of at least this many rows take the chunked delta rule (delta_chunk/
                                  # delta_scan.comp); 0: never; -1: the device's default (64 on GPUs, never on CPUs)
    cn_rows: bool = True          # the combined expert matvec's RMSNorm by each row's last workgroup, rows side by
                                  # side (combine_norm.glsl); off: the last workgroup of all, row after row (H100,
                                  # 35B-A3B, 4 / 16 rows: 5.74 / 14.67 ms a step against 5.89 / 15.35; run 53)
    conv_pre: bool = True         # the conv1d after a linear layer's input projection (mul_mvk.comp CONV): every
                                  # column's slot window loaded before the first column's conv (CONV_PRE; H100,
                                  # 35B-A3B, 4 / 16 rows: 5.80 / 15.26 ms against 5.89 / 15.35; run 53)
    delta_cols: int = 2           # the row-at-a-time delta rule's columns of S a subgroup (delta_rule.comp COLS: 1,
                                  # 2 or 4; the same bits on lavapipe, within rounding on the H100; H100, 35B-A3B,
                                  # 1 / 4 / 16 rows: 2: 316.5 tok/s, 5.74 / 14.61 ms, 4: 312.9, 5.83 / 14.48, 1:
                                  # 314.4, 5.89 / 15.35, run 53; with the rows-by-rows norm, the conv1d's windows
                                  # first and 8 gate|up rows a workgroup: 2: 5.48-5.52 / 13.54-13.56 ms, 1: 5.61 /
                                  # 14.24, run 54)
    tiled_from: int = 0           # steps of at least this many rows take the tiled matmuls (and a MoE's experts
                                  # expert-major); 0: the device's default (64 on GPUs; CPUs never). Fewer: a hybrid
                                  # model's short prompts (no pad rows: its recurrent state) and batched decode of
                                  # that many sequences leave the matvecs (H100, 35B-A3B, 16: its 28-token prompt
                                  # and 16 sequences' decode slower; notes.md run 51)
    mv_cols: int = 8              # the widest split-K matvec variant a decode step takes (2, 4 or 8 columns of x a
                                  # workgroup; a step of more rows runs it over several column groups, grid z; the
                                  # conv1d's variant keeps a step's columns together). 2: H100, 35B-A3B 4 rows 5.33
                                  # against 5.43-5.47 ms (the conv1d's too); H200 (conv1d's whole): 4 rows 5.22 ms
                                  # either way, 16 rows 14.40 against 13.14, llama 8B 4 rows 6.69 against 5.47
                                  # (notes.md run 61)
    splitk_wgs: int = 256         # split K of tiled matmuls whose grid has fewer workgroups (0: off)
    splitk_min: int = 512         # the fewest K columns a part of split K takes
    xq8: bool = False             # Q8_0 and Q4_0 matvecs on integer dot products, x quantized first (opt-in)
    norm_in: bool = True          # decode steps' RMSNorm split between the residual add and its readers
    xq8_in: bool = True           # ... with h' also as 8-bit blocks for a Q8_0 gate|up
    xq8_q4: bool = False          # ... and a Q4_0 one (its nibbles on integer dot products; the float kernel's
                                  # 28672 x 4096 runs at 1.6 TB/s on the H100 whatever its shape: notes.md run 63)
    step_buckets: bool = True     # steps of more than 8 rows padded to a few shapes (GPUs)
    tiled_prompts: bool = True    # prompt steps padded to the tiled matmuls' rows (GPUs)
    expert_tiles: bool = True     # prompt steps' expert matmuls in tiles (mul_mc_id on cooperative matrices,
                                  # mul_mt_id elsewhere) instead of mul_mm_id's 8 columns a pass; GPUs (H200,
                                  # 35B-A3B Q4_0: pp512 3,853 vs 2,115 tok/s, pp2048 4,712 vs 2,295; notes.md run 40)
    expert_union: bool = False    # decode steps of several rows: each expert the rows share read once (mul_mm_id
                                  # over moe_sort's work list) instead of once per pair (mul_mv_id); slower where
                                  # measured (H200, 35B-A3B: 4 rows 350 vs 498 tok/s, 16 rows 525 vs 801; run 40)
    mvid_unroll: bool = False     # decode steps' expert matvecs (mul_mv_id) with 4 units a lane in flight (and
                                  # gate and up together) instead of one: the same sums, bit for bit (opt-in: slower
                                  # where measured, H200 35B-A3B tg 209 vs 228 tok/s, 4 rows 424 vs 491; run 44)
    mvid_splitk: bool = True      # decode steps' fused expert matvecs (gate|up with the SwiGLU, down with the
                                  # weighted sum) in mul_mvk's split-K form (mul_mvk_id.comp: a workgroup's
                                  # invocations walk RPS rows together) instead of a subgroup a row (mul_mv_id);
                                  # GPUs (H100, Q4_0: 35B-A3B tg 250.5 vs 223.6 tok/s, 4 rows 556 vs 488, 16 rows
                                  # 858 vs 737; 30B-A3B tg 210.7 vs 182.0; notes.md run 45)
    mvid_glu_wg: int = 0          # ... the split-K gate|up's workgroup size (0: the device's; a 2048-wide Q4_0
                                  # expert row is 256 units of 8 columns: 2 rounds of a 128-lane workgroup)
    mvid_glu_rows: int = 8        # ... its weight rows a workgroup (8 or 16; 0: shaders/variants.py MVID_ROWS's): a
                                  # lane's x loads shared by more rows, fewer workgroups (each reads all of its
                                  # row's x: 8 KB a workgroup of the 35B-A3B's gate|up, against 4.6 KB of weights;
                                  # H100, 35B-A3B, 4 / 16 rows: 5.60-5.61 / 14.23-14.24 ms a step against 5.66-5.68 /
                                  # 14.59-14.63, one row the same; 16 with 16 down rows slower: run 54; only the
                                  # 35B-A3B measured)
    mvid_combine_rows: int = 0    # ... the split-K down projection's (8 or 16; 0: MVID_ROWS's; the 35B-A3B's moves its
                                  # bytes at 0.35 TB/s in a 1-row step, 0.63 at 4 rows: run 52's ablation; 8 measured
                                  # slower on an H100: tg64 273.5 against 314.8 tok/s, 4 rows 5.90 against 5.68 ms)
    memory_mib: int = 0           # MiB of a device's memory an engine (or a split model's part) may fill (0: all):
                                  # a GPU shared with other work, or one standing in for a smaller card
    mtp_block_ahead: bool = True  # speculative turns: the MTP block submitted behind a verify step ahead, over all
                                  # its rows (vkengine/serving/speculate.py, Speculator._submit_block_ahead); H200,
                                  # 35B-A3B, the server at C = 1 with 3 drafts: 473 / 478 tok/s against 455 / 462
                                  # (notes.md run 49)
    mtp_spec_drafts: bool = True  # ... and behind that block, the chained drafts of each sequence's row as if the
                                  # verify step accepted every draft, used where it does (the host's collect and
                                  # acceptance then no longer sit between the block and the drafts); H100, 35B-A3B,
                                  # the server at C = 1 with 3 drafts: 500 / 508 tok/s against 461 / 458 (run 50)
    poll_picks: bool = False      # a masked step's collect() watches host memory for its tokens before the
                                  # fence wait (bench/mask_bench.py --probe measures it; off until measured)

    @classmethod
    def from_env(cls, env=None) -> Options:
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        for f in fields(cls):
            v = env.get(f"VKENGINE_{f.name.upper()}")
            if v is None or v == "":
                continue
            try:
                kw[f.name] = v != "0" if f.type == "bool" else v if f.type == "str" else int(v)
            except ValueError:
                raise VkEngineError(f"VKENGINE_{f.name.upper()}={v!r} is not a number") from None
        return cls(**kw)
