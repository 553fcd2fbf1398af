"""`parity report DIR`: every parity artifact in DIR as one row of a Markdown
table in DIR/README.md, plus DIR/history.svg, a small hand-written chart of the
figures over the runs (no plotting library for four polylines)."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path

from vkengine.errors import VkEngineError

SERIES = (  # (summary key, label, colour)
    ("strict", "strict", "#1f77b4"),
    ("either_mode", "either mode", "#2ca02c"),
    ("self_agreement", "llama.cpp self-agreement", "#7f7f7f"),
    ("teacher_forced_top1", "teacher-forced top-1", "#d62728"),
)
BAR_PCT = 99.0


def load_artifacts(folder: Path) -> list[tuple[Path, dict]]:
    arts = []
    for f in sorted(folder.glob("*.json")):
        try:
            doc = json.loads(f.read_text(encoding="utf-8"))
        except ValueError as e:
            raise VkEngineError(f"{f} is not valid JSON ({e}); remove it or rerun `parity run`") from None
        if isinstance(doc, dict) and str(doc.get("schema", "")).startswith("vkengine-parity/"):
            arts.append((f, doc))
    arts.sort(key=lambda fa: (fa[1].get("created", ""), fa[0].name))
    return arts


def _cell(text: str) -> str:
    return escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


def _r(s: dict, key: str) -> str:
    r = s[key]
    return f"{r['k']}/{r['n']} ({r['pct']:.2f}%)"


def _bars(doc: dict) -> str:
    return "; ".join(f"{b['name']} {'ok' if b['pass'] else 'MISSED'}" for b in doc["bars"])


def table(arts: list[tuple[Path, dict]]) -> str:
    head = ("| date | device | model | N x prompts | strict | either mode | self-agreement | teacher-forced top-1 "
            "| IDENT / TIE / DIV | bar | verdict |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for f, d in arts:
        s, c = d["summary"], d["summary"]["classification"]
        verdict = f"**{d['verdict']}**" + (" (see note)" if d.get("note") else "")
        rows.append(
            f"| [{d['created'][:10]}]({f.name}) | {_cell(d['device']['name'])} | {_cell(d['model']['file'])} "
            f"| {d['n_predict']} x {d['prompts']['count']} ({_cell(d['prompts']['name'])}) | {_r(s, 'strict')} "
            f"| {_r(s, 'either_mode')} | {_r(s, 'self_agreement')} | {_r(s, 'teacher_forced_top1')} "
            f"| {c['IDENTICAL']} / {c['TIE-BREAK']} / {c['DIVERGED']} | {_bars(d)} | {verdict} |")
    return head + "\n".join(rows) + "\n"


def notes(arts: list[tuple[Path, dict]]) -> list[str]:
    """Deviation notes, one paragraph per artifact that has one."""
    out = [f"Note on {f.name} ({d['created'][:10]}): {_cell(d['note'])}\n" for f, d in arts if d.get("note")]
    return out


def svg(arts: list[tuple[Path, dict]], w: int = 640, h: int = 260) -> str:
    """Percentages per run (x: runs in date order), with the 99% bar dashed."""
    left, right, top, bottom = 48, 190, 16, 36
    pw, ph = w - left - right, h - top - bottom
    vals = [d["summary"][k]["pct"] for _, d in arts for k, _, _ in SERIES]
    lo = min([BAR_PCT, *vals])
    lo = max(0.0, (int(lo) // 10) * 10.0)          # floor to a multiple of 10
    n = len(arts)

    def x(i):
        return left + (pw * (i + 0.5) / n if n else 0)

    def y(v):
        return top + ph * (100.0 - v) / (100.0 - lo)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for v in range(int(lo), 101, 10 if 100 - lo > 30 else 5):
        out.append(f'<line x1="{left - 4}" x2="{left}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#999"/>'
                   f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v}%</text>')
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y(BAR_PCT):.1f}" y2="{y(BAR_PCT):.1f}" '
               'stroke="#000" stroke-dasharray="4 3"/>')
    for i, (_, d) in enumerate(arts):
        out.append(f'<text x="{x(i):.1f}" y="{top + ph + 14}" text-anchor="middle">{escape(d["created"][:10])}</text>')
    for j, (key, label, colour) in enumerate(SERIES):
        pts = [(x(i), y(d["summary"][key]["pct"])) for i, (_, d) in enumerate(arts)]
        if len(pts) > 1:
            out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="'
                       + " ".join(f"{px:.1f},{py:.1f}" for px, py in pts) + '"/>')
        out += [f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{colour}"/>' for px, py in pts]
        ly = top + 12 + 16 * j
        out.append(f'<rect x="{left + pw + 10}" y="{ly - 8}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{left + pw + 24}" y="{ly + 1}">{escape(label)}</text>')
    ly = top + 12 + 16 * len(SERIES)
    out.append(f'<line x1="{left + pw + 10}" x2="{left + pw + 20}" y1="{ly - 3}" y2="{ly - 3}" stroke="#000" '
               f'stroke-dasharray="4 3"/><text x="{left + pw + 24}" y="{ly + 1}">bar {BAR_PCT:g}%</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render(folder: Path) -> Path:
    folder = Path(folder)
    if not folder.is_dir():
        raise VkEngineError(f"{folder} is not a folder of parity artifacts")
    arts = load_artifacts(folder)
    if not arts:
        raise VkEngineError(f"no parity artifacts (*.json with a vkengine-parity schema) in {folder}")
    (folder / "history.svg").write_text(svg(arts), encoding="utf-8")
    latest = arts[-1][1]
    md = [
        "# Parity with llama.cpp",
        "",
        "Written by `parity report` from the JSON artifacts in this folder; do not edit by hand.",
        "Each artifact is one `parity run`: N greedy tokens per prompt from our engine and from llama-server",
        "in two modes (A: defaults, B: `-fa off -b 64 -ub 64`), each mode run twice. Definitions:",
        "`shared/notes/parity.md` and each artifact's `definitions` block. Bars: either mode >= 99%,",
        "teacher-forced top-1 >= 99%, no DIVERGED case.",
        "",
        table(arts),
        *notes(arts),
        "![history of the parity figures](history.svg)",
        "",
        f"Latest ({arts[-1][0].name}): llama-server {latest['llama_cpp']['modes']['A'].get('build_info')}, "
        f"engine {latest['engine']['version']} at {str(latest['engine']['git_commit'])[:12]}, "
        f"mean KL over the top-{latest['n_probs']} {latest['summary']['mean_kl_topn']:.4f} nats.",
        "",
    ]
    out = folder / "README.md"
    out.write_text("\n".join(md), encoding="utf-8")
    return out
