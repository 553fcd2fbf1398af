#version 450
// y[r][i] = silu(gu[r][i]) * gu[r][F + i]: gate and up projections side by side
// (one matmul over the concatenated ffn_gate|ffn_up weight).
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint gu_off, gu_stride, y_off, y_stride;
    uint F, rows;
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows * p.F) return;
    uint r = i / p.F;
    uint c = i % p.F;
    uint gb = p.gu_off + r * p.gu_stride;
    act[p.y_off + r * p.y_stride + c] = silu(act[gb + c]) * act[gb + p.F + c];
}
