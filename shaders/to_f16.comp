#version 450
// x (fp32 rows) -> halves for mul_mc2.comp's direct loads: h[r][c] = half(x[r][c])
// in rows of h_stride8 * 8 halves, zeros past `cols` and in rows rows ..
// rows_pad (mul_mc2 loads whole tiles of tokens). One invocation per 8 halves.
#include "common.glsl"

layout(binding = 0) readonly buffer Act { float act[]; };
layout(binding = 1) writeonly buffer H { uvec4 h[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, cols, rows, rows_pad;
    uint h_off8, h_stride8;   // in units of 8 halves
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows_pad * p.h_stride8) return;
    uint r = i / p.h_stride8, c0 = (i % p.h_stride8) * 8u;
    float v[8];
    [[unroll]] for (uint j = 0u; j < 8u; j++)
        v[j] = r < p.rows && c0 + j < p.cols ? act[p.x_off + r * p.x_stride + c0 + j] : 0.0;
    h[p.h_off8 + i] = uvec4(packHalf2x16(vec2(v[0], v[1])), packHalf2x16(vec2(v[2], v[3])),
                            packHalf2x16(vec2(v[4], v[5])), packHalf2x16(vec2(v[6], v[7])));
}
