#version 450
#ifdef XQ8
#extension GL_EXT_integer_dot_product : require
#endif
// y[c][row] (+)= sum_k W[row][k] * x[c][k] for columns c < N: the GPUs'
// split-K matvec (lavapipe runs mul_mv.comp). A workgroup takes RPS rows
// (ITEMS_PER_WG = RPS) and all its invocations walk their units together (a
// 4096-row matrix keeps 4x more loads in flight than with a subgroup per row
// group); the subgroups' sums meet in shared memory, added in subgroup order.
// Each unit is dequantized once and used for NCOLS columns of x. Every variant
// a device uses for matvecs sums a row in the same order, batched or alone.
// Fused epilogues, by variant (Kernels.mul_mat picks them): GLU, NORM, ROPE,
// NORM_PARTS / NORM_IN (the RMSNorm split between a residual add and its
// readers), PARTS_Q8, XQ8 (integer dot products); see below.
// grid: (row groups folded into x/y, ceil(N / NCOLS) in z)
#include "common.glsl"

// x and y live in the same activation buffer, bound twice: x through a
// readonly restrict binding (so GPUs may read it through their non-coherent
// cache: every lane re-reads x), y through a writable one. Their regions never
// overlap.
layout(binding = 0) readonly restrict buffer Wq { uint wq[]; };
layout(binding = 1) readonly restrict buffer X4 { vec4 act4[]; };
// NORM (the fused RMSNorm, below) is compiled into the split-K variants of up
// to 4 columns only: the host fuses it into steps of at most 4 rows
// (Kernels.NORM_MAX_ROWS), and the other variants keep their registers and a
// plain y binding. With it y is coherent: the last workgroup reads every
// workgroup's rows.
// ROPE (the fused RoPE and KV-cache write, below) likewise.
// NO_EPI: no epilogues (the XQ8 variants, which take neither a norm nor RoPE:
// compiled in, they cost the 4-column kernel registers and time, notes.md run 16)
#if NCOLS <= 4 && !defined(NO_EPI)
#define NORM_CODE 1
layout(binding = 2) coherent buffer Y { float act[]; };
layout(binding = 2) coherent buffer Y4 { vec4 yv4[]; };
layout(binding = 2) coherent buffer Yu { uint actu[]; };
layout(binding = 3) readonly restrict buffer NW { vec4 nw4[]; };   // NORM's weight
layout(binding = 4) readonly restrict buffer RopeT { float rtable[]; };   // ROPE's cos/sin table
layout(binding = 5) readonly restrict buffer RParams { uint rparams[]; };  // ROPE: positions and slots
layout(binding = 6) writeonly restrict buffer RKv { uint rkv[]; };        // ROPE: the KV cache
#elif defined(PARTS_Q8)
// PARTS_Q8 (below) without the epilogues (the 8-column "pq" variants): y
// coherent all the same, the last workgroup of a block reads its h'
#define NORM_CODE 0
layout(binding = 2) coherent buffer Y { float act[]; };
layout(binding = 2) coherent buffer Y4 { vec4 yv4[]; };
layout(binding = 2) coherent buffer Yu { uint actu[]; };
#else
#define NORM_CODE 0
layout(binding = 2) buffer Y { float act[]; };
#endif
// The RMSNorm between a residual add (the producer) and the matvecs that read
// its output (the consumers), on GPUs' decode steps, split so that no
// workgroup normalizes a whole row alone (the fused NORM below does that):
// NORM_PARTS (the "p" variants, plain accumulate, RPS = 4): besides y, each
//   workgroup writes its rows of h' = y * w (w the norm's weight, binding 3,
//   from nw_off) to h_off (rows h_stride apart) and, per column, the sum of
//   its 4 rows' squares to word sync_off + column * sq_stride + workgroup.
// NORM_IN (the "n" variants): x is h'; every workgroup first adds the K / 4
//   sums of each column (from word sync_off, K / 4 words a column) into
//   shared memory, then runs the products and scales its sums by
//   1 / sqrt(mean square + eps): W @ (y * w * scale), what W @ rms_norm(y)
//   gives up to rounding. The sums are added before the products, not
//   beside them (fewer live registers: notes.md run 18).
// Every variant adds a column's squares in the same order, batched or alone.
// PARTS_Q8 (with NORM_PARTS: the "pq" variants): h' also as 8-bit blocks of
//   32 rows for an XQ8 reader (the SwiGLU's gate|up on integer dot products,
//   "nx" variants: NORM_IN with XQ8), so that it needs no quantize dispatch.
//   The 32 / RPS workgroups of a block count themselves on a zeroed word
//   (pc_off + grid z * M / 32 + block); the last one reads the block's h'
//   of every column through the coherent binding and writes its int8 words
//   (pq_off + column * M / 4 + block * 8) and scale (pd_off + column * M /
//   32 + block) with q8.glsl's rounding, what quantize_q8.comp writes for
//   those floats, then zeroes the word. A second plane of int8 words
//   (pq2_off + column * M / 4 + block * 8) holds what the first leaves of
//   each value in steps of d / 254 (rounded: |x - q d| <= d / 2 keeps it
//   within +-127), so that the two give h' to within d / 508 (the first
//   alone: d / 2, which moved the KL against llama.cpp 9x: notes.md run 23).
//   It also adds the
//   block's 8 sums of 4 squares (in order) into one per block (ps_off +
//   column * M / 32 + block), which the reader adds instead of the K / 4
//   sums (NORM_IN_BLK). Its offsets ride in the RoPE words (a p variant
//   takes no RoPE).
#ifdef PARTS_Q8
#ifndef NORM_PARTS
#error "PARTS_Q8 needs NORM_PARTS"
#endif
#include "q8.glsl"
#define PQ_OFF p.rope_row0
#define PD_OFF p.n_q
#define PC_OFF p.n_k
#define PS_OFF p.head_dim
#define PQ2_OFF p.n_rot
#endif
// NORM_IN_BLK (with NORM_IN, the "nx" variants): the producer's sums come one
// per 32 values (PARTS_Q8's block sums, K / 32 a column from sync_off)
#ifdef NORM_IN_BLK
layout(binding = 1) readonly restrict buffer X1 { float act1[]; };
#endif
#if defined(NORM_IN) || defined(NORM_PARTS)
#if defined(NORM_PARTS) && RPS != 4
#error "NORM_PARTS: the sums are of 4 rows"
#endif
#if !NORM_CODE
layout(binding = 3) readonly restrict buffer NW { vec4 nw4[]; };
#endif
layout(binding = 3) readonly restrict buffer NWs { float nws[]; };
#endif
#ifdef XQ8
// XQ8 (Q8_0 and Q4_0 weights, split-K variants; Kernels.xq8): x comes as 8-bit blocks
// (quantize_q8.comp: per column, K / 4 words of int8 from word xq_off, then
// K / 32 block scales from xd_off) and a lane's 16 weights of a row meet a
// column's 16 values in four integer dot products; the block scales multiply
// the sum. Built without epilogues (NO_EPI); opt-in, as its quantize
// dispatches cost the 1-row step more than it saves (notes.md runs 16-17)
layout(binding = 7) readonly restrict buffer XQ4 { uvec4 xq4[]; };
layout(binding = 7) readonly restrict buffer XQD { float xqd[]; };
// XQ2 (the "nx" variants): x in two planes of int8, the second in steps of
// the block's scale / 254 (PARTS_Q8 below), from word XQ2_OFF (a RoPE word:
// the XQ8 variants take no RoPE)
#ifdef XQ2
#define XQ2_OFF p.rope_row0
#endif
#if defined(WT_Q4_0)
// (Q4_0) 8 x the sum of x's 16 int8 values in a uvec4: what a row's nibbles (q + 8 as bytes) take off their dot
// product with them, so that it is sum (q + 8) x - 8 sum x = sum q x, exact in integers
int xq8_sum8(uvec4 x) {
    const int ONES = 0x01010101;
    return 8 * (dotPacked4x8EXT(ONES, int(x.x)) + dotPacked4x8EXT(ONES, int(x.y))
                + dotPacked4x8EXT(ONES, int(x.z)) + dotPacked4x8EXT(ONES, int(x.w)));
}
#define XQ8_LESS(v) - (v)
#else
#define XQ8_LESS(v)
#endif
#endif
// ROUTE (the "r" variants, a MoE router's logits; NORM_CODE, no other
// epilogue): then, by the workgroup that finishes last (counted as NORM's),
// each column's top-k experts and their weights (moe_router.comp's choice,
// moe_route.glsl) into route rows: ids (uint words) at ROUTE_OFF + column *
// ROUTE_STRIDE, weights ROUTE_K words after them; one dispatch and barrier
// less than a moe_router of its own. Its fields ride in the RoPE words.
#ifdef ROUTE
#if !NORM_CODE
#error "ROUTE needs the epilogue variants' coherent y"
#endif
#include "moe_route.glsl"
#define ROUTE_OFF p.rope_row0
#define ROUTE_STRIDE p.n_q
#define ROUTE_K p.n_k
#define ROUTE_SCALE p.eps
#endif
// CONV (the "c" variants, NORM_CODE; Gated DeltaNet's input projection in
// decode-sized steps): rows below CONV_C are channels of the causal depthwise
// conv1d + SiLU that follows (conv1d.comp's arithmetic, one invocation a
// channel walking the step's columns in order: a column's slot window of K-1
// inputs, [slot][K-1][C] from CONV_STATE in binding 8, zeros at position 0,
// shifted through): silu(conv) goes to CONV_Y + column * CONV_YS + row instead
// of y, and for columns below CONV_SNAPS the window to the snapshot rows at
// CONV_SNAP; rows from CONV_C up go to y as they are. Weights [C][K] f32 from
// CONV_W in binding 3. One dispatch and barrier less a linear layer. Its fields
// ride in the RoPE words (positions and slots as RoPE's).
#ifdef CONV
#if !NORM_CODE
#error "CONV is an epilogue variant"
#endif
layout(binding = 3) readonly restrict buffer NWc { float convw[]; };
layout(binding = 8) buffer CState { float cst[]; };
#define CONV_KMAX 8
#define CONV_C p.n_q
#define CONV_K p.n_k
#define CONV_Y p.q_off
#define CONV_YS p.q_stride
#define CONV_W p.table_off
#define CONV_STATE p.k_off
#define CONV_SNAP p.v_off
#define CONV_SNAPS p.kv_row_words
// 1: every column's slot window loaded before the first column's conv (independent loads: one memory latency
// for a step's columns rather than one a column, each behind the column before; the same arithmetic)
layout(constant_id = 2) const uint CONV_PRE = 0;
#endif
#include "mul_mv_push.glsl"

