#version 450
// Gated attention's per-head prologue (Qwen3-Next / Qwen3.5 full-attention
// layers, build_layer_attn in llama.cpp's qwen35.cpp):
//   q heads: RMSNorm(q) * wq, RoPE on the first n_rot dims -> q_out (f32)
//   k heads: RMSNorm(k) * wk, RoPE -> K cache at (slot, pos)
//   v heads: as they are -> V cache at (slot, pos)
// RoPE rotates (d, d + n_rot/2) (NEOX; Qwen3.5's interleaved M-RoPE reduces to
// it for text, where all sections share the position). q heads are q_head_stride
// apart in a row (2*head_dim when each head's gate follows its query), k and v
// heads start at columns k_col and v_col. One subgroup per (row, head); each
// lane produces whole f16 pairs, or, into a q8_0 cache, words of 4 values whose
// 32-value blocks' maxima the subgroup takes together. cos/sin from the host table [pos][n_rot/2][2].
// The norm weights and the table share binding 0 (one weight-arena group).
// The KV cache's layouts: kv.glsl (KV_K_Q8, KV_V_Q8).
#include "common.glsl"
#include "kv.glsl"

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
    uint ring;   // kv_at
} p;

// a position's row in the cache: sliding-window layers' caches are rings of
// `ring` positions (position t at row t % ring); 0: no wrap
uint kv_at(uint t) { return p.ring != 0u && t >= p.ring ? t % p.ring : t; }

// dimension d of a head (kind 0 q, 1 k, 2 v) whose first input float is src:
// v as it is; q and k normed (scale, weights at wn) and rotated (table row tb)
float head_value(uint kind, uint src, uint d, float scale, uint wn, uint tb) {
    if (kind == 2u) return act[src + d];
    float val = act[src + d] * scale * wf[wn + d];
    if (d < p.n_rot) {
        uint half_rot = p.n_rot / 2u;
        bool second = d >= half_rot;
        uint pi = second ? d - half_rot : d;
        uint pd = second ? d - half_rot : d + half_rot;
        float c = wf[tb + 2u * pi], s = wf[tb + 2u * pi + 1u];
        float y = act[src + pd] * scale * wf[wn + pd];
        val = second ? val * c + y * s : val * c - y * s;
    }
    return val;
}

void main() {
    uint heads = p.n_head + 2u * p.n_kv;
    uint hd2 = p.head_dim / 2u;
    uint half_rot = p.n_rot / 2u;
    uvec2 items = workgroup_items(p.n_rows * heads);
    KvSlot sl = kv_slot(p.slot_stride, p.n_kv, p.head_dim);
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
        uint row = kv_at(pos);
        uint base = kind == 1u ? p.k_off + slot * sl.k_stride : p.v_off + slot * sl.v_stride;
        if (kind == 1u ? KV_K_Q8 != 0 : (kind == 2u && KV_V_Q8 != 0)) {
            uint qrow = base + (row * p.n_kv + hh) * (p.head_dim / 4u);
            uint srow = base + (kind == 1u ? sl.k_scales : sl.v_scales) + (row * p.n_kv + hh) * (p.head_dim / 64u);
            uint S = gl_SubgroupSize;
            if (S >= 8u) {
                // q8_0, a lane a word (4 values; two words a lane in subgroups of 8), a pass whole
                // units of 16 words: each block's max a subgroupMax of its 8 words' lanes, the unit's
                // scale word written by the lane of its first word (before: a lane took a whole unit
                // of 64 values, 2 lanes busy on a 128-wide head; notes.md run 34)
                uint nw = p.head_dim / 4u;
                uint per = max(S, 16u);
                uint lane = gl_SubgroupInvocationID;
                for (uint w = 0u; w < nw; w += per) {
                    uint wa = w + lane, wb = w + S + lane;            // this lane's words
                    bool ona = wa < nw, onb = per > S && wb < nw;
                    vec4 xa = vec4(0.0), xb = vec4(0.0);
                    [[unroll]] for (uint j = 0u; j < 4u; j++) {
                        if (ona) xa[j] = head_value(kind, src, 4u * wa + j, scale, wn, tb);
                        if (onb) xb[j] = head_value(kind, src, 4u * wb + j, scale, wn, tb);
                    }
                    vec4 ya = abs(xa), yb = abs(xb);
                    float aa = max(max(ya.x, ya.y), max(ya.z, ya.w)), ab = max(max(yb.x, yb.y), max(yb.z, yb.w));
                    uint ba = lane / 8u, bb = (S + lane) / 8u;        // their blocks in this pass
                    float ma = 0.0, ma2 = 0.0, mb = 0.0, mb2 = 0.0;  // the blocks' maxima, and the next ones'
                    for (uint b = 0u; b < per / 8u; b++) {
                        float m = subgroupMax(max(ba == b ? aa : 0.0, bb == b ? ab : 0.0));
                        if (ba == b) ma = m;
                        if (ba + 1u == b) ma2 = m;
                        if (bb == b) mb = m;
                        if (bb + 1u == b) mb2 = m;
                    }
                    if (ona) {
                        float d = kv_q8_scale(ma);
                        kv[qrow + wa] = kv_q8_pack(xa, kv_q8_inv(d));
                        if ((wa & 15u) == 0u) kv[srow + wa / 16u] = packHalf2x16(vec2(d, kv_q8_scale(ma2)));
                    }
                    if (onb) {
                        float d = kv_q8_scale(mb);
                        kv[qrow + wb] = kv_q8_pack(xb, kv_q8_inv(d));
                        if ((wb & 15u) == 0u) kv[srow + wb / 16u] = packHalf2x16(vec2(d, kv_q8_scale(mb2)));
                    }
                }
                continue;
            }
            // subgroups under 8 lanes: a lane a unit of 64 values (two blocks and their scale word)
            for (uint u = gl_SubgroupInvocationID; u < p.head_dim / 64u; u += gl_SubgroupSize) {
                vec2 ds;
                [[unroll]] for (uint b = 0u; b < 2u; b++) {
                    float x[32];
                    float amax = 0.0;
                    [[unroll]] for (uint j = 0u; j < 32u; j++) {
                        x[j] = head_value(kind, src, 64u * u + 32u * b + j, scale, wn, tb);
                        amax = max(amax, abs(x[j]));
                    }
                    float d = kv_q8_scale(amax);
                    float id = kv_q8_inv(d);
                    [[unroll]] for (uint j = 0u; j < 8u; j++)
                        kv[qrow + 16u * u + 8u * b + j] = kv_q8_pack(vec4(x[4u * j], x[4u * j + 1u], x[4u * j + 2u],
                                                                          x[4u * j + 3u]), id);
                    ds[b] = d;
                }
                kv[srow + u] = packHalf2x16(ds);
            }
            continue;
        }
        for (uint w = gl_SubgroupInvocationID; w < hd2; w += gl_SubgroupSize) {
            vec2 outv = vec2(head_value(kind, src, 2u * w, scale, wn, tb),
                             head_value(kind, src, 2u * w + 1u, scale, wn, tb));
            if (kind == 0u) {
                uint ob = p.q_off + r * p.q_stride + hh * p.head_dim + 2u * w;
                act[ob] = outv.x;
                act[ob + 1u] = outv.y;
            } else {
                kv[base + (row * p.n_kv + hh) * hd2 + w] = packHalf2x16(outv);
            }
        }
    }
}
