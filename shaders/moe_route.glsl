// A MoE router's choice for one row, by one subgroup: the top K of E logits
// (ties to the lowest expert index), weights = softmax over the selected
// logits times SCALE (= softmax over all experts, top-k, renormalized, as
// Qwen3_5MoeTopKRouter and llama.cpp's build_moe_ffn with norm_w).
// MOE_ROUTE_ROW(LOGIT, E, K, SCALE, PUT): LOGIT(e) reads expert e's logit,
// PUT(t, id, w) stores the t-th choice (called by one lane). moe_router.comp
// and the router matvec's ROUTE epilogue (mul_mvk.comp) both expand it, so
// that they choose alike. Lane j owns experts j, j + S, ... (at most 64:
// E <= 64 S), marked taken in bit j of a 64-bit mask (no rescan of earlier
// winners: that held the decode step's router at ~125 us a layer on the H200).
#define MOE_ROUTE_KMAX 16
#define MOE_ROUTE_ROW(LOGIT, E, K, SCALE, PUT) { \
    uint lane_ = gl_SubgroupInvocationID; \
    uvec2 taken_ = uvec2(0u); \
    float selv_[MOE_ROUTE_KMAX]; \
    uint sel_[MOE_ROUTE_KMAX]; \
    for (uint t_ = 0u; t_ < (K); t_++) { \
        float best_ = -1.0 / 0.0; \
        uint bi_ = 0xffffffffu; \
        for (uint e_ = lane_, j_ = 0u; e_ < (E); e_ += gl_SubgroupSize, j_++) { \
            float v_ = LOGIT(e_); \
            bool free_ = ((j_ < 32u ? taken_.x >> j_ : taken_.y >> (j_ - 32u)) & 1u) == 0u; \
            if (free_ && (bi_ == 0xffffffffu || v_ > best_)) { best_ = v_; bi_ = e_; } \
        } \
        float m_ = subgroupMax(bi_ == 0xffffffffu ? -1.0 / 0.0 : best_); \
        uint win_ = subgroupMin(bi_ != 0xffffffffu && best_ == m_ ? bi_ : 0xffffffffu); \
        if (win_ == bi_) { \
            uint j_ = (win_ - lane_) / gl_SubgroupSize; \
            if (j_ < 32u) taken_.x |= 1u << j_; else taken_.y |= 1u << (j_ - 32u); \
        } \
        sel_[t_] = win_; \
        selv_[t_] = m_; \
    } \
    float sum_ = 0.0; \
    for (uint t_ = 0u; t_ < (K); t_++) sum_ += exp(selv_[t_] - selv_[0]); \
    if (subgroupElect()) { \
        for (uint t_ = 0u; t_ < (K); t_++) PUT(t_, sel_[t_], exp(selv_[t_] - selv_[0]) / sum_ * (SCALE)); \
    } \
}
