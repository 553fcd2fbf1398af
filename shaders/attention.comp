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
// K and V are f16 or q8_0 each (kv.glsl: KV_K_Q8, KV_V_Q8); a q8_0 K row is read
// as int8 in uvec4s, a block's sum scaled once; a q8_0 V pair comes with its
// block's scale (kv_q8_pair_word).
#include "common.glsl"
#include "kv.glsl"
#extension GL_KHR_shader_subgroup_shuffle : require

// q and the output: the same activation buffer bound twice (q readonly). In
// the split-K variant (SPLIT) the output binding is coherent because the last
// slice of a (row, head) reads the slices other workgroups wrote, and counts
// them on a uint alias; the one-pass variant (prefill) keeps a write-only one.
#ifndef SPLIT
#define SPLIT 0
#endif
#if SPLIT
layout(binding = 0) coherent buffer Out { float act[]; };
layout(binding = 0) coherent buffer OutU { uint actu[]; };
#else
layout(binding = 0) writeonly restrict buffer Out { float act[]; };
#endif
layout(binding = 1) readonly restrict buffer Q4 { vec4 act4[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) readonly restrict buffer Kv { uint kv[]; };
layout(binding = 3) readonly restrict buffer Kv4 { uvec4 kv4[]; };
layout(binding = 4) readonly buffer Sinks { float sinks[]; };

// words (f16 pairs) of a V row that one lane owns: ceil(head_dim / 2 / subgroup)
layout(constant_id = 2) const uint WPL = 1;
// The head size (also p.head_dim) as a specialization constant, so that the
// driver unrolls the q.k loop and issues a lane's K loads together, and the V
// rows loaded ahead of their use (VB x WPL words a lane; the host takes up to
// 32 words). H200, 1B Q8_0 (notes.md run 18): decode attention at position 128
// 19.4 -> 16.9 us a layer (head size and 8 V rows from push constants before),
// tg512 945-952 -> 995-996 tok/s
layout(constant_id = 3) const uint HD = 64;
layout(constant_id = 4) const uint VB = 8;

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
    // split-K (flash-decoding): 0 = one pass over all positions, writing the
    // output. Else each (row, head) is cut into n_parts slices of `chunk`
    // positions (slices past the row's position do nothing); a row whose
    // position is within the first slice writes its output at once, else each
    // slice writes (max, sum, unnormalized output) to
    // part_off + ((row * n_head + head) * n_parts + part) * (head_dim + 2)
    // and counts itself on word sync_off + row * n_head + head (zero between
    // dispatches), and the slice that counts last merges them into the
    // output and resets the counter: one dispatch, no second pass.
    uint chunk, n_parts, part_off, sync_off;
    // sliding-window layers: a row at position pos sees pos - window + 1 .. pos
    // (0: all of 0..pos); softcap > 0: scores become softcap * tanh(score / softcap)
    // (Gemma 2) before the softmax
    uint window;
    float softcap;
    uint ring;   // kv_at
    uint sink_off;   // sink_weight
} p;

// gpt-oss's attention sinks: a learned logit per query head (binding 4 at
// sink_off; 0xffffffff: none) that joins the softmax's denominator with no
// value: o = acc / (l + e^(sink - m)) for acc and l taken against the max m
float sink_weight(uint h, float m) {
    return p.sink_off == 0xffffffffu ? 0.0 : exp(sinks[p.sink_off + h] - m);
}

// a position's row in the cache: sliding-window layers' caches are rings of
// `ring` positions (position t at row t % ring); 0: no wrap
uint kv_at(uint t) { return p.ring != 0u && t >= p.ring ? t % p.ring : t; }

