#version 450
// dst[i] = src[i] over vec4s, VPT vec4s per invocation (unrolled, coalesced:
// consecutive invocations touch consecutive vec4s). Used to measure the
// device's copy bandwidth, the ceiling that decode is compared with.
#include "common.glsl"

layout(binding = 0) readonly buffer Src { vec4 src[]; };
layout(binding = 1) writeonly buffer Dst { vec4 dst[]; };

layout(push_constant) uniform P {
    uint src_off, dst_off, n;   // in vec4s
} p;

#define VPT 4

void main() {
    uint wg = workgroup_linear();
    uint base = wg * gl_WorkGroupSize.x * VPT + gl_LocalInvocationID.x;
    [[unroll]] for (uint k = 0; k < VPT; k++) {
        uint i = base + k * gl_WorkGroupSize.x;
        if (i < p.n) dst[p.dst_off + i] = src[p.src_off + i];
    }
}
