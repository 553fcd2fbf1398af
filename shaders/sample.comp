#version 450
// Second pass of sampling on the device: a workgroup per row merges the
// row's topk_part.comp lists into its top_k candidates (the same order:
// largest first, equal values by lowest index), then one invocation draws the
// token as vkengine/sampling.py's Sampler does, in float32: top-k, top-p and
// min-p on the softmax of the logits, then the softmax at the temperature and
// the draw with the row's uniform u (cdf searched as numpy's choice: the first
// candidate whose normalized cdf exceeds u). temperature <= 0: the best
// candidate (the argmax). The token goes to the params buffer, where greedy
// tokens go, so a chained step reads it the same way.
// Per row r, params words samp_off + 8 r ..: temperature, top_k (1..k),
// top_p, min_p, u (floats as bits, top_k an integer).
#include "common.glsl"

#define VPL 16
#define KMAX 64
#define NONE 0xffffffffu

layout(binding = 0) readonly buffer Act { float act[]; };
layout(binding = 0) readonly buffer ActU { uint actu[]; };
layout(binding = 1) buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint tmp_off, n_cand, rows;   // n_cand pairs a row (slices x k)
    uint samp_off, out_off;
} p;

shared float sv[2][64];
shared uint si[2][64];
shared float topv[KMAX];
shared uint topi[KMAX];

bool before(float av, uint ai, float bv, uint bi) { return av > bv || (av == bv && ai < bi); }

void main() {
    uint WG = gl_WorkGroupSize.x, lid = gl_LocalInvocationID.x;
    uint r = workgroup_linear();
    if (r >= p.rows) return;
    uint sp = p.samp_off + 8u * r;
    float temp = uintBitsToFloat(params[sp]);
    uint top_k = clamp(params[sp + 1u], 1u, uint(KMAX));
    uint rounds = temp > 0.0 ? top_k : 1u;
    uint cb = p.tmp_off + 2u * r * p.n_cand;
    float v[VPL];
    uint ix[VPL];
    float bv = -1.0 / 0.0;
    uint bi = NONE;
    [[unroll]] for (uint j = 0; j < VPL; j++) {
        uint c = j * WG + lid;
        v[j] = c < p.n_cand ? act[cb + 2u * c] : -1.0 / 0.0;
        ix[j] = c < p.n_cand ? actu[cb + 2u * c + 1u] : NONE;
        if (ix[j] != NONE && before(v[j], ix[j], bv, bi)) { bv = v[j]; bi = ix[j]; }
    }
    for (uint k = 0; k < rounds; k++) {
        float m = subgroupMax(bv);
        uint mi = subgroupMin(bv == m ? bi : NONE);
        uint h = k & 1u;
        if (subgroupElect()) { sv[h][gl_SubgroupID] = m; si[h][gl_SubgroupID] = mi; }
        barrier();
        float wv = sv[h][0];
        uint wi = si[h][0];
        for (uint g = 1; g < gl_NumSubgroups; g++)
            if (before(sv[h][g], si[h][g], wv, wi)) { wv = sv[h][g]; wi = si[h][g]; }
        if (lid == 0u) { topv[k] = wv; topi[k] = wi; }
        if (wi != NONE && bi == wi) {
            bv = -1.0 / 0.0;
            bi = NONE;
            [[unroll]] for (uint j = 0; j < VPL; j++)
                if (ix[j] != NONE && before(wv, wi, v[j], ix[j]) && before(v[j], ix[j], bv, bi)) {
                    bv = v[j]; bi = ix[j];
                }
        }
    }
    barrier();
    if (lid != 0u) return;
    uint nk = 0u;
    while (nk < rounds && topi[nk] != NONE) nk++;
    uint tok = 0u;
    if (nk > 0u) tok = topi[0];
    float l0 = nk > 0u ? topv[0] : 0.0;
    if (temp > 0.0 && nk > 1u && !isinf(l0)) {
        float top_p = uintBitsToFloat(params[sp + 2u]), min_p = uintBitsToFloat(params[sp + 3u]);
        float u = uintBitsToFloat(params[sp + 4u]);
        float sum = 0.0;
        for (uint j = 0; j < nk; j++) sum += exp(topv[j] - l0);
        uint keep = nk;
        if (top_p < 1.0) {            // the first prefix whose probabilities reach top_p
            float cum = 0.0;
            for (uint j = 0; j < nk; j++) {
                cum += exp(topv[j] - l0) / sum;
                if (cum >= top_p) { keep = j + 1u; break; }
            }
        }
        if (min_p > 0.0) {            // probabilities at least min_p times the first's
            float p0 = 1.0 / sum;
            uint kk = 1u;
            while (kk < keep && exp(topv[kk] - l0) / sum >= min_p * p0) kk++;
            keep = kk;
        }
        float s0 = l0 / temp;
        bool gaps = isinf(s0) || isnan(s0);   // a temperature so small that it overflows
        float tot = 0.0;
        for (uint j = 0; j < keep; j++) tot += exp((gaps ? (topv[j] - l0) / temp : topv[j] / temp - s0));
        float c = 0.0;
        uint pick = keep - 1u;
        for (uint j = 0; j < keep; j++) {
            c += exp((gaps ? (topv[j] - l0) / temp : topv[j] / temp - s0));
            if (c / tot > u) { pick = j; break; }
        }
        tok = topi[pick];
    }
    params[p.out_off + r] = tok;
}
