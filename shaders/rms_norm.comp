#version 450
// y[r] = x[src(r)] / sqrt(mean(x[src(r)]^2) + eps) * w. One subgroup per row,
// vec4 loads, 4 in flight per lane (a row is short: latency, not bandwidth,
// is what this kernel waits on).
// src(r) = r, or params[map_off + r] when map_off != NO_MAP (the final norm
// gathers only the rows whose logits are wanted). n, strides and offsets are
// multiples of 4.
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

void main() {
    uvec2 items = workgroup_items(p.rows);
    uint n4 = p.n / 4u;
    uint S = gl_SubgroupSize;
    for (uint r = items.x + gl_SubgroupID; r < items.y; r += gl_NumSubgroups) {
        uint src = p.map_off == NO_MAP ? r : params[p.map_off + r];
        uint xb = (p.x_off + src * p.x_stride) / 4u;
        float ss = 0.0;
        for (uint i0 = gl_SubgroupInvocationID; i0 < n4; i0 += S * UNR) {
            vec4 v[UNR];
            [[unroll]] for (uint k = 0; k < UNR; k++) {
                uint i = i0 + k * S;
                v[k] = i < n4 ? x4[xb + i] : vec4(0.0);
            }
            [[unroll]] for (uint k = 0; k < UNR; k++) ss += dot(v[k], v[k]);
        }
        float scale = inversesqrt(subgroupAdd(ss) / float(p.n) + p.eps);
        uint yb = (p.y_off + r * p.y_stride) / 4u;
        uint wb = p.w_off / 4u;
        for (uint i0 = gl_SubgroupInvocationID; i0 < n4; i0 += S * UNR) {
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
