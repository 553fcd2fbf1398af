#version 450
// Causal attention of prompt-sized steps on NVIDIA's workgroup-scope
// cooperative matrices (VK_NV_cooperative_matrix2): attention_mc.comp's
// contract (query row r of slot params[slot_off + r] at position
// params[pos_off + r] attends to positions lo..pos of its slot; lo = pos -
// window + 1 on sliding-window layers, else 0) for an f16 cache that does not
// wrap (ring 0), after llama.cpp's flash_attn_cm2.comp (ggml-vulkan).
//
// A workgroup takes BR query rows of one head (gl_WorkGroupID.x: the row
// block, .y: the head). Per block of BC positions, as one workgroup-scope
// matrix each (the driver splits them among the subgroups and pipelines the
// tensor-addressed loads):
//   S = Q K^T (fp16 operands, Q scaled before its rounding, fp32 sums), masked where a row
//   may not see a position (only in blocks that hold such a pair);
//   the online softmax on the accumulators themselves (row max and sums by
//   coopMatReduceNV and a product with ones, exponentials per element), the
//   running max offset by 3 ln 2 (llama.cpp's FATTN_KQ_MAX_OFFSET);
//   O = O e^(m_old - m) + P V (P as halves; V loaded after the softmax).
// attention_mc.comp moves every score through shared memory and two lanes a
// row: its prompt attention ran at ~32 TFLOPS on the H200 (notes.md run 36).
// Rows of several slots in one block (mixed server steps): one pass per slot,
// each row masked out of the others' passes (a row's O, l and m only take
// positions of its own pass, so the accumulators carry across passes).
// K and V load unclamped from the cache except in the last block of a pass,
// whose positions past the pass's end load as zeros (clamped: never reading
// past the slot, nor values that could be NaN); rows past n_rows load zero
// queries and are dropped by the clamped store.
// SPLIT: as attention_mc.comp's, gl_WorkGroupID.z takes the z-th of n_parts
// pieces (whole BC blocks) of a pass's positions and writes O, m and l
// unnormalized ([z][row][head] x (HD + 2) at part_off) for attention_merge.comp.
// Compiled by the newer glslc (scripts/glslc-ext.sh); run where
// Kernels.attention_on_coopmat2 says the device can.
#extension GL_EXT_control_flow_attributes : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_KHR_cooperative_matrix : require
#extension GL_NV_cooperative_matrix2 : require
#extension GL_KHR_memory_scope_semantics : require

#ifndef HD
#define HD 128
#endif
#ifndef BR
#define BR 64                 // query rows a workgroup
#endif
#ifndef BC
#define BC 64                 // positions a block
#endif
#define WG 128
layout(local_size_x = WG, local_size_y = 1, local_size_z = 1) in;

// q and the output: the same activation buffer bound twice (q readonly)
layout(binding = 0) writeonly restrict buffer Out { float act[]; };
layout(binding = 1) readonly restrict buffer Q { float actq[]; };
layout(binding = 2) readonly buffer Params { uint params[]; };
layout(binding = 3) readonly restrict buffer Kv { float16_t kvb[]; };
layout(binding = 4) readonly buffer Sinks { float sinks[]; };
#ifdef SPLIT
layout(binding = 5) writeonly buffer Part { float part[]; };
#endif

layout(push_constant) uniform P {
    uint q_off, q_stride, o_off, o_stride;
    uint n_rows, n_head, n_kv, head_dim;
    uint k_off, v_off, slot_stride;
    uint pos_off, slot_off;
    float scale;
    uint window;
    float softcap;
    uint ring;       // 0 here (AttentionKernels: caches that wrap take attention_mc)
    uint sink_off;   // gpt-oss's sinks (0xffffffff: none): o = O / (l + e^(sink - m))
#ifdef SPLIT
    uint n_parts, part_off;
#endif
} p;

#define NONE 0xffffffffu
shared uint sh_pos[BR], sh_lo[BR], sh_slot[BR];
// the pass: its slot, positions [start, end), whether every row takes it, the
// smallest position and the largest first position of its rows
shared uint sh_pass[6];