#if SPLIT
// The output of (row r, head h) from its `used` slices:
// o = sum_q e^(m_q - M) acc_q / sum_q e^(m_q - M) l_q, M = max_q m_q.
void merge(uint r, uint h, uint rh, uint used) {
    uint stride = p.head_dim + 2u;
    uint base = p.part_off + rh * p.n_parts * stride;
    float M = -1.0 / 0.0;
    for (uint q = gl_SubgroupInvocationID; q < used; q += gl_SubgroupSize) M = max(M, act[base + q * stride]);
    M = subgroupMax(M);
    float L = 0.0;
    for (uint q = gl_SubgroupInvocationID; q < used; q += gl_SubgroupSize) {
        float mq = act[base + q * stride];
        if (mq > -1.0 / 0.0) L += exp(mq - M) * act[base + q * stride + 1u];
    }
    L = subgroupAdd(L) + sink_weight(h, M);
    uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
    for (uint d = gl_SubgroupInvocationID; d < p.head_dim; d += gl_SubgroupSize) {
        float o = 0.0;
        for (uint q = 0u; q < used; q++) {
            float mq = act[base + q * stride];
            if (mq > -1.0 / 0.0) o += exp(mq - M) * act[base + q * stride + 2u + d];
        }
        act[ob + d] = o / L;
    }
}
#endif

