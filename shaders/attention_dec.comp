#version 450
// Decode attention at any depth (flash-decoding over KV-head groups): query row
// r (slot = params[slot_off + r], pos = params[pos_off + r]) attends to
// positions 0..pos of its slot, as attention.comp does, for steps of few rows.
//
// Work item: (row, KV head, group of GQ of its query heads, part); a workgroup
// takes ITEMS_PER_WG consecutive parts of one (row, KV head, group), each of
// its subgroups a run of consecutive parts (one part where subgroups and items
// are as many). A subgroup reads each K and V row of its positions once for
// all GQ heads (grouped-query attention: the n_head / n_kv query heads of a KV
// head share its rows), so K/V are read once per KV head, not once per query head.
//
// The positions 0..pos are cut into parts of `chunk` positions, chunk
// following the row's own position (PD: (pos + 1) / (n_parts / 2) rounded down
// to a multiple of min_chunk, at least min_chunk; else ceil((pos + 1) /
// n_parts) rounded up to one): every part does the same work at any depth, and
// the grid (rows x KV heads x groups x n_parts) does not grow with the context.
// Parts past the row's position do nothing. The chunk depends only on the
// row's position, so a row's arithmetic is the same alone or batched.
//
// The subgroup walks its positions in tiles of one subgroup: each lane scores
// one position for the GQ heads (its K row read as f16 pairs in uvec4s, q
// broadcast), the online-softmax update is two subgroup reductions per head,
// then the lanes own f16 pairs of the head dimension and accumulate the tile's
// V rows for all GQ heads, each position's weights taken from its lane with
// shuffles. The workgroup's subgroups then combine in shared memory (CMB: in
// one round, from a slot each); a row whose positions are all in one
// workgroup writes its output at once; otherwise each workgroup writes (max,
// sum, unnormalized output) per head, counts itself on one word per (row, KV
// head, group), and the last to count resets the counter and merges the
// workgroups' partials (in order), its subgroups taking a head each: one
// dispatch. (A partial per workgroup rather than per part: the merge reads
// ITEMS_PER_WG times fewer; with 72 registers a lane against 128, H200
// notes.md run 29.)
// K and V are f16 or q8_0 each (kv.glsl: KV_K_Q8, KV_V_Q8), read as
// attention.comp reads them.
#include "common.glsl"
#include "kv.glsl"
#extension GL_KHR_shader_subgroup_shuffle : require

