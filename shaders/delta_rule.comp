#version 450
// Gated delta rule (Gated DeltaNet, Yang et al. 2024), the recurrence of
// Qwen3.5's linear-attention layers, over the rows of a step. Per value head
// hv and row t of a sequence, with q, k already L2-normalized:
//   g    = A[hv] * softplus(alpha[t][hv] + dt_bias[hv])     (A = -exp(A_log) < 0)
//   beta = sigmoid(beta_raw[t][hv])
//   S    = exp(g) * S                                        S: [dk][dv], fp32
//   S   += k (beta * (v - S^T k))^T                          (the delta rule)
//   o    = scale * S^T q                                     scale = 1/sqrt(dk)
// as torch_recurrent_gated_delta_rule in HF's modeling_qwen3_5.py and
// build_delta_net_autoregressive in llama.cpp's delta-net-base.cpp.
//
// Columns of S (one per value dimension j) evolve independently, so one
// subgroup owns one column of one head of one sequence, its dk entries spread
// over the lanes (coalesced: the state is stored [head][j][i], i fastest), and
// walks that sequence's rows in order with the column in registers: a prefill
// chunk costs one state load and one store per column (batched-sequential;
// the chunked WY form is not needed for correctness). The walk is bound by
// latency, not arithmetic: the run's first and last rows are found at once (a
// ballot over a subgroup's width of rows), each row's inputs (k, q, v, the
// gate and beta) are loaded one row ahead, and a row's three dot products
// reduce together, so a row waits for one reduction, not for memory (H200,
// qwen35 0.8B, 512 prompt rows: 1.15 ms a layer with a dependent load chain a
// row, notes.md run 27). Rows of a slot must be contiguous and consecutive in
// position (the host checks); a sequence whose first row is at position 0
// starts from S = 0. The grid has one group of nv*dv subgroups per possible
// sequence in the step; group g takes the g-th run of equal slots.
// Snapshots: with snap_rows > 0, S after row r < snap_rows is also written to
// snapshot r (speculative decoding rolls back to it).
// qk_norm != 0: q and k arrive raw and are L2-normalized here (as l2_norm.comp:
// x / sqrt(|x|^2 + qk_eps)), their squared norms reduced beside the row's dot
// products, which are scaled instead of the vectors: one dispatch and barrier
// less a layer (the decode step's l2_norm; the chunked prompt form keeps it).
// Key heads serve nv/nk value heads each: hv -> hv % nk when `tiled` (GGUF,
// llama.cpp's converter reorders value heads so ggml can broadcast), else
// hv / (nv/nk) (Hugging Face's repeat_interleave).
// GNORM (decode and verify steps): the gated RMSNorm that closes the block
// (gated_rms_norm.comp) by the subgroup that finishes a (sequence, head) last:
// each subgroup writes its column's outputs through a coherent binding of the
// activations (4) and counts itself on a zeroed word (sync_off + sequence *
// nv + head); the one that brings it to dv reads the head's dv outputs of
// each of the sequence's rows and writes y = gated norm of them in place
// (gnorm.glsl, gated_rms_norm.comp's arithmetic), then zeroes the word: one
// dispatch and barrier less a layer.
#extension GL_KHR_shader_subgroup_ballot : require
#include "common.glsl"
#ifdef GNORM
#include "gnorm.glsl"
#endif

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) buffer State { float st[]; };
#ifdef GNORM
layout(binding = 4) coherent buffer ActC { float actc[]; };
layout(binding = 4) coherent buffer ActCu { uint actcu[]; };
#endif

layout(push_constant) uniform P {
    uint q_off, k_off, v_off, qkv_stride;
    uint a_off, b_off, ab_stride;
    uint o_off, o_stride;
    uint nk, nv, dk, dv, n_rows, n_groups;   // n_groups: sequences the grid covers
    uint wa_off, wdt_off;
    uint state_off, slot_stride, snap_off, snap_rows;
    uint pos_off, slot_off, tiled;
    float scale;
    uint qk_norm;
    float qk_eps;
#ifdef GNORM
    uint z_off, z_stride, gw_off, sync_off;
    float g_eps;
#endif
} p;

