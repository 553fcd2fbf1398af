#version 450
// The gated delta rule in chunks, part 2 of 2 (delta_chunk.comp, part 1, made
// G, W, U and Aqk for every chunk): each sequence's chunks in order, with its
// recurrent state S [dk][dv] held in shared memory, DVB of its value columns
// a workgroup (columns of S evolve independently). Per chunk, over the rows
// [lo, hi) of this sequence in it:
//   v'   = U - W S                              [rows][DVB]
//   o    = scale (e^G (q S) + Aqk v')            (Aqk: lower triangular, this sequence's rows)
//   S    = e^(G_last) S + (k e^(G_last - G))^T v'
// which is delta_rule.comp's recurrence a chunk at a time: a row's work no
// longer waits on the row before it, only a chunk's on the chunk before.
// One group of nv * ceil(dv / DVB) workgroups per possible sequence of the
// step; group g takes the g-th run of equal slots (as delta_rule.comp).
// Snapshots (speculative steps) are delta_rule.comp's alone.
#include "common.glsl"

#define C 32
#define DKMAX 128
#define DVB 16

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Params { uint params[]; };
layout(binding = 2) buffer State { float st[]; };
layout(binding = 3) readonly buffer Scr { float scr[]; };

layout(push_constant) uniform P {
    uint q_off, k_off, qkv_stride;
    uint o_off, o_stride;
    uint nk, nv, dk, dv, n_rows, n_groups;
    uint state_off, slot_stride, pos_off, slot_off, tiled;
    uint g_off, w_off, u_off, aq_off;
    float scale;
} p;

shared float sS[DKMAX][DVB + 1];
shared float snew[C][DVB];
shared float sqs[C][DVB];
shared float sG[C], sdec[C];

void main() {
    uint nvb = (p.dv + DVB - 1u) / DVB;
    uint wg = workgroup_linear();
    uint grp = wg / (p.nv * nvb);
    uint hv = (wg / nvb) % p.nv;
    uint j0 = (wg % nvb) * DVB;
    uint nj = min(DVB, p.dv - j0);
    uint tid = gl_LocalInvocationID.x, NT = gl_WorkGroupSize.x;
    if (grp >= p.n_groups) return;
    // the grp-th run of equal slots: rows [start, end) (the same for every invocation)
    uint start = 0u;
    if (grp > 0u) {
        uint found = 0u;
        for (uint r = 1u; r < p.n_rows; r++) {
            if (params[p.slot_off + r] != params[p.slot_off + r - 1u]) {
                found++;
                if (found == grp) { start = r; break; }
            }
        }
        if (found < grp) return;
    }
    uint slot = params[p.slot_off + start];
    uint end = start + 1u;
    while (end < p.n_rows && params[p.slot_off + end] == slot) end++;
    bool fresh = params[p.pos_off + start] == 0u;
    uint hk = p.tiled != 0u ? hv % p.nk : hv / (p.nv / p.nk);
    uint col = p.state_off + slot * p.slot_stride + hv * p.dv * p.dk;   // + j * dk + i
    for (uint idx = tid; idx < DVB * p.dk; idx += NT) {
        uint j = idx / p.dk, d = idx % p.dk;
        sS[d][j] = (j < nj && !fresh) ? st[col + (j0 + j) * p.dk + d] : 0.0;
    }
    uint qb = p.q_off + hk * p.dk, kb = p.k_off + hk * p.dk;
    for (uint c0 = start / C * C; c0 < end; c0 += C) {
        uint lo = max(start, c0), hi = min(end, c0 + C);
        uint n = hi - lo, l0 = lo - c0;
        float Gl = scr[p.g_off + (hi - 1u) * p.nv + hv];
        if (tid < n) {
            float G = scr[p.g_off + (lo + tid) * p.nv + hv];
            sG[tid] = G;
            sdec[tid] = exp(Gl - G);
        }
        barrier();
        // v' = U - W S and q S
        for (uint idx = tid; idx < n * DVB; idx += NT) {
            uint i = idx / DVB, j = idx % DVB;
            uint r = lo + i;
            float ws = 0.0, qs = 0.0;
            if (j < nj) {
                uint wr = p.w_off + (r * p.nv + hv) * p.dk, qr = qb + r * p.qkv_stride;
                for (uint d = 0; d < p.dk; d++) {
                    float s = sS[d][j];
                    ws += scr[wr + d] * s;
                    qs += act[qr + d] * s;
                }
                ws = scr[p.u_off + (r * p.nv + hv) * p.dv + j0 + j] - ws;
            }
            snew[i][j] = ws;
            sqs[i][j] = qs;
        }
        barrier();
        // outputs, and the state carried past the chunk
        for (uint idx = tid; idx < n * DVB; idx += NT) {
            uint i = idx / DVB, j = idx % DVB;
            if (j >= nj) continue;
            uint r = lo + i;
            uint ar = p.aq_off + (r * p.nv + hv) * C + l0;
            float o = exp(sG[i]) * sqs[i][j];
            for (uint m = 0; m <= i; m++) o += scr[ar + m] * snew[m][j];
            act[p.o_off + r * p.o_stride + hv * p.dv + j0 + j] = o * p.scale;
        }
        float dl = exp(Gl);
        for (uint idx = tid; idx < DVB * p.dk; idx += NT) {
            uint j = idx / p.dk, d = idx % p.dk;
            float s = sS[d][j] * dl;
            for (uint i = 0; i < n; i++) s += act[kb + (lo + i) * p.qkv_stride + d] * sdec[i] * snew[i][j];
            sS[d][j] = s;
        }
        barrier();
    }
    for (uint idx = tid; idx < DVB * p.dk; idx += NT) {
        uint j = idx / p.dk, d = idx % p.dk;
        if (j < nj) st[col + (j0 + j) * p.dk + d] = sS[d][j];
    }
}