#include "quant.glsl"

#ifndef BFLY
#define BFLY 0
#endif
#if BFLY
#extension GL_KHR_shader_subgroup_shuffle : require
#define NV (RPS * NCOLS)
#define LOG2NV (NV >= 32 ? 5u : NV >= 16 ? 4u : NV >= 8 ? 3u : NV >= 4 ? 2u : NV >= 2 ? 1u : 0u)
#endif
#define LANE gl_LocalInvocationID.x
#define FIRST_ROW rows.x
#define NEXT_ROWS ITEMS_PER_WG
shared float red[32][RPS * NCOLS];   // per subgroup (at most 32 of them)
#ifdef NORM_PARTS
shared float nsq[RPS * NCOLS];   // NORM_PARTS: the squares of the workgroup's sums
#endif
#ifdef PARTS_Q8
shared uint s_lastq;
shared float qmax[NCOLS * 8u];   // the block's largest |h'| per column, 4 values at a time
#endif
#ifdef NORM_IN
shared float nss[32][NCOLS];   // NORM_IN: each subgroup's sum of the columns' squares
// the norm's scale of column c: the subgroups' sums added in order
float norm_in_scale(uint c) {
    float t = nss[0][c];
    for (uint g = 1; g < gl_NumSubgroups; g++) t += nss[g][c];
    return inversesqrt(t / float(p.K) + p.eps);
}
#endif
#if NORM_CODE
#define NORM_COLS 4u
shared float npart[NORM_COLS][32];
shared uint s_last;
// Whether this workgroup is the dispatch's last to finish (NORM's and ROUTE's
// epilogues): its writes made visible, it counts itself on the zeroed word w of
// y's buffer; the last one resets the word once its epilogue is done.
bool last_workgroup(uint w) {
    memoryBarrierBuffer();
    barrier();
    if (gl_LocalInvocationID.x == 0u) {
        uint total = gl_NumWorkGroups.x * gl_NumWorkGroups.y * gl_NumWorkGroups.z;
        s_last = atomicAdd(actu[w], 1u) == total - 1u ? 1u : 0u;
    }
    barrier();
    return s_last != 0u;
}
#endif

