#version 450
// Second pass of split-K attention: o = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p
// over the slices p of each (row, head) written by attention.comp (slices past
// the row's position hold m = -inf, l = 0 and are skipped). One subgroup per
// (row, head); lanes own output dimensions.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint o_off, o_stride, n_rows, n_head, head_dim;
    uint n_parts, part_off;
} p;

void main() {
    uvec2 items = workgroup_items(p.n_rows * p.n_head);
    uint stride = p.head_dim + 2u;
    for (uint item = items.x + gl_SubgroupID; item < items.y; item += gl_NumSubgroups) {
        uint base = p.part_off + item * p.n_parts * stride;
        float M = -1.0 / 0.0;
        for (uint q = gl_SubgroupInvocationID; q < p.n_parts; q += gl_SubgroupSize) M = max(M, act[base + q * stride]);
        M = subgroupMax(M);
        float L = 0.0;
        for (uint q = gl_SubgroupInvocationID; q < p.n_parts; q += gl_SubgroupSize) {
            float mq = act[base + q * stride];
            if (mq > -1.0 / 0.0) L += exp(mq - M) * act[base + q * stride + 1u];
        }
        L = subgroupAdd(L);
        uint r = item / p.n_head, h = item % p.n_head;
        uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
        for (uint d = gl_SubgroupInvocationID; d < p.head_dim; d += gl_SubgroupSize) {
            float o = 0.0;
            for (uint q = 0u; q < p.n_parts; q++) {
                float mq = act[base + q * stride];
                if (mq > -1.0 / 0.0) o += exp(mq - M) * act[base + q * stride + 2u + d];
            }
            act[ob + d] = o / L;
        }
    }
}
