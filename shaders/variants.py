"""The one table of shader variants: name -> (source file, preprocessor defines).

vkengine.spirv compiles every entry with glslc into a cache keyed by a hash of
the sources and defines. Kernel wrappers (vkengine/kernels/) refer to entries
by name; workgroup size and items per workgroup are specialization constants
set at pipeline creation, not variants. The measurements behind the numbers
here are in docs/bench/notes.md (the run each comment names).
"""

# Weight storage types understood by quant.glsl, by GGUF type name (lower case).
WEIGHT_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "iq4_nl",
                "iq4_xs", "mxfp4")

# Values per unit of work (one lane, one iteration) of each type in quant.glsl.
UNIT_VALUES = {"f32": 4, "f16": 8, "bf16": 8, "q8_0": 8, "q4_0": 8, "q4_1": 8, "q5_0": 8, "q5_1": 8,
               "q4_k": 8, "q5_k": 8, "q6_k": 16, "iq4_nl": 8, "iq4_xs": 8, "mxfp4": 8}

# Weight rows per workgroup item in the GPU decode matvec: each x load serves them all.
MV_ROWS = 2

# Weight rows per subgroup in the subgroup kernels that lavapipe runs (mul_mv for
# one column, mul_mm for 8): llvmpipe pays per loaded word whatever the loads'
# shape (bench/lavapipe_probe.py), so 16 rows share each x load (notes.md,
# Lavapipe: 2x the matvec's speed, 7x the 8-column matmul's).
SG_ROWS = 16
# Types whose subgroup kernels (lavapipe) take a whole 32-value block per unit:
# one scale word per 32 values instead of per 8 (quant.glsl's UNIT32)
UNIT32_TYPES = ("q4_0", "q4_1")

# Columns of x that one workgroup multiplies against each dequantized weight unit
# in the batched matmul variant.
MATMUL_COLS = 8

# GPU matvec variants (mul_mvk.comp: a workgroup's invocations split each row
# group's K between them): the decode matvec (1 column) and, for
# batched decode (a server's running sequences, one row each), 2, 4 or 8
# columns that stream the weights once for all rows. MV_ROWS rows per
# workgroup; units in flight per lane by column count. Every variant sums a
# row in the same order, so a row's result does not depend on its batch.
MM_GPU_COLS = (2, 4, 8)
MV_GPU_UNROLL = {1: 2, 2: 2, 4: 1, 8: 1}
# weight rows per workgroup by column count: more columns read more x per
# weight unit, so more rows share each x load
MV_GPU_ROWS = {1: MV_ROWS, 2: MV_ROWS, 4: 4, 8: 4}
# Q4_0/Q4_1 on GPUs: nibbles become floats without int -> float conversions
# (quant.glsl DQ_MAGIC) and the block scale multiplies a unit's sum once instead
# of every value (mul_mv_unit.glsl HOIST), with 4 rows per workgroup: 5-20%
# faster on the H200 (notes.md run 8).
MV_Q4_TYPES = ("q4_0", "q4_1")
MV_GPU_ROWS_Q4 = {1: 4, 2: 4, 4: 4, 8: 4}
MV_GPU_UNROLL_Q4 = {1: 1, 2: 1, 4: 2, 8: 1}
# Q8_0 takes HOIST too, 4 rows per workgroup and one unit in flight at every
# column count (faster at every column count on the H200: notes.md run 10).
MV_GPU_ROWS_Q8 = {1: 4, 2: 4, 4: 4, 8: 4}
MV_GPU_UNROLL_Q8 = {1: 1, 2: 1, 4: 1, 8: 1}


def mv_gpu_config(wt: str, ncols: int) -> tuple[int, int, dict[str, int]]:
    """(rows per workgroup, units in flight per lane, extra defines) of the GPU
    matvec variant of a weight type and column count."""
    # ROWFIRST (mul_mv.comp): the batched variants decode one row at a time
    rf = {"ROWFIRST": 1} if ncols > 1 else {}
    if wt in MV_Q4_TYPES:
        return MV_GPU_ROWS_Q4[ncols], MV_GPU_UNROLL_Q4[ncols], {"DQ_MAGIC": 1, "HOIST": 1, "XFIRST": 1, **rf}
    if wt == "q8_0":
        return MV_GPU_ROWS_Q8[ncols], MV_GPU_UNROLL_Q8[ncols], {"HOIST": 1, "XFIRST": 1, **rf}
    return MV_GPU_ROWS[ncols], MV_GPU_UNROLL[ncols], {"XFIRST": 1}


