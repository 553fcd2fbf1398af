// The push constants of the matvecs (mul_mv.comp, mul_mvk.comp), one layout for
// every variant; vkengine/kernels/push.py declares the same fields.
layout(push_constant) uniform P {
    uint w_off, w_off2;     // weight words / scale words
    uint K, M, N;           // columns of W, rows of W, columns of x
    uint x_off, x_stride;   // floats; multiples of 4
    uint y_off, y_stride;   // floats
    uint flags;             // 1: add into y (fused residual); split-K variants:
                            // 2 gated linear unit (GLU), 4 RMSNorm of y (NORM),
                            // 8 RoPE and KV-cache write instead of y (ROPE),
                            // 16 the sums gated by sigmoid(g[column]) (GATE: g's
                            // offset and stride in rope_row0, n_q), 32 a bias
                            // added to each row (BIAS, epilogue variants: at
                            // table_off of binding 4)
    uint h_off, h_stride;   // NORM: output rows (floats; multiples of 4)
    uint nw_off, sync_off;  // NORM: weight (vec4 binding 3, floats), counter (words of y's buffer)
    float eps;
    // ROPE (flags & 8): y's rows are rows rope_row0.. of a qkv vector [q (n_q
    // rows) | k (n_k rows) | v]; instead of y, q rows go RoPE'd to q_out, k
    // rows RoPE'd and v rows as they are to the KV cache at the column's
    // (slot, position) as f16 pairs: rope_kv.comp's mode 0 (adjacent pairs).
    // Variants without RoPE carry other offsets here (PARTS_Q8, XQ2).
    uint rope_row0, n_q, n_k, head_dim, n_rot, table_off;
    uint q_off, q_stride, k_off, v_off, slot_stride, kv_row_words, pos_off, slot_off;
#ifdef XQ8
    uint xq_off, xd_off;    // words of binding 7 (xq_off even)
#endif
#ifdef NORM_PARTS
    uint sq_stride;         // words between columns' sums of squares (all rows of y / 4)
#endif
} p;
