#version 450
// y[r][i] = x[r][i] * sigmoid(g[r][gate(i)]), gate(i) = (i / blk) * g_blk_stride
// + (i % blk) * g_step: per-element gates laid out in blocks (the gated
// attention's gate, head_dim values every 2*head_dim in the q projection) or
// one gate per row (blk = n, g_step = 0: the shared expert's gate).
// One invocation per element; y may alias x.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint g_off, g_stride, blk, g_blk_stride, g_step;
    uint n, rows;
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows * p.n) return;
    uint r = i / p.n;
    uint c = i % p.n;
    float g = act[p.g_off + r * p.g_stride + (c / p.blk) * p.g_blk_stride + (c % p.blk) * p.g_step];
    act[p.y_off + r * p.y_stride + c] = act[p.x_off + r * p.x_stride + c] / (1.0 + exp(-g));
}
