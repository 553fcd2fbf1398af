#version 450
// Causal attention of prompt-sized steps on cooperative matrices (flash
// attention): the same contract as attention.comp without split-K (query row r
// of slot params[slot_off + r] at position params[pos_off + r] attends to
// positions 0..pos of its slot), for head_dim HD (a multiple of 16;
// shaders/variants.py ATTN_MC_HEAD_DIMS lists those compiled).
//
// A workgroup is one 32-lane subgroup (Kernels.coopmat checks the device) and
// takes 16 query rows of one head: gl_WorkGroupID = (row block, head). Its
// rows' queries, as halves, stay in registers as HD / 16 operands; the keys
// and values of the slot are walked in blocks of BC positions staged in shared
// memory (the cache already holds halves), and per block
//   S^T = K Q^T (BC x 16, fp32 sums of f16 products), written to shared memory;
//   two lanes per row take the online softmax step (running max m and sum l,
//   masked: position <= the row's pos) and write the probabilities P as
//   halves; the rows' outputs are rescaled by exp(m_old - m_new);
//   O^T += V^T P^T (HD x 16, fp32, kept in shared memory: accumulators load
//   it, multiply-add and store it back).
// Both products are written transposed so that every A operand is used by one
// multiply-add (the B operands by several): on the H200 that ran 3-18% faster
// than S = Q K^T, O += P V (bench/attn_probe.py), as mul_mc's layouts that
// reuse A operands ran 2-3x slower than those that reuse B.
// A block whose rows belong to several slots (mixed server steps) runs one
// pass per slot, each row masked out of the others' passes.
// fp16 Q and P round to 11 significant bits, as llama.cpp's coopmat flash
// attention does; S, the softmax and O stay fp32. Compiled by the newer glslc
// (scripts/glslc-ext.sh).
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_ballot : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_shuffle : require
#extension GL_KHR_shader_subgroup_vote : require

layout(local_size_x = 32, local_size_y = 1, local_size_z = 1) in;

// q and the output: the same activation buffer bound twice (q readonly)
layout(binding = 0) writeonly restrict buffer Out { float act[]; };
layout(binding = 1) readonly restrict buffer Q4 { vec4 act4[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) readonly restrict buffer Kv4 { uvec4 kv4[]; };

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
} p;

#ifndef HD
#define HD 128
#endif
#ifndef BC
#define BC 32                 // positions per block
#endif
#define LDH (HD + 8)          // halves per staged row (16-byte aligned, no bank conflicts)
#define LDU (LDH / 8)         // the same in uvec4
#define LDO (HD + 4)          // floats per output row
#define LDS (BC + 4)          // floats per score row
#define LDP (BC + 8)          // halves per probability row

shared uvec4 Ks[BC * LDU];    // Ks[t * LDU + c] = halves 8c..8c+7 of position t0 + t's key
shared uvec4 Vs[BC * LDU];
shared uvec4 Qs[16 * LDU];
shared float Ss[16 * LDS];
shared f16vec4 Ps[16 * LDP / 4];
shared float Os[16 * LDO];
shared float As[16];          // per row: the rescale factor of a block, at the end 1 / l

#define ACC coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>

