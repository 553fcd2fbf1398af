#version 450
// The parts of attention_mc.comp's SPLIT form combined: a (row, head) a
// subgroup, its dims over the lanes. Part z of a row holds, for the z-th piece
// of the positions its workgroup walked, O (unnormalized), the max m its
// exponentials were taken against and their sum l (m = -inf, l = 0 where the
// piece holds none of the row's positions). With M the largest m:
//   o = sum_z O_z e^(m_z - M) / (sum_z l_z e^(m_z - M) + e^(sink - M))
// (the sink term only with gpt-oss's sinks). Every part is read: where the
// pieces fall depends on the workgroup's rows, which this kernel does not see.
#include "common.glsl"

layout(binding = 0) writeonly buffer Out { float act[]; };
layout(binding = 1) readonly buffer Part { float part[]; };
layout(binding = 2) readonly buffer Sinks { float sinks[]; };

layout(push_constant) uniform P {
    uint o_off, o_stride, n_rows, n_head, head_dim;
    uint n_parts, part_off, sink_off;
} p;

void main() {
    uint lane = gl_SubgroupInvocationID, S = gl_SubgroupSize;
    uvec2 items = workgroup_items(p.n_rows * p.n_head);
    for (uint it = items.x + gl_SubgroupID; it < items.y; it += gl_NumSubgroups) {
        uint row = it / p.n_head, h = it % p.n_head;
        uint w = p.head_dim + 2u;
        uint zstride = p.n_rows * p.n_head * w;
        uint base = p.part_off + (row * p.n_head + h) * w;
        float M = -1.0 / 0.0;
        for (uint z = 0u; z < p.n_parts; z++) M = max(M, part[base + z * zstride + p.head_dim]);
        float L = 0.0;
        for (uint z = 0u; z < p.n_parts; z++) {
            float mz = part[base + z * zstride + p.head_dim];
            if (mz > -1.0 / 0.0) L += part[base + z * zstride + p.head_dim + 1u] * exp(mz - M);
        }
        if (p.sink_off != 0xffffffffu && L > 0.0) L += exp(sinks[p.sink_off + h] - M);
        float inv = L > 0.0 ? 1.0 / L : 0.0;
        for (uint d = lane; d < p.head_dim; d += S) {
            float acc = 0.0;
            for (uint z = 0u; z < p.n_parts; z++) {
                float mz = part[base + z * zstride + p.head_dim];
                if (mz > -1.0 / 0.0) acc += part[base + z * zstride + d] * exp(mz - M);
            }
            act[p.o_off + row * p.o_stride + h * p.head_dim + d] = acc * inv;
        }
    }
}
