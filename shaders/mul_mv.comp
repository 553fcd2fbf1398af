#version 450
// y[c][row] (+)= sum_k W[row][k] * x[c][k] for columns c < N: the subgroup
// matvec that lavapipe runs (GPUs run mul_mvk.comp). RPS weight rows per
// subgroup (SG_ROWS in variants.py); its lanes walk the rows' units (8 or 16
// values), dequantize each unit once and use it for NCOLS columns of x
// (decode: 1; batches: 8). No barrier(): lavapipe runs barriers slowly, and
// llvmpipe pays per loaded word, so RPS rows share every x load
// (bench/lavapipe_probe.py).
// grid: (row groups folded into x/y, ceil(N / NCOLS) in z)
#include "common.glsl"

// x and y live in the same activation buffer, bound twice: x through a
// readonly restrict binding, y through a writable one. Their regions never overlap.
layout(binding = 0) readonly restrict buffer Wq { uint wq[]; };
layout(binding = 1) readonly restrict buffer X4 { vec4 act4[]; };
layout(binding = 2) buffer Y { float act[]; };
#include "mul_mv_push.glsl"
#include "quant.glsl"
#include "mul_mv_unit.glsl"

void main() {
    uvec2 rows = workgroup_items(p.M);
    uint col0 = gl_WorkGroupID.z * NCOLS;
    uint ncols = min(uint(NCOLS), p.N - col0);
    uint units = units_per_row(p.K);
    uint S = gl_SubgroupSize;
    // a subgroup takes RPS consecutive rows; every x vec4 it loads serves them all
    for (uint row0 = rows.x + gl_SubgroupID * RPS; row0 < rows.y; row0 += gl_NumSubgroups * RPS) {
        // the weight row behind each of the RPS sums, and whether it exists
        uint prow[RPS];
        bool pok[RPS];
        [[unroll]] for (uint rr = 0; rr < RPS; rr++) { prow[rr] = row0 + rr; pok[rr] = row0 + rr < rows.y; }
        float acc[RPS][NCOLS];
        [[unroll]] for (uint rr = 0; rr < RPS; rr++)
            [[unroll]] for (uint c = 0; c < NCOLS; c++) acc[rr][c] = 0.0;
        // UNROLL units per lane per iteration: all their loads are issued
        // before the first is decoded, so each lane keeps several in flight
        for (uint u0 = gl_SubgroupInvocationID; u0 < units; u0 += S * UNROLL) {
            Raw raw[UNROLL][RPS];
            [[unroll]] for (uint k = 0; k < UNROLL; k++) {
                uint u = u0 + k * S;
                [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                    if (u < units && pok[rr]) raw[k][rr] = unit_fetch(p.w_off, p.w_off2, prow[rr], u, p.K);
                }
            }
            [[unroll]] for (uint k = 0; k < UNROLL; k++) {
                uint u = u0 + k * S;
                if (u >= units) continue;
                accum_unit(raw[k], u, col0, ncols, acc);
            }
        }
        [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                float s = subgroupAdd(acc[rr][c]);
                uint row = row0 + rr;
                if (c < ncols && row < rows.y && subgroupElect()) {
                    uint yi = p.y_off + (col0 + c) * p.y_stride + row;
                    act[yi] = (p.flags & 1u) != 0u ? act[yi] + s : s;
                }
            }
        }
    }
}