# Weight types whose split-K matvecs take 4 rows a workgroup at every column
# count: their "p" variants write a norm's sums of squares per 4 rows
# (Caps.norm_in), the same 4 rows batched or alone
NORM_PARTS_TYPES = tuple(wt for wt in WEIGHT_TYPES if all(mv_gpu_config(wt, nc)[0] == 4 for nc in (1, *MM_GPU_COLS)))


# The "b" variants (mul_mvkb, mul_mmb{2,4,8}) reduce a subgroup's RPS x NCOLS
# sums with a butterfly reduce-scatter (1 shuffle per kept sum) instead of a
# subgroupAdd per sum (5 shuffles each at 32 lanes); they need a lane for every
# sum, so devices whose subgroups are fixed at >= MV_BFLY_LANES lanes use them
# (NVIDIA: up to 40% faster; notes.md, "From code comments": MV_BFLY_LANES).
MV_BFLY_LANES = max(mv_gpu_config(wt, c)[0] * c for wt in ("f32", "q8_0", *MV_Q4_TYPES) for c in (1, *MM_GPU_COLS))

# Invocation tile (weight rows, tokens) of the shared-memory matmul (mul_mt):
# a workgroup of 16 x 16 invocations computes (16 TM) x (16 TN) outputs.
TILE = (8, 8)
# The smaller tile (64 x 64) for matrices whose 128 x 128 grid would leave most
# of a GPU idle (a 1B model's 2048-row projections: 64 workgroups at 512 tokens).
TILE_SMALL = (4, 4)


# Variants that only the newer glslc compiles (scripts/glslc-ext.sh), marked by
# this define: the cooperative-matrix kernels (mul_mc.comp, attention_mc.comp),
# run where Caps.coopmat says the device can.
EXT_DEFINE = "GLSLC_EXT"
# ... of which these (also marked by this define) target Vulkan 1.2 (SPIR-V 1.5) like the others, not 1.3: the
# integer-dot-product kernels (XQ8), which need the newer glslc only for GL_EXT_integer_dot_product. SPIR-V 1.6
# gives a workgroup size from a specialization constant as LocalSizeId, which needs the maintenance4 feature that
# the device is not created with (the validation layer's VUID-RuntimeSpirv-LocalSizeId-06434).
EXT_V12_DEFINE = "GLSLC_EXT_V12"
# Weight types of MoE routers (llama.cpp keeps them unquantized; mxfp4: gpt-oss files that are not) whose split-K
# matvecs of up to 4 columns have ROUTE variants (mul_mvk{b}r_*, mul_mm{b}{2,4}r_*)
ROUTE_TYPES = ("f32", "f16", "bf16", "q8_0", "mxfp4")

