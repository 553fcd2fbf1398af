#version 450
// Probe kernel (bench/mv_probe.py, kind mvq; the engine runs mul_mvk.comp's XQ8
// variants instead): the decode
// matvec of Q8_0 weights with x quantized to 8 bits per 32-value block (as
// llama.cpp's batched decode does), summed with integer dot products:
//   y[c][row] = sum_b d_w[row][b] * d_x[c][b] * sum_i q_w[row][b][i] * q_x[c][b][i]
// A workgroup takes RPS rows and all its invocations walk their units of VALS
// values (8, 16 or 32: a quarter, half or whole block; split K, like
// mul_mv.comp's GPU variants); each weight unit is loaded once for NCOLS
// columns, and 4 values of a column cost one dotPacked4x8 instead of 4
// conversions and 4 multiply-adds.
// x layout (binding 1, from word xq_off): per column, per block, 8 words of 4
// int8; its scales as floats from xd_off, per column, per block.
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_integer_dot_product : require
#extension GL_EXT_shader_explicit_arithmetic_types_int32 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require

#ifndef RPS
#define RPS 4
#endif
#ifndef NCOLS
#define NCOLS 1
#endif
#ifndef VALS
#define VALS 32
#endif
#define PARTS (32u / VALS)   // units a block
#define PAIRS (VALS / 8u)    // ivec2 loads a unit
#define WG 128

layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

layout(binding = 0) readonly restrict buffer W2 { ivec2 w2[]; };
layout(binding = 0) readonly restrict buffer W1 { uint w1[]; };
layout(binding = 1) readonly restrict buffer XQ2 { ivec2 xq2[]; };
layout(binding = 1) readonly restrict buffer XD { float xd[]; };
layout(binding = 2) buffer Y { float act[]; };

layout(push_constant) uniform P {
    uint w_off, w_off2;     // words: quants (a multiple of 4), scales (halves)
    uint K, M, N;
    uint xq_off, xd_off;    // words (a multiple of 4), floats
    uint y_off, y_stride;   // floats
} p;

shared float red[32][RPS * NCOLS];   // per subgroup (at most 32 of them: 4+ lanes)

int dotu(ivec2 a[PAIRS], ivec2 b[PAIRS]) {
    int s = 0;
    [[unroll]] for (uint i = 0; i < PAIRS; i++) s += dotPacked4x8EXT(a[i].x, b[i].x) + dotPacked4x8EXT(a[i].y, b[i].y);
    return s;
}

void main() {
    uint nb = p.K / 32u, units = nb * PARTS;
    uint row0 = gl_WorkGroupID.x * RPS;
    uint col0 = gl_WorkGroupID.z * NCOLS;
    uint ncols = min(uint(NCOLS), p.N - col0);
    float acc[RPS][NCOLS];
    [[unroll]] for (uint r = 0; r < RPS; r++)
        [[unroll]] for (uint c = 0; c < NCOLS; c++) acc[r][c] = 0.0;
    for (uint u = gl_LocalInvocationID.x; u < units; u += WG) {
        uint b = u / PARTS, part = u % PARTS;
        ivec2 xv[NCOLS][PAIRS];
        float xs[NCOLS];
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            uint cc = min(col0 + c, p.N - 1u);
            uint xi = p.xq_off / 2u + (cc * nb + b) * 4u + part * PAIRS;
            [[unroll]] for (uint i = 0; i < PAIRS; i++) xv[c][i] = xq2[xi + i];
            xs[c] = xd[p.xd_off + cc * nb + b];
        }
        [[unroll]] for (uint r = 0; r < RPS; r++) {
            uint row = min(row0 + r, p.M - 1u);
            uint blk = row * nb + b;
            ivec2 wv[PAIRS];
            [[unroll]] for (uint i = 0; i < PAIRS; i++) wv[i] = w2[p.w_off / 2u + blk * 4u + part * PAIRS + i];
            vec2 dd = unpackHalf2x16(w1[p.w_off2 + (blk >> 1)]);
            float d = (blk & 1u) != 0u ? dd.y : dd.x;
            [[unroll]] for (uint c = 0; c < NCOLS; c++)
                acc[r][c] += float(dotu(wv, xv[c])) * (d * xs[c]);
        }
    }
    [[unroll]] for (uint r = 0; r < RPS; r++)
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            float s = subgroupAdd(acc[r][c]);
            if (subgroupElect()) red[gl_SubgroupID][r * NCOLS + c] = s;
        }
    barrier();
    uint i = gl_LocalInvocationID.x;
    if (i < RPS * NCOLS) {
        uint r = i / NCOLS, c = i % NCOLS;
        if (c < ncols && row0 + r < p.M) {
            float s = red[0][i];
            for (uint g = 1u; g < gl_NumSubgroups; g++) s += red[g][i];
            act[p.y_off + (col0 + c) * p.y_stride + row0 + r] = s;
        }
    }
}