#define SMAT coopmat<float, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseAccumulator>
// a row's m, l and their factors: smeared over BC columns, or NARROW over 16 (a quarter of the registers and
// exponentials, the row sums of P a product with BC x 16 ones; m smeared back over BC for P = e^(S - m))
#ifdef NARROW
#define RW 16
#else
#define RW BC
#endif
#define RMAT coopmat<float, gl_ScopeWorkgroup, BR, RW, gl_MatrixUseAccumulator>
// O_F16: O accumulated in halves (llama.cpp's flash_attn_cm2 keeps O as its FLOAT_TYPE,
// halves, whatever the precision of S: half O's registers); OMAT32 for the end
#ifdef O_F16
#define OMAT coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator>
#else
#define OMAT coopmat<float, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator>
#endif
#define OMAT32 coopmat<float, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator>
#define NEG_INF (-1.0 / 0.0)
#define M_INIT (-1.7014117e38)   // -FLT_MAX / 2: finite, so m_old - m is never NaN
#define KQ_MAX_OFFSET (3.0 * 0.6931)

float mask_s(const in uint r, const in uint c, const in float e, const in uint t0, const in uint kend,
             const in uint slot) {
    uint t = t0 + c;
    return sh_slot[r] == slot && t <= sh_pos[r] && t >= sh_lo[r] && t < kend ? e : NEG_INF;
}

float max_op(const in float x, const in float y) { return max(x, y); }
float smear_op(const in float x, const in float y) { return x; }
float exp_e(const in uint r, const in uint c, const in float e) { return exp(e); }
float max_e(const in uint r, const in uint c, const in float a, const in float b) { return max(a, b); }
float softcap_e(const in uint r, const in uint c, const in float e) { return p.softcap * tanh(e / p.softcap); }

#ifdef SPLIT
// column 0 of a row-smeared matrix (m or l) to word w of each row's part record
float store_col0(const in uint r, const in uint c, const in float e, const in uint base, const in uint w) {
    if (c == 0u && gl_WorkGroupID.x * BR + r < p.n_rows)
        part[base + r * p.n_head * (HD + 2u) + w] = e;
    return e;
}
#endif

