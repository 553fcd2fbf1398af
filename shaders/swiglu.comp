#version 450
// y[r][i] = silu(gu[r][i]) * gu[r][F + i]: gate and up projections side by side
// (one matmul over the concatenated ffn_gate|ffn_up weight). GELU: gelu_tanh
// instead of silu (GeGLU: Gemma's FFN). OAI: gpt-oss's clamped SwiGLU
// (ggml's swiglu_oai): g = min(gate, limit), u = clamp(up, -limit, limit),
// y = g * sigmoid(alpha * g) * (u + 1).
// VEC4: 4 consecutive outputs an invocation through vec4 loads and stores
// (Kernels.swiglu takes it when F, the offsets and the strides are multiples
// of 4): the scalar kernel moved 1.2 TB/s on the H200 for a 512-row 8B
// prefill, a third of what the copy does.
#include "common.glsl"

layout(binding = 0) buffer Act { float act[]; };
layout(binding = 0) buffer Act4 { vec4 act4[]; };

layout(push_constant) uniform P {
    uint gu_off, gu_stride, y_off, y_stride;
    uint F, rows;
#ifdef OAI
    float alpha, limit;
#endif
} p;

float glu(float g, float u) {
#if defined(OAI)
    return swiglu_oai(g, u, p.alpha, p.limit);
#elif defined(GELU)
    return gelu_tanh(g) * u;
#else
    return silu_mul(g, u);
#endif
}

void main() {
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
#ifdef VEC4
    uint f4 = p.F / 4u;
    if (i >= p.rows * f4) return;
    uint r = i / f4, c = i % f4;
    uint gb = (p.gu_off + r * p.gu_stride) / 4u;
    vec4 g = act4[gb + c], u = act4[gb + f4 + c];
    act4[(p.y_off + r * p.y_stride) / 4u + c] = vec4(glu(g.x, u.x), glu(g.y, u.y), glu(g.z, u.z), glu(g.w, u.w));
#else
    if (i >= p.rows * p.F) return;
    uint r = i / p.F;
    uint c = i % p.F;
    uint gb = p.gu_off + r * p.gu_stride;
    act[p.y_off + r * p.y_stride + c] = glu(act[gb + c], act[gb + p.F + c]);
#endif
}
