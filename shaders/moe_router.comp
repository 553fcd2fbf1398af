#version 450
// MoE routing of each row: top-k experts by router logit, weights = softmax over
// the selected logits (= softmax over all experts, top-k, renormalized, as
// Qwen3_5MoeTopKRouter and llama.cpp's build_moe_ffn with norm_w), times w_scale.
// Ties go to the lowest expert index. Writes ids (as uint words) to y[r][0..k) and
// weights to y[r][k..2k); with rec_off != NO_REC also the ids to a record array.
// FIXED = 0: logits come from a matmul already in l[r].
// FIXED = 1 (parity mode, --fixed-experts): the kernel computes the logits
// itself from f32 weights, each as one serial fp32 sum over the hidden size in
// index order with no fused multiply-add (`precise`), so the choice does not
// depend on the device, its subgroup size or the batch; it stores them in l[r].
// One subgroup per row (moe_route.glsl: lane j owns experts j, j + S, ..., at most 64).
#include "common.glsl"
#include "moe_route.glsl"

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 1) buffer ActU { uint actu[]; };   // the same buffer, for ids

layout(push_constant) uniform P {
    uint h_off, h_stride;      // FIXED: hidden rows (D floats)
    uint l_off, l_stride;      // logits rows (E floats)
    uint y_off, y_stride;
    uint E, D, k, rows, w_off;
    uint rec_off, rec_stride;
    float w_scale;
} p;

const uint NONE = 0xffffffffu;

void main() {
    uvec2 items = workgroup_items(p.rows);
    for (uint r = items.x + gl_SubgroupID; r < items.y; r += gl_NumSubgroups) {
        uint lb = p.l_off + r * p.l_stride;
#if FIXED
        uint hb = p.h_off + r * p.h_stride;
        for (uint e = gl_SubgroupInvocationID; e < p.E; e += gl_SubgroupSize) {
            precise float acc = 0.0;
            for (uint d = 0u; d < p.D; d++) {
                precise float prod = act[hb + d] * wf[p.w_off + e * p.D + d];
                acc = acc + prod;
            }
            act[lb + e] = acc;
        }
#endif
#define RL(e) act[lb + (e)]
#define RPUT(t, id, w) { \
            uint yb_ = p.y_off + r * p.y_stride; \
            actu[yb_ + (t)] = (id); \
            act[yb_ + p.k + (t)] = (w); \
            if (p.rec_off != NONE) actu[p.rec_off + r * p.rec_stride + (t)] = (id); }
        MOE_ROUTE_ROW(RL, p.E, p.k, p.w_scale, RPUT)
    }
}
