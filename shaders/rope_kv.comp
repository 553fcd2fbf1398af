#version 450
// Fused RoPE + KV-cache write, one invocation per output word (2 dims):
//   q heads: rotated, written as f32 to q_out
//   k heads: rotated, packed to f16 pairs, written to the K cache at (slot, pos)
//   v heads: packed to f16 pairs, written to the V cache at (slot, pos)
// Input row r of qkv = [q (n_head*hd) | k (n_kv*hd) | v (n_kv*hd)].
// mode 0 rotates adjacent pairs (2i, 2i+1) (llama.cpp's NORM, GGUF llama
// weights); mode 1 rotates (i, i + n_rot/2) (NEOX, Hugging Face layout).
// cos/sin come from a host-computed table [pos][n_rot/2][2] (float64 on the
// host, so every device rotates identically).
// KV cache layout per layer: [slot][pos][kv_head][hd/2 words of f16 pairs].
#include "common.glsl"

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
} p;

float rotated(uint xb, uint d, float c, float s, uint pair_d, bool second) {
    float x = act[xb + d];
    float y = act[xb + pair_d];
    return second ? x * c + y * s : x * c - y * s;
}

void main() {
    uint hd2 = p.head_dim / 2u;
    uint wq_ = p.n_head * hd2;
    uint wk = p.n_kv * hd2;
    uint per_row = wq_ + 2u * wk;
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.n_rows * per_row) return;
    uint r = i / per_row;
    uint w = i % per_row;
    uint pos = params[p.pos_off + r];
    uint slot = params[p.slot_off + r];
    uint rb = p.qkv_off + r * p.qkv_stride;

    uint head_base;   // first input float of this head
    uint wi;          // word inside the head
    if (w < wq_) {
        head_base = rb + (w / hd2) * p.head_dim;
        wi = w % hd2;
    } else if (w < wq_ + wk) {
        head_base = rb + p.n_head * p.head_dim + ((w - wq_) / hd2) * p.head_dim;
        wi = (w - wq_) % hd2;
    } else {
        // V: no rotation
        uint vw = w - wq_ - wk;
        uint base = rb + (p.n_head + p.n_kv) * p.head_dim + vw * 2u;
        kv[p.v_off + slot * p.slot_stride + pos * wk + vw] = packHalf2x16(vec2(act[base], act[base + 1u]));
        return;
    }

    uint d0 = 2u * wi;
    vec2 outv;
    uint half_rot = p.n_rot / 2u;
    uint tb = p.table_off + pos * half_rot * 2u;
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
    if (w < wq_) {
        uint h = w / hd2;
        uint ob = p.q_off + r * p.q_stride + h * p.head_dim + d0;
        act[ob] = outv.x;
        act[ob + 1u] = outv.y;
    } else {
        kv[p.k_off + slot * p.slot_stride + pos * wk + (w - wq_)] = packHalf2x16(outv);
    }
}
