"""`vkengine serve --replicas N` as a user runs it: a subprocess that starts its
own Ray instance, serves the tiny model through the ingress, and stops on
SIGINT (the Ray application itself: tests/test_ray_serve.py)."""
from __future__ import annotations

import httpx
import pytest

from .serving import CTX, ServerProcess, tiny_gguf  # noqa: F401  (fixtures)

pytest.importorskip("ray", reason="ray[serve] is a test dependency (pyproject's test extra)")


@pytest.mark.parametrize("split", [False, True])
def test_serve_replicas_command(tiny_gguf, tmp_path, split):
    """split: the replica's model split across two Vulkan devices (--devices; on a GPU node each replica takes
    that many of Ray's GPUs, here none: both parts on the one lavapipe device)."""
    flags = ["--devices", "0,0"] if split else []
    p = ServerProcess(["--model", str(tiny_gguf), "--ctx", str(CTX), "--parallel", "2", "--replicas", "1", *flags],
                      tmp_path / "serve.log", ready_timeout=240)
    try:
        r = httpx.post(p.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4

    finally:
        rc = p.stop()
    assert rc == 0, p.log()[-3000:]
    assert "server stopped" in p.log()
