// Weight formats, read from a 32-bit storage buffer `wq` (the kernels do not rely on
// 16/8-bit storage, which not every device has, so halves, bytes and nibbles are
// unpacked here).
//
// The including shader declares `wq` (binding WQ_BINDING, default 0) and defines
// exactly one WT_<type>. A matrix is row-major with K columns, its values at word
// offset `woff` and, for the repacked types, per-block scales at `woff2`. Work is
// cut into units of UNIT_VALUES values (shaders/variants.py UNIT_VALUES mirrors
// these numbers). Units are small (4 to 8 bytes of quants, 8 values; 16 for
// Q6_K) so that consecutive lanes read consecutive weights AND consecutive
// activations: a lane whose unit spans 32 columns would read x 128 bytes away
// from its neighbour, and every x load would touch 32 cache lines (measured on
// the H200: Q4_0 matvec at a tenth of Q8_0's bandwidth with 32-value units).
// Each type provides:
//   UNIT_SPAN   the columns of a unit lie within one aligned span of this many
//               (32 = contiguous; K-quants interleave: 64 for Q4_K/Q5_K, 128 for Q6_K)
//   units_per_row(K)
//   Raw unit_fetch(woff, woff2, row, u, K)   only the memory loads of unit u
//   void unit_decode(Raw r, u, out v[UNIT_GROUPS], out xo[UNIT_GROUPS])
//       the unit's values as UNIT_GROUPS runs of 4 (vec4) and the column of
//       each run's first value
// Splitting loads from decoding lets a kernel issue the loads of several units
// before it needs the first one (memory latency is what limits decode).
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
//   IQ4_NL qs: 4 words a block (32 x 4-bit indices)  woff2: d as halves
//   MXFP4  qs: 4 words a block (32 x 4-bit e2m1)     woff2: the E8M0 exponent bytes, 4 a word
//   IQ4_XS GGUF's 136-byte block (34 words: d | scales_h, scales_l, 32 words of 4-bit indices)

#ifndef WQ_BINDING
#define WQ_BINDING 0
#endif
layout(binding = WQ_BINDING) readonly buffer Wq4 { uvec4 wq4[]; };
layout(binding = WQ_BINDING) readonly buffer Wq2 { uvec2 wq2[]; };

struct Raw {
    uvec4 q;   // quants
    uvec4 e;   // scales and extra bits, per type
};

#ifdef DQ_MAGIC
// Nibbles to floats without int -> float conversions (measured on the H200:
// Q4 matvecs 5-15% faster; bytes keep the conversion, whose byte selector
// makes it one instruction): a field at bits p .. p+3 of w ORed into the
// mantissa of 2^(23-p) reads as the float 2^(23-p) + field, and subtracting
// 2^(23-p) + bias is exact. One logic op and one add per value.
#define FBITS(w, p, bias) (uintBitsToFloat(((w) & (15u << (p))) | ((150u - (p)) << 23)) - (float(1u << (23u - (p))) + (bias)))
// the low / high nibbles of w's 4 bytes, minus bias
vec4 nib_lo_b(uint w, const float bias) {
    uint h = w >> 16;
    return vec4(FBITS(w, 0u, bias), FBITS(w, 8u, bias), FBITS(h, 0u, bias), FBITS(h, 8u, bias));
}
vec4 nib_hi_b(uint w, const float bias) {
    uint h = w >> 16;
    return vec4(FBITS(w, 4u, bias), FBITS(w, 12u, bias), FBITS(h, 4u, bias), FBITS(h, 12u, bias));
}
#else
vec4 nib_lo_b(uint w, const float bias) {
    return vec4(w & 15u, (w >> 8) & 15u, (w >> 16) & 15u, (w >> 24) & 15u) - bias;
}
vec4 nib_hi_b(uint w, const float bias) {
    return vec4((w >> 4) & 15u, (w >> 12) & 15u, (w >> 20) & 15u, w >> 28) - bias;
}
#endif
vec4 nib_lo(uint w) { return nib_lo_b(w, 0.0); }
vec4 nib_hi(uint w) { return nib_hi_b(w, 0.0); }
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
// the half `i & 1` of word w
float half_sel(uint w, uint i) { vec2 h = unpackHalf2x16(w); return (i & 1u) == 0u ? h.x : h.y; }
// byte i of the 12 scale bytes held in three words
uint byte3(uvec3 w, uint i) { return (w[i >> 2] >> (8u * (i & 3u))) & 255u; }
// 6-bit scale and min of sub-block `is` (get_scale_min_k4 in ggml-quants.c)
vec2 scale_min_k4(uvec3 sw, uint is) {
    if (is < 4u) {
        return vec2(byte3(sw, is) & 63u, byte3(sw, is + 4u) & 63u);
    }
    uint a = byte3(sw, is + 4u);
    return vec2((a & 15u) | ((byte3(sw, is - 4u) >> 6) << 4),
                (a >> 4) | ((byte3(sw, is) >> 6) << 4));
}

