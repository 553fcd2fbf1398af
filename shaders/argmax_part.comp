#version 450
// First pass of argmax: the largest value of each CHUNK-value slice of each row
// and its index (lowest among equals), one subgroup per slice, vec4 loads with
// 4 in flight per lane. argmax.comp then reduces the slices of a row.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 0) readonly buffer Act4 { vec4 act4[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, n, rows;
    uint tmp_off, chunk;    // tmp: per (row, slice) the pair (value, index as float bits)
} p;

void consider(inout float best, inout uint bi, float v, uint i) {
    if (v > best || (v == best && i < bi)) { best = v; bi = i; }
}

void main() {
    uint n_chunks = (p.n + p.chunk - 1u) / p.chunk;
    uvec2 items = workgroup_items(p.rows * n_chunks);
    uint S = gl_SubgroupSize;
    for (uint item = items.x + gl_SubgroupID; item < items.y; item += gl_NumSubgroups) {
        uint r = item / n_chunks;
        uint c = item % n_chunks;
        uint lo = c * p.chunk, hi = min(p.n, lo + p.chunk);
        uint xb = p.x_off + r * p.x_stride;          // 16-byte aligned
        float best = -1.0 / 0.0;
        uint bi = 0xffffffffu;
        uint lo4 = lo / 4u, hi4 = hi / 4u;           // chunk is a multiple of 4
        for (uint i0 = lo4 + gl_SubgroupInvocationID; i0 < hi4; i0 += 4u * S) {
            vec4 v[4];
            [[unroll]] for (uint k = 0; k < 4u; k++) {
                uint i = i0 + k * S;
                v[k] = i < hi4 ? act4[xb / 4u + i] : vec4(-1.0 / 0.0);
            }
            [[unroll]] for (uint k = 0; k < 4u; k++) {
                uint i = (i0 + k * S) * 4u;
                if (i0 + k * S < hi4) {
                    consider(best, bi, v[k].x, i); consider(best, bi, v[k].y, i + 1u);
                    consider(best, bi, v[k].z, i + 2u); consider(best, bi, v[k].w, i + 3u);
                }
            }
        }
        for (uint i = hi4 * 4u + gl_SubgroupInvocationID; i < hi; i += S) consider(best, bi, act[xb + i], i);
        float m = subgroupMax(best);
        uint idx = subgroupMin(best == m ? bi : 0xffffffffu);
        if (idx == 0xffffffffu) idx = lo;            // a slice of NaNs: any index of it
        if (subgroupElect()) {
            act[p.tmp_off + 2u * item] = m;
            act[p.tmp_off + 2u * item + 1u] = uintBitsToFloat(idx);
        }
    }
}
