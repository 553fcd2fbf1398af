// The token columns of a tiled matmul's tile (mul_mt.comp, mul_mc.comp), after
// its P block: plain (column c is x row c, y row c; grid y walks blocks of
// columns, grid z split K's parts) or MUL_ID (grid y walks moe_sort.comp's
// work list: the tile multiplies expert e's rows with a block of the pairs
// routed to e, column c being pair list[col0 + c][e] = r*k + i: x row r (slot
// i) and y row r slot i). Binding 1 (x) is the activation buffer, where the
// lists are too.
#define NO_TILE 0xffffffffu
#ifdef MUL_ID
layout(binding = 1) readonly restrict buffer XU { uint xu[]; };
uint g_e;          // the tile's expert
uint g_cnt;        // its pairs

// the tile's first column (NO_TILE: no block of the list for this workgroup)
uint tile_cols(uint bn) {
    if (gl_WorkGroupID.y >= xu[p.blocks_off]) return NO_TILE;
    uint blk = xu[p.blocks_off + 1u + gl_WorkGroupID.y];
    g_e = blk >> 16;
    g_cnt = xu[p.cnt_off + g_e];
    return (blk & 0xffffu) * bn;
}
uint n_cols() { return g_cnt; }
uint pair_of(uint col) { return xu[p.list_off + col * p.list_stride + g_e]; }
uint x_row(uint col) { uint pr = pair_of(col); return p.x_off + (pr / p.k) * p.x_stride + (pr % p.k) * p.x_slot_stride; }
uint y_row(uint col) { uint pr = pair_of(col); return p.y_off + (pr / p.k) * p.y_stride + (pr % p.k) * p.y_slot_stride; }
#define W_ROW0 (g_e * p.M)
#else
uint tile_cols(uint bn) { return gl_WorkGroupID.y * bn; }
uint n_cols() { return p.N; }
uint x_row(uint col) { return p.x_off + col * p.x_stride; }
uint y_row(uint col) { return p.y_off + gl_WorkGroupID.z * p.z_stride + col * p.y_stride; }
#define W_ROW0 0u
#endif
