// The KV cache's storage (vkengine/state.py KVCache), shared by its writers
// (rope_kv.comp, norm_rope_kv.comp) and readers (attention.comp,
// attention_dec.comp, attention_mc.comp). Per layer, K and V each, per slot of
// `cap` positions (32-bit words):
//   f16 (default):  [pos][kv_head][hd/2 words: f16 pairs]
//   q8_0 (KV_K_Q8, KV_V_Q8): the quants [pos][kv_head][hd/4 words: 4 x int8,
//     value j of a word in byte j], then, from cap * n_kv * hd/4 words into the
//     slot, the scales [pos][kv_head][hd/64 words: f16 pairs]. Block b of a
//     head's row (values 32b .. 32b+31) is quant words 8b .. 8b+7 and half
//     b % 2 of scale word b / 2 (hd a multiple of 64).
// q8_0 as llama.cpp's quantize_row_q8_0_ref (ggml-quants.c): per block
// d = max|x| / 127, stored as f16; q = roundf(x * (1 / d)) (0 where d = 0),
// with 1 / d taken of the unrounded d; a value is q * d.
// Kernels take K's slot stride (push constant slot_stride): the positions a slot
// holds, V's stride and where the scales start follow from it (kv_slot). With a
// q8_0 side the state rounds cap up to a multiple of 4, so that every slot and
// every row of quants starts 16-byte aligned (uvec4 loads).
#ifndef KV_K_Q8
#define KV_K_Q8 0
#endif
#ifndef KV_V_Q8
#define KV_V_Q8 0
#endif

// words of one position of one KV head in a slot: its row, and for q8_0 its scales
uint kv_pos_words(bool q8, uint hd) { return q8 ? hd / 4u + hd / 64u : hd / 2u; }

struct KvSlot {
    uint k_stride, v_stride;   // words of a slot of K, of V
    uint k_scales, v_scales;   // q8_0: where a slot's scales start, in words from the slot's start
};

KvSlot kv_slot(uint k_slot_stride, uint n_kv, uint hd) {
    KvSlot s;
    s.k_stride = k_slot_stride;
#if KV_K_Q8 || KV_V_Q8
    uint cap = k_slot_stride / (n_kv * kv_pos_words(KV_K_Q8 != 0, hd));
    s.v_stride = cap * n_kv * kv_pos_words(KV_V_Q8 != 0, hd);
    s.k_scales = cap * n_kv * (hd / 4u);
    s.v_scales = s.k_scales;
#else
    s.v_stride = k_slot_stride;
    s.k_scales = 0u;
    s.v_scales = 0u;
#endif
    return s;
}

// -- q8_0 blocks --------------------------------------------------------------------

float kv_q8_scale(float amax) { return amax / 127.0; }

float kv_q8_inv(float d) { return d != 0.0 ? 1.0 / d : 0.0; }

// 4 values -> a word of 4 int8 (value j in byte j): roundf(x * id), halves away
// from zero (x - trunc(x) is exact, so ties are found exactly)
uint kv_q8_pack(vec4 x, float id) {
    vec4 y = x * id;
    vec4 t = trunc(y);
    vec4 r = t + mix(vec4(0.0), sign(y), greaterThanEqual(abs(y - t), vec4(0.5)));
    ivec4 i = clamp(ivec4(r), ivec4(-127), ivec4(127));
    return uint(i.x & 255) | (uint(i.y & 255) << 8) | (uint(i.z & 255) << 16) | (uint(i.w & 255) << 24);
}

// a word of 4 int8 -> 4 floats
vec4 kv_i8x4(uint w) {
    int i = int(w);
    return vec4(bitfieldExtract(i, 0, 8), bitfieldExtract(i, 8, 8), bitfieldExtract(i, 16, 8), bitfieldExtract(i, 24, 8));
}

// Values 2w and 2w+1 of a q8_0 row as one word, where an f16 row has their pair:
// their two int8 (bits 0-15, from quant word w / 2) and their block's scale
// (f16, bits 16-31, from scale word w / 32)
uint kv_q8_pair_word(uint quant_word, uint scale_word, uint w) {
    return ((quant_word >> (16u * (w & 1u))) & 0xffffu) | ((scale_word >> (16u * ((w >> 4) & 1u))) << 16);
}

vec2 kv_q8_pair(uint u) {
    int i = int(u);
    return vec2(bitfieldExtract(i, 0, 8), bitfieldExtract(i, 8, 8)) * unpackHalf2x16(u >> 16).x;
}

// Values 8c .. 8c+7 of a q8_0 row as 4 words of f16 pairs (an f16 row's uvec4
// c): from the uvec4 of quants that holds them (quant words 4(c/2) ..) and
// their block's scale word (c / 8)
uvec4 kv_q8_halves8(uvec4 q, uint c, uint scale_word) {
    uvec2 w = (c & 1u) != 0u ? q.zw : q.xy;
    float d = unpackHalf2x16(scale_word)[(c >> 2) & 1u];
    vec4 a = kv_i8x4(w.x) * d;
    vec4 b = kv_i8x4(w.y) * d;
    return uvec4(packHalf2x16(a.xy), packHalf2x16(a.zw), packHalf2x16(b.xy), packHalf2x16(b.zw));
}

// a V word as the readers load it (an f16 pair, or kv_q8_pair_word's) -> its 2 values
#if KV_V_Q8
#define KV_V_PAIR(u) kv_q8_pair(u)
#else
#define KV_V_PAIR(u) unpackHalf2x16(u)
#endif
