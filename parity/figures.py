"""The parity figures of shared/notes/parity.md, computed from plain lists so
that they can be tested on hand-made data. Nothing here runs a model.

Per case (one prompt, N greedy tokens) the inputs are: the engine's free-run
tokens; llama.cpp mode A's and mode B's tokens (each run twice); mode A's top-N
(id, logprob) candidates per position; and the engine's teacher-forced
log-probabilities along mode A's tokens (for each position: its argmax and its
log-softmax at the ids that matter there).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

# A first divergence is a TIE-BREAK when llama.cpp itself puts the two tokens
# this close (nats = logit difference); the calibration in parity.md saw its own
# two modes flip at top-2 margins of 0.03-0.19 nats.
NEAR_TIE_NATS = 0.5
BARS = {"either_mode": 0.99, "teacher_forced_top1": 0.99}

IDENTICAL, TIE_BREAK, DIVERGED = "IDENTICAL", "TIE-BREAK", "DIVERGED"

TopN = Sequence[tuple[int, float]]   # (token id, logprob), best first


def agree(a: Sequence[int], b: Sequence[int]) -> int:
    """Positions where two token lists hold the same token."""
    return sum(1 for x, y in zip(a, b) if x == y)


def agree_either(e: Sequence[int], a: Sequence[int], b: Sequence[int]) -> int:
    return sum(1 for x, y, z in zip(e, a, b) if x == y or x == z)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(top: TopN) -> float | None:
    """llama.cpp's logprob gap between its first and second candidate."""
    return top[0][1] - top[1][1] if len(top) >= 2 else None


def pick_margin(top: TopN, token: int) -> float | None:
    """How far below llama.cpp's top-1 the engine's token sits (None: outside
    the top-N, so not a near tie by any measure we hold)."""
    for tid, lp in top:
        if tid == token:
            return top[0][1] - lp
    return None


def kl_topn(top: TopN, engine_logprobs: dict[int, float]) -> float:
    """KL(llama.cpp || engine) over llama.cpp's top-N ids plus one bucket for
    all other tokens: a coarse-grained KL, a lower bound on the full one, that
    needs only what n_probs returns."""
    p = [math.exp(lp) for _, lp in top]
    q = [math.exp(engine_logprobs[tid]) for tid, _ in top]
    p_rest, q_rest = max(0.0, 1.0 - sum(p)), max(0.0, 1.0 - sum(q))
    kl = sum(pi * math.log(pi / max(qi, 1e-30)) for pi, qi in zip(p, q) if pi > 0)
    if p_rest > 0:
        kl += p_rest * math.log(p_rest / max(q_rest, 1e-30))
    return max(0.0, kl)


@dataclass
class Flip:
    """A position where the engine picked another token than llama.cpp mode A."""
    pos: int
    source: str                  # "free-run" (first divergence) or "re-anchored"
    engine_token: int
    ref_token: int
    ref_top2_margin: float | None    # llama.cpp top1 - top2 logprob there
    pick_margin: float | None        # llama.cpp top1 - logprob of the engine's token
    engine_gap: float | None         # engine logprob of its token - of the reference token

    @property
    def near_tie(self) -> bool:
        # the engine's pick must itself be within the margin of llama.cpp's
        # top-1: this implies the top-2 margin is, and is never more lenient
        return self.pick_margin is not None and self.pick_margin < NEAR_TIE_NATS


@dataclass
class CaseFigures:
    n: int
    strict: int
    either_mode: int
    self_agreement: int
    mode_a_repeat: int
    mode_b_repeat: int
    first_divergence: int | None        # engine vs mode A, free run
    first_divergence_b: int | None      # engine vs mode B, free run
    teacher_forced_top1: int
    teacher_forced_near: int            # ... or within NEAR_TIE_NATS of llama.cpp's top-1
    kl_topn: float                      # mean over the N positions
    flips: list[Flip] = field(default_factory=list)
    classification: str = IDENTICAL

    def to_json(self) -> dict:
        d = asdict(self)
        d["flips"] = [asdict(f) for f in self.flips]
        return d