# Weight types whose split-K matvecs have XQ8 variants (mul_mvk{b}x_*,
# mul_mm{b}{2,4,8}x_*: x quantized to 8 bits by quantize_q8.comp, integer dot
# products; GL_EXT_integer_dot_product needs the newer glslc too). They have
# no epilogues but the SwiGLU (NO_EPI), so only matrices that never take a norm
# or RoPE use them (MatmulKernels.mul_mat)
# Q4_0 (its nibbles are q + 8 as bytes, less 8 times x's sum a half-block): the gate|up with the SwiGLU reading
# the "pq" producer's blocks (Caps.xq8_in), where the float kernel's nibble decoding bounds the 8B's largest
# matvec (H100, 28672 x 4096: 41 us, 1.6 TB/s at every rows / units / workgroup choice; notes.md run 63)
XQ8_TYPES = ("q8_0", "q4_0")
# mul_mc's tile: BM weight rows x BN tokens, its 8 subgroups in an SGM x SGN grid
# (the fastest layout measured; notes.md, "From code comments": MC_TILE).
MC_TILE = (64, 128, 1, 8)
# The experts' tiles of a prompt step (MUL_ID: mul_mc_id, mul_mt_id): an expert
# gets n x k / E of a step's n rows on average (16 at 512 rows of qwen35moe's
# 256 experts, 8 used), so narrow token blocks (BN 32 on the cooperative
# matrices, 64 on mul_mt) waste little on padded columns. Not measured on a GPU.
MC_ID_TILE = (128, 32, 4, 2)
# mul_mc2's tiles with fp32 sums (VK_NV_cooperative_matrix2: one workgroup-scope
# BM x BN matrix a workgroup) by the rows they start from, their chunks, and the
# weight types it loads (notes.md run 11).
MC2_TILES = ((6144, (128, 256)), (0, (128, 128)))
MC2_UNROLL = {(128, 256): 4, (128, 128): 8}   # slices per chunk (the shader's UNROLL)
MC2_TYPES = ("f16", "q4_0", "q4_1", "q8_0")
# its fp16-accumulator tiles (ACC_F16: what llama.cpp's Vulkan backend runs by
# default on such devices, matmul_*_f16acc_cm2; half the accumulator registers,
# so a 256 x 256 tile fits) and their chunks, by the rows they start from
# (notes.md run 13; "From code comments": MC2H_TILES)
MC2H_TILES = ((16384, (256, 256)), (6144, (128, 256)), (0, (64, 256)))
# Prompt steps of at least Options.mc2_big_from rows: matrices of 4096+ rows on 256 x 256 tiles too (the 8B's
# qkv, o and down projections; with 4,096-row steps H100, 8B Q4_0: pp4096 / pp16384 / pp32768 +9% / +8% / +6%,
# notes.md run 59); a smaller step keeps MC2H_TILES, whose narrower tiles make enough workgroups of its rows.
MC2H_BIG_TILES = ((4096, (256, 256)), (0, (64, 256)))
MC2H_UNROLL = {(256, 256): 4, (128, 256): 4, (128, 128): 8, (64, 256): 4,
               # narrower token tiles for prompt steps of few rows (MC2H_SMALL_BN)
               (256, 64): 4, (256, 128): 4, (128, 64): 8, (64, 64): 8, (64, 128): 8}
# Prompt steps of at most BN rows take the table's BM with this BN instead of
# 256 tokens (Options.mc2_small): a 64-row step on a 256-token tile multiplies
# four times the tokens it has (H100, 8B Q4_0: pp64 +37%, pp128 +18%; notes.md run 51).
MC2H_SMALL_BN = (64, 128)
# 64-deep slices (llama.cpp's BK there) where they measured faster: Q4_0 in the
# 64 x 256 tile (the 8B's down projection 15.9 -> 13.4 ms a 512-row step; slower
# on 128 x 256 in place of 256 x 256 and on 128 x 256: notes.md run 37).
# VKENGINE_MC2_BK=32 turns it off.
MC2_K64 = {"types": ("q4_0",), "tiles": ((64, 256),)}
# Q4_0's scales staged in shared memory as halves (SC_F16: a quarter of the
# (d, m) pairs' bytes), in chunks of these many slices (fewer barriers a K
# loop): Options.mc2_unroll picks one (0: the pairs, MC2H_UNROLL's chunks).
# Chunks of 16 measured slower (H200, 8B pp512 step 72.2 against 58.3 ms) and
# took minutes of the driver's compile; 16 and 32 are gone (notes.md run 49).
MC2_SC_F16_UNROLLS = (4, 8)
# gate|up with the SwiGLU in mul_mc2h's epilogue, written as halves for the
# down projection (GLU; Options.mc2_glu): the tiles it has (BM/2 gate rows and
# as many up rows) and the weight types
MC2_GLU_TILES = ((256, 256), (128, 256))
MC2_GLU_TYPES = ("f16", "q4_0")
# Where the engine takes it: the matrices where it measured faster than mul_mc
# (F16 and Q4_0 of 4096+ rows with fp16 sums; not Q8_0: notes.md runs 11 and
# 13, "From code comments": MC2_ENGINE_TYPES).
MC2_ENGINE_TYPES = ("f16", "q4_0")
MC2_FROM_ROWS = 4096
MC2_F32_FROM_ROWS = 16384   # with fp32 sums (VKENGINE_MC2_F16ACC=0)
# The cooperative-matrix attention (attention_mc.comp) by head size: (NSG
# subgroups a workgroup, DS subgroups a 16-row block, BC positions a block).
# 64 and 128 measured 3-4x faster than attention.comp with 4 subgroups sharing
# the staged keys and values (notes.md run 12, "From code comments":
# ATTN_MC_HEAD_DIMS). 256 (Qwen3.5's) does not fit a lane's registers with one
# subgroup a row block (128 accumulator registers alone), so two subgroups
# take a block, half its dims each (notes.md run 27).
ATTN_MC = {64: (4, 1, 32), 128: (4, 1, 32), 256: (4, 2, 32)}
ATTN_MC_HEAD_DIMS = tuple(ATTN_MC)
# The same on NVIDIA's workgroup-scope matrices (attention_mc2.comp,
# VK_NV_cooperative_matrix2; f16 caches that do not wrap): (BR query rows, BC
# positions) a workgroup by head size, llama.cpp's flash_attn_cm2 blocks
# (ggml-vulkan.cpp get_fa_tuning_params_coopmat2: 64 x 64, 64 x 32 for heads of 256).
ATTN_MC2 = {64: (64, 64), 128: (64, 64), 256: (64, 32)}


