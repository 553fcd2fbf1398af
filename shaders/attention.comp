#version 450
// Causal attention over the KV cache, decode and prefill alike: query row r
// (slot = params[slot_off + r], pos = params[pos_off + r]) attends to positions
// 0..pos of its slot, so a prefill chunk, a decode step and a mixed batch are the
// same dispatch. Grouped-query attention: query head h reads kv head
// h / (n_head / n_kv).
//
// One subgroup per (row, query head), walking the positions in tiles of one
// subgroup: each lane scores one position of the tile (a whole q.k dot, K read
// as f16 pairs in uvec4s, q broadcast from cache), the tile's softmax update is
// two subgroup reductions (online softmax: running max and sum), then the lanes
// switch to owning f16 pairs of the head dimension and accumulate the tile's V
// rows, each position's weight taken from its lane with a shuffle. Positions are
// independent within a tile, so their loads overlap instead of queueing.
#include "common.glsl"
#extension GL_KHR_shader_subgroup_shuffle : require

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 0) readonly buffer Act4 { vec4 act4[]; };
layout(binding = 1) readonly buffer Params { uint params[]; };
layout(binding = 2) readonly buffer Kv { uint kv[]; };
layout(binding = 2) readonly buffer Kv4 { uvec4 kv4[]; };

// words (f16 pairs) of a V row that one lane owns: ceil(head_dim / 2 / subgroup)
layout(constant_id = 2) const uint WPL = 1;

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
} p;

void main() {
    uvec2 items = workgroup_items(p.n_rows * p.n_head);
    uint hd2 = p.head_dim / 2u;
    uint hd8 = p.head_dim / 8u;
    uint lane = gl_SubgroupInvocationID;
    uint S = gl_SubgroupSize;
    uint row_words = p.n_kv * hd2;
    for (uint item = items.x + gl_SubgroupID; item < items.y; item += gl_NumSubgroups) {
        uint r = item / p.n_head;
        uint h = item % p.n_head;
        uint kvh = h / (p.n_head / p.n_kv);
        uint pos = params[p.pos_off + r];
        uint slot = params[p.slot_off + r];
        uint qb4 = (p.q_off + r * p.q_stride + h * p.head_dim) / 4u;
        uint kb = p.k_off + slot * p.slot_stride + kvh * hd2;
        uint vb = p.v_off + slot * p.slot_stride + kvh * hd2;
        vec2 acc[WPL];
        [[unroll]] for (uint i = 0; i < WPL; i++) acc[i] = vec2(0.0);
        float m = -1.0 / 0.0;
        float l = 0.0;
        for (uint t0 = 0u; t0 <= pos; t0 += S) {
            uint t = t0 + lane;
            float s = -1.0 / 0.0;
            if (t <= pos) {
                uint k4 = (kb + t * row_words) / 4u;
                float d = 0.0;
                for (uint i = 0u; i < hd8; i++) {
                    uvec4 kw = kv4[k4 + i];
                    d += dot(act4[qb4 + 2u * i], vec4(unpackHalf2x16(kw.x), unpackHalf2x16(kw.y)))
                       + dot(act4[qb4 + 2u * i + 1u], vec4(unpackHalf2x16(kw.z), unpackHalf2x16(kw.w)));
                }
                s = d * p.scale;
            }
            float m_new = max(m, subgroupMax(s));
            float corr = exp(m - m_new);
            float e = t <= pos ? exp(s - m_new) : 0.0;
            l = l * corr + subgroupAdd(e);
            [[unroll]] for (uint i = 0; i < WPL; i++) acc[i] *= corr;
            uint n_valid = min(S, pos + 1u - t0);
            for (uint j = 0u; j < n_valid; j++) {
                float ej = subgroupShuffle(e, j);
                uint vrow = vb + (t0 + j) * row_words;
                [[unroll]] for (uint i = 0; i < WPL; i++) {
                    uint w = lane + i * S;
                    if (w < hd2) acc[i] += ej * unpackHalf2x16(kv[vrow + w]);
                }
            }
            m = m_new;
        }
        uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
        [[unroll]] for (uint i = 0; i < WPL; i++) {
            uint w = lane + i * S;
            if (w < hd2) {
                act[ob + 2u * w] = acc[i].x / l;
                act[ob + 2u * w + 1u] = acc[i].y / l;
            }
        }
    }
}
