#version 450
// y[r][i] = a[r][i] + b[r][i] (residual add, for graphs where it cannot be
// fused into the preceding matmul).
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint a_off, a_stride, b_off, b_stride, y_off, y_stride;
    uint n, rows;
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows * p.n) return;
    uint r = i / p.n;
    uint c = i % p.n;
    act[p.y_off + r * p.y_stride + c] = act[p.a_off + r * p.a_stride + c] + act[p.b_off + r * p.b_stride + c];
}
