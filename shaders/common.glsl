// Shared by every kernel: subgroup extensions, the workgroup-size specialization
// constant and the "work items per workgroup" convention.
//
// Kernels assign whole work items (a matrix row, an attention head, a norm row)
// to subgroups and reduce with subgroup operations only: no shared memory and no
// barrier(), which keeps them fast on lavapipe (where barrier() is very slow) and
// correct whatever subgroup size the driver picks (8 on lavapipe, 32 on NVIDIA,
// 32 or 64 on AMD, 8-32 on Intel). A workgroup takes ITEMS_PER_WG items; its
// subgroups take them in turn.
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_EXT_control_flow_attributes : require

#ifdef FIXED_WG   // (probes: the workgroup size fixed at compile time)
layout(local_size_x = FIXED_WG, local_size_y = 1, local_size_z = 1) in;
#else
layout(local_size_x_id = 0, local_size_y = 1, local_size_z = 1) in;
#endif
layout(constant_id = 1) const uint ITEMS_PER_WG = 4;

// Grids larger than maxComputeWorkGroupCount[0] (65535 on lavapipe) are folded
// into two dimensions by the host; this undoes the fold.
uint workgroup_linear() {
    return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x;
}

// First and one-past-last work item of this workgroup.
uvec2 workgroup_items(uint n_items) {
    uint first = workgroup_linear() * ITEMS_PER_WG;
    return uvec2(first, min(first + ITEMS_PER_WG, n_items));
}

float silu(float x) { return x / (1.0 + exp(-x)); }
// SwiGLU's product, not contracted into anything around it, so that every kernel
// that makes it (swiglu.comp, the expert matvecs' GLU epilogue) rounds alike
float silu_mul(float g, float u) {
    precise float r = silu(g) * u;
    return r;
}
// gpt-oss's clamped SwiGLU (ggml's swiglu_oai), as swiglu.comp's OAI and the
// expert matvecs' GLU epilogue both compute it
float swiglu_oai(float g, float u, float alpha, float limit) {
    float x = min(g, limit);
    return x / (1.0 + exp(-alpha * x)) * (clamp(u, -limit, limit) + 1.0);
}
// GELU, tanh approximation (Gemma's gelu_pytorch_tanh; ggml_gelu): tanh's
// argument clamped where it is +-1 in float32 (tanh of large values is inf / inf
// on some drivers)
float gelu_tanh(float x) {
    return 0.5 * x * (1.0 + tanh(clamp(0.7978845608028654 * (x + 0.044715 * x * x * x), -10.0, 10.0)));
}
