// Shared by the sampling kernels (topk_part.comp, sample.comp).
// no candidate: above every token id, and not a NaN's bits (lavapipe turned
// 0xffffffff, moved between arrays, into 0x7fc00000)
#define NONE 0x7f000000u

// NaN by its bits: lavapipe's compiler folds isnan() away (and then orders NaN)
bool is_nan(float x) { return (floatBitsToUint(x) & 0x7fffffffu) > 0x7f800000u; }

// a before b in the candidates' order: larger value first, equal values by lower index
bool before(float av, uint ai, float bv, uint bi) { return av > bv || (av == bv && ai < bi); }
