// The gated RMSNorm of one head of one row, by one subgroup:
//   y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i] * silu(z[i])
// (Qwen3_5RMSNormGated in HF, build_norm_gated in llama.cpp's qwen35.cpp).
// GNORM_HEAD(X, Z, W, Y, HD, EPS): X(i), Z(i) and W(i) read the head's i-th
// input, gate and weight, Y(i, v) writes its i-th output. gated_rms_norm.comp
// and delta_rule.comp's fused form (GNORM) both expand it, so that they give
// the same bits.
#define GNORM_HEAD(X, Z, W, Y, HD, EPS) { \
    float ss_ = 0.0; \
    for (uint i_ = gl_SubgroupInvocationID; i_ < (HD); i_ += gl_SubgroupSize) { \
        float v_ = X(i_); \
        ss_ += v_ * v_; \
    } \
    float sc_ = inversesqrt(subgroupAdd(ss_) / float(HD) + (EPS)); \
    for (uint i_ = gl_SubgroupInvocationID; i_ < (HD); i_ += gl_SubgroupSize) \
        Y(i_, X(i_) * sc_ * W(i_) * silu(Z(i_))); \
}
