#version 450
// First pass of sampling on the device: the K best values of each slice of
// WG * VPL values of each row (largest first, equal values by lowest index,
// as numpy's stable sort of -x; NaN is never taken), as (value, index) pairs;
// sample.comp merges a row's slices. A workgroup per (row, slice). Each
// invocation holds its VPL values in registers and knows its own best; each
// of the K rounds finds the workgroup's best (subgroup reductions, then the
// subgroups' winners in shared memory), writes it, and its owner moves on to
// its next value. Fewer than K values (or non-NaN ones) leave the rest of the
// list as (-inf, NONE).
#include "common.glsl"
#include "topk.glsl"

#define VPL 16

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 0) buffer ActU { uint actu[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, n, rows;
    uint tmp_off, k;        // tmp: per (row, slice) k pairs (value, index)
} p;

shared float sv[2][64];     // each subgroup's winner of a round (rounds alternate halves)
shared uint si[2][64];


void main() {
    uint WG = gl_WorkGroupSize.x, lid = gl_LocalInvocationID.x;
    uint chunk = WG * VPL;
    uint n_sl = (p.n + chunk - 1u) / chunk;
    uint item = workgroup_linear();
    if (item >= p.rows * n_sl) return;                 // the whole workgroup
    uint r = item / n_sl, lo = (item % n_sl) * chunk;
    uint xb = p.x_off + r * p.x_stride;
    float v[VPL];
    [[unroll]] for (uint j = 0; j < VPL; j++) {
        uint i = lo + j * WG + lid;
        v[j] = i < p.n ? act[xb + i] : uintBitsToFloat(0x7fc00000u);
    }
    float bv = -1.0 / 0.0;
    uint bi = NONE;
    [[unroll]] for (uint j = 0; j < VPL; j++) {
        uint i = lo + j * WG + lid;
        if (!is_nan(v[j]) && before(v[j], i, bv, bi)) { bv = v[j]; bi = i; }
    }
    uint out0 = p.tmp_off + 2u * item * p.k;
    for (uint k = 0; k < p.k; k++) {
        float m = subgroupMax(bv);
        uint mi = subgroupMin(bv == m ? bi : NONE);
        uint h = k & 1u;
        if (subgroupElect()) { sv[h][gl_SubgroupID] = m; si[h][gl_SubgroupID] = mi; }
        barrier();
        float wv = sv[h][0];
        uint wi = si[h][0];
        for (uint g = 1; g < gl_NumSubgroups; g++)
            if (before(sv[h][g], si[h][g], wv, wi)) { wv = sv[h][g]; wi = si[h][g]; }
        if (lid == 0u) { act[out0 + 2u * k] = wv; actu[out0 + 2u * k + 1u] = wi; }
        if (wi != NONE && bi == wi) {                  // the owner: its best after the one taken
            bv = -1.0 / 0.0;
            bi = NONE;
            [[unroll]] for (uint j = 0; j < VPL; j++) {
                uint i = lo + j * WG + lid;
                if (!is_nan(v[j]) && before(wv, wi, v[j], i) && before(v[j], i, bv, bi)) { bv = v[j]; bi = i; }
            }
        }
    }
}