def case_figures(engine: Sequence[int], mode_a: Sequence[int], mode_a2: Sequence[int],
                 mode_b: Sequence[int], mode_b2: Sequence[int], top_a: Sequence[TopN],
                 tf_top1: Sequence[int], tf_logprobs: Sequence[dict[int, float]]) -> CaseFigures:
    """tf_top1[i] / tf_logprobs[i]: the engine's argmax and log-softmax at
    position i given the prompt and mode A's tokens before i; tf_logprobs[i]
    must hold llama.cpp's top-N ids there, mode A's token and the engine's
    free-run token."""
    n = len(mode_a)
    if not (len(engine) == len(mode_b) == len(tf_top1) == len(tf_logprobs) == len(top_a) == n):
        raise ValueError("engine, modes, top-N and teacher-forced rows differ in length")
    d = first_divergence(engine, mode_a)
    flips: list[Flip] = []
    if d is not None:
        flips.append(_flip(d, "free-run", engine[d], mode_a, top_a, tf_logprobs))
        # re-anchored: after the first divergence the engine is fed mode A's
        # tokens (teacher forcing) and every further disagreement is a flip
        flips += [_flip(i, "re-anchored", tf_top1[i], mode_a, top_a, tf_logprobs)
                  for i in range(d + 1, n) if tf_top1[i] != mode_a[i]]
    if not flips:
        cls = IDENTICAL
    elif all(f.near_tie for f in flips):
        cls = TIE_BREAK
    else:
        cls = DIVERGED
    kl = sum(kl_topn(top_a[i], tf_logprobs[i]) for i in range(n)) / n if n else 0.0
    margins = [pick_margin(top_a[i], tf_top1[i]) for i in range(n)]
    near = sum(1 for i in range(n) if tf_top1[i] == mode_a[i]
               or (margins[i] is not None and margins[i] < NEAR_TIE_NATS))
    return CaseFigures(
        n=n, strict=agree(engine, mode_a), either_mode=agree_either(engine, mode_a, mode_b),
        self_agreement=agree(mode_a, mode_b), mode_a_repeat=agree(mode_a, mode_a2),
        mode_b_repeat=agree(mode_b, mode_b2), first_divergence=d,
        first_divergence_b=first_divergence(engine, mode_b),
        teacher_forced_top1=agree(tf_top1, mode_a), teacher_forced_near=near, kl_topn=kl, flips=flips,
        classification=cls)


def _flip(i, source, token, mode_a, top_a, tf_logprobs) -> Flip:
    lp = tf_logprobs[i]
    gap = lp[token] - lp[mode_a[i]] if token in lp and mode_a[i] in lp else None
    return Flip(i, source, int(token), int(mode_a[i]), top2_margin(top_a[i]),
                pick_margin(top_a[i], token), gap)


def ratio(k: int, n: int) -> dict:
    return {"k": k, "n": n, "pct": round(100.0 * k / n, 2) if n else 0.0}


def summarize(cases: Sequence[CaseFigures], note: str | None = None) -> dict:
    """Totals over the cases, the bars with a verdict each, and the verdict."""
    n = sum(c.n for c in cases)
    s = {key: ratio(sum(getattr(c, key) for c in cases), n)
         for key in ("strict", "either_mode", "self_agreement", "mode_a_repeat", "mode_b_repeat",
                     "teacher_forced_top1", "teacher_forced_near")}
    s["positions"] = n
    s["mean_kl_topn"] = sum(c.kl_topn * c.n for c in cases) / n if n else 0.0
    s["classification"] = {k: sum(c.classification == k for c in cases) for k in (IDENTICAL, TIE_BREAK, DIVERGED)}
    bars = [{"name": f"{key.replace('_', '-')} >= {100 * thr:g}%", "value_pct": s[key]["pct"],
             "pass": n > 0 and s[key]["k"] >= math.ceil(thr * n - 1e-9)} for key, thr in BARS.items()]
    n_div = s["classification"][DIVERGED]
    bars.append({"name": "no DIVERGED case", "value": n_div, "pass": n_div == 0})
    ok = all(b["pass"] for b in bars)
    verdict = "PASS" if ok else "BELOW BAR"
    return {"summary": s, "bars": bars, "verdict": verdict,
            "note": note}


def summary_line(s: dict) -> str:
    def f(key):
        r = s[key]
        return f"{r['k']}/{r['n']} = {r['pct']:.2f}%"
    c = s["classification"]
    return (f"strict {f('strict')}, either llama.cpp mode {f('either_mode')}, llama.cpp self-agreement "
            f"{f('self_agreement')}, teacher-forced top-1 {f('teacher_forced_top1')} (or a near tie: "
            f"{f('teacher_forced_near')}), mean KL(top-N) "
            f"{s['mean_kl_topn']:.4f}; {c[IDENTICAL]} identical, {c[TIE_BREAK]} tie-break, {c[DIVERGED]} diverged")