#if NORM_CODE
// ROPE's store of row `row` of y for column col: s its sum, s2 that of its
// pair partner (row ^ 1, the same workgroup); rope_kv.comp's arithmetic
void rope_store(uint row, uint col, float s, float s2) {
    uint g = p.rope_row0 + row;
    uint pos = rparams[p.pos_off + col], slot = rparams[p.slot_off + col];
    bool odd = (g & 1u) != 0u;
    float x0 = odd ? s2 : s, x1 = odd ? s : s2;
    uint d0 = ((g < p.n_q ? g : g - p.n_q) % p.head_dim) & ~1u;
    vec2 o = vec2(x0, x1);
    if (g < p.n_q + p.n_k && d0 < p.n_rot) {
        uint tb = p.table_off + pos * p.n_rot + d0;
        float c = rtable[tb], sn = rtable[tb + 1u];
        precise float y0 = x0 * c - x1 * sn;
        precise float y1 = x0 * sn + x1 * c;
        o = vec2(y0, y1);
    }
    if (g < p.n_q) {
        act[p.q_off + col * p.q_stride + g] = odd ? o.y : o.x;
    } else if (!odd) {
        uint w = g < p.n_q + p.n_k ? p.k_off + (g - p.n_q) / 2u : p.v_off + (g - p.n_q - p.n_k) / 2u;
        rkv[w + slot * p.slot_stride + pos * p.kv_row_words] = packHalf2x16(o);
    }
}
#endif