layout(binding = 0) coherent buffer Out { float act[]; };
layout(binding = 0) coherent buffer OutU { uint actu[]; };
layout(binding = 1) readonly restrict buffer Q4 { vec4 act4[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) readonly restrict buffer Kv { uint kv[]; };
layout(binding = 3) readonly restrict buffer Kv4 { uvec4 kv4[]; };
layout(binding = 4) readonly buffer Sinks { float sinks[]; };

// words (f16 pairs) of a V row that one lane owns: ceil(head_dim / 2 / subgroup)
layout(constant_id = 2) const uint WPL = 1;
layout(constant_id = 3) const uint HD = 64;    // the head size (also p.head_dim): loops unroll
layout(constant_id = 4) const uint VB = 8;     // V rows a lane loads ahead of their use
layout(constant_id = 5) const uint GQ = 1;     // query heads of one KV head an item takes
// lanes that score one position together (f16 K): 1, a lane a position; LP > 1,
// LP lanes share a position's K row (HD / LP dims each, one 16-byte load of a
// row segment per 8 dims: rows read whole by neighbouring lanes) and reduce its
// dot products with LP-lane butterflies, and the lane's dims of q stay in
// registers (LP = 1 reads q's HD dims from memory for every position tile)
layout(constant_id = 6) const uint LP = 1;
// (f16 K, LP = 1) uvec4 of a K row a lane keeps: HD / 8 loads the next tile's K rows
// during this one's softmax and V rows; 0 loads them when they are scored (168
// registers against 72 on the H200, slower: notes.md run 29)
layout(constant_id = 7) const uint KPF = 0;
// 1: a tile's first VB V rows loaded before its scores (they do not depend on them); 0: after
// (1: 96 registers against 72, not faster on the H200: notes.md run 29); with VW, the tile's first round of wide
// loads (VB uvec4 a lane: VB x S / lr rows) before the scores (Caps.attn_vpre; alone slower on the H100, run 59)
layout(constant_id = 8) const uint VPRE = 0;
// (LP > 1) 1: a tile's K row segments for all LP passes loaded before any of its dot products (LP x HD / LP / 8
// uvec4 a lane: one memory latency a tile rather than, where the compiler keeps the passes' loads behind the
// butterflies before them, one a pass); the same arithmetic (Caps.attn_khoist)
layout(constant_id = 9) const uint KH = 0;
// (f16 V, HD / 8 a power of two; VW: the smallest subgroup the kernel runs with) V rows read in uvec4s (8 dims a
// lane, 16-byte loads): a row's HD / 8 uvec4 over LR = min(HD / 8, subgroup) lanes (NQ = HD / 8 / LR uvec4 each),
// S / LR rows a load instruction, VB uvec4 loads ahead a lane; each lane group sums its own rows, the groups' sums
// added by butterflies after the last tile (Caps.attn_vwide); 0: an f16 pair a lane (WPL words), every lane every row
layout(constant_id = 10) const uint VW = 0;
// 1: the workgroup's subgroups combined in one round (each writes its (max, sum, output) to its own shared slots,
// one barrier, every invocation then adds its outputs' slots in subgroup order); 0: one subgroup after another with
// a barrier each (ITEMS_PER_WG x GQ x (HD + 2) floats of slots against GQ x (HD + 2): the host takes 0 where the
// slots would not fit the device's shared memory; Caps.attn_combine, Kernels.dec_combine)
layout(constant_id = 11) const uint CMB = 0;
// the last workgroup's merge of the row's partials: 0, in two passes (the partials' maxima first, then their sums and
// outputs scaled to the largest, 8 partials' words loaded a round); MB > 0, in one pass of rounds of MB partials, each
// round's maxima, sums and words loaded together and the running sums rescaled to the round's new max (flash
// attention's update; fewer dependent loads: ceil(used / MB) rounds against 2 + ceil(used / 8); other rounding)
// (Caps.attn_merge)
layout(constant_id = 12) const uint MB = 0;
// 1: a part's positions the row's position over half the grid's parts, rounded DOWN to a multiple of min_chunk (at
// least min_chunk), so that a row uses between half the parts and all of them (0: over all the parts, rounded up:
// a row just past n_parts x min_chunk x k positions uses about k / (k + 1) of them, at 4,097 positions half)
// (Caps.attn_parts_down; the host plans twice the parts)
layout(constant_id = 13) const uint PD = 0;
// (LP > 1) 1: the item's query heads' q in shared memory, loaded once by the workgroup (all its subgroups take the
// same row and heads), each pass reading a lane's dims from there; 0: in registers (DL4 vec4 a head a lane), 32 a lane
// for two heads of 128: what VPRE's V rows cost (Caps.attn_qsh)
layout(constant_id = 14) const uint QSH = 0;

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
    // parts per (row, KV head, group); a part's positions are a multiple of
    // min_chunk; partial results, one a workgroup, at part_off + ((row * n_head
    // + head) * (n_parts / ITEMS_PER_WG) + workgroup) * (head_dim + 2);
    // counters (zero between dispatches) at sync_off + (row * n_kv + kv head) *
    // groups + group
    uint n_parts, min_chunk, part_off, sync_off;
    // sliding-window layers: a row at position pos sees pos - window + 1 .. pos
    // (0: all of 0..pos), the parts cut from those; softcap > 0: scores become
    // softcap * tanh(score / softcap) (Gemma 2)
    uint window;
    float softcap;
    uint ring;   // kv_at
    uint sink_off;   // sink_weight
    // gate_blk != 0: the output of (row r, head h) times sigmoid of its gate,
    // gate_off + r * gate_stride + h * gate_blk + d (Qwen3.5's gated attention:
    // the gates interleaved after each head's query), sigmoid_mul.comp's
    // arithmetic: one dispatch and barrier less a decode step's layer
    uint gate_off, gate_stride, gate_blk;
} p;

// the output value v of (row r, head h, dimension d), gated where the step asks
float gated(float v, uint r, uint h, uint d) {
    if (p.gate_blk == 0u) return v;
    float g = act[p.gate_off + r * p.gate_stride + h * p.gate_blk + d];
    return v / (1.0 + exp(-g));
}

// gpt-oss's attention sinks: a learned logit per query head (binding 4 at
// sink_off; 0xffffffff: none) that joins the softmax's denominator with no
// value: o = acc / (l + e^(sink - m)) for acc and l taken against the max m
float sink_weight(uint h, float m) {
    return p.sink_off == 0xffffffffu ? 0.0 : exp(sinks[p.sink_off + h] - m);
}

// a position's row in the cache: sliding-window layers' caches are rings of
// `ring` positions (position t at row t % ring); 0: no wrap
uint kv_at(uint t) { return p.ring != 0u && t >= p.ring ? t % p.ring : t; }

