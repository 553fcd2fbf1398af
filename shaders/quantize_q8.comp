#version 450
// x rows (floats) -> 8-bit blocks for the integer-dot matvecs (mul_mv.comp's
// XQ8 variants), as llama.cpp quantizes activations for its integer-dot
// matvecs (q8_1 without the block sum): per block of 32 values, d = max|x| /
// 127 and q = roundEven(x * (1 / d)), clamped to +-127 (q = 0 where d = 0).
// Output (binding 1): per row, K / 4 words of 4 int8 (value k in byte k % 4 of
// word k / 4) from word q_off + row * K / 4, and the block scales as floats from
// d_off + row * K / 32. One invocation per block.
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

layout(binding = 0) readonly restrict buffer X4 { vec4 x4[]; };
layout(binding = 1) writeonly restrict buffer Q { uint q[]; };
layout(binding = 1) writeonly restrict buffer D { float dq[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride;   // floats, multiples of 4
    uint K, rows;           // K a multiple of 32
    uint q_off, d_off;      // words
} p;

uint pack4(vec4 v, float id) {
    ivec4 i = clamp(ivec4(roundEven(v * id)), ivec4(-127), ivec4(127));
    return uint(i.x & 255) | (uint(i.y & 255) << 8) | (uint(i.z & 255) << 16) | (uint(i.w & 255) << 24);
}

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
        vec4 a = abs(v[i]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    float d = amax / 127.0;
    float id = d > 0.0 ? 1.0 / d : 0.0;
    uint qb = p.q_off + row * (p.K / 4u) + blk * 8u;
    [[unroll]] for (uint i = 0u; i < 8u; i++) q[qb + i] = pack4(v[i], id);
    dq[p.d_off + row * nb + blk] = d;
}