def attn_mc_shared_bytes(hd: int, nsg: int, bc: int) -> int:
    """Shared memory of an attention_mc.comp variant (its arrays: staged keys
    and values, scores, probabilities, per-row factors, pass slots and ends)."""
    return 2 * bc * (hd + 8) * 2 + nsg * 16 * (bc + 4) * 4 + nsg * 16 * (bc + 8) * 2 + nsg * 16 * 4 + 2 * nsg * 4
# KV cache storage types (shaders/kv.glsl; llama-server's --cache-type-k/-v
# names), K and V each. The kernels that write or read the cache have a variant
# per combination other than f16/f16, named with kv_tag's suffix and compiled
# with KV_K_Q8 / KV_V_Q8.
KV_TYPES = ("f16", "q8_0")
KV_OPS = ("rope_kv", "norm_rope_kv", "attention", "attention_split", "attention_dec")


def kv_tag(k: str, v: str) -> str:
    """The variant-name suffix of a KV cache of K type k and V type v ("" for f16/f16)."""
    return {("f16", "f16"): "", ("q8_0", "f16"): "_kq8", ("f16", "q8_0"): "_vq8", ("q8_0", "q8_0"): "_kvq8"}[k, v]


def _kv_defines(k: str, v: str) -> dict[str, int]:
    return {**({"KV_K_Q8": 1} if k == "q8_0" else {}), **({"KV_V_Q8": 1} if v == "q8_0" else {})}


