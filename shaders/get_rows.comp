#version 450
// Embedding lookup: y[r][:] = scale * dequant(W[ids[r]][:]), ids read from the params
// buffer. One invocation per (row, unit). ROW_PART: W holds rows [row_lo,
// row_hi) of a matrix split across buffers; other ids are left to their parts.
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { uint wq[]; };
layout(binding = 1) writeonly buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };

layout(push_constant) uniform P {
    uint w_off, w_off2;
    uint K, n_rows;
    uint ids_off;           // uint index into params
    uint y_off, y_stride;
    float scale;            // y = scale * W[id] (Gemma's embeddings times sqrt(n_embd))
#ifdef ROW_PART
    uint row_lo, row_hi;
#endif
} p;

#include "quant.glsl"

void main() {
    uint units = units_per_row(p.K);
    uint i = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (i >= p.n_rows * units) return;
    uint r = i / units;
    uint u = i % units;
    uint id = params[p.ids_off + r];
#ifdef ROW_PART
    if (id < p.row_lo || id >= p.row_hi) return;
    id -= p.row_lo;
#endif
    vec4 v[UNIT_GROUPS];
    uint xo[UNIT_GROUPS];
    unit_load(p.w_off, p.w_off2, id, u, p.K, v, xo);
    uint yb = p.y_off + r * p.y_stride;
    [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) {
        [[unroll]] for (uint k = 0; k < 4; k++) act[yb + xo[g] + k] = v[g][k] * p.scale;
    }
}
