#version 450
// The gated delta rule in chunks, part 1 of 2 (delta_scan.comp is part 2):
// what a chunk of a step's rows needs that does not depend on the recurrent
// state, for all chunks and value heads at once. The chunked (WY / UT
// transform) form of torch_chunk_gated_delta_rule in HF's modeling_qwen3_5.py
// (and tests/reference_hybrid.py delta_rule_chunked): per chunk of C rows of
// one sequence and value head, with G the gates' cumulative sum from the
// chunk's first row (G_i = g_first + ... + g_i, g = A softplus(alpha + dt)):
//   A[i][j] = beta_i (k_i . k_j) e^(G_i - G_j)      j < i, else 0
//   T       = (I + A)^-1                             (unit lower triangular)
//   W       = T (beta k e^G)        [C][dk]          keys that read the state
//   U       = T (beta v)            [C][dv]          values before the state's share
//   Aqk[i][j] = (q_i . k_j) e^(G_i - G_j)            j <= i, else 0
// delta_scan.comp then walks a sequence's chunks in order with the state:
// v' = U - W S, o = scale (e^G q S + Aqk v'), S = e^(G_last) S + (k e^(G_last - G))^T v'.
//
// Chunks here are the step's rows [b C, b C + C); a chunk may hold the end of
// one sequence and the start of the next (rows of a slot are contiguous), so
// every product above is masked to pairs of rows of the same slot and G
// restarts where the slot changes: the chunk's matrices are block diagonal,
// one block a sequence's share. One workgroup a (chunk, value head); outputs
// to the scratch buffer: G [row][nv], W [row][nv][dk], U [row][nv][dv],
// Aqk [row][nv][C] (column j: the chunk's row j).
#include "common.glsl"

#define C 32
#define DKMAX 128

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) readonly buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) buffer Scr { float scr[]; };

layout(push_constant) uniform P {
    uint q_off, k_off, v_off, qkv_stride;
    uint a_off, b_off, ab_stride;
    uint nk, nv, dk, dv, n_rows;
    uint wa_off, wdt_off, slot_off, tiled;
    uint g_off, w_off, u_off, aq_off;
} p;

shared float sk[C][DKMAX + 1];   // the chunk's keys (+1: rows on different banks)
shared float sA[C][C + 1];
shared float sT[C][C + 1];
shared float sg[C], sG[C], sbeta[C];
shared uint sslot[C];

float softplus(float x) { return x > 20.0 ? x : log(1.0 + exp(x)); }

