#version 450
// Group a step's (row, slot) expert pairs by expert, for the batched expert
// matmul (mul_mm_id.comp): list[j][e] = index r*k + i of the j-th pair routed
// to expert e (in increasing order), cnt[0][e] = how many. One invocation per
// expert scans the ids (written by moe_router.comp as uint words).
#include "common.glsl"

layout(binding = 0) buffer Act { uint actu[]; };

layout(push_constant) uniform P {
    uint ids_off, ids_stride, k, n_rows, E;
    uint list_off, list_stride, cnt_off;
} p;

void main() {
    uint e = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (e >= p.E) return;
    uint c = 0u;
    for (uint r = 0u; r < p.n_rows; r++) {
        for (uint i = 0u; i < p.k; i++) {
            if (actu[p.ids_off + r * p.ids_stride + i] == e) {
                actu[p.list_off + c * p.list_stride + e] = r * p.k + i;
                c++;
            }
        }
    }
    actu[p.cnt_off + e] = c;
}
