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
// Each chunk's W, q and k rows are staged in shared memory in turn (coalesced
// loads; the products then read shared memory only): with the products reading
// them from global memory a chunk took ~39 us on the H200, latency-bound.
// The workgroup is 128 invocations (the host's DELTA_CHUNK_WG): for v' and
// q S, (row, 4 columns) each; for S, a key dimension each, its DVB columns in
// registers.
#extension GL_KHR_shader_subgroup_ballot : require
#include "common.glsl"

#define C 32
#define DKMAX 128
#define DVB 16
#define NTH 128   // invocations (C rows x DVB / 4 column quads; DKMAX key dims)
#define SCAN_U 8  // rows an invocation checks at a time when finding a run

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
shared float sX[C][DKMAX + 1];    // the chunk's rows of W, then q, then k
shared float sAq[C][C + 1];
shared float snew[C][DVB];
shared float sG[C], sdec[C];
shared uint s_cnt[NTH], s_found, s_end;

// rows [lo, lo + n) of a [row][...] array (row stride `stride`, this head at `base`) into sX:
// a key dimension an invocation, all C loads issued before the stores
void stage(uint base, uint stride, uint lo, uint n, uint tid, bool from_scr) {
    uint d = tid;
    if (d >= p.dk) return;
    float v[C];
    [[unroll]] for (uint i = 0; i < C; i++) {
        uint a = base + (lo + min(i, n - 1u)) * stride + d;
        v[i] = from_scr ? scr[a] : act[a];
    }
    [[unroll]] for (uint i = 0; i < C; i++) sX[i][d] = v[i];
}

// sum_d sX[i][d] * S[d][j0 .. j0 + 3]
vec4 rows_times_state(uint i, uint jq) {
    vec4 acc = vec4(0.0);
    for (uint d = 0; d < p.dk; d++) {
        float x = sX[i][d];
        acc += x * vec4(sS[d][jq], sS[d][jq + 1u], sS[d][jq + 2u], sS[d][jq + 3u]);
    }
    return acc;
}