void main() {
    uint row0 = gl_WorkGroupID.x * BR;
    uint h = gl_WorkGroupID.y;
    uint kvh = h / (p.n_head / p.n_kv);
    uint lid = gl_LocalInvocationID.x;
    for (uint i = lid; i < BR; i += WG) {
        uint row = row0 + i;
        bool live = row < p.n_rows;
        uint pos = live ? params[p.pos_off + row] : 0u;
        sh_pos[i] = pos;
        sh_lo[i] = p.window != 0u && pos >= p.window ? pos + 1u - p.window : 0u;
        sh_slot[i] = live ? params[p.slot_off + row] : NONE;
    }

    // Q (rows past n_rows: zeros) as halves; the scale is applied to S (fp32), as attention_mc does
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> tQ =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
    tQ = setTensorLayoutDimensionNV(tQ, p.n_rows, p.q_stride);
    tQ = setTensorLayoutStrideNV(tQ, p.q_stride & ~3u, 1);
    coopmat<float, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseAccumulator> q32;
    coopMatLoadTensorNV(q32, actq, p.q_off & ~3u, sliceTensorLayoutNV(tQ, row0, BR, h * HD, HD));
    q32 *= p.scale;   // (as llama.cpp's flash_attn_cm2: S comes out scaled, no product a block)
    coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseA> qa =
        coopmat<float16_t, gl_ScopeWorkgroup, BR, HD, gl_MatrixUseA>(q32);

    // K and V of this KV head: [position][HD] halves, rows n_kv * HD apart, a slot slot_stride words
    uint row_h = p.n_kv * HD;
    uint cap = p.slot_stride / (row_h / 2u);   // positions a slot holds
    tensorViewNV<2, false, 1, 0> tr = createTensorViewNV(2, false, 1, 0);
    tensorLayoutNV<2> tK = createTensorLayoutNV(2);
    tK = setTensorLayoutDimensionNV(tK, cap, HD);
    tK = setTensorLayoutStrideNV(tK, row_h & ~7u, 1);
    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> tKc =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);

    OMAT o = OMAT(0.0);
    RMAT l = RMAT(0.0), m = RMAT(M_INIT);
    coopmat<float16_t, gl_ScopeWorkgroup, BC, RW, gl_MatrixUseB> ones =
        coopmat<float16_t, gl_ScopeWorkgroup, BC, RW, gl_MatrixUseB>(1.0);

    uint prev = NONE;   // the slot of the pass before (slots taken in increasing order)
    while (true) {
        barrier();   // sh_* written (first pass), sh_pass read (the pass before)
        if (lid == 0u) {
            uint slot = NONE;
            for (uint i = 0u; i < BR; i++) {
                uint s = sh_slot[i];
                if (s != NONE && (prev == NONE || s > prev) && (slot == NONE || s < slot)) slot = s;
            }
            uint ks = NONE, ke = 0u, all = 1u, minpos = NONE, maxlo = 0u;
            for (uint i = 0u; i < BR; i++) {
                if (sh_slot[i] == NONE) continue;
                if (sh_slot[i] != slot) { all = 0u; continue; }
                ks = min(ks, sh_lo[i]);
                ke = max(ke, sh_pos[i] + 1u);
                minpos = min(minpos, sh_pos[i]);
                maxlo = max(maxlo, sh_lo[i]);
            }
            sh_pass[0] = slot; sh_pass[1] = ks; sh_pass[2] = ke;
            sh_pass[3] = all; sh_pass[4] = minpos; sh_pass[5] = maxlo;
        }
        barrier();
        uint slot = sh_pass[0];
        if (slot == NONE) break;
        prev = slot;
        uint kstart = sh_pass[1], kend = sh_pass[2];
        bool all = sh_pass[3] != 0u;
        uint minpos = sh_pass[4], maxlo = sh_pass[5];
#ifdef SPLIT
        {   // this part's piece of the pass's positions only (whole blocks)
            uint plen = ((kend - kstart + p.n_parts - 1u) / p.n_parts + BC - 1u) / BC * BC;
            uint k0 = kstart;
            kstart = min(k0 + gl_WorkGroupID.z * plen, kend);
            kend = min(kend, k0 + (gl_WorkGroupID.z + 1u) * plen);
        }
#endif
        uint k_base = (2u * (p.k_off + slot * p.slot_stride) + kvh * HD) & ~7u;
        uint v_base = (2u * (p.v_off + slot * p.slot_stride) + kvh * HD) & ~7u;
        tKc = setTensorLayoutDimensionNV(tKc, kend, HD);   // (which resets the stride: set it after)
        tKc = setTensorLayoutStrideNV(tKc, row_h & ~7u, 1);
        [[dont_unroll]]
        for (uint t0 = kstart; t0 < kend; t0 += BC) {
            bool tail = t0 + BC > kend;
            coopmat<float16_t, gl_ScopeWorkgroup, HD, BC, gl_MatrixUseB> kt;
            coopmat<float16_t, gl_ScopeWorkgroup, BC, HD, gl_MatrixUseB> v;
            if (tail) {
                coopMatLoadTensorNV(kt, kvb, k_base, sliceTensorLayoutNV(tKc, t0, BC, 0, HD), tr);
            } else {
                coopMatLoadTensorNV(kt, kvb, k_base, sliceTensorLayoutNV(tK, t0, BC, 0, HD), tr);
            }
            SMAT s = SMAT(0.0);
            s = coopMatMulAdd(qa, kt, s);
            if (p.softcap > 0.0) coopMatPerElementNV(s, s, softcap_e);
            // a pair a row may not see: another slot's row, a position past a row's own or
            // before its window, or past the part
            if (!all || tail || t0 + BC - 1u > minpos || t0 < maxlo)
                coopMatPerElementNV(s, s, mask_s, t0, kend, slot);
            RMAT rowmax, em;
            SMAT pm;
            coopMatReduceNV(rowmax, s, gl_CooperativeMatrixReduceRowNV, max_op);
            rowmax += RMAT(KQ_MAX_OFFSET);
            RMAT m_old = m;
            coopMatPerElementNV(m, rowmax, max_e, m_old);
#ifdef NARROW
            SMAT mb;
            coopMatReduceNV(mb, m, gl_CooperativeMatrixReduceRowNV, smear_op);
            coopMatPerElementNV(pm, s - mb, exp_e);
#else
            coopMatPerElementNV(pm, s - m, exp_e);
#endif
            coopMatPerElementNV(em, m_old - m, exp_e);
            coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA> pa =
                coopmat<float16_t, gl_ScopeWorkgroup, BR, BC, gl_MatrixUseA>(pm);
            RMAT rowsum = RMAT(0.0);
            rowsum = coopMatMulAdd(pa, ones, rowsum);   // the row sums of P (as rounded to halves)
            // V loaded only now, as llama.cpp's flash_attn_cm2 does, not beside K: held through S and the
            // softmax it cost the 8B's pp512 at depth 16k a third of its attention time (H100: 47.7 -> 31.1 ms
            // a step; notes.md run 50)
            if (tail) coopMatLoadTensorNV(v, kvb, v_base, sliceTensorLayoutNV(tKc, t0, BC, 0, HD));
            else coopMatLoadTensorNV(v, kvb, v_base, sliceTensorLayoutNV(tK, t0, BC, 0, HD));
            l = em * l + rowsum;
            OMAT32 emd;
            coopMatReduceNV(emd, em, gl_CooperativeMatrixReduceRowNV, smear_op);
#ifdef O_F16
            o *= OMAT(emd);
#else
            o *= emd;
#endif
            o = coopMatMulAdd(pa, v, o);
        }
    }

    tensorLayoutNV<2, gl_CooperativeMatrixClampModeConstantNV> tO =
        createTensorLayoutNV(2, gl_CooperativeMatrixClampModeConstantNV);