#if defined(WT_Q4_0) || defined(WT_Q4_1)
// a Q4 block's scale word(s) as Raw.e (Q4_0: two f16 scales per word, the
// block's parity picks one; Q4_1: d|m in one word), and its (d, m): value = q * d + m
uvec4 q4_scales(uint woff2, uint blk) {
#if defined(WT_Q4_0)
    return uvec4(wq[woff2 + (blk >> 1)], blk, 0u, 0u);
#else
    return uvec4(wq[woff2 + blk], 0u, 0u, 0u);
#endif
}
vec2 q4_dm(uvec4 e) {
#if defined(WT_Q4_0)
    float d = half_sel(e.x, e.y);
    return vec2(d, -8.0 * d);
#else
    return unpackHalf2x16(e.x);
#endif
}
#endif

#if defined(WT_F32)
#define UNIT_VALUES 4
#define UNIT_GROUPS 1
#define UNIT_SPAN 32
uint units_per_row(uint K) { return K / 4u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    return Raw(wq4[(woff + row * K) / 4u + u], uvec4(0u));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    v[0] = uintBitsToFloat(r.q);
    xo[0] = u * 4u;
}
#elif defined(WT_F16) || defined(WT_BF16)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 32
#if defined(WT_F16)
#define UNPACK2(w) unpackHalf2x16(w)
#else
#define UNPACK2(w) bf16x2(w)
#endif
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    return Raw(wq4[(woff + row * (K / 2u)) / 4u + u], uvec4(0u));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    v[0] = vec4(UNPACK2(r.q.x), UNPACK2(r.q.y));
    v[1] = vec4(UNPACK2(r.q.z), UNPACK2(r.q.w));
    xo[0] = u * 8u; xo[1] = u * 8u + 4u;
}
#elif defined(WT_Q8_0)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 32
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 32u) + (u >> 2);
    uvec2 w = wq2[woff / 2u + blk * 4u + (u & 3u)];
    return Raw(uvec4(w, 0u, 0u), uvec4(wq[woff2 + (blk >> 1)], blk, 0u, 0u));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    float d = half_sel(r.e.x, r.e.y);
    v[0] = sbytes4(r.q.x) * d;
    v[1] = sbytes4(r.q.y) * d;
    xo[0] = u * 8u; xo[1] = u * 8u + 4u;
}
#define UNIT_SCALED 1
// unit_decode without the block scale: the weights are v * dm.x + dm.y
void unit_decode_s(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS], out vec2 dm) {
    dm = vec2(half_sel(r.e.x, r.e.y), 0.0);
    v[0] = sbytes4(r.q.x);
    v[1] = sbytes4(r.q.y);
    xo[0] = u * 8u; xo[1] = u * 8u + 4u;
}
#elif (defined(WT_Q4_0) || defined(WT_Q4_1)) && defined(UNIT32)
// a whole block per unit (lavapipe's subgroup matvecs: one scale word per 32
// values instead of per 8; llvmpipe pays per loaded word, see SG_ROWS in
// shaders/variants.py)
#define UNIT_VALUES 32
#define UNIT_GROUPS 8
#define UNIT_SPAN 32
uint units_per_row(uint K) { return K / 32u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 32u) + u, b = woff + blk * 4u;
    return Raw(uvec4(wq[b], wq[b + 1u], wq[b + 2u], wq[b + 3u]), q4_scales(woff2, blk));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    vec2 dm = q4_dm(r.e);
    float d = dm.x, m = dm.y;
    [[unroll]] for (uint j = 0; j < 4u; j++) {
        v[2u * j] = nib_lo(r.q[j]) * d + m;
        v[2u * j + 1u] = nib_hi(r.q[j]) * d + m;
        xo[2u * j] = u * 32u + j * 4u;
        xo[2u * j + 1u] = u * 32u + 16u + j * 4u;
    }
}
#elif defined(WT_Q4_0) || defined(WT_Q4_1)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 32
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 32u) + (u >> 2);
    return Raw(uvec4(wq[woff + blk * 4u + (u & 3u)], 0u, 0u, 0u), q4_scales(woff2, blk));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    vec2 dm = q4_dm(r.e);
    float d = dm.x, m = dm.y;
    v[0] = nib_lo(r.q.x) * d + m;
    v[1] = nib_hi(r.q.x) * d + m;
    uint c = (u >> 2) * 32u + (u & 3u) * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#define UNIT_SCALED 1