#include "mul_mv_unit.glsl"

void main() {
    uvec2 rows = workgroup_items(p.M);
    uint col0 = gl_WorkGroupID.z * NCOLS;
    uint ncols = min(uint(NCOLS), p.N - col0);
    uint units = units_per_row(p.K);
    uint S = gl_WorkGroupSize.x;
#ifdef NORM_IN
    {   // the producer's sums of 4 rows' squares (K / 4 a column; NORM_IN_BLK:
        // of 32, K / 32), every column's loads side by side; each subgroup's
        // sums to nss, read after the products' barrier
        float t[NCOLS];
        [[unroll]] for (uint c = 0; c < NCOLS; c++) t[c] = 0.0;
#ifdef NORM_IN_BLK
        uint nb32 = p.K / 32u;
        for (uint v = LANE; v < nb32; v += S) {
            float q[NCOLS];
            [[unroll]] for (uint c = 0; c < NCOLS; c++) q[c] = act1[p.sync_off + XCOL(c) * nb32 + v];
            [[unroll]] for (uint c = 0; c < NCOLS; c++) t[c] += q[c];
        }
#else
        uint n4 = p.K / 16u;
        for (uint v = LANE; v < n4; v += S) {
            vec4 q[NCOLS];
            [[unroll]] for (uint c = 0; c < NCOLS; c++) q[c] = act4[p.sync_off / 4u + XCOL(c) * n4 + v];
            [[unroll]] for (uint c = 0; c < NCOLS; c++) t[c] += (q[c].x + q[c].y) + (q[c].z + q[c].w);
        }
#endif
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            float u = subgroupAdd(t[c]);
            if (subgroupElect()) nss[gl_SubgroupID][c] = u;
        }
    }
