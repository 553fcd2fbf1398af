#version 450
// x[r][i] = -inf where bit i of row r's mask is clear (a grammar's allowed
// tokens, one bit a token, 32 a word, in the params buffer; an all-ones word
// leaves its 32 values alone): constrained decoding on the device's
// argmax / sampling path. One invocation a word.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 1) readonly buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, n, rows;
    uint mask_off, words;   // row r's mask: params[mask_off + r * words ..], words = ceil(n / 32)
} p;

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.rows * p.words) return;
    uint r = i / p.words, w = i % p.words;
    uint m = params[p.mask_off + i];
    if (m == 0xffffffffu) return;
    uint base = p.x_off + r * p.x_stride + w * 32u;
    uint top = min(32u, p.n - w * 32u);
    for (uint b = 0u; b < top; b++) {
        if ((m & (1u << b)) == 0u) act[base + b] = -1.0 / 0.0;
    }
}