// the first word of the partial (max, sum, unnormalized output) of (row r, head h) written by the row's
// workgroup wi (of n_parts / ITEMS_PER_WG): the layout the push constants' part_off describes
uint partial_at(uint r, uint h, uint wi) {
    return p.part_off + ((r * p.n_head + h) * (p.n_parts / ITEMS_PER_WG) + wi) * (p.head_dim + 2u);
}

// The output of (row r, head h) from its `used` partials (a workgroup's each), in order:
// o = sum_q e^(m_q - M) acc_q / sum_q e^(m_q - M) l_q, M = max_q m_q; a lane owns
// the V row's words of the main loop. MB > 0: in one pass of rounds of MB
// partials, o and L following the running max; MB = 0: M first, then lane j
// holds the weight of partial q0 + j and each lane loads 8 partials' words
// before it adds them (the loads overlap).
void merge(uint r, uint h, uint used) {
    const uint hd2 = HD / 2u;
    uint lane = gl_SubgroupInvocationID;
    uint S = gl_SubgroupSize;
    uint stride = p.head_dim + 2u;
    uint base = partial_at(r, h, 0u);
    float M = -1.0 / 0.0, L = 0.0;
    vec2 o[WPL];
    [[unroll]] for (uint i = 0; i < WPL; i++) o[i] = vec2(0.0);
    if (MB > 0u) {
        // (MB) one pass: every lane takes each round's maxima and sums (the same words for all lanes) and its words
        // of the partials' outputs, all loaded before the round's arithmetic
        const uint MB1 = MB > 0u ? MB : 1u;   // (no array of size 0)
        for (uint q0 = 0u; q0 < used; q0 += MB1) {
            float mq[MB1], lq[MB1];
            vec2 a[MB1][WPL];
            [[unroll]] for (uint jj = 0; jj < MB1; jj++) {
                uint b = base + (q0 + jj) * stride;
                bool ok = q0 + jj < used;
                mq[jj] = ok ? act[b] : -1.0 / 0.0;
                lq[jj] = ok ? act[b + 1u] : 0.0;
                [[unroll]] for (uint i = 0; i < WPL; i++) {
                    uint w = lane + i * S;
                    a[jj][i] = (ok && w < hd2) ? vec2(act[b + 2u + 2u * w], act[b + 3u + 2u * w]) : vec2(0.0);
                }
            }
            float mn = M;
            [[unroll]] for (uint jj = 0; jj < MB1; jj++) mn = max(mn, mq[jj]);
            float corr = M > -1.0 / 0.0 ? exp(M - mn) : 0.0;
            L *= corr;
            [[unroll]] for (uint i = 0; i < WPL; i++) o[i] *= corr;
            [[unroll]] for (uint jj = 0; jj < MB1; jj++) {
                float c = mq[jj] > -1.0 / 0.0 ? exp(mq[jj] - mn) : 0.0;
                L += c * lq[jj];
                [[unroll]] for (uint i = 0; i < WPL; i++) o[i] += c * a[jj][i];
            }
            M = mn;
        }
    } else {
        for (uint q = lane; q < used; q += S) M = max(M, act[base + q * stride]);
        M = subgroupMax(M);
        for (uint q0 = 0u; q0 < used; q0 += S) {
            uint q = q0 + lane;
            float c = 0.0;
            if (q < used) {
                float mq = act[base + q * stride];
                c = mq > -1.0 / 0.0 ? exp(mq - M) : 0.0;
                L += c * act[base + q * stride + 1u];
            }
            uint n = min(S, used - q0);
            for (uint j0 = 0u; j0 < n; j0 += 8u) {
                vec2 a[8][WPL];
                [[unroll]] for (uint jj = 0; jj < 8u; jj++) {
                    uint b = base + (q0 + j0 + jj) * stride + 2u;
                    [[unroll]] for (uint i = 0; i < WPL; i++) {
                        uint w = lane + i * S;
                        a[jj][i] = (j0 + jj < n && w < hd2) ? vec2(act[b + 2u * w], act[b + 2u * w + 1u]) : vec2(0.0);
                    }
                }
                [[unroll]] for (uint jj = 0; jj < 8u; jj++) {
                    float cj = subgroupShuffle(c, min(j0 + jj, S - 1u));
                    [[unroll]] for (uint i = 0; i < WPL; i++) o[i] += cj * a[jj][i];
                }
            }
        }
        L = subgroupAdd(L);
    }
    L += sink_weight(h, M);
    uint ob = p.o_off + r * p.o_stride + h * p.head_dim;
    [[unroll]] for (uint i = 0; i < WPL; i++) {
        uint w = lane + i * S;
        if (w < hd2) {
            act[ob + 2u * w] = gated(o[i].x / L, r, h, 2u * w);
            act[ob + 2u * w + 1u] = gated(o[i].y / L, r, h, 2u * w + 1u);
        }
    }
}

