#version 450
// The last step of a split-K matmul (Kernels.mul_mat, split_k_parts): y[c][r]
// (+)= sum over parts s < S of part[s][c][r], the parts' partial sums over
// their K ranges (mul_mt/mul_mc with klen), added in part order so a
// result does not depend on scheduling. Parts are N x M row-major (stride M),
// z_stride floats apart, in their own buffer.
#include "common.glsl"

layout(binding = 0) readonly restrict buffer Part { float part[]; };
layout(binding = 1) buffer Y { float act[]; };

layout(push_constant) uniform P {
    uint parts, z_stride, M, N;
    uint y_off, y_stride, accumulate;
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.M * p.N) return;
    uint c = i / p.M, r = i % p.M;
    float s = part[i];
    for (uint z = 1u; z < p.parts; z++) s += part[z * p.z_stride + i];
    uint yi = p.y_off + c * p.y_stride + r;
    act[yi] = p.accumulate != 0u ? act[yi] + s : s;
}
