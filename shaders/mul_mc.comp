#version 450
// Prefill matmul on cooperative matrices (tensor cores; VK_KHR_cooperative_matrix):
// y[c][row] (+)= sum_k W[row][k] * x[c][k], like mul_mt.comp, with the
// multiply-adds in 16 x 16 x 16 fp16 tiles that accumulate in fp32.
// A workgroup of 8 subgroups of 32 lanes (Kernels.coopmat checks the device)
// computes a BM x BN tile (weight rows x tokens). Per BK slice of K it
// dequantizes its BM weight rows into shared memory as halves (W: row-major,
// the A operand) and converts BN token rows of x to halves (x: the B operand,
// column-major); each subgroup then owns WM x WN of the tile, (WM/16) x (WN/16)
// accumulators. Results go out through a per-subgroup 16 x 16 staging tile, so
// edges (rows past M, tokens past N) and accumulation need no special case.
// fp16 operands round W and x to 11 significant bits, as llama.cpp's coopmat
// kernels do; the sums stay fp32.
// Compiled by the newer glslc (scripts/glslc-ext.sh); only GPUs whose driver
// reports 16x16x16 f16 x f16 -> f32 subgroup matrices run it.
// MUL_ID (mul_mc_id): the experts' matmul of a prompt step in such tiles, over
// moe_sort.comp's work list of (expert, block of its pairs), as mul_mt.comp's
// MUL_ID (mul_tiled_cols.glsl).
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require

layout(local_size_x = 256, local_size_y = 1, local_size_z = 1) in;

// x and y: the same activation buffer bound twice (x readonly), see mul_mv.comp
layout(binding = 0) readonly restrict buffer Wq { uint wq[]; };
layout(binding = 1) readonly restrict buffer X4 { vec4 act4[]; };
layout(binding = 2) buffer Y { float act[]; };

layout(push_constant) uniform P {
    uint w_off, w_off2;
    uint K, M, N;
    uint x_off, x_stride;   // multiples of 4
    uint y_off, y_stride;
    uint accumulate;
    // split K (Kernels.split_k_parts): workgroup z sums K columns [z klen, (z +
    // 1) klen) and writes its partial sums z_stride floats after y_off (klen a
    // multiple of the K slice and of the weight type's unit span: Kernels
    // takes multiples of 256; 0: all of K, z = 0); reduce_k.comp adds the parts
    uint klen, z_stride;
#ifdef MUL_ID
    uint k, list_off, list_stride, cnt_off, blocks_off, x_slot_stride, y_slot_stride;
#endif
} p;

#include "quant.glsl"
#include "mul_tiled_cols.glsl"

#ifndef BK
#define BK 32
#endif
#define LD (BK + 8)          // halves per shared row: rows stay 16-byte aligned
// subgroups along the rows (SGM) and the tokens (SGN), SGM SGN = 8: set by
// shaders/variants.py MC_TILE. On the H200 every shape with more than one
// 16-token column of accumulators per subgroup (WN > 16) ran 2-3x slower
// whatever the loop order (bench/mm_probe.py), so the tiles keep WN = 16.
#define WM (BM / SGM)
#define WN (BN / SGN)
#define TMC (WM / 16)
#define TNC (WN / 16)
shared f16vec4 Ws[BM * LD / 4];   // halves: [r * LD + k] = W[row0 + r][k0 + k]
shared f16vec4 Xs[BN * LD / 4];   // halves: [c * LD + k] = x[col0 + c][k0 + k]
shared float Cs[8 * 256];         // one 16 x 16 staging tile per subgroup

// The units whose values fall in a BK slice: those of the slice's GSPAN-column
// group (K-quant units interleave within 64 or 128 columns; a group wider than
// the slice is decoded once per slice it touches, see mul_mt.comp).
#define GSPAN (BK > UNIT_SPAN ? BK : UNIT_SPAN)
#define UPS (GSPAN / UNIT_VALUES)
#define WPT ((BM * UPS + 255) / 256)      // weight units per invocation and slice
#define XPT (BN * BK / 4 / 256)           // x vec4 per invocation and slice
Raw wr_[WPT];
vec4 xr_[XPT];