shared uint last_wg;
shared vec4 sh_q4[QSH != 0u ? GQ * HD / 4u : 1u];   // (QSH) the item's heads' q
// (CMB) each subgroup's (max, sum, output) per head, subgroup s's at s * GQ + g; (no CMB) the running (max, sum,
// output scaled to the max) per head
const uint CMB_SLOTS = CMB != 0u ? ITEMS_PER_WG * GQ : 1u;
const uint SER_SLOTS = CMB != 0u ? 1u : GQ;
shared float sh_cm[CMB_SLOTS];
shared float sh_cl[CMB_SLOTS];
shared float sh_co[CMB_SLOTS * HD];
shared float sh_m[SER_SLOTS];
shared float sh_l[SER_SLOTS];
shared float sh_o[SER_SLOTS * HD];

void main() {
    uint group = p.n_head / p.n_kv;              // query heads per KV head
    uint n_groups = (group + GQ - 1u) / GQ;      // items per (row, KV head) and part
    uint wg_per = p.n_parts / ITEMS_PER_WG;      // workgroups per (row, KV head, group)
    uint wg = workgroup_linear();
    uint rg = wg / wg_per;                       // (row, KV head, group)
    uint blk = wg % wg_per;
    if (rg >= p.n_rows * p.n_kv * n_groups) return;
    uint part0 = blk * ITEMS_PER_WG;             // this workgroup's first part
    const uint hd2 = HD / 2u;
    const uint hd8 = HD / 8u;
    uint lane = gl_SubgroupInvocationID;
    uint S = gl_SubgroupSize;
    const uint kw_ = KV_K_Q8 != 0 ? HD / 4u : hd2;   // words of a K row (int8 quads or f16 pairs)
    const uint vw_ = KV_V_Q8 != 0 ? HD / 4u : hd2;   // of a V row
    uint k_row = p.n_kv * kw_;                        // words of one position
    uint v_row = p.n_kv * vw_;
    uint s_row = p.n_kv * (HD / 64u);                 // scale words of one position (q8_0)
    uint gi = rg % n_groups;
    uint kvh = (rg / n_groups) % p.n_kv;
    uint r = rg / (n_groups * p.n_kv);
    uint h0 = kvh * group + gi * GQ;             // its first query head
    uint nh = min(GQ, group - gi * GQ);          // and how many
    uint pos = params[p.pos_off + r];
    uint slot = params[p.slot_off + r];
    uint lo = p.window != 0u && pos >= p.window ? pos + 1u - p.window : 0u;   // the row's first position
    uint total = pos + 1u - lo;
    uint chunk;
    if (PD != 0u) {
        chunk = max(1u, total / (p.min_chunk * (p.n_parts / 2u))) * p.min_chunk;
    } else {
        chunk = (total + p.n_parts - 1u) / p.n_parts;
        chunk = (chunk + p.min_chunk - 1u) / p.min_chunk * p.min_chunk;
    }
    uint used = (total + chunk - 1u) / chunk;
    if (part0 >= used) return;                   // the whole workgroup past the row's position
    KvSlot sl = kv_slot(p.slot_stride, p.n_kv, HD);
    uint kb = p.k_off + slot * sl.k_stride + kvh * kw_;
    uint vb = p.v_off + slot * sl.v_stride + kvh * vw_;
    uint ksb = p.k_off + slot * sl.k_stride + sl.k_scales + kvh * (HD / 64u);   // (q8_0)
    uint vsb = p.v_off + slot * sl.v_stride + sl.v_scales + kvh * (HD / 64u);
    uint qb4[GQ];
    [[unroll]] for (uint g = 0; g < GQ; g++)
        qb4[g] = (p.q_off + r * p.q_stride + (h0 + min(g, nh - 1u)) * p.head_dim) / 4u;
    const uint DL4 = HD / LP / 4u;               // (LP > 1) vec4 of q a lane keeps: its dims of each head
    uint ld = (lane % LP) * (HD / LP);           // ... from this dim
    vec4 qr[GQ][DL4];
    if (LP > 1u && QSH == 0u) {
        [[unroll]] for (uint g = 0; g < GQ; g++)
            [[unroll]] for (uint i = 0; i < DL4; i++) qr[g][i] = act4[qb4[g] + ld / 4u + i];
    }
    if (LP > 1u && QSH != 0u) {   // (uniform: the workgroup's row and heads)
        for (uint x = gl_LocalInvocationIndex; x < GQ * HD / 4u; x += gl_WorkGroupSize.x)
            sh_q4[x] = act4[qb4[x / (HD / 4u)] + x % (HD / 4u)];
        barrier();
    }
    // this subgroup's positions: ppg consecutive parts of the workgroup's, one range
    uint n_wg = (used + ITEMS_PER_WG - 1u) / ITEMS_PER_WG;   // the row's workgroups with positions
    uint ppg = (ITEMS_PER_WG + gl_NumSubgroups - 1u) / gl_NumSubgroups;
    uint pa = part0 + gl_SubgroupID * ppg;
    uint pb = min(min(used, part0 + ITEMS_PER_WG), pa + ppg);
    vec2 acc[GQ][WPL];
    // (VW: the smallest subgroup the kernel runs with) vec2 of a V row a lane owns at most: 4 a uvec4
    const uint VWD = VW == 0u ? 1u : VW;
    const uint NQW = VW != 0u ? (HD / 8u <= VWD ? 4u : 4u * (HD / 8u) / VWD) : 4u;   // (no array of size 0)
    vec2 accw[GQ][NQW];
    uint lr = min(HD / 8u, S);                   // (VW) lanes a V row
    uint nq = HD / 8u / lr;                      // ... uvec4 of it a lane
    float m[GQ];
    float l[GQ];
    [[unroll]] for (uint g = 0; g < GQ; g++) {
        m[g] = -1.0 / 0.0;
        l[g] = 0.0;
        [[unroll]] for (uint i = 0; i < WPL; i++) acc[g][i] = vec2(0.0);
        [[unroll]] for (uint i = 0; i < NQW; i++) accw[g][i] = vec2(0.0);
    }
    if (pa < pb) {
        uint first = lo + pa * chunk;
        uint last = min(pos, lo + pb * chunk - 1u);
        uvec4 kr[KPF + 1u];   // (KPF) the tile's K row, loaded during the tile before
#if !KV_K_Q8
        if (KPF > 0u && LP == 1u && first + lane <= last) {
            uint k4 = (kb + kv_at(first + lane) * k_row) / 4u;
            [[unroll]] for (uint i = 0u; i < KPF; i++) kr[i] = kv4[k4 + i];
        }
#endif
        for (uint t0 = first; t0 <= last; t0 += S) {
            uint t = t0 + lane;
            uint n_valid = min(S, last + 1u - t0);
            // (VPRE) the tile's first VB V rows, loaded before the scores
            uint vw[VB][WPL];
            if (VPRE != 0u && VW == 0u) [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                uint vrow = vb + kv_at(t0 + jj) * v_row;
#if KV_V_Q8
                uint vsrow = vsb + kv_at(t0 + jj) * s_row;
#endif
                [[unroll]] for (uint i = 0; i < WPL; i++) {
                    uint w = lane + i * S;
#if KV_V_Q8
                    vw[jj][i] = (jj < n_valid && w < hd2) ? kv_q8_pair_word(kv[vrow + w / 2u], kv[vsrow + w / 32u], w) : 0u;
#else
                    vw[jj][i] = (jj < n_valid && w < hd2) ? kv[vrow + w] : 0u;
#endif
                }
            }
#if !KV_V_Q8
            // (VPRE, VW) the tile's first VB x S / lr V rows (its first round of wide loads), before the scores
            uvec4 vpw[VW != 0u && VPRE != 0u ? VB : 1u][NQW / 4u];
            if (VW != 0u && VPRE != 0u) {
                uint R = S / lr, sub = lane / lr, q0 = lane % lr;
                [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                    uint j = jj * R + sub;
                    uint v4 = (vb + kv_at(t0 + min(j, n_valid - 1u)) * v_row) / 4u + q0 * nq;
                    [[unroll]] for (uint u = 0; u < NQW / 4u; u++)
                        vpw[jj][u] = (j < n_valid && u < nq) ? kv4[v4 + u] : uvec4(0u);
                }
            }
#endif
            float s[GQ];
            [[unroll]] for (uint g = 0; g < GQ; g++) s[g] = 0.0;
            if (t <= last) {
                uint k4 = (kb + kv_at(t) * k_row) / 4u;
#if KV_K_Q8
                // per 64 values: a scale word, two blocks of 2 uvec4 of int8 each
                [[unroll]] for (uint u = 0u; u < HD / 64u; u++) {
                    vec2 du = unpackHalf2x16(kv[ksb + kv_at(t) * s_row + u]);
                    [[unroll]] for (uint b = 0u; b < 2u; b++) {
                        uint blk = 2u * u + b;
                        uvec4 k0 = kv4[k4 + 2u * blk], k1 = kv4[k4 + 2u * blk + 1u];
                        vec4 kq[8] = vec4[8](kv_i8x4(k0.x), kv_i8x4(k0.y), kv_i8x4(k0.z), kv_i8x4(k0.w),
                                             kv_i8x4(k1.x), kv_i8x4(k1.y), kv_i8x4(k1.z), kv_i8x4(k1.w));
                        [[unroll]] for (uint g = 0; g < GQ; g++) {
                            uint qa = qb4[g] + 8u * blk;
                            float db = 0.0;
                            [[unroll]] for (uint j = 0u; j < 8u; j++) db += dot(act4[qa + j], kq[j]);
                            s[g] += db * du[b];
                        }
                    }
                }
#else
                if (LP == 1u) {
                    [[unroll]] for (uint i = 0u; i < hd8; i++) {
                        uvec4 kw;
                        if (KPF > 0u) kw = kr[i];
                        else kw = kv4[k4 + i];
                        vec4 ka = vec4(unpackHalf2x16(kw.x), unpackHalf2x16(kw.y));
                        vec4 kc = vec4(unpackHalf2x16(kw.z), unpackHalf2x16(kw.w));
                        [[unroll]] for (uint g = 0; g < GQ; g++)
                            s[g] += dot(act4[qb4[g] + 2u * i], ka) + dot(act4[qb4[g] + 2u * i + 1u], kc);
                    }
                }
#endif
            }
#if !KV_K_Q8
            // the next tile's K rows in flight during this tile's softmax and V rows
            if (KPF > 0u && LP == 1u && t + S <= last) {
                uint k4 = (kb + kv_at(t + S) * k_row) / 4u;
                [[unroll]] for (uint i = 0u; i < KPF; i++) kr[i] = kv4[k4 + i];
            }
            if (LP > 1u) {
                // LP passes: in pass ps the lanes of group lane / LP score position t0 + (lane / LP) * LP + ps,
                // so after the passes lane j holds the score of position t0 + j
                uint grp0 = lane - lane % LP;
                uvec4 kh[KH != 0u ? LP : 1u][DL4 / 2u];
                if (KH != 0u) {   // (past the row's last position: its last row, scored and then masked)
                    [[unroll]] for (uint ps = 0; ps < LP; ps++) {
                        uint k4 = (kb + kv_at(min(t0 + grp0 + ps, last)) * k_row + ld / 2u) / 4u;
                        [[unroll]] for (uint i = 0u; i < DL4 / 2u; i++) kh[ps][i] = kv4[k4 + i];
                    }
                }
                [[unroll]] for (uint ps = 0; ps < LP; ps++) {
                    uint tp = t0 + grp0 + ps;
                    float d[GQ];
                    [[unroll]] for (uint g = 0; g < GQ; g++) d[g] = 0.0;
                    if (KH != 0u || tp <= last) {
                        uint k4 = (kb + kv_at(tp) * k_row + ld / 2u) / 4u;
                        [[unroll]] for (uint i = 0u; i < DL4 / 2u; i++) {
                            uvec4 kw = KH != 0u ? kh[ps][i] : kv4[k4 + i];
                            vec4 ka = vec4(unpackHalf2x16(kw.x), unpackHalf2x16(kw.y));
                            vec4 kc = vec4(unpackHalf2x16(kw.z), unpackHalf2x16(kw.w));
                            [[unroll]] for (uint g = 0; g < GQ; g++) {
                                if (QSH != 0u) {
                                    uint qx = g * (HD / 4u) + ld / 4u + 2u * i;
                                    d[g] += dot(sh_q4[qx], ka) + dot(sh_q4[qx + 1u], kc);
                                } else {
                                    d[g] += dot(qr[g][2u * i], ka) + dot(qr[g][2u * i + 1u], kc);
                                }
                            }
                        }
                    }
                    [[unroll]] for (uint g = 0; g < GQ; g++) {
                        [[unroll]] for (uint o = 1u; o < LP; o <<= 1u) d[g] += subgroupShuffleXor(d[g], o);
                        if (lane % LP == ps) s[g] = d[g];
                    }
                }
            }
#endif
            float e[GQ];
            [[unroll]] for (uint g = 0; g < GQ; g++) {
                float sg = s[g] * p.scale;
                if (p.softcap > 0.0) sg = p.softcap * tanh(clamp(sg / p.softcap, -10.0, 10.0));
                sg = t <= last ? sg : -1.0 / 0.0;
                float m_new = max(m[g], subgroupMax(sg));
                float corr = exp(m[g] - m_new);
                e[g] = t <= last ? exp(sg - m_new) : 0.0;
                l[g] = l[g] * corr + subgroupAdd(e[g]);
                [[unroll]] for (uint i = 0; i < WPL; i++) acc[g][i] *= corr;
                if (VW != 0u) [[unroll]] for (uint i = 0; i < NQW; i++) accw[g][i] *= corr;
                m[g] = m_new;
            }
#if !KV_V_Q8
            if (VW != 0u) {
                // lane group sub = lane / lr takes rows j0 + jj * R + sub, uvec4 q0 * nq .. of each
                uint R = S / lr, sub = lane / lr, q0 = lane % lr;
                for (uint j0 = 0u; j0 < n_valid; j0 += VB * R) {
                    uvec4 vv[VB][NQW / 4u];
                    if (VPRE != 0u && j0 == 0u) {
                        [[unroll]] for (uint jj = 0; jj < VB; jj++)
                            [[unroll]] for (uint u = 0; u < NQW / 4u; u++)
                                vv[jj][u] = vpw[min(jj, VPRE != 0u ? VB - 1u : 0u)][u];
                    } else [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                        uint j = j0 + jj * R + sub;
                        uint v4 = (vb + kv_at(t0 + min(j, n_valid - 1u)) * v_row) / 4u + q0 * nq;
                        [[unroll]] for (uint u = 0; u < NQW / 4u; u++)
                            vv[jj][u] = (j < n_valid && u < nq) ? kv4[v4 + u] : uvec4(0u);
                    }
                    [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                        uint j = j0 + jj * R + sub;
                        [[unroll]] for (uint g = 0; g < GQ; g++) {
                            float ej = subgroupShuffle(e[g], min(j, S - 1u));
                            if (j < n_valid) {
                                [[unroll]] for (uint u = 0; u < NQW / 4u; u++) {
                                    accw[g][4u * u] += ej * unpackHalf2x16(vv[jj][u].x);
                                    accw[g][4u * u + 1u] += ej * unpackHalf2x16(vv[jj][u].y);
                                    accw[g][4u * u + 2u] += ej * unpackHalf2x16(vv[jj][u].z);
                                    accw[g][4u * u + 3u] += ej * unpackHalf2x16(vv[jj][u].w);
                                }
                            }
                        }
                    }
                }
                continue;
            }
#endif
            for (uint j0 = 0u; j0 < n_valid; j0 += VB) {
                if (j0 > 0u || VPRE == 0u) {
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
                }
                [[unroll]] for (uint jj = 0; jj < VB; jj++) {
                    uint src = min(j0 + jj, S - 1u);
                    [[unroll]] for (uint g = 0; g < GQ; g++) {
                        float ej = subgroupShuffle(e[g], src);
                        if (j0 + jj < n_valid) {
                            [[unroll]] for (uint i = 0; i < WPL; i++) acc[g][i] += ej * KV_V_PAIR(vw[jj][i]);
                        }
                    }
                }
            }
        }
    }
    // (VW) the lane groups' sums added: lanes 0 .. lr - 1 hold the head's whole output, uvec4 lane * nq ..
    if (VW != 0u && pa < pb) {
        [[unroll]] for (uint g = 0; g < GQ; g++)
            [[unroll]] for (uint i = 0; i < NQW; i++)
                for (uint o = lr; o < S; o <<= 1u) accw[g][i] += subgroupShuffleXor(accw[g][i], o);
    }
    uint nl = gl_WorkGroupSize.x;
    if (CMB != 0u) {
        // one round: subgroups with positions (those below ITEMS_PER_WG: a subgroup takes a part at least) write
        // their slots, those without write an empty one; each invocation then adds its outputs' slots in order
        uint nsg = min(gl_NumSubgroups, ITEMS_PER_WG);
        uint sg = gl_SubgroupID;
        bool has = pa < pb;
        if (sg < nsg) {
            [[unroll]] for (uint g = 0; g < GQ; g++) {
                uint sl = sg * GQ + g;
                if (lane == 0u) { sh_cm[sl] = has ? m[g] : -1.0 / 0.0; sh_cl[sl] = has ? l[g] : 0.0; }
                if (VW != 0u) {
                    if (lane < lr) [[unroll]] for (uint i = 0; i < NQW; i++) {
                        uint w = lane * nq * 4u + i;
                        if (i < nq * 4u) {
                            sh_co[sl * HD + 2u * w] = has ? accw[g][i].x : 0.0;
                            sh_co[sl * HD + 2u * w + 1u] = has ? accw[g][i].y : 0.0;
                        }
                    }
                } else [[unroll]] for (uint i = 0; i < WPL; i++) {
                    uint w = lane + i * S;
                    if (w < hd2) {
                        sh_co[sl * HD + 2u * w] = has ? acc[g][i].x : 0.0;
                        sh_co[sl * HD + 2u * w + 1u] = has ? acc[g][i].y : 0.0;
                    }
                }
            }
        }
        barrier();
        for (uint x = gl_LocalInvocationIndex; x < nh * HD; x += nl) {
            uint g = x / HD, d = x % HD;
            float M = -1.0 / 0.0;
            for (uint s2 = 0u; s2 < nsg; s2++) M = max(M, sh_cm[s2 * GQ + g]);
            float L = 0.0, o = 0.0;
            for (uint s2 = 0u; s2 < nsg; s2++) {
                float ms = sh_cm[s2 * GQ + g];
                float c = ms > -1.0 / 0.0 ? exp(ms - M) : 0.0;
                L += c * sh_cl[s2 * GQ + g];
                o += c * sh_co[(s2 * GQ + g) * HD + d];
            }
            if (n_wg == 1u) {
                act[p.o_off + r * p.o_stride + (h0 + g) * p.head_dim + d] =
                    gated(o / (L + sink_weight(h0 + g, M)), r, h0 + g, d);
            } else {
                uint b = partial_at(r, h0 + g, blk);
                act[b + 2u + d] = o;
                if (d == 0u) { act[b] = M; act[b + 1u] = L; }
            }
        }
    } else {
        // the workgroup's subgroups combined in shared memory, one at a time in
        // subgroup order: sh_m, sh_l and sh_o hold (max, sum, output scaled to the max)
        for (uint x = gl_LocalInvocationIndex; x < GQ * HD; x += nl) sh_o[x] = 0.0;
        if (gl_LocalInvocationIndex < GQ) { sh_m[gl_LocalInvocationIndex] = -1.0 / 0.0; sh_l[gl_LocalInvocationIndex] = 0.0; }
        barrier();
        for (uint sgi = 0u; sgi < gl_NumSubgroups; sgi++) {
            if (gl_SubgroupID == sgi && pa < pb) {
                [[unroll]] for (uint g = 0; g < GQ; g++) {
                    float mo = sh_m[g];
                    float mn = max(mo, m[g]);
                    float co = mo > -1.0 / 0.0 ? exp(mo - mn) : 0.0;
                    float cn = m[g] > -1.0 / 0.0 ? exp(m[g] - mn) : 0.0;
                    if (VW != 0u) {
                        if (lane < lr) [[unroll]] for (uint i = 0; i < NQW; i++) {
                            uint w = lane * nq * 4u + i;   // (the word of dims 2w, 2w + 1)
                            if (i < nq * 4u) {
                                sh_o[g * HD + 2u * w] = sh_o[g * HD + 2u * w] * co + accw[g][i].x * cn;
                                sh_o[g * HD + 2u * w + 1u] = sh_o[g * HD + 2u * w + 1u] * co + accw[g][i].y * cn;
                            }
                        }
                    } else [[unroll]] for (uint i = 0; i < WPL; i++) {
                        uint w = lane + i * S;
                        if (w < hd2) {
                            sh_o[g * HD + 2u * w] = sh_o[g * HD + 2u * w] * co + acc[g][i].x * cn;
                            sh_o[g * HD + 2u * w + 1u] = sh_o[g * HD + 2u * w + 1u] * co + acc[g][i].y * cn;
                        }
                    }
                    subgroupBarrier();
                    if (subgroupElect()) { sh_l[g] = sh_l[g] * co + l[g] * cn; sh_m[g] = mn; }
                }
            }
            barrier();
        }
        // one workgroup for the row's positions: the output at once; else this
        // workgroup's (max, sum, unnormalized output) per head into slot blk
        for (uint x = gl_LocalInvocationIndex; x < nh * HD; x += nl) {
            uint g = x / HD, d = x % HD;
            if (n_wg == 1u) act[p.o_off + r * p.o_stride + (h0 + g) * p.head_dim + d] =
                gated(sh_o[x] / (sh_l[g] + sink_weight(h0 + g, sh_m[g])), r, h0 + g, d);
            else act[partial_at(r, h0 + g, blk) + 2u + d] = sh_o[x];
        }
        if (n_wg > 1u && gl_LocalInvocationIndex < nh) {
            uint b = partial_at(r, h0 + gl_LocalInvocationIndex, blk);
            act[b] = sh_m[gl_LocalInvocationIndex];
            act[b + 1u] = sh_l[gl_LocalInvocationIndex];
        }
    }
    if (n_wg == 1u) return;                      // written at once (uniform: the row's position)
    // this workgroup's partial visible to the others before it counts itself;
    // the last of the row's workgroups to count merges with all its subgroups
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationIndex == 0u) {
        last_wg = atomicAdd(actu[p.sync_off + rg], 1u) == n_wg - 1u ? 1u : 0u;
        if (last_wg == 1u) actu[p.sync_off + rg] = 0u;
    }
    barrier();
    if (last_wg == 0u) return;
    memoryBarrierBuffer();
    for (uint g = gl_SubgroupID; g < nh; g += gl_NumSubgroups) merge(r, h0 + g, n_wg);
}
