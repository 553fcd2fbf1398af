#version 450
// x[r][i] = cap * tanh(x[r][i] / cap), in place: Gemma 2's final logit
// soft-capping (tanh's argument clamped where it is +-1 in float32).
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, n, rows;
    float cap;
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows * p.n) return;
    uint a = p.x_off + (i / p.n) * p.x_stride + i % p.n;
    act[a] = p.cap * tanh(clamp(act[a] / p.cap, -10.0, 10.0));
}