void main() {
    uint nvb = (p.dv + DVB - 1u) / DVB;
    uint wg = workgroup_linear();
    uint grp = wg / (p.nv * nvb);
    uint hv = (wg / nvb) % p.nv;
    uint j0 = (wg % nvb) * DVB;
    uint nj = min(DVB, p.dv - j0);
    uint tid = gl_LocalInvocationID.x;
    if (grp >= p.n_groups) return;
    // the grp-th run of equal slots: rows [start, end), found by the whole
    // workgroup SCAN_U rows an invocation at a time (a walk a row at a time
    // waited on a load a row: ~1 ms for 4,096 rows on the H200)
    uint start = 0u;
    if (grp > 0u) {
        if (tid == 0u) s_found = 0xffffffffu;
        barrier();
        uint base = 0u;   // boundaries in the blocks before
        for (uint b0 = 1u; b0 < p.n_rows; b0 += NTH * SCAN_U) {
            uint r0 = b0 + tid * SCAN_U;
            uint sl[SCAN_U + 1];
            [[unroll]] for (uint u = 0; u <= SCAN_U; u++)
                sl[u] = params[p.slot_off + min(r0 + u, p.n_rows) - 1u];   // rows r0-1 .. r0+SCAN_U-1
            uint cnt = 0u;
            [[unroll]] for (uint u = 0; u < SCAN_U; u++)
                if (r0 + u < p.n_rows && sl[u + 1u] != sl[u]) cnt++;
            uint excl = subgroupExclusiveAdd(cnt);
            uint tot = subgroupAdd(cnt);
            if (subgroupElect()) s_cnt[gl_SubgroupID] = tot;
            barrier();
            uint before = base + excl, all = 0u;
            for (uint g = 0; g < gl_NumSubgroups; g++) {
                if (g < gl_SubgroupID) before += s_cnt[g];
                all += s_cnt[g];
            }
            if (before < grp && grp <= before + cnt) {
                uint k = before;
                [[unroll]] for (uint u = 0; u < SCAN_U; u++)
                    if (r0 + u < p.n_rows && sl[u + 1u] != sl[u]) { k++; if (k == grp) s_found = r0 + u; }
            }
            barrier();
            if (s_found != 0xffffffffu) break;
            base += all;
        }
        start = s_found;
        if (start == 0xffffffffu) return;
    }
    uint slot = params[p.slot_off + start];
    if (tid == 0u) s_end = p.n_rows;
    barrier();
    for (uint b0 = start + 1u; b0 < p.n_rows; b0 += NTH * SCAN_U) {
        uint r0 = b0 + tid * SCAN_U;
        uint sl[SCAN_U];
        [[unroll]] for (uint u = 0; u < SCAN_U; u++) sl[u] = params[p.slot_off + min(r0 + u, p.n_rows - 1u)];
        [[unroll]] for (uint u = 0; u < SCAN_U; u++)
            if (r0 + u < p.n_rows && sl[u] != slot) { atomicMin(s_end, r0 + u); break; }
        barrier();
        if (s_end != p.n_rows) break;
    }
    uint end = s_end;
    bool fresh = params[p.pos_off + start] == 0u;
    uint hk = p.tiled != 0u ? hv % p.nk : hv / (p.nv / p.nk);
    uint col = p.state_off + slot * p.slot_stride + hv * p.dv * p.dk;   // + j * dk + i
    // S: a key dimension an invocation, its DVB columns in registers
    uint d = tid;
    float s[DVB];
    [[unroll]] for (uint j = 0; j < DVB; j++)
        s[j] = (d < p.dk && j < nj && !fresh) ? st[col + (j0 + j) * p.dk + d] : 0.0;
    uint qb = p.q_off + hk * p.dk, kb = p.k_off + hk * p.dk;
    uint wstride = p.nv * p.dk;
    uint ri = tid / (DVB / 4u), jq = (tid % (DVB / 4u)) * 4u;   // v' and q S: row ri, columns jq .. jq + 3
    for (uint c0 = start / C * C; c0 < end; c0 += C) {
        uint lo = max(start, c0), hi = min(end, c0 + C);
        uint n = hi - lo, l0 = lo - c0;
        float Gl = scr[p.g_off + (hi - 1u) * p.nv + hv];
        if (tid < n) {
            float G = scr[p.g_off + (lo + tid) * p.nv + hv];
            sG[tid] = G;
            sdec[tid] = exp(Gl - G);
        }
        if (d < p.dk) [[unroll]] for (uint j = 0; j < DVB; j++) sS[d][j] = s[j];
        {
            float a[C * C / NTH];
            [[unroll]] for (uint u = 0; u < C * C / NTH; u++) {
                uint idx = tid + u * NTH, i = min(idx / C, n - 1u), m = min(idx % C, n - 1u);
                a[u] = scr[p.aq_off + ((lo + i) * p.nv + hv) * C + l0 + m];
            }
            [[unroll]] for (uint u = 0; u < C * C / NTH; u++) {
                uint idx = tid + u * NTH, i = idx / C, m = idx % C;
                sAq[i][m] = m < n ? a[u] : 0.0;
            }
        }
        stage(p.w_off + hv * p.dk, wstride, lo, n, tid, true);
        barrier();
        // v' = U - W S
        if (ri < n) {
            vec4 ws = rows_times_state(ri, jq);
            uint ur = p.u_off + ((lo + ri) * p.nv + hv) * p.dv + j0 + jq;
            [[unroll]] for (uint c = 0; c < 4u; c++)
                snew[ri][jq + c] = jq + c < nj ? scr[ur + c] - ws[c] : 0.0;
        }
        barrier();
        stage(qb, p.qkv_stride, lo, n, tid, false);
        barrier();
        // o = scale (e^G q S + Aqk v')
        if (ri < n) {
            vec4 o = exp(sG[ri]) * rows_times_state(ri, jq);
            for (uint m = 0; m <= ri; m++)
                o += sAq[ri][m] * vec4(snew[m][jq], snew[m][jq + 1u], snew[m][jq + 2u], snew[m][jq + 3u]);
            uint orow = p.o_off + (lo + ri) * p.o_stride + hv * p.dv + j0 + jq;
            [[unroll]] for (uint c = 0; c < 4u; c++)
                if (jq + c < nj) act[orow + c] = o[c] * p.scale;
        }
        barrier();
        stage(kb, p.qkv_stride, lo, n, tid, false);
        barrier();
        // S = e^G_last S + (k e^(G_last - G))^T v'
        if (d < p.dk) {
            float dl = exp(Gl);
            [[unroll]] for (uint j = 0; j < DVB; j++) s[j] *= dl;
            for (uint i = 0; i < n; i++) {
                float kd = sX[i][d] * sdec[i];
                [[unroll]] for (uint j = 0; j < DVB; j++) s[j] += kd * snew[i][j];
            }
        }
        barrier();
    }
    if (d < p.dk) [[unroll]] for (uint j = 0; j < DVB; j++)
        if (j < nj) st[col + (j0 + j) * p.dk + d] = s[j];
}
