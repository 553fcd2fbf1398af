#version 450
// Second pass of split-K attention: o = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p
// over the slices p of each (row, head) written by attention.comp: those that
// hold positions 0 .. pos of the row (the cache's other slices are not written).
// One subgroup per (row, head); lanes own output dimensions.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint o_off, o_stride, n_rows, n_head, head_dim;
    uint n_parts, part_off;
    uint pos_off, chunk;
} p;

void main() {
    uvec2 items = workgroup_items(p.n_rows * p.n_head);
    uint stride = p.head_dim + 2u;
    for (uint item = items.x + gl_SubgroupID; item < items.y; item += gl_NumSubgroups) {
        uint base = p.part_off + item * p.n_parts * stride;
        uint r = item / p.n_head, h = item % p.n_head;
        uint used = min(p.n_parts, params[p.pos_off + r] / p.chunk + 1u);
        float M = -1.0 / 0.0;
        for (uint q = gl_SubgroupInvocationID; q < used; q += gl_SubgroupSize) M = max(M, act[base + q * stride]);
        M = subgroupMax(M);
        float L = 0.0;
        for (uint q = gl_SubgroupInvocationID; q < used; q += gl_SubgroupSize) {
            float mq = act[base + q * stride];
            if (mq > -1.0 / 0.0) L += exp(mq - M) * act[base + q * stride + 1u];
        }
        L = subgroupAdd(L);
        uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
        for (uint d = gl_SubgroupInvocationID; d < p.head_dim; d += gl_SubgroupSize) {
            float o = 0.0;
            for (uint q = 0u; q < used; q++) {
                float mq = act[base + q * stride];
                if (mq > -1.0 / 0.0) o += exp(mq - M) * act[base + q * stride + 2u + d];
            }
            act[ob + d] = o / L;
        }
    }
}
