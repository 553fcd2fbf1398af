#version 450
// out[r] = index of the largest x[r][i] (lowest index among equals, as
// numpy.argmax), from argmax_part.comp's per-slice winners, written into the
// params buffer so greedy decode reads back one word per sequence.
#include "common.glsl"

layout(binding = 0) readonly buffer Act { float act[]; };
layout(binding = 1) buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint tmp_off, n_chunks, rows, out_off;
} p;

void main() {
    uvec2 items = workgroup_items(p.rows);
    for (uint r = items.x + gl_SubgroupID; r < items.y; r += gl_NumSubgroups) {
        float best = -1.0 / 0.0;
        uint bi = 0xffffffffu;
        for (uint c = gl_SubgroupInvocationID; c < p.n_chunks; c += gl_SubgroupSize) {
            uint t = p.tmp_off + 2u * (r * p.n_chunks + c);
            float v = act[t];
            uint i = floatBitsToUint(act[t + 1u]);
            if (v > best || (v == best && i < bi) || bi == 0xffffffffu) { best = v; bi = i; }
        }
        float m = subgroupMax(best);
        uint idx = subgroupMin(best == m ? bi : 0xffffffffu);
        if (idx == 0xffffffffu) idx = subgroupMin(bi);
        if (subgroupElect()) params[p.out_off + r] = idx;
    }
}