void main() {
    uint wg = workgroup_linear();
    uint blk = wg / p.nv, hv = wg % p.nv;
    uint r0 = blk * C;
    if (r0 >= p.n_rows) return;
    uint nb = min(C, p.n_rows - r0);
    uint hk = p.tiled != 0u ? hv % p.nk : hv / (p.nv / p.nk);
    uint tid = gl_LocalInvocationID.x, NT = gl_WorkGroupSize.x;

    if (tid < C) {
        uint r = r0 + tid;
        bool ok = tid < nb;
        sslot[tid] = ok ? params[p.slot_off + r] : 0xffffffffu - tid;   // past the step: a slot of its own
        float g = 0.0, beta = 0.0;
        if (ok) {
            g = wf[p.wa_off + hv] * softplus(act[p.a_off + r * p.ab_stride + hv] + wf[p.wdt_off + hv]);
            beta = 1.0 / (1.0 + exp(-act[p.b_off + r * p.ab_stride + hv]));
        }
        sg[tid] = g;
        sbeta[tid] = beta;
    }
    uint kb = p.k_off + hk * p.dk;
    // a key dimension an invocation, all C loads issued before the stores (a loop of
    // load-then-store waits on each load)
    for (uint d = tid; d < p.dk; d += NT) {
        float v[C];
        [[unroll]] for (uint i = 0; i < C; i++) v[i] = act[kb + (r0 + min(i, nb - 1u)) * p.qkv_stride + d];
        [[unroll]] for (uint i = 0; i < C; i++) sk[i][d] = i < nb ? v[i] : 0.0;
    }
    barrier();
    // G from the first row of the row's sequence in this chunk
    if (tid < C) {
        uint s = tid;
        while (s > 0u && sslot[s - 1u] == sslot[tid]) s--;
        float G = 0.0;
        for (uint m = s; m <= tid; m++) G += sg[m];
        sG[tid] = G;
        if (tid < nb) scr[p.g_off + (r0 + tid) * p.nv + hv] = G;
    }
    barrier();
    // A (strictly lower) and Aqk (lower, diagonal included), both within a sequence
    uint qb = p.q_off + hk * p.dk;
    for (uint idx = tid; idx < C * C; idx += NT) {
        uint i = idx / C, j = idx % C;
        bool same = i < nb && sslot[i] == sslot[j];
        float a = 0.0, aq = 0.0;
        if (same && j <= i) {
            float dec = exp(sG[i] - sG[j]);
            uint qr = qb + (r0 + i) * p.qkv_stride;
            float kk = 0.0, qk = 0.0;
            for (uint d0 = 0; d0 < p.dk; d0 += 8u) {   // q's loads 8 at a time (dk % 8 == 0)
                float qv[8];
                [[unroll]] for (uint u = 0; u < 8u; u++) qv[u] = act[qr + d0 + u];
                [[unroll]] for (uint u = 0; u < 8u; u++) {
                    float kj = sk[j][d0 + u];
                    kk += sk[i][d0 + u] * kj;
                    qk += qv[u] * kj;
                }
            }
            if (j < i) a = sbeta[i] * kk * dec;
            aq = qk * dec;
        }
        sA[i][j] = a;
        if (i < nb) scr[p.aq_off + ((r0 + i) * p.nv + hv) * C + j] = aq;
    }
    barrier();
    // T = (I + A)^-1 a column at a time: (I + A) T = I gives, below the diagonal,
    // T[i][j] = -sum_{j <= m < i} A[i][m] T[m][j]; a column needs only itself
    if (tid < C) {
        uint j = tid;
        for (uint i = 0; i < j; i++) sT[i][j] = 0.0;
        sT[j][j] = 1.0;
        for (uint i = j + 1u; i < C; i++) {
            float s = 0.0;
            for (uint m = j; m < i; m++) s += sA[i][m] * sT[m][j];
            sT[i][j] = -s;
        }
    }
    barrier();
    // W = T (beta k e^G), U = T (beta v); T is zero between sequences. A key (value)
    // dimension an invocation: the chunk's C inputs of it in registers, then a row
    // of outputs each
    for (uint d = tid; d < p.dk; d += NT) {
        float kv[C];
        [[unroll]] for (uint j = 0; j < C; j++) kv[j] = sbeta[j] * exp(sG[j]) * sk[j][d];
        for (uint i = 0; i < nb; i++) {
            float w = 0.0;
            [[unroll]] for (uint j = 0; j < C; j++) w += sT[i][j] * kv[j];
            scr[p.w_off + ((r0 + i) * p.nv + hv) * p.dk + d] = w;
        }
    }
    uint vb = p.v_off + hv * p.dv;
    for (uint e = tid; e < p.dv; e += NT) {
        float vv[C];
        [[unroll]] for (uint j = 0; j < C; j++) vv[j] = act[vb + (r0 + min(j, nb - 1u)) * p.qkv_stride + e];
        [[unroll]] for (uint j = 0; j < C; j++) vv[j] *= sbeta[j];   // 0 past the step
        for (uint i = 0; i < nb; i++) {
            float u = 0.0;
            [[unroll]] for (uint j = 0; j < C; j++) u += sT[i][j] * vv[j];
            scr[p.u_off + ((r0 + i) * p.nv + hv) * p.dv + e] = u;
        }
    }
}
