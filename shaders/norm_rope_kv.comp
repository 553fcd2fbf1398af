#version 450
// Gated attention's per-head prologue (Qwen3-Next / Qwen3.5 full-attention
// layers, build_layer_attn in llama.cpp's qwen35.cpp):
//   q heads: RMSNorm(q) * wq, RoPE on the first n_rot dims -> q_out (f32)
//   k heads: RMSNorm(k) * wk, RoPE -> K cache at (slot, pos) (f16 pairs)
//   v heads: as they are -> V cache at (slot, pos)
// RoPE rotates (d, d + n_rot/2) (NEOX; Qwen3.5's interleaved M-RoPE reduces to
// it for text, where all sections share the position). q heads are q_head_stride
// apart in a row (2*head_dim when each head's gate follows its query), k and v
// heads start at columns k_col and v_col. One subgroup per (row, head); each
// lane produces whole f16 pairs. cos/sin from the host table [pos][n_rot/2][2].
// The norm weights and the table share binding 0 (one weight-arena group).
// KV cache per layer: [slot][pos][kv_head][head_dim/2 words], as rope_kv.comp.
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) writeonly buffer Kv { uint kv[]; };

layout(push_constant) uniform P {
    uint qkv_off, qkv_stride, q_head_stride, k_col, v_col;
    uint q_off, q_stride;
    uint n_rows, n_head, n_kv, head_dim, n_rot;
    uint table_off, wq_off, wk_off;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float eps;
} p;

void main() {
    uint heads = p.n_head + 2u * p.n_kv;
    uint hd2 = p.head_dim / 2u;
    uint half_rot = p.n_rot / 2u;
    uvec2 items = workgroup_items(p.n_rows * heads);
    for (uint it = items.x + gl_SubgroupID; it < items.y; it += gl_NumSubgroups) {
        uint r = it / heads;
        uint h = it % heads;
        uint pos = params[p.pos_off + r];
        uint slot = params[p.slot_off + r];
        uint rb = p.qkv_off + r * p.qkv_stride;
        uint kind = h < p.n_head ? 0u : (h < p.n_head + p.n_kv ? 1u : 2u);   // q, k, v
        uint hh = kind == 0u ? h : (kind == 1u ? h - p.n_head : h - p.n_head - p.n_kv);
        uint src = kind == 0u ? rb + hh * p.q_head_stride
                 : rb + (kind == 1u ? p.k_col : p.v_col) + hh * p.head_dim;
        uint wn = kind == 0u ? p.wq_off : p.wk_off;
        float scale = 1.0;
        if (kind != 2u) {
            float ss = 0.0;
            for (uint i = gl_SubgroupInvocationID; i < p.head_dim; i += gl_SubgroupSize) {
                float x = act[src + i];
                ss += x * x;
            }
            scale = inversesqrt(subgroupAdd(ss) / float(p.head_dim) + p.eps);
        }
        uint tb = p.table_off + pos * half_rot * 2u;
        uint cache = p.slot_stride * slot + pos * p.n_kv * hd2 + hh * hd2;
        for (uint w = gl_SubgroupInvocationID; w < hd2; w += gl_SubgroupSize) {
            vec2 outv;
            for (uint k = 0u; k < 2u; k++) {
                uint d = 2u * w + k;
                float val;
                if (kind == 2u) {
                    val = act[src + d];
                } else {
                    val = act[src + d] * scale * wf[wn + d];
                    if (d < p.n_rot) {
                        bool second = d >= half_rot;
                        uint pi = second ? d - half_rot : d;
                        uint pd = second ? d - half_rot : d + half_rot;
                        float c = wf[tb + 2u * pi], s = wf[tb + 2u * pi + 1u];
                        float y = act[src + pd] * scale * wf[wn + pd];
                        val = second ? val * c + y * s : val * c - y * s;
                    }
                }
                outv[k] = val;
            }
            if (kind == 0u) {
                uint ob = p.q_off + r * p.q_stride + hh * p.head_dim + 2u * w;
                act[ob] = outv.x;
                act[ob + 1u] = outv.y;
            } else {
                kv[(kind == 1u ? p.k_off : p.v_off) + cache + w] = packHalf2x16(outv);
            }
        }
    }
}
