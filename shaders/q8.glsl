// 8-bit blocks of x for the XQ8 matvecs (quantize_q8.comp writes them; any
// other kernel that rounds x to blocks must use these so that the same floats
// give the same blocks): per block of 32 values, d = max|x| / 127 and
// q = roundEven(x * (1 / d)), clamped to +-127 (q = 0 where d = 0)
float q8_scale(float amax) { return amax / 127.0; }

float q8_inv(float d) { return d > 0.0 ? 1.0 / d : 0.0; }

// 4 values -> one word of 4 int8 (value j in byte j)
uint q8_pack(vec4 v, float id) {
    ivec4 i = clamp(ivec4(roundEven(v * id)), ivec4(-127), ivec4(127));
    return uint(i.x & 255) | (uint(i.y & 255) << 8) | (uint(i.z & 255) << 16) | (uint(i.w & 255) << 24);
}

float q8_amax4(vec4 v) {
    vec4 a = abs(v);
    return max(max(a.x, a.y), max(a.z, a.w));
}