// global -> registers: slice k0's weight units (rows past M and columns past K
// read as zeros) and x values
void fetch(uint k0, uint row0, uint col0, uint tid, uint N) {
    uint ubase = (k0 / GSPAN) * UPS;
    [[unroll]] for (uint t = 0; t < WPT; t++) {
        uint i = tid + t * 256u;
        uint r = i / UPS, u = ubase + i % UPS;
        wr_[t] = Raw(uvec4(0u), uvec4(0u));
        if (i < BM * UPS && row0 + r < p.M && u * UNIT_VALUES < p.K)
            wr_[t] = unit_fetch(p.w_off, p.w_off2, W_ROW0 + row0 + r, u, p.K);
    }
    [[unroll]] for (uint t = 0; t < XPT; t++) {
        uint i = tid + t * 256u;
        uint c = i / (BK / 4u), k4 = i % (BK / 4u);
        uint col = col0 + c;
        xr_[t] = col < N && k0 + k4 * 4u < p.K ? act4[(x_row(col) + k0) / 4u + k4] : vec4(0.0);
    }
}

// registers -> shared memory as halves (the weights decoded on the way)
void stash(uint k0, uint tid) {
    uint ubase = (k0 / GSPAN) * UPS;
    [[unroll]] for (uint t = 0; t < WPT; t++) {
        uint i = tid + t * 256u;
        if (i < BM * UPS) {
            uint r = i / UPS, u = ubase + i % UPS;
            vec4 v[UNIT_GROUPS];
            uint xo[UNIT_GROUPS];
            unit_decode(wr_[t], u, v, xo);
            [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) {
                uint kk = xo[g] - k0;   // wraps to a large value below the slice
                if (kk < BK) Ws[(r * LD + kk) / 4u] = f16vec4(v[g]);
            }
        }
    }
    [[unroll]] for (uint t = 0; t < XPT; t++) {
        uint i = tid + t * 256u;
        uint c = i / (BK / 4u), k4 = i % (BK / 4u);
        Xs[(c * LD) / 4u + k4] = f16vec4(xr_[t]);
    }
}

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint sg = gl_SubgroupID;
    uint lane = gl_SubgroupInvocationID;
    uint row0 = gl_WorkGroupID.x * BM;
    uint col0 = tile_cols(BN);
    if (col0 == NO_TILE) return;     // (uniform: past the work list)
    uint N = n_cols();
    uint wr = sg % SGM, wc = sg / SGM;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[TMC * TNC];   // [i * TNC + j]
    [[unroll]] for (uint i = 0; i < TMC * TNC; i++)
        acc[i] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);

    uint kb = gl_WorkGroupID.z * p.klen, ke = p.klen == 0u ? p.K : min(p.K, kb + p.klen);
    for (uint k0 = kb; k0 < ke; k0 += BK) {
        fetch(k0, row0, col0, tid, N);
        stash(k0, tid);
        barrier();
        [[unroll]] for (uint kk = 0; kk < BK; kk += 16u) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a[TMC];
            [[unroll]] for (uint i = 0; i < TMC; i++)
                coopMatLoad(a[i], Ws, ((wr * WM + i * 16u) * LD + kk) / 4u, LD / 4u, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0; j < TNC; j++) {
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> b;
                coopMatLoad(b, Xs, ((wc * WN + j * 16u) * LD + kk) / 4u, LD / 4u, gl_CooperativeMatrixLayoutColumnMajor);
                [[unroll]] for (uint i = 0; i < TMC; i++)
                    acc[i * TNC + j] = coopMatMulAdd(a[i], b, acc[i * TNC + j]);
            }
        }
        barrier();
    }
    // out: Cs[sg * 256 + c * 16 + r] = tile (r, c); 16 consecutive rows per token
    [[unroll]] for (uint i = 0; i < TMC; i++) {
        [[unroll]] for (uint j = 0; j < TNC; j++) {
            coopMatStore(acc[i * TNC + j], Cs, sg * 256u, 16u, gl_CooperativeMatrixLayoutColumnMajor);
            subgroupMemoryBarrierShared();
            subgroupBarrier();
            for (uint e = lane; e < 256u; e += gl_SubgroupSize) {
                uint row = row0 + wr * WM + i * 16u + (e & 15u);
                uint col = col0 + wc * WN + j * 16u + (e >> 4);
                if (row < p.M && col < N) {
                    uint yi = y_row(col) + row;
                    float s = Cs[sg * 256u + e];
                    act[yi] = p.accumulate != 0u ? act[yi] + s : s;
                }
            }
            subgroupBarrier();
        }
    }
}
