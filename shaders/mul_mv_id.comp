#version 450
// Expert matvec selected by id (ggml_mul_mat_id), for decode-sized steps: the
// experts' matrices are stacked in one tensor of E x M rows (GGUF ffn_*_exps),
// expert e's row m is global row e*M + m, and row r of the batch uses experts
// ids[r][0..k) (uint words at route[r][0..k), written by moe_router.comp):
//   y[r][i][m] = W[ids[r][i]][m] . x[r][i]          (i < k)
// x_slot_stride = 0 reads the same x row for every i. The weighted sum over i
// is moe_combine.comp's. One subgroup per output row, lanes over the row's
// units as mul_mv.comp. grid: (row groups folded into x/y, pairs r*k + i in z)
// EXPERT_PART: the stacked experts are split across buffers (a device whose
// storage-buffer range is smaller than one layer's experts); this dispatch
// binds experts [e_lo, e_hi) and skips the pairs routed elsewhere.
// GLU: each expert's M rows are gate (rows [0, M/2)) over up; y[r][i][m] =
// silu(gate_m . x) * (up_m . x) for m < M/2 (the SwiGLU of the routed experts
// without a dispatch and a barrier of its own).
// COMBINE: y[r][m] += sum_i wt[r][i] * (W[ids[r][i]][m] . x[r][i]), the weights
// at route[r][k + i] (moe_combine.comp's sum, in slot order, folded into the
// down projection: grid z is the rows, each subgroup an output row's k dots).
// With norm != 0 it also takes the RMSNorm after that residual add, as mul_mvk's
// NORM epilogue does: y written through a coherent binding (2), each workgroup
// counts itself on its row's zeroed word sync_off + r, and the row's last one
// computes h[r] = y[r] / sqrt(mean(y[r]^2) + eps) * w (w at nw_off, binding 3)
// and resets the word (combine_norm.glsl): the next layer's attention norm without a dispatch and a
// barrier of its own, in rms_norm.comp WG_ROW's arithmetic (the same workgroup
// size, loads, reduction order and expressions: the host fuses it only where
// that kernel is the device's, so h is bit for bit what the unfused ops give).
// Biases (b_off != 0xffffffff; GLU and COMBINE, gpt-oss): each expert's bias row
// (E x M floats at b_off of binding 4) added to its sums first, what moe_bias
// after the plain matvec gives; GLU with oai != 0: gpt-oss's clamped SwiGLU
// (swiglu_oai, as swiglu.comp's OAI).
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { uint wq[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Act4 { vec4 act4[]; };
layout(binding = 1) readonly buffer ActU { uint actu[]; };
#ifdef COMBINE
layout(binding = 2) coherent buffer Y { float yc[]; };
layout(binding = 2) coherent buffer Y4 { vec4 yc4[]; };
layout(binding = 2) coherent buffer Yu { uint ycu[]; };
layout(binding = 3) readonly buffer NW { vec4 nw4[]; };
shared float npart[32];
shared uint s_last;
#endif
#if defined(GLU) || defined(COMBINE)
layout(binding = 4) readonly buffer EBias { float eb[]; };
#endif

layout(push_constant) uniform P {
    uint w_off, w_off2;          // expert 0's weight words / scale words
    uint K, M, k, n_rows;        // columns, rows per expert, experts per row, batch rows
    uint ids_off, ids_stride;
    uint x_off, x_stride, x_slot_stride;   // floats; multiples of 4
    uint y_off, y_stride, y_slot_stride;
#ifdef EXPERT_PART
    uint e_lo, e_hi;
#endif
#ifdef COMBINE
    uint norm, sync_off, nw_off, h_off, h_stride;
    float eps;
    uint b_off;
#endif
#ifdef GLU
    uint b_off, oai;
    float alpha, limit;
#endif
} p;

#include "quant.glsl"
#ifdef COMBINE
#include "combine_norm.glsl"
#endif

#ifndef UNROLL
float row_dot(uint grow, uint xb) {
    uint units = units_per_row(p.K);
    float acc = 0.0;
    for (uint u = gl_SubgroupInvocationID; u < units; u += gl_SubgroupSize) {
        vec4 v[UNIT_GROUPS];
        uint xo[UNIT_GROUPS];
        unit_load(p.w_off, p.w_off2, grow, u, p.K, v, xo);
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) acc += dot(v[g], act4[(xb + xo[g]) >> 2]);
    }
    return acc;
}
#else
// UNROLL (the "4" variants, Caps.mvid_unroll): a lane's units u, u + S, ..
// u + (UNROLL - 1) S of a row (rows_dot with n = 2: of two rows, GLU's gate and up)
// loaded before their products, UNROLL x 2 loads in flight where the loop
// above has one; each row's sum takes the same products in the same order,
// so the sums are bit for bit the plain variants' (and mul_mm_id's, whose
// union decode rows equal them)
#define NR 2
void rows_dot(uint n, uint grow[NR], uint xb, out float acc[NR]) {
    uint units = units_per_row(p.K), S = gl_SubgroupSize;
    [[unroll]] for (uint q = 0; q < NR; q++) acc[q] = 0.0;
    for (uint u = gl_SubgroupInvocationID; u < units; u += UNROLL * S) {
        vec4 v[NR][UNROLL][UNIT_GROUPS];
        uint xo[UNROLL][UNIT_GROUPS];
        [[unroll]] for (uint j = 0; j < UNROLL; j++) {
            if (u + j * S < units) {
                [[unroll]] for (uint q = 0; q < NR; q++) {
                    vec4 vq[UNIT_GROUPS];
                    if (q < n) unit_load(p.w_off, p.w_off2, grow[q], u + j * S, p.K, vq, xo[j]);
                    v[q][j] = vq;
                }
            }
        }
        [[unroll]] for (uint j = 0; j < UNROLL; j++) {
            if (u + j * S < units) {
                vec4 xv[UNIT_GROUPS];
                [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) xv[g] = act4[(xb + xo[j][g]) >> 2];
                [[unroll]] for (uint q = 0; q < NR; q++) {
                    if (q < n) {
                        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) acc[q] += dot(v[q][j][g], xv[g]);
                    }
                }
            }
        }
    }
}
float row_dot(uint grow, uint xb) {
    uint g2[NR] = uint[NR](grow, grow);
    float a[NR];
    rows_dot(1u, g2, xb, a);
    return a[0];
}
#endif