// unit_decode without the block scale: the weights are v * dm.x + dm.y
// (Q4_0: v = q - 8, dm.y = 0)
void unit_decode_s(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS], out vec2 dm) {
#if defined(WT_Q4_0)
    dm = vec2(half_sel(r.e.x, r.e.y), 0.0);
    const float bias = 8.0;
#else
    dm = unpackHalf2x16(r.e.x);
    const float bias = 0.0;
#endif
    v[0] = nib_lo_b(r.q.x, bias);
    v[1] = nib_hi_b(r.q.x, bias);
    uint c = (u >> 2) * 32u + (u & 3u) * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#elif defined(WT_IQ4_XS)
// 256-value super-blocks of eight 32-value sub-blocks, each with a 6-bit
// scale (low 4 bits in scales_l, high 2 in scales_h) times the f16 d, minus 32;
// values IQ4_NL's levels (dequantize_row_iq4_xs in ggml-quants.c)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 32
const float LEVELS[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                   1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint base = woff + (row * (K / 256u) + (u >> 5)) * 34u;
    return Raw(uvec4(wq[base + 2u + (u & 31u)], 0u, 0u, 0u), uvec4(wq[base], wq[base + 1u], 0u, 0u));
}
vec4 lut_lo(uint w) { return vec4(LEVELS[w & 15u], LEVELS[(w >> 8) & 15u], LEVELS[(w >> 16) & 15u], LEVELS[(w >> 24) & 15u]); }
vec4 lut_hi(uint w) { return vec4(LEVELS[(w >> 4) & 15u], LEVELS[(w >> 12) & 15u], LEVELS[(w >> 20) & 15u], LEVELS[w >> 28]); }
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint ib = (u & 31u) >> 2;     // sub-block
    float d = unpackHalf2x16(r.e.x).x;
    uint sl = (r.e.y >> (8u * (ib >> 1))) & 255u;
    uint ls = ((sl >> (4u * (ib & 1u))) & 15u) | (((r.e.x >> (16u + 2u * ib)) & 3u) << 4);
    float dl = d * (float(ls) - 32.0);
    v[0] = lut_lo(r.q.x) * dl;
    v[1] = lut_hi(r.q.x) * dl;
    uint c = (u >> 5) * 256u + ib * 32u + (u & 3u) * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#elif defined(WT_IQ4_NL) || defined(WT_MXFP4)
// Q4_0's layout with values from a 16-entry table: IQ4_NL's non-linear levels
// (kvalues_iq4nl) times the block's f16 d; MXFP4's e2m1 levels, doubled
// (kvalues_mxfp4), times 2^(e - 128) for the block's E8M0 byte e
// (ggml_e8m0_to_fp32_half: gpt-oss's expert weights)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 32
#if defined(WT_IQ4_NL)
const float LEVELS[16] = float[16](-127.0, -104.0, -83.0, -65.0, -49.0, -35.0, -22.0, -10.0,
                                   1.0, 13.0, 25.0, 38.0, 53.0, 69.0, 89.0, 113.0);
#else
const float LEVELS[16] = float[16](0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0,
                                   0.0, -1.0, -2.0, -3.0, -4.0, -6.0, -8.0, -12.0);
#endif
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 32u) + (u >> 2);
#if defined(WT_IQ4_NL)
    uint sw = wq[woff2 + (blk >> 1)];
#else
    uint sw = wq[woff2 + (blk >> 2)];