#endif
    // the workgroup takes RPS consecutive rows; every x
    // vec4 it loads serves them all
    for (uint row0 = FIRST_ROW; row0 < rows.y; row0 += NEXT_ROWS) {
        // the weight row behind each of the RPS sums, and whether it exists
        uint prow[RPS];
        bool pok[RPS];
        [[unroll]] for (uint rr = 0; rr < RPS; rr++) { prow[rr] = row0 + rr; pok[rr] = row0 + rr < rows.y; }
        // GLU (flags & 2): W is gate (rows [0, M/2)) over up (rows [M/2, M));
        // the workgroup's first RPS/2 sums are gate rows i .. i + RPS/2 - 1, the
        // others the up rows of the same i, and y[c][i] = silu(gate) * up: the
        // SwiGLU of the feed-forward layer without a dispatch of its own
        const uint H = RPS / 2u;
        bool glu = (p.flags & 2u) != 0u;
        uint pfirst = workgroup_linear() * H;
        if (glu) {
            [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                uint j = rr < H ? rr : rr - H;
                prow[rr] = (rr < H ? 0u : p.M >> 1) + pfirst + j;
                pok[rr] = pfirst + j < (p.M >> 1);
            }
        }
        float acc[RPS][NCOLS];
        [[unroll]] for (uint rr = 0; rr < RPS; rr++)
            [[unroll]] for (uint c = 0; c < NCOLS; c++) acc[rr][c] = 0.0;
#ifdef XQ8
        // 16 values a lane (half a block: one uvec4 of weights and of each
        // column's x), not the float path's 8-value units of Q8_0 (H200 probe:
        // 16 beat 8 by 4-11% at 4 columns); Q4_0: the block's 16 bytes, whose
        // low or high nibbles are the half's values
        {
            uint nb = p.K / 32u, halves = p.K / 16u;
            for (uint u = LANE; u < halves; u += S) {
                uint b = u >> 1;
                uvec4 wv[RPS];
                float dw[RPS];
                [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                    if (!pok[rr]) { wv[rr] = uvec4(0u); dw[rr] = 0.0; continue; }
                    uint blk = prow[rr] * nb + b;
#if defined(WT_Q4_0)
                    // the block's 16 bytes: this half's 16 values are their low nibbles (u even: values 0-15)
                    // or their high ones (16-31), each the value's q + 8 as a byte
                    wv[rr] = (wq4[p.w_off / 4u + blk] >> ((u & 1u) * 4u)) & 0x0F0F0F0Fu;
#else
                    wv[rr] = wq4[p.w_off / 4u + blk * 2u + (u & 1u)];
#endif
                    dw[rr] = half_sel(wq[p.w_off2 + (blk >> 1)], blk);
                }
                // every column's x before the first product (as XFIRST does)
                uvec4 xa[NCOLS];
                float da[NCOLS];
#ifdef XQ2
                uvec4 xa2[NCOLS];
#endif
                [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                    uint col = XCOL(c);
                    xa[c] = xq4[p.xq_off / 4u + col * halves + u];
                    da[c] = xqd[p.xd_off + col * nb + b];
#ifdef XQ2
                    xa2[c] = xq4[XQ2_OFF / 4u + col * halves + u];
#endif
                }
                [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                    uvec4 xv = xa[c];
                    float dx = da[c];
#if defined(WT_Q4_0)
                    // the column's sums (per plane), once for the RPS rows (XQ8_LESS)
                    int xs8 = xq8_sum8(xv);
#ifdef XQ2
                    int xs8b = xq8_sum8(xa2[c]);
#endif
#endif
                    [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                        int s = dotPacked4x8EXT(int(wv[rr].x), int(xv.x)) + dotPacked4x8EXT(int(wv[rr].y), int(xv.y))
                              + dotPacked4x8EXT(int(wv[rr].z), int(xv.z)) + dotPacked4x8EXT(int(wv[rr].w), int(xv.w))
                              XQ8_LESS(xs8);
#ifdef XQ2
                        // the second plane, in steps of dx / 254: 254 s + s2 (at most 16 x 127 x 127 x 255 < 2^31)
                        uvec4 x2 = xa2[c];
                        int s2 = dotPacked4x8EXT(int(wv[rr].x), int(x2.x)) + dotPacked4x8EXT(int(wv[rr].y), int(x2.y))
                               + dotPacked4x8EXT(int(wv[rr].z), int(x2.z)) + dotPacked4x8EXT(int(wv[rr].w), int(x2.w))
                               XQ8_LESS(xs8b);
                        acc[rr][c] += float(s * 254 + s2) * (dw[rr] * (dx * (1.0 / 254.0)));
#else
                        acc[rr][c] += float(s) * (dw[rr] * dx);
#endif
                    }
                }
            }
        }
#else
        // UNROLL units per lane per iteration: all their loads are issued
        // before the first is decoded, so each lane keeps several in flight
        for (uint u0 = LANE; u0 < units; u0 += S * UNROLL) {
            Raw raw[UNROLL][RPS];
            [[unroll]] for (uint k = 0; k < UNROLL; k++) {
                uint u = u0 + k * S;
                [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                    if (u < units && pok[rr]) raw[k][rr] = unit_fetch(p.w_off, p.w_off2, prow[rr], u, p.K);
                }
            }
            [[unroll]] for (uint k = 0; k < UNROLL; k++) {
                uint u = u0 + k * S;
                if (u >= units) continue;
                accum_unit(raw[k], u, col0, ncols, acc);
            }
        }
#endif
#if BFLY
        // reduce-scatter across the subgroup: at each of the first log2(RPS *
        // NCOLS) steps a lane keeps half of its sums and adds its partner's
        // half (1 shuffle per kept sum, against 5 per sum for subgroupAdd), then
        // the remaining lane bits are summed; every sum follows the same tree
        // (lane masks S/2, S/4, ..., 1) whatever RPS and NCOLS are, so a row's
        // result does not depend on the variant
        {
            float vals[NV];
            [[unroll]] for (uint rr = 0; rr < RPS; rr++)
                [[unroll]] for (uint c = 0; c < NCOLS; c++) vals[rr * NCOLS + c] = acc[rr][c];
            uint lane = gl_SubgroupInvocationID, j = 0u;
            [[unroll]] for (uint st = 0; st < LOG2NV; st++) {
                const uint hv = NV >> (st + 1u);
                uint m = gl_SubgroupSize >> (st + 1u);
                bool up = (lane & m) != 0u;
                if (up) j += hv;
                [[unroll]] for (uint i = 0; i < hv; i++) {
                    float keep = up ? vals[hv + i] : vals[i];
                    float send = up ? vals[i] : vals[hv + i];
                    vals[i] = keep + subgroupShuffleXor(send, m);
                }
            }
            float s = vals[0];
            for (uint m = gl_SubgroupSize >> (LOG2NV + 1u); m > 0u; m >>= 1) s += subgroupShuffleXor(s, m);
            if ((lane & ((gl_SubgroupSize >> LOG2NV) - 1u)) == 0u) red[gl_SubgroupID][j] = s;
        }
#else
        [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                float s = subgroupAdd(acc[rr][c]);
                if (subgroupElect()) red[gl_SubgroupID][rr * NCOLS + c] = s;
            }
        }
