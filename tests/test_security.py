"""Security defaults, each checked on a real server: it listens on loopback
only unless told otherwise; the API key guards every route but /health and is
compared in constant time (hmac.compare_digest, whatever the given key's
length or bytes); an empty key is refused rather than silently turning auth
off; no file path that a request carries is ever opened (a Python audit hook in
the server process logs every file event on such paths); the limits are
reported by /props and enforced."""
from __future__ import annotations

import asyncio
import hmac
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.app import AuthMiddleware

from .serving import CTX, ServerProcess, tiny_gguf  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
KEY = "s3cret-key-for-tests"


@pytest.fixture(scope="module")
def audited(tiny_gguf, tmp_path_factory):
    """A server with an API key (from VKENGINE_API_KEY) whose model path holds a marker, run under the
    audit hook of tests/audit_serve.py."""
    marker = "vkmarker" + os.urandom(4).hex()
    d = tmp_path_factory.mktemp("audit") / marker
    d.mkdir()
    model = d / "model.gguf"
    shutil.copy(tiny_gguf, model)
    (d / "secret.txt").write_text("do not read me")
    log = tmp_path_factory.mktemp("auditlog") / "events.log"
    srv = ServerProcess(["--model", str(model), "--ctx", str(CTX), "--parallel", "2", "--max-tokens", "16"],
                        tmp_path_factory.mktemp("server") / "server.log",
                        launcher=["tests/audit_serve.py", str(log), marker],
                        env={**os.environ, "VKENGINE_API_KEY": KEY})
    srv.marker, srv.dir, srv.events = marker, d, log
    yield srv
    srv.stop()