// state entries per lane: dk / subgroup size (dk <= 128 on subgroups of 8); the "_e4" variants hold 4
// (dk <= 128 on subgroups of 32): every array below is MAXE registers a lane whatever dk is, and fewer
// registers keep more subgroups resident (the sums are the same: entries past dk add zeros)
#ifndef MAXE
#define MAXE 16
#endif
// COLS: columns a subgroup owns (consecutive j of one head of one sequence; dv a multiple of it): their
// state entries side by side, the row's k, q, gate and beta loaded once for all, their reductions
// independent (in flight together). Each column's arithmetic is the one-column kernel's, so the results
// are the same bits: the products and sums below are explicit fma(), so that no compiler contracts
// a*b + c*d one way in one form and another in the other (the H100 failed the forms' same-bits test
// before). The "_c2" / "_c4" variants: decode steps of several sequences, where a column a subgroup made
// a 4-sequence step two waves of subgroups (nv x dv x 4 of them) of short dependent chains.
#ifndef COLS
#define COLS 1
#endif

float softplus(float x) { return x > 20.0 ? x : log(1.0 + exp(x)); }

void main() {
    const uint dvc = p.dv / COLS;                // column groups of a head
    uint per_group = p.nv * dvc;
    uint lane = gl_SubgroupInvocationID;
    uint S = gl_SubgroupSize;
    uvec2 items = workgroup_items(p.n_groups * per_group);
    for (uint it = items.x + gl_SubgroupID; it < items.y; it += gl_NumSubgroups) {
        uint grp = it / per_group;
        uint hv = (it % per_group) / dvc;
        uint j0 = (it % dvc) * COLS;             // the first of its columns
        // the grp-th run of equal slots, rows [start, end): boundaries are the rows r >= 1 whose slot differs
        // from row r - 1's; run g starts at boundary g (run 0 at row 0) and ends at boundary g + 1 (or
        // n_rows). One ballot a subgroup's width of rows finds both (a step of up to S + 1 rows: one round
        // of loads), where a loop over the rows found the start one dependent load after another
        uint start = grp == 0u ? 0u : ~0u, end = p.n_rows;
        uint found = 0u;
        for (uint r0 = 1u; r0 < p.n_rows; r0 += S) {
            uint r = r0 + lane;
            bool bnd = r < p.n_rows && params[p.slot_off + r] != params[p.slot_off + r - 1u];
            uvec4 bal = subgroupBallot(bnd);
            uint nth = found + subgroupBallotInclusiveBitCount(bal);   // boundaries up to this lane's row
            uvec4 hs = subgroupBallot(bnd && nth == grp);
            if (grp > 0u && hs != uvec4(0u)) start = r0 + subgroupBallotFindLSB(hs);
            uvec4 he = subgroupBallot(bnd && nth == grp + 1u);
            if (he != uvec4(0u)) {
                end = r0 + subgroupBallotFindLSB(he);
                break;
            }
            found += subgroupBallotBitCount(bal);
        }
        if (start >= p.n_rows) continue;   // (fewer runs than groups; ~0u: not found)
        uint slot = params[p.slot_off + start];
        uint hk = p.tiled != 0u ? hv % p.nk : hv / (p.nv / p.nk);
        uint col0 = p.state_off + slot * p.slot_stride + (hv * p.dv + j0) * p.dk;   // column c at col0 + c * dk
        bool fresh = params[p.pos_off + start] == 0u;
        float s[COLS][MAXE];
        [[unroll]] for (uint c = 0; c < COLS; c++)
            [[unroll]] for (uint e = 0; e < MAXE; e++) {
                uint i = lane + e * S;
                s[c][e] = (i < p.dk && !fresh) ? st[col0 + c * p.dk + i] : 0.0;
            }
        float A = wf[p.wa_off + hv];
        float dtb = wf[p.wdt_off + hv];
        // row inputs, loaded a row ahead of their use
        float kn[MAXE], qn[MAXE];
        float vn[COLS];
        float an, bn;
#define LOAD_ROW(r) { \
            uint kb_ = p.k_off + (r) * p.qkv_stride + hk * p.dk, qb_ = p.q_off + (r) * p.qkv_stride + hk * p.dk; \
            [[unroll]] for (uint e = 0; e < MAXE; e++) { \
                uint i = lane + e * S; \
                kn[e] = i < p.dk ? act[kb_ + i] : 0.0; \
                qn[e] = i < p.dk ? act[qb_ + i] : 0.0; \
            } \
            [[unroll]] for (uint c = 0; c < COLS; c++) vn[c] = act[p.v_off + (r) * p.qkv_stride + hv * p.dv + j0 + c]; \
            an = act[p.a_off + (r) * p.ab_stride + hv]; \
            bn = act[p.b_off + (r) * p.ab_stride + hv]; }
        LOAD_ROW(start)
        for (uint r = start; r < end; r++) {
            float kk[MAXE], qq[MAXE];
            [[unroll]] for (uint e = 0; e < MAXE; e++) { kk[e] = kn[e]; qq[e] = qn[e]; }
            float decay = exp(A * softplus(an + dtb));
            float beta = 1.0 / (1.0 + exp(-bn));
            float vr[COLS];
            [[unroll]] for (uint c = 0; c < COLS; c++) vr[c] = vn[c];
            if (r + 1u < end) LOAD_ROW(r + 1u)
            // S^T k, S^T q (before the decay) and k.q: independent reductions at once, so a
            // row waits for one reduction's latency: with S' = decay S + k delta^T,
            // S'^T q = decay S^T q + (k.q) delta
            float ks[COLS], qs[COLS];
            float qk = 0.0, k2 = 0.0, q2 = 0.0;
            [[unroll]] for (uint c = 0; c < COLS; c++) { ks[c] = 0.0; qs[c] = 0.0; }
            [[unroll]] for (uint e = 0; e < MAXE; e++) {
                [[unroll]] for (uint c = 0; c < COLS; c++) {
                    ks[c] = fma(s[c][e], kk[e], ks[c]);
                    qs[c] = fma(s[c][e], qq[e], qs[c]);
                }
                qk = fma(kk[e], qq[e], qk);
                k2 = fma(kk[e], kk[e], k2);
                q2 = fma(qq[e], qq[e], q2);
            }
            [[unroll]] for (uint c = 0; c < COLS; c++) {
                ks[c] = subgroupAdd(ks[c]);
                qs[c] = subgroupAdd(qs[c]);
            }
            qk = subgroupAdd(qk);
            if (p.qk_norm != 0u) {
                float ik = inversesqrt(subgroupAdd(k2) + p.qk_eps), iq = inversesqrt(subgroupAdd(q2) + p.qk_eps);
                [[unroll]] for (uint c = 0; c < COLS; c++) {
                    ks[c] *= ik;
                    qs[c] *= iq;
                }
                qk *= ik * iq;
                [[unroll]] for (uint e = 0; e < MAXE; e++) kk[e] *= ik;
            }
            [[unroll]] for (uint c = 0; c < COLS; c++) {
                float delta = fma(-decay, ks[c], vr[c]) * beta;
                [[unroll]] for (uint e = 0; e < MAXE; e++) s[c][e] = fma(kk[e], delta, s[c][e] * decay);
                float o = fma(qk, delta, decay * qs[c]);
#ifdef GNORM
                if (subgroupElect()) actc[p.o_off + r * p.o_stride + hv * p.dv + j0 + c] = o * p.scale;
#else
                if (subgroupElect()) act[p.o_off + r * p.o_stride + hv * p.dv + j0 + c] = o * p.scale;
#endif
            }
            if (r < p.snap_rows) {
                uint sc = p.snap_off + r * p.slot_stride + (hv * p.dv + j0) * p.dk;
                [[unroll]] for (uint c = 0; c < COLS; c++)
                    [[unroll]] for (uint e = 0; e < MAXE; e++) {
                        uint i = lane + e * S;
                        if (i < p.dk) st[sc + c * p.dk + i] = s[c][e];
                    }
            }
        }
        [[unroll]] for (uint c = 0; c < COLS; c++)
            [[unroll]] for (uint e = 0; e < MAXE; e++) {
                uint i = lane + e * S;
                if (i < p.dk) st[col0 + c * p.dk + i] = s[c][e];
            }
#ifdef GNORM
        memoryBarrierBuffer();   // (these columns' outputs before the count)
        uint cw = p.sync_off + grp * p.nv + hv;
        uint before = 0u;
        if (subgroupElect()) before = atomicAdd(actcu[cw], uint(COLS));
        if (subgroupBroadcastFirst(before) == p.dv - COLS) {
            memoryBarrierBuffer();
            for (uint r = start; r < end; r++) {
                uint xb = p.o_off + r * p.o_stride + hv * p.dv;
                uint zb = p.z_off + r * p.z_stride + hv * p.dv;
#define GX(i) actc[xb + (i)]
#define GZ(i) act[zb + (i)]
#define GW(i) wf[p.gw_off + (i)]
#define GY(i, v) actc[xb + (i)] = (v)
                GNORM_HEAD(GX, GZ, GW, GY, p.dv, p.g_eps)
            }
            if (subgroupElect()) actcu[cw] = 0u;
        }
#endif
    }
}