#endif
    return Raw(uvec4(wq[woff + blk * 4u + (u & 3u)], 0u, 0u, 0u), uvec4(sw, blk, 0u, 0u));
}
float lut_scale(uvec4 e) {
#if defined(WT_IQ4_NL)
    return half_sel(e.x, e.y);
#else
    uint x = (e.x >> (8u * (e.y & 3u))) & 255u;
    return uintBitsToFloat(x < 2u ? 0x00200000u << x : (x - 1u) << 23);
#endif
}
vec4 lut_lo(uint w) { return vec4(LEVELS[w & 15u], LEVELS[(w >> 8) & 15u], LEVELS[(w >> 16) & 15u], LEVELS[(w >> 24) & 15u]); }
vec4 lut_hi(uint w) { return vec4(LEVELS[(w >> 4) & 15u], LEVELS[(w >> 12) & 15u], LEVELS[(w >> 20) & 15u], LEVELS[w >> 28]); }
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    float d = lut_scale(r.e);
    v[0] = lut_lo(r.q.x) * d;
    v[1] = lut_hi(r.q.x) * d;
    uint c = (u >> 2) * 32u + (u & 3u) * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#define UNIT_SCALED 1
// unit_decode without the block scale: the weights are v * dm.x
void unit_decode_s(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS], out vec2 dm) {
    dm = vec2(lut_scale(r.e), 0.0);
    v[0] = lut_lo(r.q.x);
    v[1] = lut_hi(r.q.x);
    uint c = (u >> 2) * 32u + (u & 3u) * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#elif defined(WT_Q5_0) || defined(WT_Q5_1)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 32
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 32u) + (u >> 2);
    uint b = woff + blk * 5u;   // 5-word blocks: not 16-byte aligned, scalar loads
#if defined(WT_Q5_0)
    uint sw = wq[woff2 + (blk >> 1)];
#else
    uint sw = wq[woff2 + blk];
#endif
    return Raw(uvec4(wq[b + 1u + (u & 3u)], wq[b], 0u, 0u), uvec4(sw, blk, 0u, 0u));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint rr = u & 3u;
    vec4 lo = nib_lo(r.q.x) + bits4(r.q.y, rr * 4u) * 16.0;
    vec4 hi = nib_hi(r.q.x) + bits4(r.q.y, 16u + rr * 4u) * 16.0;
#if defined(WT_Q5_0)
    float d = half_sel(r.e.x, r.e.y);
    v[0] = (lo - 16.0) * d;
    v[1] = (hi - 16.0) * d;
#else
    vec2 dm = unpackHalf2x16(r.e.x);
    v[0] = lo * dm.x + dm.y;
    v[1] = hi * dm.x + dm.y;
