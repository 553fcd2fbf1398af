#version 450
// Prefill matmul on NVIDIA's workgroup-scope cooperative matrices
// (VK_NV_cooperative_matrix2): y[c][row] (+)= sum_k W[row][k] * x[c][k], the
// product of mul_mc.comp. A workgroup computes a BM x BN tile (weight rows x
// tokens) as one workgroup-scope matrix, which the driver splits among its
// subgroups and feeds with its own pipelined loads (mul_mc's subgroup matrices
// cannot overlap loads and multiplies on this driver: docs/bench/notes.md run 10).
//  - W comes in through tensor-addressed loads: halves directly (F16), or with
//    a decode function that dequantizes one value of a block (Q4_0 and Q4_1:
//    a block's 16 bytes of nibbles are one buffer element; Q8_0: 32 bytes, two
//    16-value elements, since arrays are only 16-byte aligned). Each chunk of
//    UNROLL slices stages its blocks' scales in shared memory first (reading a
//    scale from global memory per decoded value cost ~30%).
//  - x comes as halves from binding 1 (Kernels.mul_mat converts it with
//    to_f16.comp into rows of a multiple of 8 halves, zero rows up to a whole
//    number of BN-token tiles), loaded directly: no clamping, and offsets and
//    strides the compiler can prove 16-byte aligned (unaligned direct loads
//    measured 3-5x slower).
//  - W rows past M: the workgroups of the last row tile load through a clamped
//    layout (2.5x slower loads, so only there); y goes out through a clamped,
//    transposed view, which drops rows past M and tokens past N.
// GLU: W is gate over up (M = 2F rows) and the tile's rows are BM/2 gate rows
// and the same BM/2 up rows, two matrices multiplied against each slice of x;
// y[c][i] = silu(gate[i] . x[c]) * (up[i] . x[c]) (as swiglu.comp's silu_mul),
// written as halves in to_f16's layout (the next mul_mc2's x: rows of y_stride
// halves, N its padded token count), so neither gate|up's floats, nor the
// separate swiglu, nor the down projection's to_f16 are needed.
// fp16 operands and fp32 sums, as mul_mc. Compiled by the newer glslc
// (scripts/glslc-ext.sh); run where Kernels.coopmat2 says the device can.
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_buffer_reference : require

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

layout(binding = 0) readonly restrict buffer Wq { uint wq[]; };
layout(binding = 0) readonly restrict buffer Wb { uvec4 wblk[]; };
layout(binding = 0) readonly restrict buffer Wh { float16_t wh[]; };
layout(binding = 1) readonly restrict buffer Xh { float16_t xh[]; };
layout(binding = 2) buffer Y { float act[]; };
#ifdef GLU
layout(binding = 2) buffer Yh { float16_t yh[]; };
#define TM (BM / 2)         // a workgroup's gate rows (and as many up rows)
#else
#define TM BM
#endif

layout(push_constant) uniform P {
    uint w_off, w_off2;     // words
    uint K, M, N;
    uint x_off, x_stride;   // halves, multiples of 8
    uint y_off, y_stride;
    uint accumulate;
} p;

#ifndef BK
#define BK 32               // slice depth; 64 needs K a multiple of 64 (Kernels.mc2_variant)
#endif
#ifndef UNROLL
#define UNROLL 8            // slices per chunk
#endif
#if defined(WT_Q8_0)
#define QBLOCK 16           // values per buffer element (half a Q8_0 block)
#elif defined(WT_F16)
#define QBLOCK 1
#else
#define QBLOCK 32
#endif

#if !defined(WT_F16)
layout(buffer_reference, std430, buffer_reference_align = 16) buffer QBlk { uint q[4]; };

