#version 450
// First pass of sampling on the device: the R best values of each slice of
// WG * VPL values of each row (R: the row's top_k, one for a greedy row; at
// most k), largest first, equal values by lowest index (as numpy's stable
// sort of -x; NaN is never taken), as (value, index) pairs at a stride of k
// a slice; sample.comp merges a row's slices. A workgroup per (row, slice),
// each invocation holding VPL values; topk.glsl's topk_wg takes the R best.
// Fewer than R values (or non-NaN ones) leave the rest of the list as
// (-inf, NONE).
#include "common.glsl"
#define TOPK_VPL 16
#include "topk.glsl"
layout(binding = 0) buffer Act { float act[]; };
layout(binding = 0) buffer ActU { uint actu[]; };
layout(binding = 1) readonly buffer Params { uint params[]; };
layout(push_constant) uniform P {
    uint x_off, x_stride, n, rows;
    uint tmp_off, k;        // tmp: per (row, slice) k pairs (value, index)
    uint samp_off;          // params words of the rows' sampling (sample.comp)
} p;
void main() {
    uint WG = gl_WorkGroupSize.x, lid = gl_LocalInvocationID.x;
    uint chunk = WG * TOPK_VPL;
    uint n_sl = (p.n + chunk - 1u) / chunk;
    uint item = workgroup_linear();
    if (item >= p.rows * n_sl) return;                 // the whole workgroup
    uint r = item / n_sl, lo = (item % n_sl) * chunk;
    // the row's rounds: its top_k (sample.comp reads no more of each list),
    // one for a greedy row
    uint sp = p.samp_off + 8u * r;
    uint R = uintBitsToFloat(params[sp]) > 0.0 ? clamp(params[sp + 1u], 1u, p.k) : 1u;
    uint xb = p.x_off + r * p.x_stride;
    float v[TOPK_VPL];
    uint ix[TOPK_VPL];
    [[unroll]] for (uint j = 0; j < TOPK_VPL; j++) {
        uint i = lo + j * WG + lid;
        v[j] = i < p.n ? act[xb + i] : -1.0 / 0.0;
        ix[j] = i < p.n && !is_nan(v[j]) ? i : NONE;
    }
    if (!topk_wg(v, ix, R)) return;
    uint out0 = p.tmp_off + 2u * item * p.k;
    for (uint k = 0; k < R; k++) { act[out0 + 2u * k] = tk_v[k]; actu[out0 + 2u * k + 1u] = tk_i[k]; }
}
