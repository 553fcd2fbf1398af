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
from vkengine.engine import Readback
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
    assert cf.teacher_forced_near == 2            # position 0 is a near tie, position 2 is not


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
                         teacher_forced_top1=tf, teacher_forced_near=tf, kl_topn=0.01, classification=cls)


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
        tokens, positions, out_rows = list(tokens), list(positions), list(out_rows)
        assert len(tokens) <= self.max_batch and len(out_rows) <= self.max_out and readback == Readback.LOGITS
        self.calls.append(positions)
        return np.stack([self.row(tokens[r], positions[r]) for r in out_rows])


@pytest.mark.parametrize("max_batch,max_out", [(32, 32), (5, 3), (4, 1)])
def test_teacher_forced_chunking(max_batch, max_out):
    toks, start = list(range(3, 20)), 6
    keep = [{1, 2} for _ in toks]
    eng = TableEngine(max_batch, max_out)
    banned = [int(np.argmax(eng.row(toks[0], start)))]          # the first row's best is excluded
    top1, lps = teacher_forced(eng, toks, start, keep, banned)
    assert len(top1) == len(toks)
    for i, t in enumerate(toks):
        r = eng.row(t, start + i).astype(np.float64)
        ls = r - r.max() - np.log(np.exp(r - r.max()).sum())
        masked = r.copy()
        masked[banned] = -np.inf
        assert top1[i] == int(np.argmax(masked))
        assert lps[i][1] == pytest.approx(ls[1]) and lps[i][top1[i]] == pytest.approx(ls[top1[i]])
    assert top1[0] != banned[0]
    assert [p for call in eng.calls for p in call] == list(range(start, start + len(toks)))


def test_eog_ids_follow_llama_cpp(smollm2):
    from parity.engine_side import eog_ids
    tok = smollm2.tokenizer
    ids = eog_ids(tok)
    assert tok.hf.token_to_id("<|im_end|>") in ids and tok.hf.token_to_id("<|endoftext|>") in ids
    assert tok.hf.token_to_id("<|im_start|>") not in ids


# -- prompts, tokens, artifact files, report --------------------------------------

def test_default_prompt_set():
    ps = load_prompt_set("default")
    assert len(ps.prompts) == 20 and len({p.id for p in ps.prompts}) == 20
    assert 5 <= sum(p.chat for p in ps.prompts) <= 15
    assert load_prompt_set(str(ROOT / "parity/prompts/default.json")).sha256 == ps.sha256
    with pytest.raises(VkEngineError, match="no prompt set"):
        load_prompt_set("no-such-set")
    short = load_prompt_set("short")    # for large models on slow devices: a subset of the default set
    assert len(short.prompts) == 4 and all(p in ps.prompts for p in short.prompts)


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
    assert "620/640 (96.88%)" in rows[0] and "MISSED" in rows[0] and "(see note)" in rows[0]
    assert "Note on a.json (2026-01-01): ties \\| noise" in md
    assert "**PASS**" in rows[1]
    svg = ET.fromstring((tmp_path / "history.svg").read_text())
    assert len([e for e in svg.iter() if e.tag.endswith("polyline")]) == 4
    (tmp_path / "empty").mkdir()
    with pytest.raises(VkEngineError, match="no parity artifacts"):
        render(tmp_path / "empty")


def test_note_after_the_run(tmp_path):
    """`parity note` writes the deviation note into an existing artifact, which the
    report then shows; anything that is not an artifact is refused in one line."""
    from parity.cli import main
    art = _artifact("2026-01-01T00:00:00+00:00", 600, 620, "BELOW BAR")
    (tmp_path / "a.json").write_text(json.dumps(art))
    assert main(["note", str(tmp_path / "a.json"), "  near ties only  "]) == 0
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["note"] == "near ties only" and doc["note_written"] and doc["summary"] == art["summary"]
    assert "Note on a.json (2026-01-01): near ties only" in render(tmp_path).read_text()
    (tmp_path / "other.json").write_text("{}")
    for path, text in ((tmp_path / "other.json", "x"), (tmp_path / "missing.json", "x"),
                       (tmp_path / "a.json", "  ")):
        r = subprocess.run([sys.executable, "-m", "parity.cli", "note", str(path), text], capture_output=True,
                           text=True, cwd=ROOT)
        assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


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


