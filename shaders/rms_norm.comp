#version 450
// y[r] = x[src(r)] / sqrt(mean(x[src(r)]^2) + eps) * w. One subgroup per row.
// src(r) = r, or params[map_off + r] when map_off != NO_MAP (the final norm
// gathers only the rows whose logits are wanted).
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint w_off;             // norm weight (f32) in the weight buffer
    uint n, rows;
    uint map_off;
    float eps;
} p;

const uint NO_MAP = 0xffffffffu;

void main() {
    uvec2 items = workgroup_items(p.rows);
    for (uint r = items.x + gl_SubgroupID; r < items.y; r += gl_NumSubgroups) {
        uint src = p.map_off == NO_MAP ? r : params[p.map_off + r];
        uint xb = p.x_off + src * p.x_stride;
        float ss = 0.0;
        for (uint i = gl_SubgroupInvocationID; i < p.n; i += gl_SubgroupSize) {
            float v = act[xb + i];
            ss += v * v;
        }
        float scale = inversesqrt(subgroupAdd(ss) / float(p.n) + p.eps);
        uint yb = p.y_off + r * p.y_stride;
        for (uint i = gl_SubgroupInvocationID; i < p.n; i += gl_SubgroupSize) {
            act[yb + i] = act[xb + i] * scale * wf[p.w_off + i];
        }
    }
}
