#version 450
// Causal attention of prompt-sized steps on cooperative matrices (flash
// attention): the same contract as attention.comp without split-K (query row r
// of slot params[slot_off + r] at position params[pos_off + r] attends to
// positions 0..pos of its slot), for head_dim HD (a multiple of 16;
// shaders/variants.py ATTN_MC_HEAD_DIMS lists those compiled).
//
// A workgroup is NSG subgroups of 32 lanes (Kernels.coopmat checks the device)
// on one KV head (gl_WorkGroupID.y). Its query heads' 16-row blocks, counted
// (row block, head within the KV group) with the head fastest, are dealt NSG
// to a workgroup (gl_WorkGroupID.x): the subgroups of a workgroup share each
// staged block of keys and values, which is loaded once (a KV group of 4+
// heads: 4 heads of the same rows; one head: 4 consecutive row blocks). Per
// block of BC positions (the next block's loads in flight meanwhile), each
// subgroup, on its 16 rows:
//   S^T = K Q^T (BC x 16, fp32 sums of f16 products; its Q^T operands stay in
//   registers), written to its shared scores;
//   two lanes per row take the online softmax step and write the
//   probabilities P as halves;
//   O^T += V^T P^T (HD x 16, fp32 accumulators kept in registers).
// The running max m of a row only moves when a block's max exceeds it by more
// than RESCALE_SLACK (P then stays below e^8, well inside fp16): the O columns
// are rescaled (through shared memory, one 16 x 16 tile at a time) only in the
// blocks where some row's m moved, which after the first blocks is rare.
// Both products are written transposed so that every A operand is used by one
// multiply-add (the B operands by several): on the H200 that ran 3-18% faster
// than S = Q K^T, O += P V (bench/attn_probe.py), as mul_mc's layouts that
// reuse A operands ran 2-3x slower than those that reuse B.
// A workgroup whose rows belong to several slots (mixed server steps) runs one
// pass per slot, each row masked out of the others' passes.
// With DS > 1 (head sizes whose accumulators and Q^T operands would not fit a
// lane's registers: 256), DS consecutive subgroups take one 16-row block, each
// HD / DS of its dims: each computes its dims' share of S^T, the shares are
// summed through shared memory in a fixed order (so every subgroup of the
// block computes bit-identical probabilities), and each accumulates its own
// dims of O^T. Two workgroup barriers a block more.
// SPLIT (prompt rows at depth: too few workgroups for the GPU, each walking
// every key, ran at a tenth of the big prompt's FLOP rate on the H200): the
// positions a pass of the workgroup walks, [kstart, kend), are cut into
// n_parts pieces of whole BC blocks, gl_WorkGroupID.z taking the z-th (so the
// parts follow the rows' actual positions, not the cache's length), and
// instead of O / l it writes O, m and l unnormalized to `part` ([z][row][head]
// x (HD + 2) floats at part_off; m = -inf, l = 0 where the piece holds none of
// a row's positions); attention_merge.comp then combines a row's parts
// (flash-decoding's split K).
// fp16 Q and P round to 11 significant bits, as llama.cpp's coopmat flash
// attention does; S, the softmax and O stay fp32. Compiled by the newer glslc
// (scripts/glslc-ext.sh).
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_ballot : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require
#include "kv.glsl"   // the KV cache's layouts: f16 or q8_0 (KV_K_Q8, KV_V_Q8), dequantized as staged

#ifndef HD
#define HD 128
#endif
#ifndef BC
#define BC 32                 // positions per block
#endif
#ifndef NSG
#define NSG 4                 // subgroups per workgroup
#endif
#ifndef DS
#define DS 1                  // subgroups a 16-row block (each on HD / DS dims)
#endif
#define WG (32 * NSG)
#define HDS (HD / DS)         // dims a subgroup accumulates
#define RB (NSG / DS)         // 16-row blocks a workgroup

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