# -- against the real llama-server ----------------------------------------------

TOP_LEVEL = {"schema", "created", "engine", "device", "llama_cpp", "model", "kv_cache", "prompts", "n_predict",
             "n_probs", "repeats", "near_tie_nats", "excluded_from_greedy", "definitions", "seconds", "summary", "bars",
             "verdict", "note", "cases"}
CASE_KEYS = {"id", "chat", "n", "prompt_ids", "engine", "mode_a", "mode_b", "mode_a_run2", "mode_b_run2", "text",
            "probs_refetched", "mode_a_repeat", "mode_b_repeat", "teacher_forced_near",
             "first_divergence", "first_divergence_b", "flips", "classification", "strict", "either_mode",
             "self_agreement", "teacher_forced_top1", "kl_topn"}


@pytest.mark.slow
def test_harness_on_default_prompts(reference_server, reference_server_b, smollm2_engine, tmp_path):
    out = tmp_path / "parity.json"
    cfg = RunConfig(model=None, endpoint=reference_server.url, endpoint_b=reference_server_b.url, out=str(out),
                    note="integration test")
    art = run_parity(cfg, engine=smollm2_engine)
    doc = json.loads(out.read_text())
    assert doc == json.loads(json.dumps(art))
    assert set(doc) == TOP_LEVEL and doc["schema"] == "vkengine-parity/1"
    assert doc["model"]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and len(doc["model"]["sha256"]) == 64
    assert doc["model"]["architecture"] == "llama" and doc["device"]["name"]
    assert doc["kv_cache"] == {"k": "f16", "v": "f16"}
    assert doc["prompts"] == {"name": "default", "sha256": load_prompt_set("default").sha256, "count": 20}
    for m in ("A", "B"):
        assert doc["llama_cpp"]["modes"][m]["build_info"].startswith("b11434")
    assert len(doc["cases"]) == 20
    for c in doc["cases"]:
        assert set(c) == CASE_KEYS
        assert all(len(c[k]) == 32 for k in ("engine", "mode_a", "mode_b", "mode_a_run2", "mode_b_run2"))
        assert c["mode_a_repeat"] == F.agree(c["mode_a"], c["mode_a_run2"])
        assert c["strict"] == F.agree(c["engine"], c["mode_a"])           # figures match the stored tokens
        assert c["first_divergence"] == F.first_divergence(c["engine"], c["mode_a"])
    s = doc["summary"]
    assert s["positions"] == 640
    assert s["strict"]["k"] == sum(c["strict"] for c in doc["cases"])
    assert s["strict"]["k"] <= s["either_mode"]["k"]
    assert s["teacher_forced_top1"]["pct"] >= 97.0, F.summary_line(s)
    diverged = [(c["id"], c["flips"]) for c in doc["cases"] if c["classification"] == F.DIVERGED]
    assert not diverged, diverged
    assert [b["pass"] for b in doc["bars"]] == [b["pass"] for b in F.summarize(
        [F.CaseFigures(**{k: c[k] for k in F.CaseFigures.__dataclass_fields__ if k != "flips"})
         for c in doc["cases"]])["bars"]]