#endif
        barrier();
        uint i = gl_LocalInvocationID.x;
        if (glu) {
            if (i < H * NCOLS) {
                uint c = i % NCOLS;
                if (c < ncols && pok[i / NCOLS]) {
                    float g = red[0][i], u = red[0][i + H * NCOLS];
                    for (uint sg = 1; sg < gl_NumSubgroups; sg++) { g += red[sg][i]; u += red[sg][i + H * NCOLS]; }
#ifdef NORM_IN
                    float sc = norm_in_scale(c);
                    g *= sc;
                    u *= sc;
#endif
                    act[p.y_off + (col0 + c) * p.y_stride + pfirst + i / NCOLS] = silu(g) * u;
                }
            }
        }
#ifdef CONV
        else if (i < RPS && row0 + i < rows.y) {
            uint row = row0 + i;
            float sv[NCOLS];
            [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                float s = red[0][i * NCOLS + c];
                for (uint g = 1; g < gl_NumSubgroups; g++) s += red[g][i * NCOLS + c];
                sv[c] = s;
            }
            if (row >= CONV_C) {
                [[unroll]] for (uint c = 0; c < NCOLS; c++)
                    if (c < ncols) act[p.y_off + (col0 + c) * p.y_stride + row] = sv[c];
            } else {
                uint km1 = CONV_K - 1u, C = CONV_C;
                float w[CONV_KMAX], win[CONV_KMAX];
                [[unroll]] for (uint j = 0; j < CONV_KMAX; j++) {
                    w[j] = j < CONV_K ? convw[CONV_W + row * CONV_K + j] : 0.0;
                    win[j] = 0.0;
                }
                uint cur = 0xffffffffu;
                // (CONV_PRE) each column's slot window, all loaded before any is used or the state written (a
                // thread's row of the state only; a slot's columns are one run, so no window is stale)
                float pre[CONV_PRE != 0u ? NCOLS : 1][CONV_KMAX - 1];
                if (CONV_PRE != 0u) {
                    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                        uint col = col0 + min(c, ncols - 1u), slot = rparams[p.slot_off + col];
                        bool fresh = rparams[p.pos_off + col] == 0u;
                        [[unroll]] for (uint j = 0; j < CONV_KMAX - 1; j++)
                            pre[c][j] = (j < km1 && !fresh) ? cst[CONV_STATE + slot * p.slot_stride + j * C + row] : 0.0;
                    }
                }
                [[unroll]] for (uint c = 0; c < NCOLS; c++) {
                    if (c >= ncols) break;
                    uint col = col0 + c, slot = rparams[p.slot_off + col];
                    if (slot != cur) {
                        if (cur != 0xffffffffu)
                            for (uint j = 0u; j < km1; j++) cst[CONV_STATE + cur * p.slot_stride + j * C + row] = win[j];
                        bool fresh = rparams[p.pos_off + col] == 0u;
                        if (CONV_PRE != 0u) {
                            [[unroll]] for (uint j = 0; j < CONV_KMAX - 1; j++) win[j] = pre[c][j];
                            win[CONV_KMAX - 1] = 0.0;
                        } else {
                            [[unroll]] for (uint j = 0; j < CONV_KMAX; j++)
                                win[j] = (j < km1 && !fresh) ? cst[CONV_STATE + slot * p.slot_stride + j * C + row] : 0.0;
                        }
                        cur = slot;
                    }
                    float x = sv[c];
                    float acc = w[km1] * x;
                    [[unroll]] for (uint j = 0; j < CONV_KMAX - 1; j++) {
                        if (j < km1) acc += w[j] * win[j];
                    }
                    [[unroll]] for (uint j = 0; j < CONV_KMAX - 1; j++) {
                        if (j + 1u < km1) win[j] = win[j + 1];
                        else if (j + 1u == km1) win[j] = x;
                    }
                    act[CONV_Y + col * CONV_YS + row] = silu(acc);
                    if (col < CONV_SNAPS)
                        for (uint j = 0u; j < km1; j++) cst[CONV_SNAP + col * p.slot_stride + j * C + row] = win[j];
                }
                if (cur != 0xffffffffu)
                    for (uint j = 0u; j < km1; j++) cst[CONV_STATE + cur * p.slot_stride + j * C + row] = win[j];
            }
        }
