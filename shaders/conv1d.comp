#version 450
// Causal depthwise conv1d (kernel K <= KMAX) + SiLU over the rows of a step,
// with the last K-1 inputs of each sequence kept per slot (Gated DeltaNet's
// short convolution: ggml_ssm_conv in llama.cpp, causal_conv1d_update in HF):
//   y[r][c] = silu(sum_j w[c][j] * in(t - K + 1 + j)[c]),  w[c][K-1] on the newest input
// One invocation per channel walks the rows in order (RG at a time). Rows of one slot must be
// contiguous and consecutive in position (the host checks); a slot whose first
// row in the step is at position 0 starts from zeros, otherwise from its state.
// State per slot: [K-1][C] floats (oldest input first). With snap_rows > 0 the
// window after row r (r < snap_rows) is also written to snapshot r, so that a
// speculative step can be rolled back to any of its rows.
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) buffer State { float st[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint w_off;              // weights [C][K] in the weight buffer
    uint C, K, n_rows;
    uint state_off, slot_stride;   // floats; slot_stride = (K-1)*C
    uint snap_off, snap_rows;
    uint pos_off, slot_off;
} p;

#define KMAX 8
#define RG 8   // rows a group

void main() {
    uint c = workgroup_linear() * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    if (c >= p.C) return;
    uint km1 = p.K - 1u;
    float w[KMAX];
    [[unroll]] for (uint j = 0; j < KMAX; j++) w[j] = j < p.K ? wf[p.w_off + c * p.K + j] : 0.0;
    float win[KMAX];   // win[0..K-2]: previous inputs, oldest first
    [[unroll]] for (uint j = 0; j < KMAX; j++) win[j] = 0.0;
    uint cur = 0xffffffffu;
    // rows in groups of RG: their slots and inputs loaded before any is used,
    // so the walk waits for memory once a group rather than once a row (it is
    // bound by latency: one invocation per channel is few for a GPU)
    for (uint r0 = 0u; r0 < p.n_rows; r0 += RG) {
        uint slots[RG];
        float xs[RG];
        [[unroll]] for (uint g = 0; g < RG; g++) {
            uint r = min(r0 + g, p.n_rows - 1u);
            slots[g] = params[p.slot_off + r];
            xs[g] = act[p.x_off + r * p.x_stride + c];
        }
        [[unroll]] for (uint g = 0; g < RG; g++) {
            uint r = r0 + g;
            if (r >= p.n_rows) break;
            uint slot = slots[g];
            if (slot != cur) {
                if (cur != 0xffffffffu) {
                    for (uint j = 0u; j < km1; j++) st[p.state_off + cur * p.slot_stride + j * p.C + c] = win[j];
                }
                bool fresh = params[p.pos_off + r] == 0u;
                [[unroll]] for (uint j = 0; j < KMAX; j++) {
                    win[j] = (j < km1 && !fresh) ? st[p.state_off + slot * p.slot_stride + j * p.C + c] : 0.0;
                }
                cur = slot;
            }
            float x = xs[g];
            float acc = w[km1] * x;
            [[unroll]] for (uint j = 0; j < KMAX - 1; j++) {
                if (j < km1) acc += w[j] * win[j];
            }
            // shift the window: drop the oldest, append x
            [[unroll]] for (uint j = 0; j < KMAX - 1; j++) {
                if (j + 1u < km1) win[j] = win[j + 1];
                else if (j + 1u == km1) win[j] = x;
            }
            act[p.y_off + r * p.y_stride + c] = silu(acc);
            if (r < p.snap_rows) {
                for (uint j = 0u; j < km1; j++) st[p.snap_off + r * p.slot_stride + j * p.C + c] = win[j];
            }
        }
    }
    if (cur != 0xffffffffu) {
        for (uint j = 0u; j < km1; j++) st[p.state_off + cur * p.slot_stride + j * p.C + c] = win[j];
    }
}
