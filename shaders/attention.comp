#version 450
// Causal attention over the KV cache, decode and prefill alike: query row r
// (slot = params[slot_off + r], pos = params[pos_off + r]) attends to positions
// 0..pos of its slot, so a prefill chunk, a decode step and a mixed batch are the
// same dispatch. One subgroup per (row, query head); lanes own f16 pairs of the
// head dimension; online softmax (running max and sum) over positions.
// Grouped-query attention: query head h reads kv head h / (n_head / n_kv).
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Params { uint params[]; };
layout(binding = 2) readonly buffer Kv { uint kv[]; };

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
} p;

// words per lane: head_dim / 2 / subgroup size, at most MAXW (head_dim <= 256
// with subgroups of at least 8)
#define MAXW 16

void main() {
    uvec2 items = workgroup_items(p.n_rows * p.n_head);
    uint hd2 = p.head_dim / 2u;
    uint lane = gl_SubgroupInvocationID;
    uint S = gl_SubgroupSize;
    for (uint item = items.x + gl_SubgroupID; item < items.y; item += gl_NumSubgroups) {
        uint r = item / p.n_head;
        uint h = item % p.n_head;
        uint kvh = h / (p.n_head / p.n_kv);
        uint pos = params[p.pos_off + r];
        uint slot = params[p.slot_off + r];
        uint qb = p.q_off + r * p.q_stride + h * p.head_dim;
        vec2 q[MAXW];
        vec2 acc[MAXW];
        [[unroll]] for (uint i = 0; i < MAXW; i++) {
            uint w = lane + i * S;
            q[i] = w < hd2 ? vec2(act[qb + 2u * w], act[qb + 2u * w + 1u]) * p.scale : vec2(0.0);
            acc[i] = vec2(0.0);
        }
        uint row_words = p.n_kv * hd2;
        uint kb = p.k_off + slot * p.slot_stride + kvh * hd2;
        uint vb = p.v_off + slot * p.slot_stride + kvh * hd2;
        float m = -1.0 / 0.0;
        float l = 0.0;
        for (uint t = 0u; t <= pos; t++) {
            float part = 0.0;
            [[unroll]] for (uint i = 0; i < MAXW; i++) {
                uint w = lane + i * S;
                if (w < hd2) part += dot(q[i], unpackHalf2x16(kv[kb + t * row_words + w]));
            }
            float s = subgroupAdd(part);
            float m_new = max(m, s);
            float corr = exp(m - m_new);
            float e = exp(s - m_new);
            l = l * corr + e;
            [[unroll]] for (uint i = 0; i < MAXW; i++) {
                uint w = lane + i * S;
                if (w < hd2) acc[i] = acc[i] * corr + e * unpackHalf2x16(kv[vb + t * row_words + w]);
            }
            m = m_new;
        }
        uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
        [[unroll]] for (uint i = 0; i < MAXW; i++) {
            uint w = lane + i * S;
            if (w < hd2) {
                act[ob + 2u * w] = acc[i].x / l;
                act[ob + 2u * w + 1u] = acc[i].y / l;
            }
        }
    }
}
