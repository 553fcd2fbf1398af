#version 450
// Batched expert matmul for prefill: y[r][i][m] = W[e][m] . x[r][i] for every
// pair (r, i) routed to expert e, taken from moe_sort.comp's per-expert lists.
// Expert-major: workgroups of expert e dequantize each unit of its rows once
// and use it for up to NCOLS of its pairs (mul_mv_id.comp reads the expert's
// weights again for every pair; that suits decode, where pairs rarely share an
// expert). A pair's sum is accumulated in the same order as mul_mv_id.comp's.
// grid: (row groups folded into x/y, experts in z)
// EXPERT_PART: this dispatch binds experts [e_lo, e_hi) of a stack split across
// buffers (grid z = e_hi - e_lo); lists and counts stay indexed by expert id.
// BLOCKS (decode steps of several rows): grid z walks moe_sort.comp's work list
// of (expert, block of NCOLS pairs), so the experts the rows share are read
// once and the grid holds only the blocks that exist (most experts have no pair).
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { uint wq[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Act4 { vec4 act4[]; };
layout(binding = 1) readonly buffer ActU { uint actu[]; };

layout(push_constant) uniform P {
    uint w_off, w_off2;          // expert 0's weight words / scale words
    uint K, M, k;                // columns, rows per expert, experts per row
    uint list_off, list_stride, cnt_off;
    uint x_off, x_stride, x_slot_stride;   // floats; multiples of 4
    uint y_off, y_stride, y_slot_stride;
#ifdef EXPERT_PART
    uint e_lo, e_hi;
#endif
#ifdef BLOCKS
    uint blocks_off;
#endif
} p;

#include "quant.glsl"

#define NCOLS 8

void main() {
#if defined(EXPERT_PART)
    uint e = p.e_lo + gl_WorkGroupID.z, e_row0 = gl_WorkGroupID.z * p.M;
    uint b_lo = 0u;
#elif defined(BLOCKS)
    if (gl_WorkGroupID.z >= actu[p.blocks_off]) return;
    uint blk = actu[p.blocks_off + 1u + gl_WorkGroupID.z];
    uint e = blk >> 16, e_row0 = e * p.M;
    uint b_lo = (blk & 0xffffu) * NCOLS;
#else
    uint e = gl_WorkGroupID.z, e_row0 = e * p.M;
    uint b_lo = 0u;
#endif
    uint cnt = actu[p.cnt_off + e];
#ifdef BLOCKS
    cnt = min(cnt, b_lo + NCOLS);        // this block's pairs alone
#endif
    if (cnt == 0u) return;
    uvec2 rows = workgroup_items(p.M);
    uint units = units_per_row(p.K);
    for (uint m = rows.x + gl_SubgroupID; m < rows.y; m += gl_NumSubgroups) {
        for (uint b0 = b_lo; b0 < cnt; b0 += NCOLS) {
            uint nc = min(uint(NCOLS), cnt - b0);
            uint xb[NCOLS];
            uint yb[NCOLS];
            float acc[NCOLS];
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                uint pr = c < nc ? actu[p.list_off + (b0 + c) * p.list_stride + e] : 0u;
                uint r = pr / p.k, i = pr % p.k;
                xb[c] = p.x_off + r * p.x_stride + i * p.x_slot_stride;
                yb[c] = p.y_off + r * p.y_stride + i * p.y_slot_stride;
                acc[c] = 0.0;
            }
            for (uint u = gl_SubgroupInvocationID; u < units; u += gl_SubgroupSize) {
                vec4 v[UNIT_GROUPS];
                uint xo[UNIT_GROUPS];
                unit_load(p.w_off, p.w_off2, e_row0 + m, u, p.K, v, xo);
                [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                    if (c < nc) {
                        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) acc[c] += dot(v[g], act4[(xb[c] + xo[g]) >> 2]);
                    }
                }
            }
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                float s = subgroupAdd(acc[c]);
                if (c < nc && subgroupElect()) act[yb[c] + m] = s;
            }
        }
    }
}