@pytest.mark.slow
def test_model_mismatch_is_refused(reference_client, tmp_path):
    from parity.reference import check_model
    from vkengine.model import load_model
    from vkengine.tools.synth.llama import config_for, synth_llama
    path = synth_llama(config_for("tiny", None), "q8_0", 0, tmp_path, formats=("gguf",), workers=1)["gguf"]
    with pytest.raises(VkEngineError, match="model mismatch: .* serves SmolLM2-135M-Instruct.Q4_1.gguf"):
        check_model(reference_client, load_model(path))
    # same file name, other model: the shapes give it away
    (tmp_path / "same").mkdir()
    renamed = (tmp_path / "same" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    renamed.write_bytes(path.read_bytes())
    with pytest.raises(VkEngineError, match="model mismatch: .* reports n_(vocab|embd)="):
        check_model(reference_client, load_model(renamed))


@pytest.mark.slow
def test_cli_starts_both_modes_itself(llama_server_exe, tmp_path):
    """`parity run` without --endpoint-b starts llama-server per mode (reusing
    the cached build), then `parity report` renders the folder."""
    prompts = tmp_path / "two.json"
    prompts.write_text(json.dumps({"name": "two", "prompts": [
        {"id": "raw", "text": "1, 2, 3, 4,"},
        {"id": "chat", "messages": [{"role": "user", "content": "Say hi."}]}]}))
    out = tmp_path / "docs" / "two.json"
    r = subprocess.run([sys.executable, "-m", "parity.cli", "run", "--prompts", str(prompts), "--n-predict", "4",
                        "--repeats", "1", "--out", str(out), "--note", "smoke"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "building llama-server" not in r.stderr                 # the stamp made it reuse the build
    doc = json.loads(out.read_text())
    modes = doc["llama_cpp"]["modes"]
    assert modes["A"]["started_by"] == "parity harness" and modes["A"]["args"] == []
    assert modes["B"]["command"][-6:] == ["-fa", "off", "-b", "64", "-ub", "64"]
    assert [c["id"] for c in doc["cases"]] == ["raw", "chat"] and len(doc["cases"][1]["engine"]) == 4
    assert doc["cases"][1]["prompt_ids"][0] == 1                   # <|im_start|> from the chat template
    rep = subprocess.run([sys.executable, "-m", "parity.cli", "report", str(out.parent)],
                         capture_output=True, text=True, cwd=ROOT)
    assert rep.returncode == 0, rep.stderr
    assert "two.json" in (out.parent / "README.md").read_text()


@pytest.mark.slow
def test_cli_q8_cache_on_both_sides(llama_server_exe, tmp_path):
    """`parity run --cache-type-k q8_0 --cache-type-v q8_0`: llama-server
    started with -ctk/-ctv q8_0 and flash attention on in both modes (it
    refuses a quantized V cache without), our engine with the same cache; the
    artifact says so."""
    prompts = tmp_path / "one.json"
    prompts.write_text(json.dumps({"name": "one", "prompts": [{"id": "raw", "text": "1, 2, 3, 4,"}]}))
    out = tmp_path / "q8.json"
    r = subprocess.run([sys.executable, "-m", "parity.cli", "run", "--prompts", str(prompts), "--n-predict", "4",
                        "--repeats", "1", "--out", str(out), "--note", "smoke", "-ctk", "q8_0", "-ctv", "q8_0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["kv_cache"] == {"k": "q8_0", "v": "q8_0"}
    modes = doc["llama_cpp"]["modes"]
    assert modes["A"]["args"] == ["-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0"]
    assert modes["B"]["command"][-10:] == ["-fa", "on", "-b", "64", "-ub", "64", "-ctk", "q8_0", "-ctv", "q8_0"]
    assert len(doc["cases"][0]["engine"]) == 4 and len(doc["cases"][0]["mode_a"]) == 4


@pytest.mark.slow
def test_harness_with_split_engine(reference_server, reference_server_b, smollm2_engine, smollm2, device, tmp_path):
    """`parity run --devices`: the harness over the embedded model split across
    two Vulkan devices (on the one physical device) records the split and
    gives the unsplit engine's tokens and figures."""
    from vkengine.device import Device
    from vkengine.split import SplitEngine
    devs = [Device(device.info.index) for _ in range(2)]
    split = SplitEngine(smollm2, devs, smollm2_engine.cfg, [2, 1])
    try:
        runs = []
        for eng in (smollm2_engine, split):
            cfg = RunConfig(model=None, prompts="short", n_predict=12, endpoint=reference_server.url,
                            endpoint_b=reference_server_b.url, out=str(tmp_path / "p.json"), note="test")
            runs.append(run_parity(cfg, engine=eng))
        whole, parted = runs
        assert parted["device"]["split"].startswith("split across 2 devices: layers 0-19 on")
        assert "split" not in whole["device"]
        assert [c["engine"] for c in parted["cases"]] == [c["engine"] for c in whole["cases"]]
        assert parted["summary"] == whole["summary"]
    finally:
        split.close()
        for d in devs:
            d.close()
