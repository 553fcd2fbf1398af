#version 450
// Second pass of sampling on the device: a workgroup per row merges the
// row's topk_part.comp lists (the first top_k pairs of each: topk_part wrote
// no more) into its top_k candidates (topk.glsl's topk_wg: the same order,
// largest first, equal values by lowest index), then one invocation draws the
// token (sample_draw.glsl: Sampler's draw in float32 with the row's uniform;
// temperature <= 0: the argmax). The token goes to the params buffer, where
// greedy tokens go, so a chained step reads it the same way.
// Per row r, params words samp_off + 8 r ..: temperature, top_k (1..k),
// top_p, min_p, u (floats as bits, top_k an integer).
#include "common.glsl"
#define TOPK_VPL 16
#include "topk.glsl"
#define KMAX TOPK_MAX
layout(binding = 0) readonly buffer Act { float act[]; };
layout(binding = 0) readonly buffer ActU { uint actu[]; };
layout(binding = 1) buffer Params { uint params[]; };
layout(push_constant) uniform P {
    uint tmp_off, n_cand, rows;   // n_cand pairs a row (slices x KMAX)
    uint samp_off, out_off;
} p;
#include "sample_draw.glsl"
void main() {
    uint WG = gl_WorkGroupSize.x, lid = gl_LocalInvocationID.x;
    uint r = workgroup_linear();
    if (r >= p.rows) return;
    uint sp = p.samp_off + 8u * r;
    float temp = uintBitsToFloat(params[sp]);   // (sample_draw reads the rest)
    uint top_k = clamp(params[sp + 1u], 1u, uint(KMAX));
    uint rounds = temp > 0.0 ? top_k : 1u;      // topk_part.comp wrote as many a slice
    uint cb = p.tmp_off + 2u * r * p.n_cand;
    float v[TOPK_VPL];
    uint ix[TOPK_VPL];
    [[unroll]] for (uint j = 0; j < TOPK_VPL; j++) {
        uint c = j * WG + lid;
        bool ok = c < p.n_cand && c % KMAX < rounds;
        v[j] = ok ? act[cb + 2u * c] : -1.0 / 0.0;
        ix[j] = ok ? actu[cb + 2u * c + 1u] : NONE;
    }
    if (!topk_wg(v, ix, rounds)) return;
    params[p.out_off + r] = sample_draw(tk_v, tk_i, rounds, sp);
}