#endif
    uint c = (u >> 2) * 32u + rr * 4u;
    xo[0] = c; xo[1] = c + 16u;
}
#elif defined(WT_Q4_K)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 64
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 256u) + (u >> 5);
    uint base = woff + blk * 36u;
    return Raw(uvec4(wq[base + 4u + (u & 31u)], 0u, 0u, 0u), wq4[base / 4u]);  // qs word; d|dmin + scales
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint w = u & 31u;
    uint j = w >> 3;              // which 64-value group
    uint l0 = (w & 7u) * 4u;      // first of 4 consecutive values inside it
    vec2 dm = unpackHalf2x16(r.e.x);
    vec2 s0 = scale_min_k4(r.e.yzw, 2u * j);
    vec2 s1 = scale_min_k4(r.e.yzw, 2u * j + 1u);
    v[0] = nib_lo(r.q.x) * (dm.x * s0.x) - dm.y * s0.y;
    v[1] = nib_hi(r.q.x) * (dm.x * s1.x) - dm.y * s1.y;
    uint c = (u >> 5) * 256u + j * 64u + l0;
    xo[0] = c; xo[1] = c + 32u;
}
#elif defined(WT_Q5_K)
#define UNIT_VALUES 8
#define UNIT_GROUPS 2
#define UNIT_SPAN 64
uint units_per_row(uint K) { return K / 8u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 256u) + (u >> 5);
    uint w = u & 31u;
    uint base = woff + blk * 44u;
    // qs word, qh[l0 .. l0+3]; d|dmin + 12 scale bytes
    return Raw(uvec4(wq[base + 12u + w], wq[base + 4u + (w & 7u)], 0u, 0u), wq4[base / 4u]);
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint w = u & 31u;
    uint j = w >> 3;              // which 64-value group
    uint l0 = (w & 7u) * 4u;      // first of 4 consecutive values inside it
    vec2 dm = unpackHalf2x16(r.e.x);
    vec2 s0 = scale_min_k4(r.e.yzw, 2u * j);
    vec2 s1 = scale_min_k4(r.e.yzw, 2u * j + 1u);
    uint qh = r.q.y;
    vec4 lo = nib_lo(r.q.x) + vec4((qh >> (2u * j)) & 1u, (qh >> (8u + 2u * j)) & 1u,
                                   (qh >> (16u + 2u * j)) & 1u, (qh >> (24u + 2u * j)) & 1u) * 16.0;
    vec4 hi = nib_hi(r.q.x) + vec4((qh >> (2u * j + 1u)) & 1u, (qh >> (9u + 2u * j)) & 1u,
                                   (qh >> (17u + 2u * j)) & 1u, (qh >> (25u + 2u * j)) & 1u) * 16.0;
    v[0] = lo * (dm.x * s0.x) - dm.y * s0.y;
    v[1] = hi * (dm.x * s1.x) - dm.y * s1.y;
    uint c = (u >> 5) * 256u + j * 64u + l0;
    xo[0] = c; xo[1] = c + 32u;
}
#elif defined(WT_Q6_K)
#define UNIT_VALUES 16
#define UNIT_GROUPS 4
#define UNIT_SPAN 128
uint units_per_row(uint K) { return K / 16u; }
Raw unit_fetch(uint woff, uint woff2, uint row, uint u, uint K) {
    uint blk = row * (K / 256u) + (u >> 4);
    uint r = u & 15u;
    uint n = r >> 3;              // which 128-value half
    uint l4 = r & 7u;             // l = 4 * l4 .. +3 inside it
    uint base = woff + blk * 53u; // 53-word blocks: not 16-byte aligned, scalar loads
    return Raw(uvec4(wq[base + 16u * n + l4], wq[base + 16u * n + 8u + l4], wq[base + 32u + 8u * n + l4],
                     wq[base + 52u]),
               uvec4(wq[base + 48u], wq[base + 49u], wq[base + 50u], wq[base + 51u]));
}
void unit_decode(Raw r, uint u, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    uint rr = u & 15u;
    uint n = rr >> 3;
    uint l0 = (rr & 7u) * 4u;
    uint qa = r.q.x, qb = r.q.y, qh = r.q.z;   // ql[l], ql[l + 32], qh[l]
    float d = unpackHalf2x16(r.q.w).x;
    uint is = 8u * n + (l0 >> 4);               // scales[is], is+2, is+4, is+6 (int8)
    float s0 = float(bitfieldExtract(int(r.e[is >> 2]), int(8u * (is & 3u)), 8));
    float s1 = float(bitfieldExtract(int(r.e[(is + 2u) >> 2]), int(8u * ((is + 2u) & 3u)), 8));
    float s2 = float(bitfieldExtract(int(r.e[(is + 4u) >> 2]), int(8u * ((is + 4u) & 3u)), 8));
    float s3 = float(bitfieldExtract(int(r.e[(is + 6u) >> 2]), int(8u * ((is + 6u) & 3u)), 8));
    vec4 h0 = vec4(qh & 3u, (qh >> 8) & 3u, (qh >> 16) & 3u, (qh >> 24) & 3u);
    vec4 h1 = vec4((qh >> 2) & 3u, (qh >> 10) & 3u, (qh >> 18) & 3u, (qh >> 26) & 3u);
    vec4 h2 = vec4((qh >> 4) & 3u, (qh >> 12) & 3u, (qh >> 20) & 3u, (qh >> 28) & 3u);
    vec4 h3 = vec4((qh >> 6) & 3u, (qh >> 14) & 3u, (qh >> 22) & 3u, (qh >> 30) & 3u);
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

void unit_load(uint woff, uint woff2, uint row, uint u, uint K, out vec4 v[UNIT_GROUPS], out uint xo[UNIT_GROUPS]) {
    unit_decode(unit_fetch(woff, woff2, row, u, K), u, v, xo);
}
