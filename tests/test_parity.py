"""The parity harness: figure computations on hand-made data (fast), and the
whole harness against a real llama-server on the embedded model (slow, but it
runs in CI: the fixtures build llama-server when it is missing)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from parity import figures as F
from parity.engine_side import teacher_forced
from parity.prompts import load_prompt_set
from parity.reference import check_tokens
from parity.report import render
from parity.run import RunConfig, run_parity, to_json, write_atomic
from vkengine.errors import VkEngineError

ROOT = Path(__file__).resolve().parents[1]


def top(*pairs):
    """top-N from (id, prob) pairs, best first, as (id, logprob)."""
    return [(t, math.log(p)) for t, p in pairs]


# -- counts ---------------------------------------------------------------------

def test_agreement_counts():
    e, a, b = [1, 2, 3, 4, 5], [1, 2, 9, 4, 0], [1, 7, 3, 8, 0]
    assert F.agree(e, a) == 3
    assert F.agree(a, b) == 2
    assert F.agree_either(e, a, b) == 4          # position 2 matches b only; position 4 matches neither
    assert F.first_divergence(e, a) == 2
    assert F.first_divergence(a, a) is None
    assert F.first_divergence([1, 2], [1, 2, 3]) == 2


def test_margins():
    t = top((5, 0.5), (6, 0.3), (7, 0.2))
    assert F.top2_margin(t) == pytest.approx(math.log(0.5 / 0.3))
    assert F.pick_margin(t, 7) == pytest.approx(math.log(0.5 / 0.2))
    assert F.pick_margin(t, 99) is None
    assert F.top2_margin(t[:1]) is None


def test_kl_topn():
    t = top((1, 0.6), (2, 0.3))
    same = {1: math.log(0.6), 2: math.log(0.3)}
    assert F.kl_topn(t, same) == pytest.approx(0.0, abs=1e-12)
    other = {1: math.log(0.3), 2: math.log(0.6)}
    want = 0.6 * math.log(0.6 / 0.3) + 0.3 * math.log(0.3 / 0.6) + 0.1 * math.log(0.1 / 0.1)
    assert F.kl_topn(t, other) == pytest.approx(want)
    assert F.kl_topn(t, other) > 0.2


# -- classification -------------------------------------------------------------

def _case(engine, ref, tops, tf_top1=None, b=None):
    """Teacher-forced log-probs made consistent with tf_top1 (default: the
    engine follows the reference everywhere when re-anchored)."""
    tf_top1 = list(ref) if tf_top1 is None else tf_top1
    lps = []
    for i, t in enumerate(tops):
        d = {tid: lp for tid, lp in t}
        d[engine[i]] = d.get(engine[i], -5.0)
        d[tf_top1[i]] = max(d.values()) + 0.01
        lps.append(d)
    b = list(ref) if b is None else b
    return F.case_figures(engine, ref, ref, b, b, tops, tf_top1, lps)


CONFIDENT = top((10, 0.9), (11, 0.05))
NEAR_TIE = top((10, 0.40), (11, 0.38))          # margin 0.05 nats


def test_identical():
    cf = _case([10, 10, 10], [10, 10, 10], [CONFIDENT] * 3)
    assert cf.classification == F.IDENTICAL and cf.flips == [] and cf.first_divergence is None
    assert cf.strict == cf.teacher_forced_top1 == 3


def test_tie_break_at_near_tie():
    # the engine takes llama.cpp's #2 where #1 and #2 are 0.05 nats apart,
    # and re-anchored it agrees everywhere after
    cf = _case([10, 11, 12, 13], [10, 10, 10, 10], [CONFIDENT, NEAR_TIE, CONFIDENT, CONFIDENT])
    assert cf.first_divergence == 1
    assert cf.classification == F.TIE_BREAK
    assert [f.pos for f in cf.flips] == [1]
    assert cf.flips[0].ref_top2_margin == pytest.approx(math.log(0.40 / 0.38))


def test_diverged_at_confident_position():
    cf = _case([10, 11, 11], [10, 10, 10], [CONFIDENT, CONFIDENT, CONFIDENT])
    assert cf.classification == F.DIVERGED
    assert cf.flips[0].pick_margin == pytest.approx(math.log(0.9 / 0.05))


def test_diverged_when_pick_outside_top_n():
    # top-2 is a near tie, but the engine's token is not even in llama.cpp's top-N
    cf = _case([10, 99], [10, 10], [CONFIDENT, NEAR_TIE])
    assert cf.flips[0].pick_margin is None
    assert cf.classification == F.DIVERGED


def test_re_anchored_flip_after_a_tie_counts():
    # first divergence at a near tie, but after re-anchoring the engine
    # disagrees at a confident position: a real difference, not a tie
    tops = [NEAR_TIE, CONFIDENT, CONFIDENT]
    cf = _case([11, 11, 11], [10, 10, 10], tops, tf_top1=[11, 10, 11])
    assert [(f.pos, f.source) for f in cf.flips] == [(0, "free-run"), (2, "re-anchored")]
    assert cf.classification == F.DIVERGED
    assert cf.teacher_forced_top1 == 1


def test_either_mode_and_self_agreement():
    cf = _case([10, 11, 12], [10, 10, 10], [CONFIDENT, NEAR_TIE, NEAR_TIE], b=[10, 11, 13])
    assert (cf.strict, cf.either_mode, cf.self_agreement) == (1, 2, 1)
    assert cf.first_divergence_b == 2


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError):
        F.case_figures([1], [1, 2], [1, 2], [1, 2], [1, 2], [CONFIDENT] * 2, [1, 2], [{}, {}])


# -- summary and bars -------------------------------------------------------------

def _fig(n, strict, either, tf, cls=F.IDENTICAL):
    return F.CaseFigures(n=n, strict=strict, either_mode=either, self_agreement=n, mode_a_repeat=n,
                         mode_b_repeat=n, first_divergence=None, first_divergence_b=None,
                         teacher_forced_top1=tf, kl_topn=0.01, classification=cls)


def test_bars_at_the_edge():
    # 634/640 is the either-mode bar (99% rounded up), 633/640 misses it
    ok = F.summarize([_fig(640, 630, 634, 640)])
    assert ok["verdict"] == "PASS" and all(b["pass"] for b in ok["bars"])
    low = F.summarize([_fig(640, 630, 633, 640)], note="near ties on a 135M Q4_1 model")
    assert low["verdict"] == "BELOW BAR"
    assert [b["pass"] for b in low["bars"]] == [False, True, True]
    assert low["note"] == "near ties on a 135M Q4_1 model"
    div = F.summarize([_fig(32, 32, 32, 32), _fig(32, 3, 3, 32, F.DIVERGED)])
    assert div["bars"][2]["pass"] is False and div["summary"]["classification"][F.DIVERGED] == 1
    assert div["summary"]["strict"] == {"k": 35, "n": 64, "pct": 54.69}
    assert "35/64" in F.summary_line(div["summary"])


# -- teacher forcing chunks --------------------------------------------------------

class TableEngine:
    """Stands in for Engine.step's contract only (not for llama-server): logits
    are a fixed function of (token, position), and every call is checked
    against the row limits."""
    V = 40

    def __init__(self, max_batch, max_out):
        self.max_batch, self.max_out, self.calls = max_batch, max_out, []

    def row(self, tok, pos):
        return np.random.default_rng(tok * 1000 + pos).standard_normal(self.V).astype(np.float32)

    def step(self, tokens, positions, slots, out_rows, readback):
        tokens, positions = list(tokens), list(positions)
        assert len(tokens) <= self.max_batch and len(out_rows) <= self.max_out
        assert readback == ("logits" if out_rows else "none")
        self.calls.append((positions[0], len(tokens), len(out_rows)))
        return np.stack([self.row(tokens[r], positions[r]) for r in out_rows]) if out_rows else None


@pytest.mark.parametrize("max_batch,max_out", [(256, 64), (5, 3), (4, 1)])
def test_teacher_forced_chunking(max_batch, max_out):
    toks = list(range(3, 20))
    first = 6
    keep = [{1, 2} for _ in range(first, len(toks))]
    eng = TableEngine(max_batch, max_out)
    top1, lps = teacher_forced(eng, toks, first, keep)
    assert len(top1) == len(toks) - first
    for i, p in enumerate(range(first, len(toks))):
        r = eng.row(toks[p], p).astype(np.float64)
        ls = r - r.max() - np.log(np.exp(r - r.max()).sum())
        assert top1[i] == int(np.argmax(r))
        assert lps[i][1] == pytest.approx(ls[1]) and lps[i][top1[i]] == pytest.approx(ls.max())
    covered = sorted(p for start, n, _ in eng.calls for p in range(start, start + n))
    assert covered == list(range(len(toks)))      # every position runs exactly once, in order


# -- prompts, tokens, artifact files, report --------------------------------------

def test_default_prompt_set():
    ps = load_prompt_set("default")
    assert len(ps.prompts) == 20 and len({p.id for p in ps.prompts}) == 20
    assert 5 <= sum(p.chat for p in ps.prompts) <= 15
    assert load_prompt_set(str(ROOT / "parity/prompts/default.json")).sha256 == ps.sha256
    with pytest.raises(VkEngineError, match="no prompt set"):
        load_prompt_set("no-such-set")


def test_prompt_set_validation(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"prompts": [{"id": "x", "text": "a", "messages": []}]}))
    with pytest.raises(VkEngineError, match="exactly one"):
        load_prompt_set(str(f))


def test_tokenizer_mismatch_message():
    check_tokens([1, 2, 3], [1, 2, 3], "p", "http://x")
    with pytest.raises(VkEngineError, match="tokenizer mismatch on p: at token 1"):
        check_tokens([1, 2, 3], [1, 5, 3], "p", "http://x")


def test_write_atomic_keeps_old_artifact(tmp_path):
    p = tmp_path / "a.json"
    write_atomic(p, {"v": [1, 2, 3]})
    assert json.loads(p.read_text()) == {"v": [1, 2, 3]}
    with pytest.raises(TypeError):
        write_atomic(p, {"v": object()})            # dies half way
    assert json.loads(p.read_text()) == {"v": [1, 2, 3]}
    assert [x.name for x in tmp_path.iterdir()] == ["a.json"]


def test_to_json_keeps_strings():
    doc = {"ids": [1, 2, 3], "text": "x [1,\n 2]", "nested": [[1, 2], ["a", 1]]}
    assert json.loads(to_json(doc)) == doc
    assert '"ids": [1, 2, 3]' in to_json(doc)


def _artifact(created, strict, either, verdict="PASS", note=None):
    n = 640
    r = lambda k: {"k": k, "n": n, "pct": round(100 * k / n, 2)}   # noqa: E731
    return {"schema": "vkengine-parity/1", "created": created, "device": {"name": "llvmpipe (LLVM 15)"},
            "model": {"file": "m.gguf"}, "prompts": {"name": "default", "count": 20}, "n_predict": 32,
            "n_probs": 8, "engine": {"version": "0.1.0", "git_commit": "abc"},
            "llama_cpp": {"modes": {"A": {"build_info": "b11434-pypi-sdist"}}},
            "summary": {"strict": r(strict), "either_mode": r(either), "self_agreement": r(600),
                        "teacher_forced_top1": r(638), "mean_kl_topn": 0.01,
                        "classification": {"IDENTICAL": 10, "TIE-BREAK": 10, "DIVERGED": 0}},
            "bars": [{"name": "either-mode >= 99%", "pass": either >= 634}], "verdict": verdict, "note": note}


def test_report(tmp_path):
    (tmp_path / "b.json").write_text(json.dumps(_artifact("2026-02-01T00:00:00+00:00", 630, 635)))
    (tmp_path / "a.json").write_text(json.dumps(
        _artifact("2026-01-01T00:00:00+00:00", 600, 620, "BELOW BAR", "ties | noise")))
    (tmp_path / "other.json").write_text("{}")          # not an artifact: ignored
    md = render(tmp_path).read_text()
    rows = [line for line in md.splitlines() if line.startswith("| [")]
    assert len(rows) == 2 and rows[0].startswith("| [2026-01-01](a.json)")
    assert "620/640 (96.88%)" in rows[0] and "ties \\| noise" in rows[0] and "MISSED" in rows[0]
    assert "**PASS**" in rows[1]
    svg = ET.fromstring((tmp_path / "history.svg").read_text())
    assert len([e for e in svg.iter() if e.tag.endswith("polyline")]) == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(VkEngineError, match="no parity artifacts"):
        render(tmp_path / "empty")


def test_cli_unreachable_endpoint_is_one_line():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]            # closed once the block ends: nothing listens
    r = subprocess.run([sys.executable, "-m", "parity.cli", "run", "--endpoint", f"http://127.0.0.1:{port}",
                        "--endpoint-b", f"http://127.0.0.1:{port}"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.startswith("error: llama-server at http://127.0.0.1:") and "unreachable" in r.stderr
    assert "Traceback" not in r.stderr