#ifdef O_F16
    OMAT32 of = OMAT32(o);
#else
    OMAT32 of = o;
#endif
#ifdef SPLIT
    // O, m and l of this part as they are (attention_merge.comp normalizes)
    uint rec = p.n_head * (HD + 2u);
    uint pbase = p.part_off + (gl_WorkGroupID.z * p.n_rows + row0) * rec + h * (HD + 2u);
    tO = setTensorLayoutDimensionNV(tO, p.n_rows - row0, HD);
    tO = setTensorLayoutStrideNV(tO, rec, 1);
    coopMatStoreTensorNV(of, part, pbase, sliceTensorLayoutNV(tO, 0, BR, 0, HD));
    coopMatPerElementNV(m, m, store_col0, pbase, uint(HD));
    coopMatPerElementNV(l, l, store_col0, pbase, HD + 1u);
#else
    OMAT32 ld, md;
    coopMatReduceNV(ld, l, gl_CooperativeMatrixReduceRowNV, smear_op);
    if (p.sink_off != NONE) {
        coopMatReduceNV(md, m, gl_CooperativeMatrixReduceRowNV, smear_op);
        float sink = sinks[p.sink_off + h];
        [[unroll]] for (uint i = 0; i < ld.length(); i++)
            ld[i] = ld[i] > 0.0 ? ld[i] + exp(sink - md[i]) : 0.0;
    }
    [[unroll]] for (uint i = 0; i < ld.length(); i++) ld[i] = ld[i] > 0.0 ? 1.0 / ld[i] : 0.0;
    of = of * ld;
    tO = setTensorLayoutDimensionNV(tO, p.n_rows, p.o_stride);
    tO = setTensorLayoutStrideNV(tO, p.o_stride, 1);
    coopMatStoreTensorNV(of, act, p.o_off, sliceTensorLayoutNV(tO, row0, BR, h * HD, HD));
#endif
}
