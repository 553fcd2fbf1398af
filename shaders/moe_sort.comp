#version 450
// Group a step's (row, slot) expert pairs by expert, for the batched expert
// matmuls (mul_mm_id.comp; mul_mt.comp and mul_mc.comp with MUL_ID):
// list[j][e] = index r*k + i of the j-th pair routed to expert e (in
// increasing order), cnt[0][e] = how many.
// One subgroup per expert (the row kernels' items): its lanes read the ids
// (written by moe_router.comp as uint words) a subgroup-wide run at a time, UNROLL
// runs loaded before any is used (the loads' latency overlapped: every expert's
// subgroup reads the same few KB), and a ballot places each match after the
// earlier ones, so the lists come out in increasing order on any subgroup size.
// (Before: one invocation per expert looped over every pair alone, one
// workgroup in all: 1.2 ms a layer of a 512-row prompt step on the H200.)
// BLOCKS (a second dispatch, one workgroup, after the lists): the work list of
// the tiled expert matmuls from the counts: blocks[0] = the number of (expert,
// column block) pairs, blocks[1 + j] = e << 16 | b for the j-th (b: a block of
// bn of the expert's pairs), in increasing (e, b) order (a prefix sum over the
// experts), so that their grid covers the blocks that exist instead of every
// expert times the most pairs one could have.
#include "common.glsl"
#extension GL_KHR_shader_subgroup_ballot : require

layout(binding = 0) buffer Act { uint actu[]; };

layout(push_constant) uniform P {
    uint ids_off, ids_stride, k, n_rows, E;
    uint list_off, list_stride, cnt_off;
#ifdef BLOCKS
    uint bn, blocks_off;
#endif
} p;

#ifdef BLOCKS
shared uint sg_total[256];   // a workgroup's subgroups (1,024 lanes of 4 at most)

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint base = 0u;
    for (uint e0 = 0u; e0 < p.E; e0 += gl_WorkGroupSize.x) {
        uint e = e0 + lid;
        uint nb = e < p.E ? (actu[p.cnt_off + e] + p.bn - 1u) / p.bn : 0u;
        uint incl = subgroupInclusiveAdd(nb), total = subgroupAdd(nb);
        if (subgroupElect()) sg_total[gl_SubgroupID] = total;
        barrier();
        uint first = base + incl - nb, turn = 0u;
        for (uint s = 0u; s < gl_NumSubgroups; s++) {
            uint t = sg_total[s];
            if (s < gl_SubgroupID) first += t;
            turn += t;
        }
        for (uint b = 0u; b < nb; b++) actu[p.blocks_off + 1u + first + b] = (e << 16) | b;
        base += turn;
        barrier();   // sg_total is rewritten by the next turn
    }
    if (lid == 0u) actu[p.blocks_off] = base;
}
#else
#define UNROLL 8
const uint NONE = 0xffffffffu;

void main() {
    uvec2 items = workgroup_items(p.E);
    uint lane = gl_SubgroupInvocationID, S = gl_SubgroupSize;
    uint pairs = p.n_rows * p.k;
    for (uint e = items.x + gl_SubgroupID; e < items.y; e += gl_NumSubgroups) {
        uint c = 0u;
        for (uint j0 = 0u; j0 < pairs; j0 += UNROLL * S) {
            uint id[UNROLL];
            [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
                uint j = j0 + u * S + lane;
                id[u] = j < pairs ? actu[p.ids_off + (j / p.k) * p.ids_stride + j % p.k] : NONE;
            }
            [[unroll]] for (uint u = 0u; u < UNROLL; u++) {
                bool hit = id[u] == e;
                uvec4 b = subgroupBallot(hit);
                uint at = c + subgroupBallotExclusiveBitCount(b);
                if (hit) actu[p.list_off + at * p.list_stride + e] = j0 + u * S + lane;
                c += subgroupBallotBitCount(b);
            }
        }
        if (subgroupElect()) actu[p.cnt_off + e] = c;
    }
}
#endif
