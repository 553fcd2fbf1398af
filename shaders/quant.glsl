// Weight formats, read from a 32-bit storage buffer `wq` (kp enables no 16/8-bit
// storage by default, so halves, bytes and nibbles are unpacked here).
//
// The including shader declares `wq` and defines exactly one WT_<type>. Each type
// provides, for a row-major matrix of K columns starting at word offset `woff`
// (with per-block scales at `woff2` for the repacked types):
//   UNIT_VALUES / UNIT_GROUPS   values per unit, as UNIT_GROUPS runs of 4
//                               (a unit is 16 bytes of quants where the layout
//                               allows, read as one uvec4: wide loads keep more
//                               bytes in flight per lane; shaders/variants.py
//                               UNIT_VALUES mirrors these numbers)
//   units_per_row(K)
//   unit_load(woff, woff2, row, u, K, v, xo): the unit's values v[g] (vec4) and
//       the column of each run's first value xo[g]
//
// Device layouts (vkengine/quant.py repacks GGUF blocks into them; block formats
// from ggml/src/ggml-common.h and dequantize_row_* in ggml-quants.c):
//   F32, F16, BF16   row-major, 1 or 2 values a word
//   Q8_0  qs: 8 words a block (32 x int8)           woff2: d as halves
//   Q4_0  qs: 4 words a block (32 x 4 bit)          woff2: d as halves
//   Q4_1  qs: 4 words a block                       woff2: one word (d, m) a block
//   Q5_0  5 words a block: qh, then qs              woff2: d as halves
//   Q5_1  5 words a block: qh, then qs              woff2: one word (d, m) a block
//   Q4_K  GGUF's 144-byte block (36 words)
//   Q5_K  GGUF's 176-byte block (44 words)
//   Q6_K  GGUF's 210-byte block padded to 212 (53 words)

#ifndef WQ_BINDING
#define WQ_BINDING 0
#endif
layout(binding = WQ_BINDING) readonly buffer Wq4 { uvec4 wq4[]; };

float half_at(uint base, uint i) {
    vec2 h = unpackHalf2x16(wq[base + (i >> 1)]);
    return (i & 1u) == 0u ? h.x : h.y;
}
vec4 nib_lo(uint w) { return vec4(w & 15u, (w >> 8) & 15u, (w >> 16) & 15u, (w >> 24) & 15u); }
vec4 nib_hi(uint w) { return vec4((w >> 4) & 15u, (w >> 12) & 15u, (w >> 20) & 15u, w >> 28); }
vec4 bytes4(uint w) { return vec4(w & 255u, (w >> 8) & 255u, (w >> 16) & 255u, w >> 24); }
vec4 sbytes4(uint w) {
    int i = int(w);
    return vec4(bitfieldExtract(i, 0, 8), bitfieldExtract(i, 8, 8),
                bitfieldExtract(i, 16, 8), bitfieldExtract(i, 24, 8));
}
// 4 consecutive bits of `bits` starting at `first`, as 0/1 values
vec4 bits4(uint bits, uint first) {
    uint b = bits >> first;
    return vec4(b & 1u, (b >> 1) & 1u, (b >> 2) & 1u, (b >> 3) & 1u);
}
vec2 bf16x2(uint w) { return vec2(uintBitsToFloat(w << 16), uintBitsToFloat(w & 0xffff0000u)); }
uint byte_at(uint base, uint i) { return (wq[base + (i >> 2)] >> (8u * (i & 3u))) & 255u; }
// 6-bit scale and min of sub-block `is` (get_scale_min_k4 in ggml-quants.c)
vec2 scale_min_k4(uint sb, uint is) {
    if (is < 4u) {
        return vec2(byte_at(sb, is) & 63u, byte_at(sb, is + 4u) & 63u);
    }
    uint a = byte_at(sb, is + 4u);
    return vec2((a & 15u) | ((byte_at(sb, is - 4u) >> 6) << 4),
                (a >> 4) | ((byte_at(sb, is) >> 6) << 4));
}