def auth(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


# -- binding ------------------------------------------------------------------------------
def _listeners(port: int) -> list[str]:
    """Local addresses of LISTEN sockets on a port, from /proc/net/tcp{,6}."""
    out = []
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(f).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if int(p, 16) == port and state == "0A":
                out.append(addr)
    return out


def test_listens_on_loopback_only_by_default(audited):
    # ServerProcess gives no --host: the default applies
    assert _listeners(audited.port) == ["0100007F"]                  # 127.0.0.1, little-endian hex
    assert f"Uvicorn running on http://127.0.0.1:{audited.port}" in audited.log()


# -- the API key --------------------------------------------------------------------------
def test_every_route_but_health_needs_the_key(audited):
    u = audited.url
    assert httpx.get(u + "/health").status_code == 200
    for method, path in [("GET", "/metrics"), ("GET", "/slots"), ("GET", "/props"), ("GET", "/v1/models"),
                         ("POST", "/completion"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"),
                         ("GET", "/nonexistent"), ("OPTIONS", "/completion")]:
        for headers in ({}, auth("wrong"), auth(KEY[:-1]), auth(KEY + "x"), {"Authorization": KEY},
                        {"Authorization": "Basic " + KEY}, {"Authorization": "Bearer"}):
            r = httpx.request(method, u + path, headers=headers, json={"prompt": "hi"})
            assert r.status_code == 401, (method, path, headers, r.status_code)
            assert r.headers["www-authenticate"] == "Bearer"
    raw = httpx.post(u + "/completion", json={"prompt": "hi", "n_predict": 1},
                     headers={"Authorization": b"Bearer \xff\xfe\x80x"})
    assert raw.status_code == 401                                     # not ASCII, not UTF-8: still just wrong
    r = httpx.post(u + "/completion", json={"prompt": "hi", "n_predict": 2}, headers=auth())
    assert r.status_code == 200 and r.json()["tokens_predicted"] == 2
    assert httpx.get(u + "/metrics", headers={"authorization": "bearer " + KEY}).status_code == 200


def test_the_key_is_compared_in_constant_time(monkeypatch):
    """Every decision goes through hmac.compare_digest (constant time in the length of the secret), also
    for keys of another length or that share a prefix: a spy stands in for it."""
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(hmac, "compare_digest", spy)

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
    mw = AuthMiddleware(app, KEY)

    def status(header: bytes | None) -> int:
        sent = []

        async def send(msg):
            sent.append(msg)

        async def receive():
            return {"type": "http.request", "body": b""}
        headers = [(b"authorization", header)] if header is not None else []
        asyncio.run(mw({"type": "http", "path": "/completion", "headers": headers, "method": "POST"},
                       receive, send))
        return sent[0]["status"]
    given = [KEY.encode(), KEY[:-1].encode(), (KEY + "x").encode(), b"", b"x", KEY.upper().encode(),
             b"\xff" * len(KEY), b"a" * 10000]
    for g in given:
        calls.clear()
        assert status(b"Bearer " + g) == (200 if g == KEY.encode() else 401)
        assert calls == [(g, KEY.encode())]


def test_an_empty_api_key_is_refused(tiny_gguf):
    for args, env in ((["--api-key", ""], {}), ([], {"VKENGINE_API_KEY": " "})):
        p = subprocess.run([sys.executable, "-m", "vkengine.cli", "serve", "--model", str(tiny_gguf), *args],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
        assert p.returncode == 2 and "api-key" in p.stderr.lower() and "Traceback" not in p.stderr, p.stderr


# -- no file path from a request is opened -----------------------------------------------------
def test_no_path_from_a_request_is_opened(audited):
    u, d = audited.url, audited.dir
    startup = audited.events.read_text()
    assert f"{d}/model.gguf" in startup                           # the hook sees the server's own opens
    paths = [str(d / "secret.txt"), str(d / "model.gguf"), f"file://{d}/secret.txt", str(d),
             f"{d}/../{audited.marker}/secret.txt"]
    h = auth()
    answers = []
    for p in paths:
        gen = {"prompt": p, "n_predict": 2, "model": p, "slot_save_path": p, "grammar_file": p, "filename": p,
               "lora": [{"path": p, "scale": 1.0}], "json_schema": {"$ref": p}, "image_data": [{"data": p, "id": 1}],
               "response_format": {"type": "json_schema", "schema": {"$ref": p}}, "tools": [{"path": p}]}
        chat = {"model": p, "max_tokens": 2, "messages": [
            {"role": "user", "content": p},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{p}"}}]}]}
        for method, path, body in [
                ("POST", "/completion", gen), ("POST", "/v1/completions", {**gen, "max_tokens": 2}),
                ("POST", "/v1/chat/completions", chat), ("POST", "/v1/chat/completions", {**chat, "messages":
                                                                                       chat["messages"][:1]}),
                ("POST", "/tokenize", {"content": p}), ("POST", "/detokenize", {"tokens": [1], "path": p}),
                ("POST", "/slots/0?action=save", {"filename": p}),
                ("POST", f"/slots/0?action=restore&filename={p}", {}),
                ("POST", "/lora-adapters", [{"id": 0, "path": p}]), ("POST", "/load", {"model": p}),
                ("GET", f"/props?model={p}", None), ("GET", f"/v1/models/{p}", None), ("GET", f"/static/{p}", None),
                ("GET", f"/..%2f..%2f{p}", None), ("GET", "/" + "../" * 8 + p.lstrip("/"), None)]:
            r = httpx.request(method, u + path, json=body, headers={**h, "X-File": p}, timeout=120)
            answers.append(r.status_code)
            assert r.status_code < 500, (method, path, r.text[:300])
    assert 200 in answers and any(s in (404, 405) for s in answers)
    assert audited.events.read_text() == startup, audited.events.read_text()[len(startup):]


# -- limits ---------------------------------------------------------------------------------------
def test_limits_are_reported(audited):
    props = httpx.get(audited.url + "/props", headers=auth()).json()
    assert props["default_generation_settings"]["n_ctx"] == CTX and props["total_slots"] == 2
    assert props["max_tokens"] == 16 and props["max_body"] == 1 << 20 and props["max_queue"] == 64
    r = httpx.post(audited.url + "/completion", json={"prompt": "hi", "n_predict": 17}, headers=auth())
    assert r.status_code == 400 and "--max-tokens" in r.json()["error"]["message"]
