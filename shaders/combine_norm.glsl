// The COMBINE expert matvecs' closing RMSNorm (mul_mv_id.comp, mul_mvk_id.comp): with norm != 0, the
// workgroup that finishes a row last (the row's workgroups, gl_WorkGroupID.z = r, count themselves on the
// zeroed word sync_off + r of y's buffer, reset after) computes that row's h[r] = y[r] / sqrt(mean(y[r]^2) +
// eps) * w in rms_norm.comp WG_ROW's arithmetic (the same workgroup size, loads, reduction order and
// expressions), the next layer's attention norm without a dispatch and a barrier of its own. A row a
// workgroup: a step's rows normalize side by side (one workgroup walking every row after the others had
// finished made a 4-row step's tail 4 rows long). The including shader declares yc4, ycu (y's coherent
// bindings), nw4 (the weight), npart[32], s_last and the push constants it reads.
void combine_norm() {
    if (p.norm != 0u) {   // (uniform: a push constant)
        memoryBarrierBuffer();
        barrier();
        // norm == 2 (Caps.cn_rows off, for measurements): one counter, the last workgroup of all normalizes
        // every row, one after another
        bool one = p.norm == 2u;
        uint cw = one ? p.sync_off : p.sync_off + gl_WorkGroupID.z;
        if (gl_LocalInvocationID.x == 0u) {
            uint total = gl_NumWorkGroups.x * gl_NumWorkGroups.y * (one ? gl_NumWorkGroups.z : 1u);
            s_last = atomicAdd(ycu[cw], 1u) == total - 1u ? 1u : 0u;
        }
        barrier();
        if (s_last != 0u) {
            memoryBarrierBuffer();
            uint L = gl_LocalInvocationID.x, S = gl_WorkGroupSize.x, n4 = p.M / 4u;
            for (uint rr = one ? 0u : gl_WorkGroupID.z; rr < (one ? p.n_rows : gl_WorkGroupID.z + 1u); rr++) {
                uint xb = (p.y_off + rr * p.y_stride) / 4u;
                float ss = 0.0;
                for (uint i0 = L; i0 < n4; i0 += S * 4u) {
                    vec4 v[4];
                    [[unroll]] for (uint u = 0; u < 4u; u++) {
                        uint i = i0 + u * S;
                        v[u] = i < n4 ? yc4[xb + i] : vec4(0.0);
                    }
                    [[unroll]] for (uint u = 0; u < 4u; u++) ss += dot(v[u], v[u]);
                }
                ss = subgroupAdd(ss);
                if (subgroupElect()) npart[gl_SubgroupID] = ss;
                barrier();
                ss = npart[0];
                for (uint g = 1; g < gl_NumSubgroups; g++) ss += npart[g];
                float scale = inversesqrt(ss / float(p.M) + p.eps);
                barrier();   // (npart is the next row's)
                uint yb = (p.h_off + rr * p.h_stride) / 4u, wb = p.nw_off / 4u;
                for (uint i0 = L; i0 < n4; i0 += S * 4u) {
                    vec4 v[4];
                    vec4 w[4];
                    [[unroll]] for (uint u = 0; u < 4u; u++) {
                        uint i = i0 + u * S;
                        if (i < n4) { v[u] = yc4[xb + i]; w[u] = nw4[wb + i]; }
                    }
                    [[unroll]] for (uint u = 0; u < 4u; u++) {
                        uint i = i0 + u * S;
                        if (i < n4) yc4[yb + i] = v[u] * scale * w[u];
                    }
                }
            }
            if (L == 0u) ycu[cw] = 0u;
        }
    }
}