#ifdef COMBINE
#define KMAX 16   // experts a row (moe_router.comp's KMAX)
void main() {
    uvec2 rows = workgroup_items(p.M);
    uint r = gl_WorkGroupID.z;
    uint rb = p.ids_off + r * p.ids_stride;
    for (uint m = rows.x + gl_SubgroupID; m < rows.y; m += gl_NumSubgroups) {
        float part[KMAX];   // the k dots' lane partials first (their loads in flight together)
        [[unroll]] for (uint i = 0u; i < KMAX; i++) {
            if (i < p.k) part[i] = row_dot(actu[rb + i] * p.M + m, p.x_off + r * p.x_stride + i * p.x_slot_stride);
        }
        float s = 0.0;
        [[unroll]] for (uint i = 0u; i < KMAX; i++) {
            if (i < p.k) {
                float v = subgroupAdd(part[i]);
                if (p.b_off != 0xffffffffu) v = v + eb[p.b_off + actu[rb + i] * p.M + m];   // (as moe_bias.comp)
                s = fma(act[rb + p.k + i], v, s);   // (as moe_combine.comp)
            }
        }
        if (subgroupElect()) {
            uint yi = p.y_off + r * p.y_stride + m;
            yc[yi] = yc[yi] + s;
        }
    }
    combine_norm();
}
#else
void main() {
#ifdef GLU
    uvec2 rows = workgroup_items(p.M / 2u);
#else
    uvec2 rows = workgroup_items(p.M);
#endif
    uint pair = gl_WorkGroupID.z;
    uint r = pair / p.k;
    uint i = pair % p.k;
    uint e = actu[p.ids_off + r * p.ids_stride + i];
#ifdef EXPERT_PART
    if (e < p.e_lo || e >= p.e_hi) return;     // uniform: the whole workgroup has this pair
    e -= p.e_lo;
#endif
    uint xb = p.x_off + r * p.x_stride + i * p.x_slot_stride;
    for (uint m = rows.x + gl_SubgroupID; m < rows.y; m += gl_NumSubgroups) {
#ifdef GLU
#ifdef UNROLL
        float gu[NR];
        rows_dot(2u, uint[NR](e * p.M + m, e * p.M + p.M / 2u + m), xb, gu);
        float g = subgroupAdd(gu[0]), u = subgroupAdd(gu[1]);
#else
        float g = row_dot(e * p.M + m, xb), u = row_dot(e * p.M + p.M / 2u + m, xb);
        g = subgroupAdd(g);
        u = subgroupAdd(u);
#endif
        if (p.b_off != 0xffffffffu) {   // (as moe_bias.comp: the expert's gate|up bias row)
            g = g + eb[p.b_off + e * p.M + m];
            u = u + eb[p.b_off + e * p.M + p.M / 2u + m];
        }
        if (subgroupElect())
            act[p.y_off + r * p.y_stride + i * p.y_slot_stride + m] =
                p.oai != 0u ? swiglu_oai(g, u, p.alpha, p.limit) : silu_mul(g, u);
#else
        float s = subgroupAdd(row_dot(e * p.M + m, xb));
        if (subgroupElect()) act[p.y_off + r * p.y_stride + i * p.y_slot_stride + m] = s;
#endif
    }
}
#endif
