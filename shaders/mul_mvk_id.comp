#version 450
// The GPUs' expert matvecs of decode-sized steps in mul_mvk.comp's split-K form
// (Caps.mvid_splitk): mul_mv_id.comp's GLU and COMBINE epilogues, the same push
// constants, bindings and results up to rounding, but a workgroup takes RPS
// weight rows and all its invocations walk their units together (mul_mvk's
// loads in flight, its unit decoding and butterfly reduction), where
// mul_mv_id gives each row one subgroup that walks it alone.
// GLU (grid: row groups of H = RPS / 2 outputs in x/y, pairs r * k + i in z):
//   the workgroup's first H rows are gate rows of expert ids[r][i], the others
//   the up rows of the same outputs; y[r][i][m] = silu(gate_m . x) * (up_m . x).
// COMBINE (grid: row groups of RPS outputs in x/y, rows r in z): the units of
//   all k experts' rows m are one list, (expert slot, unit) pairs walked by all
//   the workgroup's invocations (a 512-column down projection leaves no lane
//   idle), each product weighted by the slot's router weight before the
//   reduction; y[r][m] += sum_i wt[r][i] * (W[ids[r][i]][m] . x[r][i]), then the
//   RMSNorm after that residual add when norm != 0 (mul_mv_id.comp's epilogue).
// Every decode row takes this kernel, batched or alone, so a row's result does
// not depend on its batch. Biases (b_off != 0xffffffff) as mul_mv_id's.
#include "common.glsl"

layout(binding = 0) readonly restrict buffer Wq { uint wq[]; };
layout(binding = 1) readonly restrict buffer X4 { vec4 act4[]; };
layout(binding = 1) readonly restrict buffer XU { uint actu[]; };
layout(binding = 1) readonly restrict buffer XF { float actf[]; };
#ifdef COMBINE
layout(binding = 2) coherent buffer Y { float yc[]; };
layout(binding = 2) coherent buffer Y4 { vec4 yc4[]; };
layout(binding = 2) coherent buffer Yu { uint ycu[]; };
layout(binding = 3) readonly buffer NW { vec4 nw4[]; };
shared float npart[32];
shared uint s_last;
#else
layout(binding = 2) buffer Y { float act[]; };
#endif
layout(binding = 4) readonly buffer EBias { float eb[]; };