#define SC_BLKS (UNROLL * BK / 32)   // 32-value blocks of a row in a chunk
#ifdef SC_F16
// Q4_0 only: a block's scale d as a half (value = (q - 8) * d, in halves: the
// same half as q * d - 8 * d in floats rounded once, both exact before it), a
// quarter of the shared memory, so chunks of more slices (fewer barriers) fit
shared float16_t sc_sh[BM * SC_BLKS];   // [r * SC_BLKS + block]
#else
shared vec2 sc_sh[BM * SC_BLKS];     // (d, m): value = q * d + m, [r * SC_BLKS + block]
#endif
uint sc_row0, sc_kb0;
#ifdef GLU
uint sc_rowu;   // the up rows' first: staged after the gate rows, at TM
#endif

vec2 block_dm(uint blk) {
#if defined(WT_Q4_1)
    return unpackHalf2x16(wq[p.w_off2 + blk]);
#else
    float d = unpackHalf2x16(wq[p.w_off2 + (blk >> 1)] >> ((blk & 1u) << 4)).x;
#if defined(WT_Q4_0)
    return vec2(d, -8.0 * d);
#else
    return vec2(d, 0.0);
#endif
#endif
}

// the scales of blocks kb0 .. kb0 + nb of rows row0 .. row0 + BM (the last row
// repeated past M) into shared memory
void stage_scales(uint row0, uint kb0, uint nb) {
    sc_kb0 = kb0;
    barrier();   // the previous chunk's loads are done with sc_sh
    for (uint i = gl_LocalInvocationID.x; i < BM * nb; i += 256u) {
#ifdef GLU
        uint ri = i / nb;
        uint r = min(ri < TM ? row0 + ri : sc_rowu + ri - TM, p.M - 1u);
#else
        uint r = min(row0 + i / nb, p.M - 1u);
#endif
#ifdef SC_F16
        sc_sh[(i / nb) * SC_BLKS + i % nb] = float16_t(block_dm(r * (p.K / 32u) + kb0 + i % nb).x);
#else
        sc_sh[(i / nb) * SC_BLKS + i % nb] = block_dm(r * (p.K / 32u) + kb0 + i % nb);
#endif
    }
    barrier();
}

// one value of a block (blockCoords, coordInBlock) whose scales are staged at row SR of sc_sh
#if defined(SC_F16)
#define DEQUANT_BODY(SR)                                                                   \
    uint c = coordInBlock[1];                                                              \
    float16_t d = sc_sh[(SR) * SC_BLKS + blockCoords[1] - sc_kb0];                         \
    uint q = (bl.q[(c & 15u) >> 2] >> (((c & 3u) << 3) + ((c & 16u) >> 2))) & 15u;        \
    return (float16_t(q) - float16_t(8.0)) * d;
#elif defined(WT_Q8_0)
#define DEQUANT_BODY(SR)                                                                   \
    uint c = coordInBlock[1];                                                              \
    vec2 dm = sc_sh[(SR) * SC_BLKS + (blockCoords[1] >> 1) - sc_kb0];                      \
    float q = float(bitfieldExtract(int(bl.q[c >> 2]), int((c & 3u) << 3), 8));            \
    return float16_t(q * dm.x + dm.y);
#else
#define DEQUANT_BODY(SR)                                                                   \
    uint c = coordInBlock[1];                                                              \
    vec2 dm = sc_sh[(SR) * SC_BLKS + blockCoords[1] - sc_kb0];                             \
    float q = float((bl.q[(c & 15u) >> 2] >> (((c & 3u) << 3) + ((c & 16u) >> 2))) & 15u); \
    return float16_t(q * dm.x + dm.y);
