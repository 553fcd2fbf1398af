"""The soak (bench/soak.py), short: 4 clients, 32 requests of the whole mix
(streams dropped mid-way, abandoned requests, the context limit, requests over
the limits, busy answers) against a server it starts, with more sequences than
device slots (parking in turns). It exits 0 only if there was no unexpected
error and the server went back to its idle state with nothing leaked. The long
run (C = 8 for minutes) is `.venv/bin/python bench/soak.py`."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .serving import tiny_gguf  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent


def test_short_soak(tiny_gguf, tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, "bench/soak.py", "--model", str(tiny_gguf), "--clients", "4",
                        "--requests", "32", "--minutes", "10", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["requests"] == 32 and not r["errors"] and not r["failures"]
    assert r["outcomes"]["ok"] > 0 and all(c["ok"] for c in r["checks"])
    assert r["ttft_ms"]["n"] > 0
