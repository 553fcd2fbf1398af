#version 450
// x rows (floats) -> 8-bit blocks for the integer-dot matvecs (mul_mv.comp's
// XQ8 variants), as llama.cpp quantizes activations for its integer-dot
// matvecs (q8_1 without the block sum): q8.glsl's rounding.
// Output (binding 1): per row, K / 4 words of 4 int8 (value k in byte k % 4 of
// word k / 4) from word q_off + row * K / 4, and the block scales as floats from
// d_off + row * K / 32. One invocation per block.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "q8.glsl"

layout(binding = 0) readonly restrict buffer X4 { vec4 x4[]; };
layout(binding = 1) writeonly restrict buffer Q { uint q[]; };
layout(binding = 1) writeonly restrict buffer D { float dq[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride;   // floats, multiples of 4
    uint K, rows;           // K a multiple of 32
    uint q_off, d_off;      // words
} p;

void main() {
    uint nb = p.K / 32u;
    uint b = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (b >= p.rows * nb) return;
    uint row = b / nb, blk = b % nb;
    uint xb = (p.x_off + row * p.x_stride) / 4u + blk * 8u;
    vec4 v[8];
    float amax = 0.0;
    [[unroll]] for (uint i = 0u; i < 8u; i++) {
        v[i] = x4[xb + i];
        amax = max(amax, q8_amax4(v[i]));
    }
    float d = q8_scale(amax);
    float id = q8_inv(d);
    uint qb = p.q_off + row * (p.K / 4u) + blk * 8u;
    [[unroll]] for (uint i = 0u; i < 8u; i++) q[qb + i] = q8_pack(v[i], id);
    dq[p.d_off + row * nb + blk] = d;
}
