#version 450
// y[r][c] += b[c] for c < n (a bias vector added to every row: Qwen2's q/k/v
// biases after their matmul). b lives in a weight buffer, y in the activations.
#include "common.glsl"

layout(binding = 0) readonly buffer W { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint b_off, y_off, y_stride;
    uint n, rows;
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows * p.n) return;
    uint r = i / p.n;
    uint c = i % p.n;
    act[p.y_off + r * p.y_stride + c] += wf[p.b_off + c];
}