// q and the output: the same activation buffer bound twice (q readonly)
layout(binding = 0) writeonly restrict buffer Out { float act[]; };
layout(binding = 1) readonly restrict buffer Q4 { vec4 act4[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) readonly restrict buffer Kv4 { uvec4 kv4[]; };
layout(binding = 4) readonly buffer Sinks { float sinks[]; };
#ifdef SPLIT
layout(binding = 5) writeonly buffer Part { float part[]; };
#endif

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
    // sliding-window layers: a row at position pos sees pos - window + 1 .. pos
    // (0: all of 0..pos); softcap > 0: scores become softcap * tanh(score /
    // softcap) (Gemma 2)
    uint window;
    float softcap;
    uint ring;   // kv_at
    uint sink_off;   // sink_weight
#ifdef SPLIT
    uint n_parts, part_off;
#endif
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

#define LDH (HD + 8)          // halves per staged row (16-byte aligned, no bank conflicts)
#define LDU (LDH / 8)         // the same in uvec4
#define LDS (BC + 4)          // floats per score row (also a 16 x 16 float tile's scratch)
#define LDP (BC + 8)          // halves per probability row
#define HU (HD / 8)           // uvec4 of a key or value row
#define STAGE (BC * HU / WG)  // uvec4 of keys (and of values) a lane stages per block
#define RESCALE_SLACK 8.0

#if (BC * HU) % WG != 0 || BC % 16 != 0 || 2 * BC < 16 * NSG || NSG % DS != 0 || HDS % 16 != 0
#error "BC x HD must split evenly over the workgroup, the staging area must hold NSG x 16 query rows, and DS divide NSG and HD / 16"
#endif

// keys at KV[0 ..), values at KV[BC * LDU ..); before the first block each
// subgroup's 16 query rows (as halves) at KV[sg * 16 * LDU ..)
shared uvec4 KV[2 * BC * LDU];
shared float Ss[NSG * 16 * LDS];        // per subgroup: S (position-major per row), then tile scratch
shared f16vec4 Ps[NSG * 16 * LDP / 4];  // per subgroup: P as halves
shared float As[NSG * 16];              // per subgroup and row: the block's rescale factor, at the end 1 / l
shared uint pass_slot[NSG], pass_end[NSG], pass_start[NSG];

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>
#define NEG_INF (-1.0 / 0.0)

void main() {
    uint lid = gl_LocalInvocationID.x;
    uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    uint kvh = gl_WorkGroupID.y;
    uint grp = p.n_head / p.n_kv;
    uint n_rb = (p.n_rows + 15u) / 16u;
    uint qi = gl_WorkGroupID.x * RB + sg / DS;  // this subgroup's (row block, head in group)
    uint dq = (sg % DS) * (HDS / 8u);           // its dims' first uvec4 of a staged row
    bool sg_live = qi < n_rb * grp;
    uint row0 = (qi / grp) * 16u;
    uint h = kvh * grp + qi % grp;
    uint hd2 = HD / 2u;
    uint row_words = p.n_kv * hd2;
    uint s_base = sg * 16u * LDS, p_base = sg * 16u * LDP / 4u, a_base = sg * 16u;

    // two lanes per row: r = lane / 2 owns half hf of the row's positions within a block
    uint r = lane >> 1, hf = lane & 1u;
    uint row = row0 + r;
    bool live = sg_live && row < p.n_rows;
    uint my_pos = live ? params[p.pos_off + row] : 0u;
    uint my_slot = live ? params[p.slot_off + row] : 0u;
    uint my_lo = p.window != 0u && my_pos >= p.window ? my_pos + 1u - p.window : 0u;   // its first position

    // queries -> halves in the staging area (rows past n_rows: zeros) -> Q^T operands
    uint q_base = sg * 16u * LDU;
    for (uint i = lane; i < 16u * HU; i += 32u) {
        uint rr = i / HU, c = i % HU;
        uvec4 u = uvec4(0u);
        if (sg_live && row0 + rr < p.n_rows) {
            uint b = (p.q_off + (row0 + rr) * p.q_stride + h * HD) / 4u + 2u * c;
            vec4 a = act4[b], bb = act4[b + 1u];
            u = uvec4(packHalf2x16(a.xy), packHalf2x16(a.zw), packHalf2x16(bb.xy), packHalf2x16(bb.zw));
        }
        KV[q_base + rr * LDU + c] = u;
    }
    subgroupBarrier();
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> qb[HDS / 16];   // Q^T (its dims)
    [[unroll]] for (uint i = 0; i < HDS / 16u; i++)
        coopMatLoad(qb[i], KV, q_base + dq + i * 2u, LDU, gl_CooperativeMatrixLayoutColumnMajor);
    ACC o[HDS / 16];                                                                // O^T (its dims)
    [[unroll]] for (uint j = 0; j < HDS / 16u; j++) o[j] = ACC(0.0);

    float m = NEG_INF, l = 0.0;
    bool done = !live;
    uvec4 kr[STAGE], vr[STAGE];
    while (true) {
        // the pass's slot: the smallest among the workgroup's rows not yet done
        uint cand = subgroupMin(done ? 0xffffffffu : my_slot);
        if (lane == 0u) pass_slot[sg] = cand;
        barrier();
        uint slot = pass_slot[0];
        [[unroll]] for (uint s = 1; s < NSG; s++) slot = min(slot, pass_slot[s]);
        if (slot == 0xffffffffu) break;
        bool act_row = !done && my_slot == slot;
        bool sg_act = subgroupAny(act_row);
        uint sg_end = sg_act ? subgroupMax(act_row ? my_pos : 0u) + 1u : 0u;   // positions this subgroup needs
        uint sg_start = subgroupMin(act_row ? my_lo : 0xffffffffu);           // (from; past sg_end if none)
        if (lane == 0u) { pass_end[sg] = sg_end; pass_start[sg] = sg_start; }
        barrier();
        uint kend = pass_end[0], kstart = pass_start[0];
        [[unroll]] for (uint s = 1; s < NSG; s++) { kend = max(kend, pass_end[s]); kstart = min(kstart, pass_start[s]); }
#ifdef SPLIT
        {   // this part's piece of the pass's positions only
            uint plen = ((kend - kstart + p.n_parts - 1u) / p.n_parts + BC - 1u) / BC * BC;
            uint k0 = kstart;
            kstart = min(k0 + gl_WorkGroupID.z * plen, kend);
            kend = min(kend, k0 + (gl_WorkGroupID.z + 1u) * plen);
        }
#endif
        // K_AT(t, c), V_AT(t, c): halves 8c .. 8c+7 of position t's row as a
        // uvec4, loaded as they are (f16) or dequantized (q8_0, kv.glsl: the
        // uvec4 of quants that holds them and their scale word)
        KvSlot sl = kv_slot(p.slot_stride, p.n_kv, HD);
        uint rw4 = row_words / 4u;           // uvec4 of an f16 position
        uint qw4 = p.n_kv * (HD / 16u);      // of a q8_0 position's quants
        uint sw = p.n_kv * (HD / 64u);       // words of a q8_0 position's scales
#if KV_K_Q8
        uint kbase = (p.k_off + slot * sl.k_stride + kvh * (HD / 4u)) / 4u;
        uint kscale = p.k_off + slot * sl.k_stride + sl.k_scales + kvh * (HD / 64u);
#define K_AT(t, c) kv_q8_halves8(kv4[kbase + kv_at(t) * qw4 + (c) / 2u], (c), KV_WORD(kscale + kv_at(t) * sw + (c) / 8u))
#else
        uint kbase = (p.k_off + slot * sl.k_stride + kvh * hd2) / 4u;
#define K_AT(t, c) kv4[kbase + kv_at(t) * rw4 + (c)]
#endif
#if KV_V_Q8
        uint vbase = (p.v_off + slot * sl.v_stride + kvh * (HD / 4u)) / 4u;
        uint vscale = p.v_off + slot * sl.v_stride + sl.v_scales + kvh * (HD / 64u);
#define V_AT(t, c) kv_q8_halves8(kv4[vbase + kv_at(t) * qw4 + (c) / 2u], (c), KV_WORD(vscale + kv_at(t) * sw + (c) / 8u))
#else
        uint vbase = (p.v_off + slot * sl.v_stride + kvh * hd2) / 4u;
#define V_AT(t, c) kv4[vbase + kv_at(t) * rw4 + (c)]
#endif
#define KV_WORD(w) kv4[(w) / 4u][(w) % 4u]

        // the first block's keys and values (positions from kend on: zeros)
        [[unroll]] for (uint k = 0; k < STAGE; k++) {
            uint i = lid + k * WG, t = kstart + i / HU, c = i % HU;
            bool ok = t < kend;
            kr[k] = ok ? K_AT(t, c) : uvec4(0u);
            vr[k] = ok ? V_AT(t, c) : uvec4(0u);
        }
        for (uint t0 = kstart; t0 < kend; t0 += BC) {
            barrier();   // the previous block (or the queries) read from the staging area
            [[unroll]] for (uint k = 0; k < STAGE; k++) {
                uint i = lid + k * WG, t = i / HU, c = i % HU;
                KV[t * LDU + c] = kr[k];
                KV[BC * LDU + t * LDU + c] = vr[k];
            }
            barrier();
            if (t0 + BC < kend) {   // the next block's loads, in flight during this one
                [[unroll]] for (uint k = 0; k < STAGE; k++) {
                    uint i = lid + k * WG, t = t0 + BC + i / HU, c = i % HU;
                    bool ok = t < kend;
                    kr[k] = ok ? K_AT(t, c) : uvec4(0u);
                    vr[k] = ok ? V_AT(t, c) : uvec4(0u);
                }
            }
            bool go = sg_act && t0 < sg_end && t0 + BC > sg_start;   // subgroup-uniform: something of this block for its rows
#if DS == 1
            if (!go) continue;
#endif
            // S^T = K Q^T (its dims' share), 16 positions at a time: each A (keys) used once
            if (go) {
                [[unroll]] for (uint c = 0; c < BC / 16u; c++) {
                    ACC s = ACC(0.0);
                    [[unroll]] for (uint i = 0; i < HDS / 16u; i++) {
                        coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ka;
                        coopMatLoad(ka, KV, c * 16u * LDU + dq + i * 2u, LDU, gl_CooperativeMatrixLayoutRowMajor);
                        s = coopMatMulAdd(ka, qb[i], s);
                    }
                    coopMatStore(s, Ss, s_base + c * 16u, LDS, gl_CooperativeMatrixLayoutColumnMajor);
                }
            }
#if DS == 1
            subgroupBarrier();
#else
            barrier();   // every share of the block's S^T written
#endif
            // online softmax of row r over this block, half hf of its positions
            const uint HB = BC / 2u;
            float sv[HB];
            float bm = NEG_INF;
            [[unroll]] for (uint j = 0; j < HB; j++) {
                uint t = hf * HB + j;
                bool ok = go && act_row && t0 + t <= my_pos && t0 + t >= my_lo;
#ifdef SPLIT
                ok = ok && t0 + t < kend;   // the part ends inside a row's range (its last block's tail)
#endif
#if DS == 1
                float sc = Ss[s_base + r * LDS + t] * p.scale;
#else
                // the shares in subgroup order: the same sum in every subgroup of the block
                uint s0 = (sg - sg % DS) * 16u * LDS + r * LDS + t;
                float sum = Ss[s0];
                [[unroll]] for (uint d = 1; d < DS; d++) sum += Ss[s0 + d * 16u * LDS];
                float sc = sum * p.scale;
#endif
                if (p.softcap > 0.0) sc = p.softcap * tanh(clamp(sc / p.softcap, -10.0, 10.0));
                sv[j] = ok ? sc : NEG_INF;
                bm = max(bm, sv[j]);
            }
#if DS > 1
            barrier();   // the shares read: Ss is the rescale's scratch below
            if (!go) continue;
#endif
            bm = max(bm, subgroupShuffleXor(bm, 1u));
            float alpha = 1.0;
            if (bm > m + RESCALE_SLACK) {   // also the row's first block (m = -inf); never for masked rows
                alpha = exp(m - bm);         // 0 while m is -inf (O and l are zero then)
                m = bm;
            }
            float ls = 0.0;
            if (m > NEG_INF) {
                [[unroll]] for (uint j = 0; j < HB; j++) {
                    sv[j] = exp(sv[j] - m);   // masked: exp(-inf) = 0
                    ls += sv[j];
                }
            } else {
                [[unroll]] for (uint j = 0; j < HB; j++) sv[j] = 0.0;
            }
            ls += subgroupShuffleXor(ls, 1u);
            l = l * alpha + ls;
            [[unroll]] for (uint j = 0; j < HB; j += 4u)
                Ps[p_base + (r * LDP + hf * HB + j) / 4u] = f16vec4(sv[j], sv[j + 1u], sv[j + 2u], sv[j + 3u]);
            // rescale the O^T columns of rows whose max moved (not a row's first
            // block: its column is still zero), one 16 x 16 tile at a time
            bool moved = alpha != 1.0 && alpha > 0.0;
            if (subgroupAny(moved)) {
                if (hf == 0u) As[a_base + r] = alpha > 0.0 ? alpha : 1.0;
                [[unroll]] for (uint j = 0; j < HDS / 16u; j++) {
                    subgroupBarrier();
                    coopMatStore(o[j], Ss, s_base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
                    subgroupBarrier();
                    for (uint e = lane; e < 256u; e += 32u) Ss[s_base + e] *= As[a_base + e / 16u];
                    subgroupBarrier();
                    coopMatLoad(o[j], Ss, s_base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
                }
            }
            subgroupBarrier();
            // O^T += V^T P^T: each A (V^T) used once, each B (P^T) for every 16 dims
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> pb[BC / 16];
            [[unroll]] for (uint c = 0; c < BC / 16u; c++)
                coopMatLoad(pb[c], Ps, p_base + c * 4u, LDP / 4u, gl_CooperativeMatrixLayoutColumnMajor);
            [[unroll]] for (uint j = 0; j < HDS / 16u; j++) {
                [[unroll]] for (uint c = 0; c < BC / 16u; c++) {
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> va;
                    coopMatLoad(va, KV, BC * LDU + c * 16u * LDU + dq + j * 2u, LDU,
                                gl_CooperativeMatrixLayoutColumnMajor);
                    o[j] = coopMatMulAdd(va, pb[c], o[j]);
                }
            }
            subgroupBarrier();   // Ss and Ps are rewritten by the next block
        }
        done = done || act_row;
    }
    if (!sg_live) return;
#ifdef SPLIT
    // O, m and l of this part as they are (attention_merge.comp normalizes)
    uint pbase = p.part_off + ((gl_WorkGroupID.z * p.n_rows + row0) * p.n_head + h) * (HD + 2u);
    uint prow = p.n_head * (HD + 2u);   // a row's stride in part
    if (hf == 0u && row0 + r < p.n_rows) {
        part[pbase + r * prow + HD] = m;
        part[pbase + r * prow + HD + 1u] = l;
    }
    [[unroll]] for (uint j = 0; j < HDS / 16u; j++) {
        subgroupBarrier();
        coopMatStore(o[j], Ss, s_base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
        subgroupBarrier();
        for (uint e = lane; e < 256u; e += 32u) {
            uint rr = e / 16u, d = e % 16u;
            if (row0 + rr < p.n_rows) part[pbase + rr * prow + dq * 8u + j * 16u + d] = Ss[s_base + e];
        }
    }
    return;
#endif
    // O / l, one 16 x 16 tile (16 dims of the 16 rows) at a time
    if (hf == 0u) {
        float den = l + (l > 0.0 ? sink_weight(h, m) : 0.0);
        As[a_base + r] = den > 0.0 ? 1.0 / den : 0.0;
    }
    [[unroll]] for (uint j = 0; j < HDS / 16u; j++) {
        subgroupBarrier();
        coopMatStore(o[j], Ss, s_base, 16u, gl_CooperativeMatrixLayoutColumnMajor);
        subgroupBarrier();
        for (uint e = lane; e < 256u; e += 32u) {
            uint rr = e / 16u, d = e % 16u;
            if (row0 + rr < p.n_rows)
                act[p.o_off + (row0 + rr) * p.o_stride + h * HD + dq * 8u + j * 16u + d] =
                    Ss[s_base + e] * As[a_base + rr];
        }
    }
}
