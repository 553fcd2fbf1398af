#version 450
// y[r] = x[src(r)] / sqrt(mean(x[src(r)]^2) + eps) * w. One subgroup per row,
// vec4 loads, 4 in flight per lane (a row is short: latency, not bandwidth,
// is what this kernel waits on).
// src(r) = r, or params[map_off + r] when map_off != NO_MAP (the final norm
// gathers only the rows whose logits are wanted). n, strides and offsets are
// multiples of 4.
#ifndef WG_ROW
#define WG_ROW 0
#endif
#include "common.glsl"

// x and y: the same activation buffer bound twice (x readonly, y written)
layout(binding = 0) readonly restrict buffer Wq { vec4 wf4[]; };
layout(binding = 1) readonly restrict buffer X4 { vec4 x4[]; };
layout(binding = 2) writeonly restrict buffer Y4 { vec4 y4[]; };
layout(binding = 3) readonly buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint w_off;             // norm weight (f32) in the weight buffer
    uint n, rows;
    uint map_off;
    float eps;
} p;

const uint NO_MAP = 0xffffffffu;
#define UNR 4u

// WG_ROW (GPU variant): the whole workgroup takes one row (ITEMS_PER_WG = 1),
// so a 2048-wide row is one round of loads per pass instead of four; the
// subgroups' sums of squares meet in shared memory.
#if WG_ROW
#define LANE gl_LocalInvocationID.x
#define FIRST_ROW items.x
#define NEXT_ROW 1u
shared float part[32];
#else
#define LANE gl_SubgroupInvocationID
#define FIRST_ROW (items.x + gl_SubgroupID)
#define NEXT_ROW gl_NumSubgroups
#endif

void main() {
    uvec2 items = workgroup_items(p.rows);
    uint n4 = p.n / 4u;
#if WG_ROW
    uint S = gl_WorkGroupSize.x;
#else
    uint S = gl_SubgroupSize;
#endif
    for (uint r = FIRST_ROW; r < items.y; r += NEXT_ROW) {
        uint src = p.map_off == NO_MAP ? r : params[p.map_off + r];
        uint xb = (p.x_off + src * p.x_stride) / 4u;
        float ss = 0.0;
        for (uint i0 = LANE; i0 < n4; i0 += S * UNR) {
            vec4 v[UNR];
            [[unroll]] for (uint k = 0; k < UNR; k++) {
                uint i = i0 + k * S;
                v[k] = i < n4 ? x4[xb + i] : vec4(0.0);
            }
            [[unroll]] for (uint k = 0; k < UNR; k++) ss += dot(v[k], v[k]);
        }
#if WG_ROW
        ss = subgroupAdd(ss);
        if (subgroupElect()) part[gl_SubgroupID] = ss;
        barrier();
        ss = part[0];
        for (uint g = 1; g < gl_NumSubgroups; g++) ss += part[g];
        float scale = inversesqrt(ss / float(p.n) + p.eps);
#else
        float scale = inversesqrt(subgroupAdd(ss) / float(p.n) + p.eps);
#endif
        uint yb = (p.y_off + r * p.y_stride) / 4u;
        uint wb = p.w_off / 4u;
        for (uint i0 = LANE; i0 < n4; i0 += S * UNR) {
            vec4 v[UNR];
            vec4 w[UNR];
            [[unroll]] for (uint k = 0; k < UNR; k++) {
                uint i = i0 + k * S;
                if (i < n4) { v[k] = x4[xb + i]; w[k] = wf4[wb + i]; }
            }
            [[unroll]] for (uint k = 0; k < UNR; k++) {
                uint i = i0 + k * S;
                if (i < n4) y4[yb + i] = v[k] * scale * w[k];
            }
        }
    }
}