void main() {
    uint lane = gl_SubgroupInvocationID;
    uint row0 = gl_WorkGroupID.x * 16u;
    uint h = gl_WorkGroupID.y;
    uint kvh = h / (p.n_head / p.n_kv);
    uint hd2 = HD / 2u;
    uint row_words = p.n_kv * hd2;

    // two lanes per row: r = lane / 2 owns half hf of the row's positions
    // within a block and of its output
    uint r = lane >> 1, hf = lane & 1u;
    uint row = row0 + r;
    bool live = row < p.n_rows;
    uint my_pos = live ? params[p.pos_off + row] : 0u;
    uint my_slot = live ? params[p.slot_off + row] : 0u;

    // queries -> halves in Qs (rows past n_rows: zeros) -> A operands
    for (uint i = lane; i < 16u * (HD / 8u); i += 32u) {
        uint rr = i / (HD / 8u), c = i % (HD / 8u);
        uvec4 u = uvec4(0u);
        if (row0 + rr < p.n_rows) {
            uint b = (p.q_off + (row0 + rr) * p.q_stride + h * HD) / 4u + 2u * c;
            vec4 a = act4[b], bb = act4[b + 1u];
            u = uvec4(packHalf2x16(a.xy), packHalf2x16(a.zw), packHalf2x16(bb.xy), packHalf2x16(bb.zw));
        }
        Qs[rr * LDU + c] = u;
    }
    for (uint i = lane; i < 16u * LDO; i += 32u) Os[i] = 0.0;
    barrier();
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> qb[HD / 16];   // Q^T
    [[unroll]] for (uint i = 0; i < HD / 16u; i++)
        coopMatLoad(qb[i], Qs, i * 2u, LDU, gl_CooperativeMatrixLayoutColumnMajor);

    float m = -1.0 / 0.0, l = 0.0;
    bool done = !live;
    while (true) {
        uvec4 todo = subgroupBallot(!done);
        if (todo == uvec4(0u)) break;
        uint slot = subgroupShuffle(my_slot, subgroupBallotFindLSB(todo));
        bool act_row = !done && my_slot == slot;
        uint kmax = subgroupMax(act_row ? my_pos : 0u);
        uint kbase = p.k_off + slot * p.slot_stride + kvh * hd2;
        uint vbase = p.v_off + slot * p.slot_stride + kvh * hd2;
        for (uint t0 = 0u; t0 <= kmax; t0 += BC) {
            // stage the block's keys and values (positions past kmax: zeros)
            for (uint i = lane; i < BC * (HD / 8u); i += 32u) {
                uint t = i / (HD / 8u), c = i % (HD / 8u);
                bool ok = t0 + t <= kmax;
                uint w = (t0 + t) * row_words;
                Ks[t * LDU + c] = ok ? kv4[(kbase + w) / 4u + c] : uvec4(0u);
                Vs[t * LDU + c] = ok ? kv4[(vbase + w) / 4u + c] : uvec4(0u);
            }
            barrier();
            // S = Q K^T, 16 positions at a time
            [[unroll]] for (uint c = 0; c < BC / 16u; c++) {
                ACC s = ACC(0.0);
                [[unroll]] for (uint i = 0; i < HD / 16u; i++) {
                    // S^T = K Q^T: each A (keys) used once
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> ka;
                    coopMatLoad(ka, Ks, c * 16u * LDU + i * 2u, LDU, gl_CooperativeMatrixLayoutRowMajor);
                    s = coopMatMulAdd(ka, qb[i], s);
                }
                coopMatStore(s, Ss, c * 16u, LDS, gl_CooperativeMatrixLayoutColumnMajor);
            }
            barrier();
            // online softmax of row r over this block, half hf of its positions
            const uint HB = BC / 2u;
            float sv[HB];
            float bm = -1.0 / 0.0;
            [[unroll]] for (uint j = 0; j < HB; j++) {
                uint t = hf * HB + j;
                bool ok = act_row && t0 + t <= my_pos;
                sv[j] = ok ? Ss[r * LDS + t] * p.scale : -1.0 / 0.0;
                bm = max(bm, sv[j]);
            }
            bm = max(bm, subgroupShuffleXor(bm, 1u));
            float m_new = max(m, bm);
            float alpha = 1.0, ls = 0.0;
            if (m_new > -1.0 / 0.0) {
                alpha = exp(m - m_new);   // 0 while m is -inf (O and l are zero then)
                [[unroll]] for (uint j = 0; j < HB; j++) {
                    sv[j] = exp(sv[j] - m_new);   // masked: exp(-inf) = 0
                    ls += sv[j];
                }
                m = m_new;
            } else {
                [[unroll]] for (uint j = 0; j < HB; j++) sv[j] = 0.0;
            }
            ls += subgroupShuffleXor(ls, 1u);
            l = l * alpha + ls;
            [[unroll]] for (uint j = 0; j < HB; j += 4u)
                Ps[(r * LDP + hf * HB + j) / 4u] = f16vec4(sv[j], sv[j + 1u], sv[j + 2u], sv[j + 3u]);
            // rescale the rows' outputs, all lanes along consecutive floats
            // (no bank conflicts), unless every factor is 1
            if (hf == 0u) As[r] = alpha;
            bool rescale = !subgroupAll(alpha == 1.0);
            barrier();
            if (rescale) {
                for (uint i = lane; i < 16u * HD; i += 32u) Os[(i / HD) * LDO + i % HD] *= As[i / HD];
                barrier();
            }
            // O += P V
            // O^T += V^T P^T: each A (V^T) used once, each B (P^T) for every 16 dims
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> pb[BC / 16];
            [[unroll]] for (uint c = 0; c < BC / 16u; c++)
                coopMatLoad(pb[c], Ps, c * 4u, LDP / 4u, gl_CooperativeMatrixLayoutColumnMajor);
            [[unroll]] for (uint j = 0; j < HD / 16u; j++) {
                ACC o;
                coopMatLoad(o, Os, j * 16u, LDO, gl_CooperativeMatrixLayoutColumnMajor);
                [[unroll]] for (uint c = 0; c < BC / 16u; c++) {
                    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> va;
                    coopMatLoad(va, Vs, c * 16u * LDU + j * 2u, LDU, gl_CooperativeMatrixLayoutColumnMajor);
                    o = coopMatMulAdd(va, pb[c], o);
                }
                coopMatStore(o, Os, j * 16u, LDO, gl_CooperativeMatrixLayoutColumnMajor);
            }
            barrier();
        }
        done = done || act_row;
    }
    if (hf == 0u) As[r] = 1.0 / l;
    barrier();
    for (uint i = lane; i < 16u * HD; i += 32u) {
        uint rr = i / HD, d = i % HD;
        if (row0 + rr < p.n_rows) act[p.o_off + (row0 + rr) * p.o_stride + h * HD + d] = Os[rr * LDO + d] * As[rr];
    }
}
