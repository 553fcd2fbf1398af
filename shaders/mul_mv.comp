#version 450
// y[c][row] (+)= sum_k W[row][k] * x[c][k] for columns c < N.
// One subgroup per weight row; its lanes walk the row's units (8 or 16 values),
// dequantize each unit once and use it for NCOLS columns of x (NCOLS = 1: the
// decode matvec; NCOLS = 8: batched prefill / batched decode).
// grid: (row groups folded into x/y, ceil(N / NCOLS) in z)
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { uint wq[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Act4 { vec4 act4[]; };

layout(push_constant) uniform P {
    uint w_off, w_off2;     // weight words / scale words
    uint K, M, N;           // columns of W, rows of W, columns of x
    uint x_off, x_stride;   // floats; multiples of 4
    uint y_off, y_stride;   // floats
    uint accumulate;        // 1: add into y (fused residual)
} p;

#include "quant.glsl"

void main() {
    uvec2 rows = workgroup_items(p.M);
    uint col0 = gl_WorkGroupID.z * NCOLS;
    uint ncols = min(uint(NCOLS), p.N - col0);
    uint units = units_per_row(p.K);
    for (uint row = rows.x + gl_SubgroupID; row < rows.y; row += gl_NumSubgroups) {
        float acc[NCOLS];
        [[unroll]] for (uint c = 0; c < NCOLS; c++) acc[c] = 0.0;
        // UNROLL units per lane per iteration: every load is issued before the
        // first unit is decoded, so each lane has several wide loads in flight
        uint step = gl_SubgroupSize * UNROLL;
        for (uint u0 = gl_SubgroupInvocationID; u0 < units; u0 += step) {
            Raw raw[UNROLL];
            [[unroll]] for (uint k = 0; k < UNROLL; k++) {
                uint u = u0 + k * gl_SubgroupSize;
                if (u < units) raw[k] = unit_fetch(p.w_off, p.w_off2, row, u, p.K);
            }
            [[unroll]] for (uint k = 0; k < UNROLL; k++) {
                uint u = u0 + k * gl_SubgroupSize;
                if (u < units) {
                    vec4 v[UNIT_GROUPS];
                    uint xo[UNIT_GROUPS];
                    unit_decode(raw[k], u, v, xo);
                    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                        if (c < ncols) {
                            uint xb = (p.x_off + (col0 + c) * p.x_stride) >> 2;
                            [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) {
                                acc[c] += dot(v[g], act4[xb + (xo[g] >> 2)]);
                            }
                        }
                    }
                }
            }
        }
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            float s = subgroupAdd(acc[c]);
            if (c < ncols && subgroupElect()) {
                uint yi = p.y_off + (col0 + c) * p.y_stride + row;
                act[yi] = p.accumulate != 0u ? act[yi] + s : s;
            }
        }
    }
}
