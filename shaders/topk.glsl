// Shared by the sampling kernels (topk_part.comp, sample.comp).
// no candidate: above every token id, and not a NaN's bits (lavapipe turned
// 0xffffffff, moved between arrays, into 0x7fc00000)
#define NONE 0x7f000000u

// NaN by its bits: lavapipe's compiler folds isnan() away (and then orders NaN)
bool is_nan(float x) { return (floatBitsToUint(x) & 0x7fffffffu) > 0x7f800000u; }

// a before b in the candidates' order: larger value first, equal values by lower index
bool before(float av, uint ai, float bv, uint bi) { return av > bv || (av == bv && ai < bi); }

#ifdef TOPK_VPL
// The workgroup's R best candidates (R <= TOPK_MAX), in before() order, then
// (-inf, NONE) once the candidates run out: each invocation brings TOPK_VPL
// pairs (v, ix; ix NONE: no candidate; every index at most once in the
// workgroup). Two levels: each subgroup takes its own R best by subgroup
// reductions alone (no barrier), each round's best going to the subgroup's
// list in shared memory while its owner moves on to its next; after one
// barrier, subgroup 0 merges the lists the same way, a lane holding the heads
// of up to TOPK_LPL lists (so subgroups of 8+ lanes at 256 invocations).
// Returns true in the one invocation that then holds the result in tk_v /
// tk_i (lane 0 of subgroup 0; the others return false and must not wait on a
// barrier afterwards).
#define TOPK_MAX 64
#define TOPK_SG 32
#define TOPK_LPL 4
shared float tk_lv[TOPK_SG][TOPK_MAX];
shared uint tk_li[TOPK_SG][TOPK_MAX];
shared float tk_v[TOPK_MAX];
shared uint tk_i[TOPK_MAX];

bool topk_wg(float v[TOPK_VPL], uint ix[TOPK_VPL], uint R) {
    uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;
    float bv = -1.0 / 0.0;
    uint bi = NONE;
    [[unroll]] for (uint j = 0; j < TOPK_VPL; j++)
        if (ix[j] != NONE && before(v[j], ix[j], bv, bi)) { bv = v[j]; bi = ix[j]; }
    for (uint k = 0; k < R; k++) {
        float m = subgroupMax(bv);
        uint mi = subgroupMin(bv == m ? bi : NONE);
        if (lane == 0u) { tk_lv[sg][k] = m; tk_li[sg][k] = mi; }
        if (mi != NONE && bi == mi) {                  // the owner: its best after the one taken
            float wv = bv;
            bv = -1.0 / 0.0;
            bi = NONE;
            [[unroll]] for (uint j = 0; j < TOPK_VPL; j++)
                if (ix[j] != NONE && before(wv, mi, v[j], ix[j]) && before(v[j], ix[j], bv, bi)) {
                    bv = v[j]; bi = ix[j];
                }
        }
    }
    barrier();
    if (sg != 0u) return false;
    uint S = gl_SubgroupSize, NS = gl_NumSubgroups;
    // list lane + t * S: its head's position, value and index. (Every shared
    // read is kept inside the lists, even one whose value is then discarded:
    // without the clamps the H200 drew token 0 for every row.)
    uint hp[TOPK_LPL];
    float hv[TOPK_LPL];
    uint hi[TOPK_LPL];
    [[unroll]] for (uint t = 0; t < TOPK_LPL; t++) {
        uint g = min(lane + t * S, NS - 1u);
        bool ok = lane + t * S < NS && R > 0u;
        hp[t] = 0u;
        hv[t] = ok ? tk_lv[g][0] : -1.0 / 0.0;
        hi[t] = ok ? tk_li[g][0] : NONE;
    }
    for (uint k = 0; k < R; k++) {
        bv = -1.0 / 0.0;
        bi = NONE;
        [[unroll]] for (uint t = 0; t < TOPK_LPL; t++)
            if (hi[t] != NONE && before(hv[t], hi[t], bv, bi)) { bv = hv[t]; bi = hi[t]; }
        float m = subgroupMax(bv);
        uint mi = subgroupMin(bv == m ? bi : NONE);
        if (lane == 0u) { tk_v[k] = m; tk_i[k] = mi; }
        if (mi != NONE && bi == mi) {                  // the owner's list moves on
            [[unroll]] for (uint t = 0; t < TOPK_LPL; t++) {
                if (hi[t] != mi) continue;
                uint g = min(lane + t * S, NS - 1u), q = hp[t] + 1u;
                hp[t] = q;
                hv[t] = q < R ? tk_lv[g][min(q, R - 1u)] : -1.0 / 0.0;
                hi[t] = q < R ? tk_li[g][min(q, R - 1u)] : NONE;
            }
        }
    }
    return lane == 0u;
}
#endif