#else
        else if (i < RPS * NCOLS) {
            uint rr = i / NCOLS, c = i % NCOLS, row = row0 + rr;
#ifdef NORM_PARTS
            nsq[i] = 0.0;
#endif
            if (c < ncols && row < rows.y) {
                float s = red[0][i];
                for (uint g = 1; g < gl_NumSubgroups; g++) s += red[g][i];
#ifdef NORM_IN
                float sc = norm_in_scale(c);
                s *= sc;
#endif
#if NORM_CODE
                if ((p.flags & 8u) != 0u) {
                    uint j = i ^ NCOLS;   // row ^ 1, the same column (NCOLS a power of 2)
                    float s2 = red[0][j];
                    for (uint g = 1; g < gl_NumSubgroups; g++) s2 += red[g][j];
#ifdef NORM_IN
                    s2 *= sc;
#endif
                    rope_store(row, col0 + c, s, s2);
                } else
#endif
                {
                    uint yi = p.y_off + (col0 + c) * p.y_stride + row;
#if NORM_CODE
                    // BIAS (flags & 32, no ROPE): the row's bias first (word table_off + row
                    // of binding 4), what add_bias then gives: y = (s + b), or y + (s + b)
                    // with the residual add (add_bias then add.comp's sum)
                    if ((p.flags & 32u) != 0u) s = s + rtable[p.table_off + row];
#endif
#ifndef NO_EPI
                    // GATE (flags & 16; every variant with epilogues, so that a row rounds
                    // alike at every column count): the column's sums times sigmoid(g[c])
                    // (g at word rope_row0 + column * n_q): Qwen3.5's shared expert, gated
                    // by its down projection rather than by a sigmoid_mul before it
                    if ((p.flags & 16u) != 0u) s = s / (1.0 + exp(-act[p.rope_row0 + (col0 + c) * p.n_q]));
#endif
#ifdef NORM_PARTS
                    float yv = (p.flags & 1u) != 0u ? act[yi] + s : s;
                    act[yi] = yv;
                    act[p.h_off + (col0 + c) * p.h_stride + row] = yv * nws[p.nw_off + row];
                    nsq[i] = yv * yv;
#else
                    act[yi] = (p.flags & 1u) != 0u ? act[yi] + s : s;
#endif
                }
            }
        }
#endif
#ifdef NORM_PARTS
        barrier();
        if (i < ncols) {
            float t = nsq[i];
            for (uint rr = 1; rr < RPS; rr++) t += nsq[rr * NCOLS + i];
            act[p.sync_off + (col0 + i) * p.sq_stride + row0 / 4u] = t;
        }
#endif
    }
#ifdef PARTS_Q8
    if (rows.x < p.M) {   // (workgroup-uniform: the grid may hold workgroups past M)
        memoryBarrierBuffer();
        barrier();
        uint nbk = p.M / 32u, b = rows.x / 32u, cw = PC_OFF + gl_WorkGroupID.z * nbk + b;
        if (gl_LocalInvocationID.x == 0u)
            s_lastq = atomicAdd(actu[cw], 1u) == 32u / RPS - 1u ? 1u : 0u;
        barrier();
        if (s_lastq != 0u) {
            memoryBarrierBuffer();
            uint L = gl_LocalInvocationID.x, S = gl_WorkGroupSize.x;
            // invocation i: column i / 8, values 4 (i % 8) .. of the block
            for (uint i = L; i < NCOLS * 8u; i += S) {
                uint c = i / 8u;
                vec4 v = c < ncols ? yv4[(p.h_off + (col0 + c) * p.h_stride) / 4u + b * 8u + i % 8u] : vec4(0.0);
                qmax[i] = q8_amax4(v);
            }
            barrier();
            for (uint i = L; i < NCOLS * 8u; i += S) {
                uint c = i / 8u, k = i % 8u;
                if (c >= ncols) continue;
                vec4 v = yv4[(p.h_off + (col0 + c) * p.h_stride) / 4u + b * 8u + k];
                float amax = 0.0;
                for (uint j = 0u; j < 8u; j++) amax = max(amax, qmax[c * 8u + j]);
                float d = q8_scale(amax), id = q8_inv(d);
                uint w1 = q8_pack(v, id);
                // the second plane: what the first leaves, in steps of d / 254
                precise vec4 r = v - vec4(clamp(ivec4(roundEven(v * id)), ivec4(-127), ivec4(127))) * d;
                actu[PQ_OFF + (col0 + c) * (p.M / 4u) + b * 8u + k] = w1;
                actu[PQ2_OFF + (col0 + c) * (p.M / 4u) + b * 8u + k] = q8_pack(r, id * 254.0);
                if (k == 0u) {
                    act[PD_OFF + (col0 + c) * nbk + b] = d;
                    uint so = p.sync_off + (col0 + c) * p.sq_stride + b * 8u;
                    float t = act[so];
                    for (uint j = 1u; j < 8u; j++) t += act[so + j];
                    act[PS_OFF + (col0 + c) * nbk + b] = t;
                }
            }
            if (L == 0u) actu[cw] = 0u;
        }
    }