def _table() -> dict[str, tuple[str, dict[str, int]]]:
    t: dict[str, tuple[str, dict[str, int]]] = {}
    for wt in WEIGHT_TYPES:
        d = {f"WT_{wt.upper()}": 1}
        sg = {**d, **({"UNIT32": 1} if wt in UNIT32_TYPES else {})}
        t[f"mul_mv_{wt}"] = ("mul_mv.comp", {**sg, "NCOLS": 1, "UNROLL": 1, "RPS": SG_ROWS})
        t[f"mul_mm_{wt}"] = ("mul_mv.comp", {**sg, "NCOLS": MATMUL_COLS, "UNROLL": 1, "RPS": SG_ROWS})
        for bf, tag in ((0, ""), (1, "b")):
            for nc in (1, *MM_GPU_COLS):
                rps, unroll, extra = mv_gpu_config(wt, nc)
                name = f"mul_mvk{tag}_{wt}" if nc == 1 else f"mul_mm{tag}{nc}_{wt}"
                t[name] = ("mul_mvk.comp", {**d, **extra, "NCOLS": nc, "UNROLL": unroll, "RPS": rps, "BFLY": bf})
                # the RMSNorm split between producer and consumers (Caps.norm_in)
                t[name.replace(f"_{wt}", f"n_{wt}")] = ("mul_mvk.comp", {**t[name][1], "NORM_IN": 1})
                if nc <= 4:   # Gated DeltaNet's input projection with the conv1d after it (the "c" variants)
                    t[name.replace(f"_{wt}", f"c_{wt}")] = ("mul_mvk.comp", {**t[name][1], "CONV": 1})
                if wt in ROUTE_TYPES and nc <= 4:   # a MoE router's logits, then its choice (the "r" variants)
                    t[name.replace(f"_{wt}", f"r_{wt}")] = ("mul_mvk.comp", {**t[name][1], "ROUTE": 1})
                if wt in NORM_PARTS_TYPES:
                    t[name.replace(f"_{wt}", f"p_{wt}")] = ("mul_mvk.comp", {**t[name][1], "NORM_PARTS": 1})
                    # and h' as 8-bit blocks for an XQ8 reader (Caps.xq8_in)
                    t[name.replace(f"_{wt}", f"pq_{wt}")] = ("mul_mvk.comp", {**t[name][1], "NORM_PARTS": 1,
                                                                               "PARTS_Q8": 1})
                if wt in XQ8_TYPES:   # x as 8-bit blocks, integer dot products (Caps.xq8)
                    t[name.replace(f"_{wt}", f"x_{wt}")] = ("mul_mvk.comp", {**t[name][1], "XQ8": 1, "NO_EPI": 1,
                                                                              EXT_DEFINE: 1, EXT_V12_DEFINE: 1})
                    # the same reading a "pq" producer's blocks of h' and its sums of squares
                    t[name.replace(f"_{wt}", f"nx_{wt}")] = ("mul_mvk.comp", {**t[name][1], "XQ8": 1, "NO_EPI": 1,
                                                                               "NORM_IN": 1, "NORM_IN_BLK": 1,
                                                                               "XQ2": 1, EXT_DEFINE: 1,
                                                                               EXT_V12_DEFINE: 1})
        t[f"mul_mt_{wt}"] = ("mul_mt.comp", {**d, "TM": TILE[0], "TN": TILE[1]})
        t[f"mul_mt64_{wt}"] = ("mul_mt.comp", {**d, "TM": TILE_SMALL[0], "TN": TILE_SMALL[1]})
        bm, bn, sgm, sgn = MC_TILE
        t[f"mul_mc_{wt}"] = ("mul_mc.comp", {**d, "BM": bm, "BN": bn, "SGM": sgm, "SGN": sgn, EXT_DEFINE: 1})
        t[f"mul_mt_id_{wt}"] = ("mul_mt.comp", {**d, "TM": TILE_SMALL[0], "TN": TILE_SMALL[1], "MUL_ID": 1})
        bm, bn, sgm, sgn = MC_ID_TILE
        t[f"mul_mc_id_{wt}"] = ("mul_mc.comp", {**d, "BM": bm, "BN": bn, "SGM": sgm, "SGN": sgn, "MUL_ID": 1,
                                                EXT_DEFINE: 1})
        if wt in MC2_TYPES:
            for tag, chunks, sums in (("", MC2_UNROLL, {}), ("h", MC2H_UNROLL, {"ACC_F16": 1})):
                for (bm, bn), unroll in chunks.items():
                    t[f"mul_mc2{tag}_{bm}x{bn}_{wt}"] = ("mul_mc2.comp", {**d, "BM": bm, "BN": bn, "UNROLL": unroll,
                                                                         **sums, EXT_DEFINE: 1})
                    if tag == "h" and wt in MC2_K64["types"] and (bm, bn) in MC2_K64["tiles"]:
                        t[f"mul_mc2hk64_{bm}x{bn}_{wt}"] = ("mul_mc2.comp", {
                            **d, "BM": bm, "BN": bn, "UNROLL": unroll, **sums, "BK": 64, EXT_DEFINE: 1})
                    if tag == "h" and wt in MC2_GLU_TYPES and (bm, bn) in MC2_GLU_TILES:
                        t[f"mul_mc2hg_{bm}x{bn}_{wt}"] = ("mul_mc2.comp", {**d, "BM": bm, "BN": bn, "UNROLL": unroll,
                                                                          **sums, "GLU": 1, EXT_DEFINE: 1})
                    # Q4_0's scales staged as halves, chunks of U slices (MC2_SC_F16_UNROLLS)
                    if tag == "h" and wt == "q4_0":
                        for u in MC2_SC_F16_UNROLLS:
                            for k64 in ((False, True) if (bm, bn) in MC2_K64["tiles"] else (False,)):
                                t[f"mul_mc2h{'k64' if k64 else ''}_u{u}_{bm}x{bn}_{wt}"] = ("mul_mc2.comp", {
                                    **d, "BM": bm, "BN": bn, "UNROLL": u, **sums, "SC_F16": 1,
                                    **({"BK": 64} if k64 else {}), EXT_DEFINE: 1})
        t[f"get_rows_{wt}"] = ("get_rows.comp", d)
        t[f"get_rows_p_{wt}"] = ("get_rows.comp", {**d, "ROW_PART": 1})   # a matrix split by rows
    for hd, (nsg, ds, bc) in ATTN_MC.items():
        t[f"attention_mc_d{hd}"] = ("attention_mc.comp", {"HD": hd, "NSG": nsg, "DS": ds, "BC": bc, EXT_DEFINE: 1})
        # prompt rows at depth: positions split across workgroups, then attention_merge
        t[f"attention_mc_d{hd}_split"] = ("attention_mc.comp", {"HD": hd, "NSG": nsg, "DS": ds, "BC": bc,
                                                                 EXT_DEFINE: 1, "SPLIT": 1})
    for hd, (br, bc) in ATTN_MC2.items():
        for sp, d in (("", {}), ("_split", {"SPLIT": 1})):
            t[f"attention_mc2_d{hd}{sp}"] = ("attention_mc2.comp", {"HD": hd, "BR": br, "BC": bc, EXT_DEFINE: 1, **d})
            # O accumulated in halves (Options.attn_mc2_of16)
            t[f"attention_mc2_d{hd}{sp}_of16"] = ("attention_mc2.comp", {"HD": hd, "BR": br, "BC": bc,
                                                                        EXT_DEFINE: 1, "O_F16": 1, **d})
            # m and l over 16 columns, not BC (Options.attn_mc2_narrow)
            t[f"attention_mc2_d{hd}{sp}_of16nr"] = ("attention_mc2.comp", {"HD": hd, "BR": br, "BC": bc,
                                                                          EXT_DEFINE: 1, "O_F16": 1, "NARROW": 1, **d})
    t["attention_merge"] = ("attention_merge.comp", {})
    for op in ("rms_norm", "rope_kv", "attention", "swiglu", "add", "add_bias", "softmax", "argmax_part", "argmax",
               "copy", "topk_part", "sample", "softcap", "mask_logits",
               "to_f16", "reduce_k"):
        t[op] = (f"{op}.comp", {})
    t["quantize_q8"] = ("quantize_q8.comp", {})   # x for the XQ8 matvecs
    t["rms_norm_wg"] = ("rms_norm.comp", {"WG_ROW": 1})
    t["swiglu4"] = ("swiglu.comp", {"VEC4": 1})   # F, offsets and strides multiples of 4
    t["geglu"] = ("swiglu.comp", {"GELU": 1})     # GELU (tanh) for SiLU: Gemma's FFN
    t["geglu4"] = ("swiglu.comp", {"GELU": 1, "VEC4": 1})
    t["swiglu_oai"] = ("swiglu.comp", {"OAI": 1})   # gpt-oss's clamped SwiGLU
    t["swiglu_oai4"] = ("swiglu.comp", {"OAI": 1, "VEC4": 1})
    t["attention_split"] = ("attention.comp", {"SPLIT": 1})   # split-K decode, slices merged in place
    t["attention_dec"] = ("attention_dec.comp", {})   # decode by KV-head group, parts following the position
    t.update(_hybrid_table())
    # the KV cache's writers and readers for quantized K and/or V
    kv_ops = [*KV_OPS, *(f"attention_mc_d{hd}{sp}" for hd in ATTN_MC_HEAD_DIMS for sp in ("", "_split"))]
    for k in KV_TYPES:
        for v in KV_TYPES:
            if kv_tag(k, v):
                for op in kv_ops:
                    src, d = t[op]
                    t[op + kv_tag(k, v)] = (src, {**d, **_kv_defines(k, v)})
    return t


