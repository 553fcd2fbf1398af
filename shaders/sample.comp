#version 450
// Second pass of sampling on the device: a workgroup per row merges the
// row's topk_part.comp lists into its top_k candidates (the same order:
// largest first, equal values by lowest index), then one invocation draws the
// token (sample_draw.glsl: Sampler's draw in float32 with the row's uniform;
// temperature <= 0: the argmax). The token goes to the params buffer, where
// greedy tokens go, so a chained step reads it the same way.
// Per row r, params words samp_off + 8 r ..: temperature, top_k (1..k),
// top_p, min_p, u (floats as bits, top_k an integer).
#include "common.glsl"
#include "topk.glsl"

#define VPL 16
#define KMAX 64

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

#include "sample_draw.glsl"

void main() {
    uint WG = gl_WorkGroupSize.x, lid = gl_LocalInvocationID.x;
    uint r = workgroup_linear();
    if (r >= p.rows) return;
    uint sp = p.samp_off + 8u * r;
    float temp = uintBitsToFloat(params[sp]);   // (sample_draw reads the rest)
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
    uint tok = sample_draw(topv, topi, rounds, sp);
    params[p.out_off + r] = tok;
}
