#version 450
// y[r] = softmax(x[r] * scale), one subgroup per row, three passes
// (max, sum of exp, normalize) so the result does not depend on lane order
// beyond float addition.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint n, rows;
    float scale;
} p;

void main() {
    uvec2 items = workgroup_items(p.rows);
    for (uint r = items.x + gl_SubgroupID; r < items.y; r += gl_NumSubgroups) {
        uint xb = p.x_off + r * p.x_stride;
        uint yb = p.y_off + r * p.y_stride;
        float m = -1.0 / 0.0;
        for (uint i = gl_SubgroupInvocationID; i < p.n; i += gl_SubgroupSize) m = max(m, act[xb + i] * p.scale);
        m = subgroupMax(m);
        float s = 0.0;
        for (uint i = gl_SubgroupInvocationID; i < p.n; i += gl_SubgroupSize) s += exp(act[xb + i] * p.scale - m);
        float inv = 1.0 / subgroupAdd(s);
        for (uint i = gl_SubgroupInvocationID; i < p.n; i += gl_SubgroupSize) act[yb + i] = exp(act[xb + i] * p.scale - m) * inv;
    }
}
