#version 450
// y[r][d] += sum_i wt[r][i] * e[r][i][d]: the experts' outputs of a row,
// weighted by the router (route[r][k + i]) and added to the residual, in slot
// order. One invocation per (row, column).
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };

layout(push_constant) uniform P {
    uint e_off, e_stride, e_slot_stride;
    uint route_off, route_stride, k;
    uint y_off, y_stride, D, rows;
} p;

void main() {
    uint t = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (t >= p.rows * p.D) return;
    uint r = t / p.D;
    uint d = t % p.D;
    float s = 0.0;
    for (uint i = 0u; i < p.k; i++) {
        // an explicit fma: the same rounding as mul_mv_id.comp's COMBINE whatever a compiler contracts
        s = fma(act[p.route_off + r * p.route_stride + p.k + i], act[p.e_off + r * p.e_stride + i * p.e_slot_stride + d],
                s);
    }
    uint yi = p.y_off + r * p.y_stride + d;
    act[yi] = act[yi] + s;
}
