#version 450
// y[r][i][c] += b[e_ri][c] for c < M: each routed expert's bias (gpt-oss's
// expert gate|up and down biases) added to its slot of a row's expert outputs,
// e_ri the expert id in route[r][i] (moe_router's ids, as float bits). One
// invocation per (row, slot, column).
#include "common.glsl"

layout(binding = 0) readonly buffer B { float b[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 1) buffer ActU { uint actu[]; };

layout(push_constant) uniform P {
    uint b_off, M, route_off, route_stride, k;
    uint y_off, y_stride, y_slot_stride, rows;
} p;

void main() {
    uint t = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (t >= p.rows * p.k * p.M) return;
    uint c = t % p.M;
    uint ri = t / p.M;
    uint r = ri / p.k, i = ri % p.k;
    uint e = actu[p.route_off + r * p.route_stride + i];
    uint yi = p.y_off + r * p.y_stride + i * p.y_slot_stride + c;
    act[yi] = act[yi] + b[p.b_off + e * p.M + c];
}