#if defined(WT_F32)
#define UNIT_VALUES 4
#define UNIT_GROUPS 1
uint units_per_row(uint K) { return K / 4u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    v[0] = uintBitsToFloat(wq4[(woff + row * K) / 4u + u]);
    xo[0] = u * 4u;
}
#elif defined(WT_F16) || defined(WT_BF16)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#if defined(WT_F16)
#define UNPACK2(w) unpackHalf2x16(w)
#else
#define UNPACK2(w) bf16x2(w)
#endif
uint units_per_row(uint K) { return K / 8u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uvec4 w = wq4[(woff + row * (K / 2u)) / 4u + u];
    v[0] = vec4(UNPACK2(w.x), UNPACK2(w.y));
    v[1] = vec4(UNPACK2(w.z), UNPACK2(w.w));
    xo[0] = u * 8u; xo[1] = u * 8u + 4u;
}
#elif defined(WT_Q8_0)
#define UNIT_VALUES 16
#define UNIT_GROUPS 4
uint units_per_row(uint K) { return K / 16u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint blk = row * (K / 32u) + (u >> 1);
    uvec4 w = wq4[woff / 4u + blk * 2u + (u & 1u)];
    float d = half_at(woff2, blk);
    v[0] = sbytes4(w.x) * d;
    v[1] = sbytes4(w.y) * d;
    v[2] = sbytes4(w.z) * d;
    v[3] = sbytes4(w.w) * d;
    uint c = u * 16u;
    xo[0] = c; xo[1] = c + 4u; xo[2] = c + 8u; xo[3] = c + 12u;
}
#elif defined(WT_Q4_0) || defined(WT_Q4_1)
#define UNIT_VALUES 32
#define UNIT_GROUPS 8
uint units_per_row(uint K) { return K / 32u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint blk = row * (K / 32u) + u;
    uvec4 w = wq4[woff / 4u + blk];
#if defined(WT_Q4_0)
    float d = half_at(woff2, blk);
    float m = -8.0 * d;
#else
    vec2 dm = unpackHalf2x16(wq[woff2 + blk]);
    float d = dm.x, m = dm.y;
#endif
    v[0] = nib_lo(w.x) * d + m; v[1] = nib_lo(w.y) * d + m;
    v[2] = nib_lo(w.z) * d + m; v[3] = nib_lo(w.w) * d + m;
    v[4] = nib_hi(w.x) * d + m; v[5] = nib_hi(w.y) * d + m;
    v[6] = nib_hi(w.z) * d + m; v[7] = nib_hi(w.w) * d + m;
    uint c = u * 32u;
    [[unroll]] for (uint g = 0; g < 8u; g++) xo[g] = c + 4u * g;
}
#elif defined(WT_Q5_0) || defined(WT_Q5_1)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
uint units_per_row(uint K) { return K / 8u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint blk = row * (K / 32u) + (u >> 2);
    uint r = u & 3u;
    uint qh = wq[woff + blk * 5u];
    uint w = wq[woff + blk * 5u + 1u + r];
    vec4 lo = nib_lo(w) + bits4(qh, r * 4u) * 16.0;
    vec4 hi = nib_hi(w) + bits4(qh, 16u + r * 4u) * 16.0;
#if defined(WT_Q5_0)
    float d = half_at(woff2, blk);
    v[0] = (lo - 16.0) * d;
    v[1] = (hi - 16.0) * d;
#else
    vec2 dm = unpackHalf2x16(wq[woff2 + blk]);
    v[0] = lo * dm.x + dm.y;
    v[1] = hi * dm.x + dm.y;
#endif
    uint c = (u >> 2) * 32u + r * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#elif defined(WT_Q4_K)
#define UNIT_VALUES 32
#define UNIT_GROUPS 8
uint units_per_row(uint K) { return K / 32u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint blk = row * (K / 256u) + (u >> 3);
    uint r = u & 7u;              // 16-byte chunk of the block's qs
    uint base = woff + blk * 36u;
    vec2 dm = unpackHalf2x16(wq[base]);
    uint j = r >> 1;              // which 64-value group
    vec2 s0 = scale_min_k4(base + 1u, 2u * j);
    vec2 s1 = scale_min_k4(base + 1u, 2u * j + 1u);
    uvec4 q = wq4[(base + 4u) / 4u + r];
    float d0 = dm.x * s0.x, m0 = dm.y * s0.y, d1 = dm.x * s1.x, m1 = dm.y * s1.y;
    v[0] = nib_lo(q.x) * d0 - m0; v[1] = nib_lo(q.y) * d0 - m0;
    v[2] = nib_lo(q.z) * d0 - m0; v[3] = nib_lo(q.w) * d0 - m0;
    v[4] = nib_hi(q.x) * d1 - m1; v[5] = nib_hi(q.y) * d1 - m1;
    v[6] = nib_hi(q.z) * d1 - m1; v[7] = nib_hi(q.w) * d1 - m1;
    uint c = (u >> 3) * 256u + j * 64u + (r & 1u) * 16u;
    [[unroll]] for (uint g = 0; g < 4u; g++) { xo[g] = c + 4u * g; xo[4u + g] = c + 32u + 4u * g; }
}
#elif defined(WT_Q5_K)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define KQS 12u
uint units_per_row(uint K) { return K / 8u; }

void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint blk = row * (K / 256u) + (u >> 5);
    uint w = u & 31u;
    uint base = woff + blk * 44u;
    vec2 dm = unpackHalf2x16(wq[base]);
    uint j = w >> 3;              // which 64-value group
    uint l0 = (w & 7u) * 4u;      // first of 4 consecutive values inside it
    vec2 s0 = scale_min_k4(base + 1u, 2u * j);
    vec2 s1 = scale_min_k4(base + 1u, 2u * j + 1u);
    uint q = wq[base + KQS + w];
    vec4 lo = nib_lo(q);
    vec4 hi = nib_hi(q);
    uint qh = wq[base + 4u + (w & 7u)];  // qh[l0 .. l0+3]
    lo += vec4((qh >> (2u * j)) & 1u, (qh >> (8u + 2u * j)) & 1u, (qh >> (16u + 2u * j)) & 1u, (qh >> (24u + 2u * j)) & 1u) * 16.0;
    hi += vec4((qh >> (2u * j + 1u)) & 1u, (qh >> (9u + 2u * j)) & 1u, (qh >> (17u + 2u * j)) & 1u, (qh >> (25u + 2u * j)) & 1u) * 16.0;
    v[0] = lo * (dm.x * s0.x) - dm.y * s0.y;
    v[1] = hi * (dm.x * s1.x) - dm.y * s1.y;
    uint c = (u >> 5) * 256u + j * 64u + l0;
    xo[0] = c; xo[1] = c + 32u;
}
#elif defined(WT_Q6_K)
#define UNIT_VALUES 16
#define UNIT_GROUPS 4
uint units_per_row(uint K) { return K / 16u; }
void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint blk = row * (K / 256u) + (u >> 4);
    uint r = u & 15u;
    uint n = r >> 3;              // which 128-value half
    uint l0 = (r & 7u) * 4u;      // l .. l+3 inside it
    uint base = woff + blk * 53u;
    uint qa = wq[base + 16u * n + (l0 >> 2)];        // ql[l]
    uint qb = wq[base + 16u * n + 8u + (l0 >> 2)];   // ql[l + 32]
    uint qh = wq[base + 32u + 8u * n + (l0 >> 2)];   // qh[l]
    float d = unpackHalf2x16(wq[base + 52u]).x;
    uint is = l0 >> 4;
    vec4 h0 = vec4(qh & 3u, (qh >> 8) & 3u, (qh >> 16) & 3u, (qh >> 24) & 3u);
    vec4 h1 = vec4((qh >> 2) & 3u, (qh >> 10) & 3u, (qh >> 18) & 3u, (qh >> 26) & 3u);
    vec4 h2 = vec4((qh >> 4) & 3u, (qh >> 12) & 3u, (qh >> 20) & 3u, (qh >> 28) & 3u);
    vec4 h3 = vec4((qh >> 6) & 3u, (qh >> 14) & 3u, (qh >> 22) & 3u, (qh >> 30) & 3u);
    uint sb = (base + 48u) * 4u + 8u * n + is;       // byte index of sc[is] in wq
    float s0 = float(bitfieldExtract(int(wq[sb >> 2]), int(8u * (sb & 3u)), 8));
    float s1 = float(bitfieldExtract(int(wq[(sb + 2u) >> 2]), int(8u * ((sb + 2u) & 3u)), 8));
    float s2 = float(bitfieldExtract(int(wq[(sb + 4u) >> 2]), int(8u * ((sb + 4u) & 3u)), 8));
    float s3 = float(bitfieldExtract(int(wq[(sb + 6u) >> 2]), int(8u * ((sb + 6u) & 3u)), 8));
    v[0] = (nib_lo(qa) + h0 * 16.0 - 32.0) * (d * s0);
    v[1] = (nib_lo(qb) + h1 * 16.0 - 32.0) * (d * s1);
    v[2] = (nib_hi(qa) + h2 * 16.0 - 32.0) * (d * s2);
    v[3] = (nib_hi(qb) + h3 * 16.0 - 32.0) * (d * s3);
    uint c = (u >> 4) * 256u + n * 128u + l0;
    xo[0] = c; xo[1] = c + 32u; xo[2] = c + 64u; xo[3] = c + 96u;
}
#else
#error "define one WT_<type>"
#endif