#endif
float16_t dequant(const in QBlk bl, const in uint blockCoords[2], const in uint coordInBlock[2]) {
    DEQUANT_BODY(blockCoords[0] - sc_row0)
}
#ifdef GLU
float16_t dequant_u(const in QBlk bl, const in uint blockCoords[2], const in uint coordInBlock[2]) {
    DEQUANT_BODY(blockCoords[0] - sc_rowu + TM)
}
#define LOAD_AU(a, tA, row0, k0) coopMatLoadTensorNV(a, wblk, p.w_off / 4u, sliceTensorLayoutNV(tA, row0, TM, k0, BK), dequant_u)
#endif
#define STAGE(row0, kb0, nb) stage_scales(row0, kb0, nb)
#define LOAD_A(a, tA, row0, k0) coopMatLoadTensorNV(a, wblk, p.w_off / 4u, sliceTensorLayoutNV(tA, row0, TM, k0, BK), dequant)
#else
#define STAGE(row0, kb0, nb)
#define LOAD_A(a, tA, row0, k0) coopMatLoadTensorNV(a, wh, (p.w_off * 2u) & ~7u, sliceTensorLayoutNV(tA, row0, TM, k0, BK))
#define LOAD_AU(a, tA, row0, k0) LOAD_A(a, tA, row0, k0)
#endif

// ACC_F16: fp16 sums (llama.cpp's f16acc matmuls, its default for quantized weights
// on these devices), converted to fp32 for y
#ifdef ACC_F16
#define ACC coopmat<float16_t, gl_ScopeWorkgroup, TM, BN, gl_MatrixUseAccumulator>
#else
#define ACC coopmat<float, gl_ScopeWorkgroup, TM, BN, gl_MatrixUseAccumulator>
#endif
#define ACC32 coopmat<float, gl_ScopeWorkgroup, TM, BN, gl_MatrixUseAccumulator>

// one slice: acc += A . B (GLU: the gate rows' A into acc, the up rows' into accu)
#ifdef GLU
#define SLICE(tA, row0, k0)                                                                \
    {                                                                                      \
        coopmat<float16_t, gl_ScopeWorkgroup, TM, BK, gl_MatrixUseA> a;                    \
        coopmat<float16_t, gl_ScopeWorkgroup, TM, BK, gl_MatrixUseA> au;                   \
        coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;                    \
        LOAD_A(a, tA, row0, k0);                                                           \
        LOAD_AU(au, tA, rowu, k0);                                                         \
        coopMatLoadTensorNV(b, xh, x_off, sliceTensorLayoutNV(tB, col0, BN, k0, BK), tr);  \
        acc = coopMatMulAdd(a, b, acc);                                                    \
        accu = coopMatMulAdd(au, b, accu);                                                 \
    }
#else
#define SLICE(tA, row0, k0)                                                                \
    {                                                                                      \
        coopmat<float16_t, gl_ScopeWorkgroup, TM, BK, gl_MatrixUseA> a;                    \
        coopmat<float16_t, gl_ScopeWorkgroup, BK, BN, gl_MatrixUseB> b;                    \
        LOAD_A(a, tA, row0, k0);                                                           \
        coopMatLoadTensorNV(b, xh, x_off, sliceTensorLayoutNV(tB, col0, BN, k0, BK), tr);  \
        acc = coopMatMulAdd(a, b, acc);                                                    \
    }
#endif

// the K loop: whole chunks of UNROLL slices, then the remaining slices
#define K_LOOP(tA)                                                                         \
    {                                                                                      \
        uint k0 = 0u;                                                                      \
        for (; k0 + UNROLL * BK <= p.K; ) {                                                \
            STAGE(row0, k0 / 32u, SC_BLKS);                                                \
            [[unroll]] for (uint j = 0u; j < UNROLL; j++, k0 += BK) {                      \
                SLICE(tA, row0, k0)                                                        \
            }                                                                              \
        }                                                                                  \
        if (k0 < p.K) {                                                                    \
            STAGE(row0, k0 / 32u, (p.K - k0) / 32u);                                       \
            for (; k0 < p.K; k0 += BK) {                                                   \
                SLICE(tA, row0, k0)                                                        \
            }                                                                              \
        }                                                                                  \
    }