void main() {
    uint split = p.chunk == 0u ? 1u : p.n_parts;
    uvec2 items = workgroup_items(p.n_rows * p.n_head * split);
    const uint hd2 = HD / 2u;
    const uint hd8 = HD / 8u;
    uint lane = gl_SubgroupInvocationID;
    uint S = gl_SubgroupSize;
    const uint kw_ = KV_K_Q8 != 0 ? HD / 4u : hd2;   // words of a K row (int8 quads or f16 pairs)
    const uint vw_ = KV_V_Q8 != 0 ? HD / 4u : hd2;   // of a V row
    uint k_row = p.n_kv * kw_;                        // words of one position
    uint v_row = p.n_kv * vw_;
    uint s_row = p.n_kv * (HD / 64u);                 // scale words of one position (q8_0)
    KvSlot sl = kv_slot(p.slot_stride, p.n_kv, HD);
    for (uint item = items.x + gl_SubgroupID; item < items.y; item += gl_NumSubgroups) {
        uint part = item % split;
        uint rh = item / split;
        uint r = rh / p.n_head;
        uint h = rh % p.n_head;
        uint kvh = h / (p.n_head / p.n_kv);
        uint pos = params[p.pos_off + r];
        uint slot = params[p.slot_off + r];
        uint lo = p.window != 0u && pos >= p.window ? pos + 1u - p.window : 0u;   // the row's first position
        uint first = p.chunk == 0u ? 0u : part * p.chunk;
        if (first > pos) continue;   // a slice past the row's position: the merge skips it
        uint last = p.chunk == 0u ? pos : min(pos, first + p.chunk - 1u);
        first = max(first, lo);      // (a slice before the window: no positions, its m stays -inf)
        uint qb4 = (p.q_off + r * p.q_stride + h * p.head_dim) / 4u;
        uint kb = p.k_off + slot * sl.k_stride + kvh * kw_;
        uint vb = p.v_off + slot * sl.v_stride + kvh * vw_;
        uint ksb = p.k_off + slot * sl.k_stride + sl.k_scales + kvh * (HD / 64u);   // (q8_0)
        uint vsb = p.v_off + slot * sl.v_stride + sl.v_scales + kvh * (HD / 64u);
        vec2 acc[WPL];
        [[unroll]] for (uint i = 0; i < WPL; i++) acc[i] = vec2(0.0);
        float m = -1.0 / 0.0;
        float l = 0.0;
        for (uint t0 = first; t0 <= last; t0 += S) {
            uint t = t0 + lane;
            float s = -1.0 / 0.0;
            if (t <= last) {
                uint k4 = (kb + kv_at(t) * k_row) / 4u;
                float d = 0.0;
#if KV_K_Q8
                // per 64 values: a scale word, two blocks of 2 uvec4 of int8 each
                [[unroll]] for (uint u = 0u; u < HD / 64u; u++) {
                    vec2 du = unpackHalf2x16(kv[ksb + kv_at(t) * s_row + u]);
                    [[unroll]] for (uint b = 0u; b < 2u; b++) {
                        uint blk = 2u * u + b;
                        uvec4 k0 = kv4[k4 + 2u * blk], k1 = kv4[k4 + 2u * blk + 1u];
                        uint qa = qb4 + 8u * blk;
                        float db = dot(act4[qa], kv_i8x4(k0.x)) + dot(act4[qa + 1u], kv_i8x4(k0.y))
                                 + dot(act4[qa + 2u], kv_i8x4(k0.z)) + dot(act4[qa + 3u], kv_i8x4(k0.w))
                                 + dot(act4[qa + 4u], kv_i8x4(k1.x)) + dot(act4[qa + 5u], kv_i8x4(k1.y))
                                 + dot(act4[qa + 6u], kv_i8x4(k1.z)) + dot(act4[qa + 7u], kv_i8x4(k1.w));
                        d += db * du[b];
                    }
                }
#else
                [[unroll]] for (uint i = 0u; i < hd8; i++) {
                    uvec4 kw = kv4[k4 + i];
                    d += dot(act4[qb4 + 2u * i], vec4(unpackHalf2x16(kw.x), unpackHalf2x16(kw.y)))
                       + dot(act4[qb4 + 2u * i + 1u], vec4(unpackHalf2x16(kw.z), unpackHalf2x16(kw.w)));
                }
#endif
                s = d * p.scale;
                if (p.softcap > 0.0) s = p.softcap * tanh(clamp(s / p.softcap, -10.0, 10.0));
            }
            float m_new = max(m, subgroupMax(s));
            float corr = exp(m - m_new);
            float e = t <= last ? exp(s - m_new) : 0.0;
            l = l * corr + subgroupAdd(e);
            [[unroll]] for (uint i = 0; i < WPL; i++) acc[i] *= corr;
            uint n_valid = min(S, last + 1u - t0);
            for (uint j0 = 0u; j0 < n_valid; j0 += VB) {
                uint vw[VB][WPL];
                [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                    uint vrow = vb + kv_at(t0 + j0 + jj) * v_row;
#if KV_V_Q8
                    uint vsrow = vsb + kv_at(t0 + j0 + jj) * s_row;
#endif
                    [[unroll]] for (uint i = 0; i < WPL; i++) {
                        uint w = lane + i * S;
#if KV_V_Q8
                        vw[jj][i] = (j0 + jj < n_valid && w < hd2)
                                  ? kv_q8_pair_word(kv[vrow + w / 2u], kv[vsrow + w / 32u], w) : 0u;
#else
                        vw[jj][i] = (j0 + jj < n_valid && w < hd2) ? kv[vrow + w] : 0u;
#endif
                    }
                }
                [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                    float ej = subgroupShuffle(e, min(j0 + jj, S - 1u));
                    if (j0 + jj < n_valid) {
                        [[unroll]] for (uint i = 0; i < WPL; i++) acc[i] += ej * KV_V_PAIR(vw[jj][i]);
                    }
                }
            }
            m = m_new;
        }
        uint used = p.chunk == 0u ? 1u : min(p.n_parts, pos / p.chunk + 1u);
        if (used == 1u) {
            l += sink_weight(h, m);
            uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
            [[unroll]] for (uint i = 0; i < WPL; i++) {
                uint w = lane + i * S;
                if (w < hd2) {
                    act[ob + 2u * w] = acc[i].x / l;
                    act[ob + 2u * w + 1u] = acc[i].y / l;
                }
            }
        }
#if SPLIT
        else {
            uint pb = p.part_off + item * (p.head_dim + 2u);
            if (subgroupElect()) { act[pb] = m; act[pb + 1u] = l; }
            [[unroll]] for (uint i = 0; i < WPL; i++) {
                uint w = lane + i * S;
                if (w < hd2) {
                    act[pb + 2u + 2u * w] = acc[i].x;
                    act[pb + 3u + 2u * w] = acc[i].y;
                }
            }
            // this slice's words visible to the others before it counts itself
            memoryBarrierBuffer();
            subgroupBarrier();
            uint before = 0u;
            if (subgroupElect()) before = atomicAdd(actu[p.sync_off + rh], 1u);
            if (subgroupMax(before) == used - 1u) {
                memoryBarrierBuffer();
                merge(r, h, rh, used);
                if (subgroupElect()) actu[p.sync_off + rh] = 0u;
            }
        }
#endif
    }
}
