#version 450
// Group a step's (row, slot) expert pairs by expert, for the batched expert
// matmuls (mul_mm_id.comp; mul_mt.comp and mul_mc.comp with MUL_ID):
// list[j][e] = index r*k + i of the j-th pair routed to expert e (in
// increasing order), cnt[0][e] = how many. One invocation per expert scans the
// ids (written by moe_router.comp as uint words).
// BLOCKS: one workgroup does every expert (in turns of its size) and also
// writes the work list of the tiled expert matmuls: blocks[0] = the number of
// (expert, column block) pairs, blocks[1 + j] = e << 16 | b for the j-th (b: a
// block of bn of the expert's pairs), so that their grid covers the blocks
// that exist instead of every expert times the most pairs one could have. The
// list's order follows the invocations' race (shared atomics); each block
// writes its own outputs, so results do not depend on it.
#include "common.glsl"

layout(binding = 0) buffer Act { uint actu[]; };

layout(push_constant) uniform P {
    uint ids_off, ids_stride, k, n_rows, E;
    uint list_off, list_stride, cnt_off;
#ifdef BLOCKS
    uint bn, blocks_off;
#endif
} p;

uint sort_expert(uint e) {
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
    return c;
}

#ifdef BLOCKS
shared uint n_blocks;

void main() {
    if (gl_LocalInvocationID.x == 0u) n_blocks = 0u;
    barrier();
    for (uint e = gl_LocalInvocationID.x; e < p.E; e += gl_WorkGroupSize.x) {
        uint nb = (sort_expert(e) + p.bn - 1u) / p.bn;
        uint base = atomicAdd(n_blocks, nb);
        for (uint b = 0u; b < nb; b++) actu[p.blocks_off + 1u + base + b] = (e << 16) | b;
    }
    barrier();
    if (gl_LocalInvocationID.x == 0u) actu[p.blocks_off] = n_blocks;
}
#else
void main() {
    uint e = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (e < p.E) sort_expert(e);
}
#endif