# Weight rows a workgroup of the split-K expert matvecs (mul_mvk_id.comp) takes, by kind (idg: gate|up with
# the SwiGLU, idc: down with the weighted sum); 0: the dense decode matvec's (mv_gpu_config, at least 2)
MVID_ROWS = {"idg": 0, "idc": 0}
# weight rows a workgroup of those besides MVID_ROWS's ("r" variants: Options.mvid_glu_rows, mvid_combine_rows)
MVID_MORE_ROWS = (8, 16)


def _hybrid_table() -> dict[str, tuple[str, dict[str, int]]]:
    """Kernels of the hybrid (Gated DeltaNet + gated attention) and MoE models."""
    t: dict[str, tuple[str, dict[str, int]]] = {}
    for wt in WEIGHT_TYPES:
        d = {f"WT_{wt.upper()}": 1}
        t[f"mul_mv_id_{wt}"] = ("mul_mv_id.comp", d)
        t[f"mul_mm_id_{wt}"] = ("mul_mm_id.comp", d)
        # experts split across buffers (storage-buffer range below one layer's experts)
        t[f"mul_mv_idp_{wt}"] = ("mul_mv_id.comp", {**d, "EXPERT_PART": 1})
        # decode steps' routed experts: gate|up with the SwiGLU, down with the weighted sum into the residual
        t[f"mul_mv_idg_{wt}"] = ("mul_mv_id.comp", {**d, "GLU": 1})
        t[f"mul_mv_idc_{wt}"] = ("mul_mv_id.comp", {**d, "COMBINE": 1})
        # ... with 4 units a lane in flight (Caps.mvid_unroll; the same sums)
        for kind, extra in (("id", {}), ("idg", {"GLU": 1}), ("idc", {"COMBINE": 1})):
            t[f"mul_mv_{kind}4_{wt}"] = ("mul_mv_id.comp", {**d, **extra, "UNROLL": 4})
        # ... in mul_mvk's split-K form on GPUs (Caps.mvid_splitk: a workgroup's invocations walk RPS rows
        # together; "b": its butterfly reduction, Caps.bfly)
        rps, unroll, extra = mv_gpu_config(wt, 1)
        for kind, ep in (("idg", "GLU"), ("idc", "COMBINE")):
            r = MVID_ROWS.get(kind) or max(rps, 2)
            for bf, tag in ((0, ""), (1, "b")):
                t[f"mul_mvk{tag}_{kind}_{wt}"] = ("mul_mvk_id.comp", {**d, **extra, ep: 1, "RPS": r,
                                                                        "UNROLL": unroll, "BFLY": bf})
                # ... with MVID_MORE_ROWS weight rows a workgroup (Caps.mvid_glu_rows / mvid_combine_rows; gate|up:
                # half of them gate rows): each lane's x loads shared by more rows, fewer workgroups
                for gr in MVID_MORE_ROWS:
                    if gr != r:
                        t[f"mul_mvk{tag}_{kind}r{gr}_{wt}"] = ("mul_mvk_id.comp", {**t[f"mul_mvk{tag}_{kind}_{wt}"][1],
                                                                                  "RPS": gr})
        t[f"mul_mm_idp_{wt}"] = ("mul_mm_id.comp", {**d, "EXPERT_PART": 1})
        # decode steps of several rows: the experts they share read once (moe_sort's work list)
        t[f"mul_mm_idb_{wt}"] = ("mul_mm_id.comp", {**d, "BLOCKS": 1})
    for op in ("conv1d", "l2_norm", "delta_rule", "delta_chunk", "delta_scan", "gated_rms_norm",
               "norm_rope_kv", "sigmoid_mul", "moe_sort",
               "moe_combine", "moe_bias"):
        t[op] = (f"{op}.comp", {})
    t["delta_rule_gn"] = ("delta_rule.comp", {"GNORM": 1})   # with the gated RMSNorm after it (decode steps)
    for name in ("delta_rule", "delta_rule_gn"):   # 4 state entries a lane (DeltaRuleKernels: dk <= 4 x subgroup)
        t[name + "_e4"] = ("delta_rule.comp", {**t[name][1], "MAXE": 4})
    for name in ("delta_rule", "delta_rule_gn", "delta_rule_e4", "delta_rule_gn_e4"):   # Caps.delta_cols
        for cols in (2, 4):
            t[f"{name}_c{cols}"] = ("delta_rule.comp", {**t[name][1], "COLS": cols})
    t["conv1d_rows"] = ("conv1d_rows.comp", {})
    t["conv1d_rows_state"] = ("conv1d_rows.comp", {"STATE": 1})
    t["moe_router"] = ("moe_router.comp", {"FIXED": 0})
    t["moe_sort_blocks"] = ("moe_sort.comp", {"BLOCKS": 1})   # and the tiled expert matmuls' work list
    t["moe_router_fixed"] = ("moe_router.comp", {"FIXED": 1})
    return t


VARIANTS = _table()
