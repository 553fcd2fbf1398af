#version 450
// Tiled matmul for prefill on GPUs: y[c][row] (+)= sum_k W[row][k] * x[c][k].
// A 256-invocation workgroup computes a BM x BN tile (weight rows x tokens),
// each invocation TM x TN of it. Per BK = 32 slice of K the workgroup
// dequantizes its BM weight rows into shared memory (each weight read from
// memory once per tile instead of once per token) and copies BN token rows, then
// every invocation does TM x TN x BK multiply-adds from shared memory.
// Uses barrier(), which lavapipe runs slowly: Kernels picks it on GPUs only.
// MUL_ID (mul_mt_id): the experts' matmul of a prompt step, as mul_mm_id.comp
// computes it (y[r][i] = W[e][...] . x[r][i] for the pairs (r, i) routed to
// expert e) but in tiles: grid y walks moe_sort.comp's (BLOCKS) work list of
// (expert e, block of BN of its pairs), the tile's rows are expert e's, and
// its token columns gather the listed pairs' x rows and scatter their y rows.
#extension GL_EXT_control_flow_attributes : require

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

#define BM (16 * TM)
#define BN (16 * TN)
#define BK 32
shared vec4 Ws[BK][BM / 4];   // Ws[k][r / 4][r % 4] = W[row0 + r][k0 + k]
shared vec4 Xs[BK][BN / 4];   // Xs[k][c / 4][c % 4] = x[col0 + c][k0 + k]

void main() {
    uint tid = gl_LocalInvocationID.x;
    uint row0 = gl_WorkGroupID.x * BM;
    uint col0 = tile_cols(BN);
    if (col0 == NO_TILE) return;     // (uniform: past the work list)
    uint N = n_cols();
    uint tx = tid % 16u, ty = tid / 16u;
    // The units whose values fall in a BK slice: those of the slice's UNIT_SPAN
    // group (K-quant units interleave within 64 or 128 columns). Units spanning
    // more than the slice are decoded once per slice they touch; the waste is
    // small next to the BN tokens each decoded weight is used for.
    const uint UPS = UNIT_SPAN / UNIT_VALUES;
    vec4 acc[TN][TM / 4];
    [[unroll]] for (uint j = 0; j < TN; j++)
        [[unroll]] for (uint i = 0; i < TM / 4; i++) acc[j][i] = vec4(0.0);

    uint kb = gl_WorkGroupID.z * p.klen, ke = p.klen == 0u ? p.K : min(p.K, kb + p.klen);
    for (uint k0 = kb; k0 < ke; k0 += BK) {
        uint ubase = (k0 / UNIT_SPAN) * UPS;
        for (uint i = tid; i < BM * UPS; i += 256u) {
            uint r = i / UPS;
            uint u = ubase + i % UPS;
            uint row = row0 + r;
            Raw raw = Raw(uvec4(0u), uvec4(0u));   // rows past M decode to zeros
            if (row < p.M) raw = unit_fetch(p.w_off, p.w_off2, W_ROW0 + row, u, p.K);
            vec4 v[UNIT_GROUPS];
            uint xo[UNIT_GROUPS];
            unit_decode(raw, u, v, xo);
            [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) {
                uint kk = xo[g] - k0;   // wraps to a large value below the slice
                if (kk < BK) {
                    [[unroll]] for (uint e = 0; e < 4u; e++) Ws[kk + e][r >> 2][r & 3u] = v[g][e];
                }
            }
        }
        for (uint i = tid; i < BN * BK / 4u; i += 256u) {
            uint c = i / (BK / 4u);
            uint k4 = i % (BK / 4u);
            uint col = col0 + c;
            vec4 xv = col < N ? act4[(x_row(col) + k0) / 4u + k4] : vec4(0.0);
            [[unroll]] for (uint e = 0; e < 4u; e++) Xs[k4 * 4u + e][c >> 2][c & 3u] = xv[e];
        }
        barrier();
        [[unroll]] for (uint k = 0; k < BK; k++) {
            vec4 a[TM / 4];
            [[unroll]] for (uint i = 0; i < TM / 4; i++) a[i] = Ws[k][ty * (TM / 4) + i];
            [[unroll]] for (uint jb = 0; jb < TN / 4; jb++) {
                vec4 b = Xs[k][tx * (TN / 4) + jb];
                [[unroll]] for (uint i = 0; i < TM / 4; i++) {
                    acc[jb * 4u + 0u][i] += a[i] * b.x;
                    acc[jb * 4u + 1u][i] += a[i] * b.y;
                    acc[jb * 4u + 2u][i] += a[i] * b.z;
                    acc[jb * 4u + 3u][i] += a[i] * b.w;
                }
            }
        }
        barrier();
    }
    [[unroll]] for (uint j = 0; j < TN; j++) {
        uint col = col0 + tx * TN + j;
        if (col >= N) continue;
        uint yb = y_row(col);
        [[unroll]] for (uint i = 0; i < TM; i++) {
            uint row = row0 + ty * TM + i;
            if (row < p.M) {
                uint yi = yb + row;
                float s = acc[j][i / 4u][i % 4u];
                act[yi] = p.accumulate != 0u ? act[yi] + s : s;
            }
        }
    }
}