void main() {
    uint row0 = gl_WorkGroupID.x * TM;
    uint col0 = gl_WorkGroupID.y * BN;
#ifdef GLU
    uint F = p.M / 2u;
    uint rowu = F + row0;   // the up rows of the gate rows row0 ..
#endif
#if !defined(WT_F16)
    sc_row0 = row0;
#ifdef GLU
    sc_rowu = rowu;
#endif
#endif
    // strides and offsets rounded down to 8 halves: the compiler can then prove
    // the direct loads aligned (they are: Kernels.mul_mat lays them out so)
    uint x_off = p.x_off & ~7u;
    tensorLayoutNV<2> tB = createTensorLayoutNV(2);
    tB = setTensorLayoutDimensionNV(tB, 0x7fffffffu, p.K);
    tB = setTensorLayoutStrideNV(tB, p.x_stride & ~7u, 1);
    tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> tD =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    tD = setTensorLayoutDimensionNV(tD, p.N, p.M);
    tD = setTensorLayoutStrideNV(tD, p.y_stride, 1);

    ACC acc = ACC(0.0);
#ifdef GLU
    ACC accu = ACC(0.0);
    if (rowu + TM <= p.M) {   // (gate rows past F read up rows: their outputs are dropped below)
#else
    if (row0 + BM <= p.M) {
#endif
        tensorLayoutNV<2> tA = createTensorLayoutNV(2);
#if QBLOCK > 1
        tA = setTensorLayoutBlockSizeNV(tA, 1, QBLOCK);
#endif
        tA = setTensorLayoutDimensionNV(tA, p.M, p.K);
#if QBLOCK == 1
        tA = setTensorLayoutStrideNV(tA, p.K & ~7u, 1);   // halves (Kernels: K % 8 == 0)
#endif
        K_LOOP(tA)
    } else {
        tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> tA =
            createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
#if QBLOCK > 1
        tA = setTensorLayoutBlockSizeNV(tA, 1, QBLOCK);
#endif
        tA = setTensorLayoutDimensionNV(tA, p.M, p.K);
        K_LOOP(tA)
    }
#ifdef ACC_F16
    // as llama.cpp's f16acc matmuls: overflowed sums clamp to the largest half
    [[unroll]] for (uint i = 0; i < acc.length(); ++i) acc[i] = clamp(acc[i], float16_t(-65504.0), float16_t(65504.0));
    ACC32 res = ACC32(acc);
#ifdef GLU
    [[unroll]] for (uint i = 0; i < accu.length(); ++i) accu[i] = clamp(accu[i], float16_t(-65504.0), float16_t(65504.0));
    ACC32 resu = ACC32(accu);
#endif
#else
    ACC32 res = acc;
#ifdef GLU
    ACC32 resu = accu;
#endif
#endif
#ifdef GLU
    // silu(g) * u as common.glsl's silu_mul (not contracted), then halves for the next matmul's x
    [[unroll]] for (uint i = 0; i < res.length(); ++i) {
        float g = res[i];
        precise float r = g / (1.0 + exp(-g)) * resu[i];
        res[i] = r;
    }
    coopmat<float16_t, gl_ScopeWorkgroup, TM, BN, gl_MatrixUseAccumulator> rh =
        coopmat<float16_t, gl_ScopeWorkgroup, TM, BN, gl_MatrixUseAccumulator>(res);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> tH =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    tH = setTensorLayoutDimensionNV(tH, p.N, F);
    tH = setTensorLayoutStrideNV(tH, p.y_stride, 1);
    coopMatStoreTensorNV(rh, yh, p.y_off, sliceTensorLayoutNV(tH, col0, BN, row0, TM), tr);
#else
    if (p.accumulate != 0u) {
        ACC32 old;
        coopMatLoadTensorNV(old, act, p.y_off, sliceTensorLayoutNV(tD, col0, BN, row0, BM), tr);
        res = old + res;
    }
    coopMatStoreTensorNV(res, act, p.y_off, sliceTensorLayoutNV(tD, col0, BN, row0, BM), tr);
#endif
}
