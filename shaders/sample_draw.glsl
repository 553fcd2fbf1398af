// sample.comp's draw, one invocation: a row's
// candidates tv/ti (its best `rounds` logits, largest first, equal values by
// lowest index; NONE after the last) and its params words sp .. (temperature,
// top_k, top_p, min_p, u) -> the token, as vkengine/sampling.py's Sampler
// draws it, in float32: top-p and min-p on the softmax of the logits, the
// softmax at the temperature, and the first candidate whose normalized cdf
// exceeds u (numpy's choice). temperature <= 0: the best candidate.
// Needs KMAX, params[] and topk.glsl.
uint sample_draw(float tv[KMAX], uint ti[KMAX], uint rounds, uint sp) {
    float temp = uintBitsToFloat(params[sp]);
    uint nk = 0u;
    while (nk < rounds && ti[nk] != NONE) nk++;
    if (nk == 0u) return 0u;
    float l0 = tv[0];
    if (!(temp > 0.0) || nk == 1u || isinf(l0)) return ti[0];
    float top_p = uintBitsToFloat(params[sp + 2u]), min_p = uintBitsToFloat(params[sp + 3u]);
    float u = uintBitsToFloat(params[sp + 4u]);
    float sum = 0.0;
    for (uint j = 0; j < nk; j++) sum += exp(tv[j] - l0);
    uint keep = nk;
    if (top_p < 1.0) {            // the first prefix whose probabilities reach top_p
        float cum = 0.0;
        for (uint j = 0; j < nk; j++) {
            cum += exp(tv[j] - l0) / sum;
            if (cum >= top_p) { keep = j + 1u; break; }
        }
    }
    if (min_p > 0.0) {            // probabilities at least min_p times the first's
        float p0 = 1.0 / sum;
        uint kk = 1u;
        while (kk < keep && exp(tv[kk] - l0) / sum >= min_p * p0) kk++;
        keep = kk;
    }
    float s0 = l0 / temp;
    bool gaps = isinf(s0) || is_nan(s0);   // a temperature so small that it overflows
    float tot = 0.0;
    for (uint j = 0; j < keep; j++) tot += exp(gaps ? (tv[j] - l0) / temp : tv[j] / temp - s0);
    float c = 0.0;
    for (uint j = 0; j < keep; j++) {
        c += exp(gaps ? (tv[j] - l0) / temp : tv[j] / temp - s0);
        if (c / tot > u) return ti[j];
    }
    return ti[keep - 1u];
}
