#version 450
// out[r] = index of the largest x[r][i] (lowest index among equals, as
// numpy.argmax), written into the host-visible params buffer so greedy decode
// reads back one word per sequence. One subgroup per row.
#include "common.glsl"

layout(binding = 0) readonly buffer Act { float act[]; };
layout(binding = 1) buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, n, rows;
    uint out_off;
} p;

void main() {
    uvec2 items = workgroup_items(p.rows);
    for (uint r = items.x + gl_SubgroupID; r < items.y; r += gl_NumSubgroups) {
        uint xb = p.x_off + r * p.x_stride;
        float best = -1.0 / 0.0;
        uint best_i = 0xffffffffu;
        for (uint i = gl_SubgroupInvocationID; i < p.n; i += gl_SubgroupSize) {
            float v = act[xb + i];
            if (v > best || best_i == 0xffffffffu) { best = v; best_i = i; }
        }
        float m = subgroupMax(best);
        uint cand = best == m ? best_i : 0xffffffffu;
        uint idx = subgroupMin(cand);
        if (subgroupElect()) params[p.out_off + r] = idx;
    }
}
