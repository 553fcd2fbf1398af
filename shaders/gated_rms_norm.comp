#version 450
// y[r][h] = x[r][h] / rms(x[r][h]) * w * silu(z[r][h]) per head of each row:
// the gated RMSNorm closing a Gated DeltaNet block (Qwen3_5RMSNormGated in HF,
// build_norm_gated in llama.cpp's qwen35.cpp). w (head_dim floats) is shared by
// the heads and, unlike the model's other norms, has no +1 folded in. One
// subgroup per (row, head); y may alias x. (Decode steps take it inside the
// delta rule: delta_rule.comp's GNORM, the same arithmetic, gnorm.glsl.)
#include "common.glsl"
#include "gnorm.glsl"

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, z_off, z_stride, y_off, y_stride;
    uint w_off, head_dim, n_heads, rows;
    float eps;
} p;

void main() {
    uvec2 items = workgroup_items(p.rows * p.n_heads);
    for (uint it = items.x + gl_SubgroupID; it < items.y; it += gl_NumSubgroups) {
        uint r = it / p.n_heads;
        uint h = it % p.n_heads;
        uint xb = p.x_off + r * p.x_stride + h * p.head_dim;
        uint zb = p.z_off + r * p.z_stride + h * p.head_dim;
        uint yb = p.y_off + r * p.y_stride + h * p.head_dim;
#define GX(i) act[xb + (i)]
#define GZ(i) act[zb + (i)]
#define GW(i) wf[p.w_off + (i)]
#define GY(i, v) act[yb + (i)] = (v)
        GNORM_HEAD(GX, GZ, GW, GY, p.head_dim, p.eps)
    }
}
