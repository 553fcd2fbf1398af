#version 450
// Weights read ahead into the device's last-level cache: a word of every 32-byte
// sector (NVIDIA's L2 allocates by sector) of up to four word ranges of one
// buffer, each invocation UN of them, consecutive invocations consecutive
// sectors. A decode step records it beside its attention (no barrier between
// them: they run together) over the weights of the matvecs after it, which the
// attention's latency-bound chain leaves the memory idle for
// (Graph.prefetch, Options.prefetch). The words read are XORed into the sink
// word (so that the loads are used; tests check the sum against numpy).
#include "common.glsl"

layout(binding = 0) readonly buffer Src { uint src[]; };
layout(binding = 1) buffer Sink { uint sink[]; };

layout(push_constant) uniform P {
    uint off_a, n_a, off_b, n_b;   // the ranges' first words and their sectors (8 words each, the last maybe short)
    uint off_c, n_c, off_d, n_d;
    uint sink_off;
} p;

#define UN 8

void main() {
    uint nab = p.n_a + p.n_b, nabc = nab + p.n_c, n = nabc + p.n_d;
    uint base = workgroup_linear() * gl_WorkGroupSize.x * UN + gl_LocalInvocationID.x;
    uint w = 0u;
    [[unroll]] for (uint k = 0u; k < UN; k++) {
        uint i = base + k * gl_WorkGroupSize.x;
        uint at = i < p.n_a ? p.off_a + 8u * i : i < nab ? p.off_b + 8u * (i - p.n_a)
                : i < nabc ? p.off_c + 8u * (i - nab) : p.off_d + 8u * (i - nabc);
        if (i < n) w ^= src[at];
    }
    w = subgroupXor(w);
    if (subgroupElect()) atomicXor(sink[p.sink_off], w);
}