#endif
#if NORM_CODE && !defined(NORM_IN) && !defined(NORM_PARTS)
    // NORM (flags & 4, with 1: y is the residual stream): h[c] = RMSNorm(y[c]) *
    // w for every column, by the workgroup that finishes last, instead of an
    // rms_norm dispatch of its own. Each workgroup makes its rows visible and
    // counts itself on a counter in y's buffer (zero between dispatches: the
    // last one resets it); the last reads all rows through the coherent binding
    // and runs rms_norm_wg's arithmetic (same workgroup size, loop, reduction
    // order and expressions), so a row's h is what that kernel gives.
    if ((p.flags & 4u) != 0u) {
        if (last_workgroup(p.sync_off)) {
            memoryBarrierBuffer();
            uint n4 = p.M / 4u, S = gl_WorkGroupSize.x, L = gl_LocalInvocationID.x;
            // up to NORM_COLS columns at a time, their loads side by side; each
            // column's sum runs in rms_norm_wg's order
            for (uint c0 = 0u; c0 < p.N; c0 += NORM_COLS) {
                uint nc = min(NORM_COLS, p.N - c0);
                float ss[NORM_COLS];
                [[unroll]] for (uint c = 0; c < NORM_COLS; c++) ss[c] = 0.0;
                for (uint i0 = L; i0 < n4; i0 += S * 4u) {
                    [[unroll]] for (uint c = 0; c < NORM_COLS; c++) {
                        if (c >= nc) continue;
                        uint xb = (p.y_off + (c0 + c) * p.y_stride) / 4u;
                        vec4 v[4];
                        [[unroll]] for (uint k = 0; k < 4u; k++) {
                            uint i = i0 + k * S;
                            v[k] = i < n4 ? yv4[xb + i] : vec4(0.0);
                        }
                        [[unroll]] for (uint k = 0; k < 4u; k++) ss[c] += dot(v[k], v[k]);
                    }
                }
                [[unroll]] for (uint c = 0; c < NORM_COLS; c++) {
                    float t = subgroupAdd(ss[c]);
                    if (subgroupElect()) npart[c][gl_SubgroupID] = t;
                }
                barrier();
                float scale[NORM_COLS];
                [[unroll]] for (uint c = 0; c < NORM_COLS; c++) {
                    float t = npart[c][0];
                    for (uint g = 1; g < gl_NumSubgroups; g++) t += npart[c][g];
                    scale[c] = inversesqrt(t / float(p.M) + p.eps);
                }
                barrier();   // npart is the next columns'
                uint wb = p.nw_off / 4u;
                for (uint i0 = L; i0 < n4; i0 += S * 4u) {
                    vec4 w[4];
                    [[unroll]] for (uint k = 0; k < 4u; k++) {
                        uint i = i0 + k * S;
                        if (i < n4) w[k] = nw4[wb + i];
                    }
                    [[unroll]] for (uint c = 0; c < NORM_COLS; c++) {
                        if (c >= nc) continue;
                        uint xb = (p.y_off + (c0 + c) * p.y_stride) / 4u, hb = (p.h_off + (c0 + c) * p.h_stride) / 4u;
                        vec4 v[4];
                        [[unroll]] for (uint k = 0; k < 4u; k++) {
                            uint i = i0 + k * S;
                            if (i < n4) v[k] = yv4[xb + i];
                        }
                        [[unroll]] for (uint k = 0; k < 4u; k++) {
                            uint i = i0 + k * S;
                            if (i < n4) {
                                vec4 hv = v[k] * scale[c] * w[k];
                                yv4[hb + i] = hv;
                            }
                        }
                    }
                }
            }
            if (L == 0u) actu[p.sync_off] = 0u;
        }
    }
#endif
#ifdef ROUTE
    {
        if (last_workgroup(p.sync_off)) {
            memoryBarrierBuffer();
            for (uint c = gl_SubgroupID; c < p.N; c += gl_NumSubgroups) {
                uint lb = p.y_off + c * p.y_stride, rb = ROUTE_OFF + c * ROUTE_STRIDE;
#define ZL(e) act[lb + (e)]
#define ZPUT(t, id, w) { actu[rb + (t)] = (id); act[rb + ROUTE_K + (t)] = (w); }
                MOE_ROUTE_ROW(ZL, p.M, ROUTE_K, ROUTE_SCALE, ZPUT)
            }
            if (gl_LocalInvocationID.x == 0u) actu[p.sync_off] = 0u;
        }
    }
#endif
}
