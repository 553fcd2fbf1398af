#version 450
// conv1d.comp's causal depthwise conv1d + SiLU for prompt-sized steps, a row
// block at a time instead of one invocation walking all rows of its channel
// (on the H200, 512 rows of Qwen3.5 0.8B's 6,144 channels took conv1d.comp
// ~175 us: 96 workgroups, each a 512-row walk). Two dispatches:
// - (default) y: an invocation a (channel, RB-row block); a row's K-1 previous
//   inputs are the rows before it of the same slot (rows of a slot are
//   contiguous and consecutive in position), and past the run's first row the
//   slot's kept window (zeros when the run starts at position 0). Reads the
//   state, writes only y.
// - STATE: then the windows kept: an invocation a (channel, row block) writes,
//   for each run that ends in its block, the run's last K-1 inputs (from x, or
//   the old window where the run is shorter than K-1) over the slot's state.
// No snapshots (speculative steps take conv1d.comp).
#include "common.glsl"

layout(binding = 0) readonly buffer Wq { float wf[]; };
layout(binding = 1) buffer Act { float act[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) buffer State { float st[]; };

layout(push_constant) uniform P {
    uint x_off, x_stride, y_off, y_stride;
    uint w_off;
    uint C, K, n_rows;
    uint state_off, slot_stride;
    uint pos_off, slot_off;
} p;

#define KMAX 8
#define RB 16   // rows a block

// input m rows before row r (m >= 1) of r's sequence: x, or the slot's window, or 0
float input_before(uint r, uint m, uint c, uint slot, uint back) {
    if (m <= back) return act[p.x_off + (r - m) * p.x_stride + c];
    uint first = r - back;   // the run's first row
    if (params[p.pos_off + first] == 0u) return 0.0;
    uint j = p.K - 1u - (m - back);   // the window's entry (oldest first)
    return st[p.state_off + slot * p.slot_stride + j * p.C + c];
}

// rows before r of its slot, up to K-1
uint rows_back(uint r, uint slot) {
    uint back = 0u;
    while (back + 1u < p.K && back < r && params[p.slot_off + r - back - 1u] == slot) back++;
    return back;
}

void main() {
#ifndef STATE
    uint n_cb = (p.C + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;
    uint wg = workgroup_linear();
    uint c = (wg % n_cb) * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    uint r0 = (wg / n_cb) * RB;
    if (c >= p.C || r0 >= p.n_rows) return;
    uint km1 = p.K - 1u;
    float w[KMAX];
    [[unroll]] for (uint j = 0; j < KMAX; j++) w[j] = j < p.K ? wf[p.w_off + c * p.K + j] : 0.0;
    uint r1 = min(r0 + RB, p.n_rows);
    for (uint r = r0; r < r1; r++) {
        uint slot = params[p.slot_off + r];
        uint back = rows_back(r, slot);
        float acc = w[km1] * act[p.x_off + r * p.x_stride + c];
        for (uint m = 1u; m <= km1; m++) acc += w[km1 - m] * input_before(r, m, c, slot, back);
        act[p.y_off + r * p.y_stride + c] = silu(acc);
    }
#else
    uint n_cb = (p.C + gl_WorkGroupSize.x - 1u) / gl_WorkGroupSize.x;
    uint wg = workgroup_linear();
    uint c = (wg % n_cb) * gl_WorkGroupSize.x + gl_LocalInvocationID.x;
    uint r0 = (wg / n_cb) * RB;
    if (c >= p.C || r0 >= p.n_rows) return;
    uint km1 = p.K - 1u;
    uint r1 = min(r0 + RB, p.n_rows);
    for (uint r = r0; r < r1; r++) {
        uint slot = params[p.slot_off + r];
        if (r + 1u < p.n_rows && params[p.slot_off + r + 1u] == slot) continue;
        // r ends its run (one invocation a channel sees it): the window after it is
        // inputs r-K+2 .. r (oldest first)
        uint back = rows_back(r, slot);
        float win[KMAX];
        [[unroll]] for (uint j = 0; j < KMAX; j++) {
            // entry j holds the input (km1 - 1 - j) rows before r
            uint m = km1 - 1u - j;
            win[j] = j < km1 ? (m == 0u ? act[p.x_off + r * p.x_stride + c] : input_before(r, m, c, slot, back)) : 0.0;
        }
        [[unroll]] for (uint j = 0; j < KMAX; j++)
            if (j < km1) st[p.state_off + slot * p.slot_stride + j * p.C + c] = win[j];
    }
#endif
}
