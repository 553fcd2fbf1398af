#version 450
// y[r][h] = x[r][h] * inversesqrt(sum(x[r][h]^2) + eps) over the heads of each
// row (Gated DeltaNet's q and k; the `l2norm` of HF's modeling_qwen3_5.py, eps
// inside the root as FLA does). One subgroup per (row, head); in place allowed.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint head_dim, n_heads, rows;
    float eps;
} p;

void main() {
    uvec2 items = workgroup_items(p.rows * p.n_heads);
    for (uint it = items.x + gl_SubgroupID; it < items.y; it += gl_NumSubgroups) {
        uint r = it / p.n_heads;
        uint h = it % p.n_heads;
        uint xb = p.x_off + r * p.x_stride + h * p.head_dim;
        uint yb = p.y_off + r * p.y_stride + h * p.head_dim;
        float ss = 0.0;
        for (uint i = gl_SubgroupInvocationID; i < p.head_dim; i += gl_SubgroupSize) {
            float v = act[xb + i];
            ss += v * v;
        }
        float scale = inversesqrt(subgroupAdd(ss) + p.eps);
        for (uint i = gl_SubgroupInvocationID; i < p.head_dim; i += gl_SubgroupSize) {
            act[yb + i] = act[xb + i] * scale;
        }
    }
}
