#version 450
// Fused RoPE + KV-cache write:
//   q heads: rotated, written as f32 to q_out
//   k heads: rotated, written to the K cache at (slot, pos)
//   v heads: written to the V cache at (slot, pos)
// Input row r of qkv = [q (n_head*hd) | k (n_kv*hd) | v (n_kv*hd)].
// One invocation per unit of work: a q word (2 dims), and per K or V head an
// f16 pair of the cache (f16) or a q8_0 word of 4 values, whose 32-value
// block's max the block's 8 invocations share through shared memory (before: an
// invocation took 64 values alone, notes.md run 34); kv.glsl has the cache's
// layouts (KV_K_Q8, KV_V_Q8).
// mode 0 rotates adjacent pairs (2i, 2i+1) (llama.cpp's NORM, GGUF llama
// weights); mode 1 rotates (i, i + n_rot/2) (NEOX, Hugging Face layout).
// cos/sin come from a host-computed table [pos][n_rot/2][2] (float64 on the
// host, so every device rotates identically).
#include "common.glsl"
#include "kv.glsl"

layout(binding = 0) readonly buffer Wq { float table[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) writeonly buffer Kv { uint kv[]; };

layout(push_constant) uniform P {
    uint qkv_off, qkv_stride, q_off, q_stride;
    uint n_rows, n_head, n_kv, head_dim, n_rot, mode;
    uint table_off;
    uint k_off, v_off, slot_stride;   // words in the KV buffer
    uint pos_off, slot_off;           // uint indices into params
    uint ring;                        // kv_at
} p;

// a position's row in the cache: sliding-window layers' caches are rings of
// `ring` positions (position t at row t % ring); 0: no wrap
uint kv_at(uint t) { return p.ring != 0u && t >= p.ring ? t % p.ring : t; }

float rotated(uint xb, uint d, float c, float s, uint pair_d, bool second) {
    float x = act[xb + d];
    float y = act[xb + pair_d];
    return second ? x * c + y * s : x * c - y * s;
}

// dims 2 wi and 2 wi + 1 of the head whose first input float is head_base,
// rotated (rot) with the table's row at tb, or as they are
vec2 head_pair(uint head_base, uint wi, uint tb, bool rot) {
    uint d0 = 2u * wi;
    if (!rot) return vec2(act[head_base + d0], act[head_base + d0 + 1u]);
    vec2 outv;
    uint half_rot = p.n_rot / 2u;
    if (p.mode == 0u) {
        if (d0 < p.n_rot) {
            uint pi = wi;
            float c = table[tb + 2u * pi], s = table[tb + 2u * pi + 1u];
            float x0 = act[head_base + d0], x1 = act[head_base + d0 + 1u];
            // precise: the same roundings as the matvec's fused RoPE (mul_mv.comp)
            precise float y0 = x0 * c - x1 * s;
            precise float y1 = x0 * s + x1 * c;
            outv = vec2(y0, y1);
        } else {
            outv = vec2(act[head_base + d0], act[head_base + d0 + 1u]);
        }
    } else {
        for (uint k = 0u; k < 2u; k++) {
            uint d = d0 + k;
            float val;
            if (d < p.n_rot) {
                bool second = d >= half_rot;
                uint pi = second ? d - half_rot : d;
                float c = table[tb + 2u * pi], s = table[tb + 2u * pi + 1u];
                val = rotated(head_base, d, c, s, second ? d - half_rot : d + half_rot, second);
            } else {
                val = act[head_base + d];
            }
            outv[k] = val;
        }
    }
    return outv;
}

// the 4 values of word wi of a head (dims 4 wi .. 4 wi + 3), rotated or not
vec4 head_word(uint head_base, uint wi, uint tb, bool rot) {
    return vec4(head_pair(head_base, 2u * wi, tb, rot), head_pair(head_base, 2u * wi + 1u, tb, rot));
}

// each invocation's |max| of its q8_0 word (0 for other invocations), so that
// a block's 8 words (consecutive invocations: every section of a row is a
// multiple of 16 words, and so is the workgroup) take its max together
shared float wmax[gl_WorkGroupSize.x];

void main() {
    uint hd = p.head_dim;
    uint hd2 = hd / 2u;
    uint wq_ = p.n_head * hd2;
    uint uk = KV_K_Q8 != 0 ? hd / 4u : hd2;   // invocations of a K head: a q8_0 word (4 values) or an f16 pair
    uint uv = KV_V_Q8 != 0 ? hd / 4u : hd2;   // of a V head
    uint per_row = wq_ + p.n_kv * (uk + uv);
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    bool q8 = false;                          // this invocation quantizes a word
    vec4 x = vec4(0.0);
    uint qw = 0u, sw = 0u, u = 0u;
    if (i < p.n_rows * per_row) {
        uint r = i / per_row;
        uint w = i % per_row;
        uint pos = params[p.pos_off + r];
        uint slot = params[p.slot_off + r];
        uint rb = p.qkv_off + r * p.qkv_stride;
        uint tb = p.table_off + pos * (p.n_rot / 2u) * 2u;
        uint row = kv_at(pos);
        if (w < wq_) {
            uint h = w / hd2, wi = w % hd2;
            vec2 outv = head_pair(rb + h * hd, wi, tb, true);
            uint ob = p.q_off + r * p.q_stride + h * hd + 2u * wi;
            act[ob] = outv.x;
            act[ob + 1u] = outv.y;
        } else {
            bool is_k = w < wq_ + p.n_kv * uk;
            uint wu = is_k ? w - wq_ : w - wq_ - p.n_kv * uk;
            uint units = is_k ? uk : uv;
            uint kvh = wu / units;
            u = wu % units;
            uint head_base = rb + (p.n_head + (is_k ? 0u : p.n_kv) + kvh) * hd;
            KvSlot sl = kv_slot(p.slot_stride, p.n_kv, hd);
            uint base = is_k ? p.k_off + slot * sl.k_stride : p.v_off + slot * sl.v_stride;
            q8 = is_k ? KV_K_Q8 != 0 : KV_V_Q8 != 0;
            if (q8) {
                x = head_word(head_base, u, tb, is_k);
                qw = base + (row * p.n_kv + kvh) * (hd / 4u) + u;
                sw = base + (is_k ? sl.k_scales : sl.v_scales) + (row * p.n_kv + kvh) * (hd / 64u) + u / 16u;
            } else {
                kv[base + (row * p.n_kv + kvh) * hd2 + u] = packHalf2x16(head_pair(head_base, u, tb, is_k));
            }
        }
    }
    if (KV_K_Q8 == 0 && KV_V_Q8 == 0) return;   // (a constant: the f16 cache's variant has no barrier)
    vec4 y = abs(x);
    uint l = gl_LocalInvocationID.x;
    wmax[l] = max(max(y.x, y.y), max(y.z, y.w));
    barrier();
    if (q8) {
        uint l0 = l & ~7u;                    // the block's first word
        float m = 0.0;
        [[unroll]] for (uint j = 0u; j < 8u; j++) m = max(m, wmax[l0 + j]);
        float d = kv_q8_scale(m);
        kv[qw] = kv_q8_pack(x, kv_q8_inv(d));
        if ((u & 15u) == 0u) {                // a unit's first word: its two blocks' scales
            float m2 = 0.0;
            [[unroll]] for (uint j = 8u; j < 16u; j++) m2 = max(m2, wmax[l + j]);
            kv[sw] = packHalf2x16(vec2(d, kv_q8_scale(m2)));
        }
    }
}