layout(push_constant) uniform P {
    uint w_off, w_off2;          // expert 0's weight words / scale words
    uint K, M, k, n_rows;        // columns, rows per expert, experts per row, batch rows
    uint ids_off, ids_stride;
    uint x_off, x_stride, x_slot_stride;   // floats; multiples of 4
    uint y_off, y_stride, y_slot_stride;
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

#define NCOLS 1
// the x row of the unit being accumulated (accum_unit reads it through MV_XOFF)
uint g_xoff;
#define MV_XOFF(c) g_xoff
#include "quant.glsl"
#ifdef COMBINE
#include "combine_norm.glsl"
#endif
#include "mul_mv_unit.glsl"

#ifndef BFLY
#define BFLY 0
#endif
#if BFLY
#extension GL_KHR_shader_subgroup_shuffle : require
#define LOG2NV (RPS >= 32 ? 5u : RPS >= 16 ? 4u : RPS >= 8 ? 3u : RPS >= 4 ? 2u : RPS >= 2 ? 1u : 0u)
#endif
#define LANE gl_LocalInvocationID.x
shared float red[32][RPS];   // per subgroup (at most 32 of them)

// the workgroup's RPS sums of acc, added across its subgroups into red (in
// subgroup order by the caller); mul_mvk.comp's reduction with one column
void reduce_rows(float acc[RPS][NCOLS]) {
#if BFLY
    float vals[RPS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) vals[rr] = acc[rr][0];
    uint lane = gl_SubgroupInvocationID, j = 0u;
    [[unroll]] for (uint st = 0; st < LOG2NV; st++) {
        const uint hv = RPS >> (st + 1u);
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
#else
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
        float s = subgroupAdd(acc[rr][0]);
        if (subgroupElect()) red[gl_SubgroupID][rr] = s;
    }
#endif
    barrier();
}

float red_sum(uint i) {
    float s = red[0][i];
    for (uint sg = 1; sg < gl_NumSubgroups; sg++) s += red[sg][i];
    return s;
}

#ifdef GLU
void main() {
    const uint H = RPS / 2u;
    uint F = p.M / 2u;
    uint pair = gl_WorkGroupID.z;
    uint r = pair / p.k, i = pair % p.k;
    uint e = actu[p.ids_off + r * p.ids_stride + i];
    g_xoff = p.x_off + r * p.x_stride + i * p.x_slot_stride;
    uint pfirst = workgroup_linear() * H;
    uint prow[RPS];
    bool pok[RPS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
        uint j = rr < H ? rr : rr - H;
        prow[rr] = e * p.M + (rr < H ? 0u : F) + pfirst + j;
        pok[rr] = pfirst + j < F;
    }
    float acc[RPS][NCOLS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) acc[rr][0] = 0.0;
    uint units = units_per_row(p.K), S = gl_WorkGroupSize.x;
    for (uint u0 = LANE; u0 < units; u0 += S * UNROLL) {
        Raw raw[UNROLL][RPS];
        [[unroll]] for (uint q = 0; q < UNROLL; q++) {
            uint u = u0 + q * S;
            [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                if (u < units && pok[rr]) raw[q][rr] = unit_fetch(p.w_off, p.w_off2, prow[rr], u, p.K);
            }
        }
        [[unroll]] for (uint q = 0; q < UNROLL; q++) {
            uint u = u0 + q * S;
            if (u < units) accum_unit(raw[q], u, 0u, 1u, acc);
        }
    }
    reduce_rows(acc);
    uint t = gl_LocalInvocationID.x;
    if (t < H && pfirst + t < F) {
        float g = red_sum(t), u = red_sum(t + H);
        uint m = pfirst + t;
        if (p.b_off != 0xffffffffu) {   // (as moe_bias.comp: the expert's gate|up bias row)
            g = g + eb[p.b_off + e * p.M + m];
            u = u + eb[p.b_off + e * p.M + F + m];
        }
        act[p.y_off + r * p.y_stride + i * p.y_slot_stride + m] =
            p.oai != 0u ? swiglu_oai(g, u, p.alpha, p.limit) : silu_mul(g, u);
    }
}
#endif

#ifdef COMBINE
#define KMAX 16   // experts a row (moe_router.comp's KMAX)
void main() {
    uint r = gl_WorkGroupID.z;
    uint rb = p.ids_off + r * p.ids_stride;
    uint mfirst = workgroup_linear() * RPS;
    uint xrow = p.x_off + r * p.x_stride;
    bool pok[RPS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) pok[rr] = mfirst + rr < p.M;
    float acc[RPS][NCOLS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) acc[rr][0] = 0.0;
    uint units = units_per_row(p.K), S = gl_WorkGroupSize.x, total = p.k * units;
    for (uint t0 = LANE; t0 < total; t0 += S * UNROLL) {
        Raw raw[UNROLL][RPS];
        [[unroll]] for (uint q = 0; q < UNROLL; q++) {
            uint t = t0 + q * S;
            uint i = t / units, u = t - i * units;
            uint e = t < total ? actu[rb + i] : 0u;
            [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
                if (t < total && pok[rr]) raw[q][rr] = unit_fetch(p.w_off, p.w_off2, e * p.M + mfirst + rr, u, p.K);
            }
        }
        [[unroll]] for (uint q = 0; q < UNROLL; q++) {
            uint t = t0 + q * S;
            if (t >= total) continue;
            uint i = t / units, u = t - i * units;
            g_xoff = xrow + i * p.x_slot_stride;
            float part[RPS][NCOLS];
            [[unroll]] for (uint rr = 0; rr < RPS; rr++) part[rr][0] = 0.0;
            accum_unit(raw[q], u, 0u, 1u, part);
            float w = actf[rb + p.k + i];
            [[unroll]] for (uint rr = 0; rr < RPS; rr++) acc[rr][0] = fma(w, part[rr][0], acc[rr][0]);
        }
    }
    reduce_rows(acc);
    uint t = gl_LocalInvocationID.x;
    if (t < RPS && pok[t]) {
        uint m = mfirst + t;
        float s = red_sum(t);
        if (p.b_off != 0xffffffffu) {   // each slot's expert's down bias, weighted as its products
            for (uint i = 0u; i < p.k; i++) s = fma(actf[rb + p.k + i], eb[p.b_off + actu[rb + i] * p.M + m], s);
        }
        uint yi = p.y_off + r * p.y_stride + m;
        yc[yi] = yc[yi] + s;
    }
    combine_norm();
}
#endif
