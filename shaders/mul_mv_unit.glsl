// accum_unit: the products of one weight unit (8 or 16 values) of each of RPS
// rows with NCOLS columns of x, added to acc; shared by the matvecs
// (mul_mv.comp on lavapipe, mul_mvk.comp on GPUs), which sum a row in the
// same order whatever their column count.
// XFIRST (the GPU variants): every column's x loads of a unit are issued
// before its first product (columns past N read column N - 1; their sums are
// never stored), instead of one column at a time behind a branch on N; the
// sums are the same, in the same order (docs/bench/notes.md run 16).
#ifndef XFIRST
#define XFIRST 0
#endif
#define XCOL(c) min(col0 + (c), p.N - 1u)
// the float offset of column c's x (the expert matvecs, mul_mvk_id.comp: the pair's own row)
#ifndef MV_XOFF
#define MV_XOFF(c) (p.x_off + XCOL(c) * p.x_stride)
#endif

// one unit (index u) of each of the RPS rows, times every column
void accum_unit(Raw r[RPS], uint u, uint col0, uint ncols, inout float acc[RPS][NCOLS]) {
#if defined(HOIST) && defined(UNIT_SCALED) && XFIRST && defined(ROWFIRST)
    // the block scale once per unit and column instead of once per value;
    // ROWFIRST (the batched GPU variants of Q8_0 and Q4): every column's x
    // first, then one row at a time (decoded, then its products with every
    // column), so only one row's values are live (fewer registers: notes.md
    // run 19). The products and sums are those of the rows-first order below,
    // in the same order, so a batched row still equals the row alone.
    uint xo[UNIT_GROUPS];
    {
        vec4 v0[UNIT_GROUPS];
        vec2 d0;
        unit_decode_s(r[0], u, v0, xo, d0);   // xo depends on u only
    }
    vec4 xa[NCOLS][UNIT_GROUPS];
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
        uint xb = MV_XOFF(c) >> 2;
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) xa[c][g] = act4[xb + (xo[g] >> 2)];
    }
#if defined(WT_Q4_1)
    float sx[NCOLS];
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
        sx[c] = 0.0;
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) sx[c] += dot(xa[c][g], vec4(1.0));
    }
#endif
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
        vec4 v[UNIT_GROUPS];
        vec2 dm;
        uint xo2[UNIT_GROUPS];
        unit_decode_s(r[rr], u, v, xo2, dm);
        [[unroll]] for (uint c = 0; c < NCOLS; c++) {
            float s = 0.0;
            [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) s += dot(v[g], xa[c][g]);
#if defined(WT_Q4_1)
            acc[rr][c] += dm.x * s + dm.y * sx[c];
#else
            acc[rr][c] += dm.x * s;
#endif
        }
    }
#elif defined(HOIST) && defined(UNIT_SCALED)
    // the block scale once per unit and column instead of once per value
    vec4 v[RPS][UNIT_GROUPS];
    vec2 dm[RPS];
    uint xo[UNIT_GROUPS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) unit_decode_s(r[rr], u, v[rr], xo, dm[rr]);
#if XFIRST
    vec4 xa[NCOLS][UNIT_GROUPS];
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
        uint xb = MV_XOFF(c) >> 2;
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) xa[c][g] = act4[xb + (xo[g] >> 2)];
    }
#endif
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
#if XFIRST
        vec4 xv[UNIT_GROUPS] = xa[c];
#else
        if (c >= ncols) continue;
        uint xb = (p.x_off + (col0 + c) * p.x_stride) >> 2;
        vec4 xv[UNIT_GROUPS];
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) xv[g] = act4[xb + (xo[g] >> 2)];
#endif
#if defined(WT_Q4_1)
        float sx = 0.0;
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) sx += dot(xv[g], vec4(1.0));
#endif
        [[unroll]] for (uint rr = 0; rr < RPS; rr++) {
            float s = 0.0;
            [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) s += dot(v[rr][g], xv[g]);
#if defined(WT_Q4_1)
            acc[rr][c] += dm[rr].x * s + dm[rr].y * sx;
#else
            acc[rr][c] += dm[rr].x * s;
#endif
        }
    }
#else
    // dequantize each row's unit once, then use it for every column
    vec4 v[RPS][UNIT_GROUPS];
    uint xo[UNIT_GROUPS];
    [[unroll]] for (uint rr = 0; rr < RPS; rr++) unit_decode(r[rr], u, v[rr], xo);
#if XFIRST
    vec4 xa[NCOLS][UNIT_GROUPS];
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
        uint xb = MV_XOFF(c) >> 2;
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) xa[c][g] = act4[xb + (xo[g] >> 2)];
    }
#endif
    [[unroll]] for (uint c = 0; c < NCOLS; c++) {
#if XFIRST
        vec4 xv[UNIT_GROUPS] = xa[c];
#else
        if (c >= ncols) continue;
        uint xb = (p.x_off + (col0 + c) * p.x_stride) >> 2;
        vec4 xv[UNIT_GROUPS];
        [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) xv[g] = act4[xb + (xo[g] >> 2)];
#endif
        [[unroll]] for (uint rr = 0; rr < RPS; rr++)
            [[unroll]] for (uint g = 0; g < UNIT_GROUPS; g++) acc[rr][c] += dot(v[rr][g], xv[g]);
    }
#endif
}
