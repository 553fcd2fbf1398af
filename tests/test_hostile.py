"""Hostile and careless clients (issue 37): a body cut off mid-way, oversize
header blocks and URLs, a foreign Host (DNS rebinding), browser-simple body
types, prompts too large to tokenize, and the validation slips the probe
found. Each reproduces what the probe did, through real sockets."""
from __future__ import annotations

import socket
import time

import httpx
import pytest

from .serving import CTX, serve, tiny_gguf  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def srv(serve):
    return serve("--parallel", "2", "--max-tokens", "16")


def _raw(port: int, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return out


def _status_count(url: str, status: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("vkengine_http_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_body_cut_off_is_a_499_without_a_traceback(srv):
    before = _status_count(srv.url, "500")
    head = (b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    for _ in range(20):
        _raw(srv.port, head + b'{"prompt":', read=False)               # then the connection closes
    bad_chunks = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\nZZ\r\n")
    for _ in range(5):
        _raw(srv.port, bad_chunks)
    time.sleep(0.5)
    assert _status_count(srv.url, "500") == before
    assert _status_count(srv.url, "499") >= 1
    log = srv.log()
    assert "Traceback" not in log and "ClientDisconnect" not in log
    assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_oversize_headers_and_urls_are_refused(srv):
    r = httpx.get(srv.url + "/health", headers={f"x-pad-{i}": "a" * 1000 for i in range(20)}, timeout=10)
    assert r.status_code == 431
    r = httpx.get(srv.url + "/v1/models?" + "q=" + "a" * 20_000, timeout=10)
    assert r.status_code == 414
    assert httpx.get(srv.url + "/health", headers={"x-small": "a" * 1000}, timeout=10).status_code == 200


def test_a_foreign_host_is_refused(srv):
    for host, want in ((f"127.0.0.1:{srv.port}", 200), (f"localhost:{srv.port}", 200), ("localhost", 200),
                       (f"[::1]:{srv.port}", 200), ("evil.example", 403), (f"attacker.test:{srv.port}", 403)):
        r = httpx.get(srv.url + "/v1/models", headers={"Host": host}, timeout=10)
        assert r.status_code == want, (host, r.text)


def test_a_request_without_host_is_answered(srv):
    assert b"200 OK" in _raw(srv.port, b"GET /health HTTP/1.0\r\n\r\n")      # (HTTP/1.0 needs none)


def test_hosts_allowed_by_flag(serve):
    from server.app import allowed_hosts
    assert allowed_hosts("0.0.0.0", None) is None and allowed_hosts("127.0.0.1", "*") is None
    assert "box.lan" in allowed_hosts("0.0.0.0", "box.lan") and "10.0.0.5" in allowed_hosts("10.0.0.5", None)
    s = serve("--parallel", "1", "--allowed-hosts", "models.internal")
    assert httpx.get(s.url + "/v1/models", headers={"Host": "models.internal:80"}, timeout=10).status_code == 200
    assert httpx.get(s.url + "/v1/models", headers={"Host": "other.internal"}, timeout=10).status_code == 403


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; b=x",
                                   "TEXT/PLAIN;charset=utf-8"])
def test_browser_simple_bodies_are_refused(srv, ctype):
    r = httpx.post(srv.url + "/completion", content=b'{"prompt": "hi", "n_predict": 2}',
                   headers={"Content-Type": ctype}, timeout=30)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]


def test_json_bodies_still_work(srv):
    body = b'{"prompt": "hi", "n_predict": 2}'
    for headers in ({"Content-Type": "application/json"}, {"Content-Type": "application/json; charset=utf-8"}, {}):
        assert httpx.post(srv.url + "/completion", content=body, headers=headers, timeout=60).status_code == 200


def test_a_prompt_too_large_is_refused_before_tokenizing(srv):
    r = httpx.post(srv.url + "/completion", json={"prompt": "word " * 200_000, "n_predict": 2}, timeout=30)
    assert r.status_code == 400 and "bytes of text" in r.json()["error"]["message"], r.text
    r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 900_000}]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # (below the bound: tokenized, then refused for its token count as before)
    r = httpx.post(srv.url + "/completion", json={"prompt": "word " * (CTX + 10), "n_predict": 2}, timeout=30)
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]


def test_the_probes_validation_slips(srv):
    r = httpx.post(srv.url + "/completion", json={"prompt": [[28, 29]], "n_predict": 2}, timeout=60)
    assert r.status_code == 200, r.text                          # a batch of one token array, as llama-server
    r = httpx.post(srv.url + "/completion", json={"prompt": "hi", "n_predict": 2, "min_p": 1.0}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(srv.url + "/completion", json={"prompt": "hi", "min_p": 1.5}, timeout=60)
    assert r.status_code == 400 and "<= 1.0" in r.json()["error"]["message"]
    for const in ("NaN", "Infinity", "-Infinity"):
        r = httpx.post(srv.url + "/completion", content=b'{"prompt": "hi", "unknown": ' + const.encode() + b"}",
                       headers={"Content-Type": "application/json"}, timeout=30)
        assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"], r.text


def _health(k: socket.socket) -> bytes:
    """One /health request on an open connection: its whole reply."""
    k.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    out = b""
    while b'"ok"}' not in out:
        chunk = k.recv(4096)
        if not chunk:
            break
        out += chunk
    return out


def _closed(s: socket.socket, wait: float) -> bool:
    """Whether the server closed the socket within `wait` seconds."""
    s.settimeout(wait)
    try:
        return s.recv(1024) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_trickled_headers_are_closed_at_the_deadline(serve):
    """Slowloris: connections that never finish their headers are closed after
    --header-timeout, including a keep-alive connection trickling its second
    request; a normal request meanwhile is answered."""
    s = serve("--parallel", "1", "--header-timeout", "1.5")
    socks = [socket.create_connection(("127.0.0.1", s.port), timeout=10) for _ in range(20)]
    for k in socks:
        k.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    ka = socket.create_connection(("127.0.0.1", s.port), timeout=10)
    assert b"200 OK" in _health(ka)
    ka.sendall(b"GET /health HTTP/1.1\r\nHo")                    # the next request, trickled
    assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    time.sleep(0.5)
    for k in socks:
        k.sendall(b"a")                                          # still trickling: bytes do not reset the deadline
    assert all(_closed(k, 3.0) for k in socks)
    assert _closed(ka, 3.0)
    assert b"200 OK" in _health(socket.create_connection(("127.0.0.1", s.port), timeout=10))
    assert "Traceback" not in s.log()


def test_past_the_connection_cap_the_oldest_trickler_goes(serve):
    """--max-connections: a flood of trickling connections cannot take every
    descriptor; the oldest still sending headers is closed for each newcomer,
    and a prompt request gets in throughout."""
    s = serve("--parallel", "1", "--max-connections", "16", "--header-timeout", "60")
    socks = []
    for _ in range(40):
        k = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        k.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        socks.append(k)
    time.sleep(0.3)
    for _ in range(5):
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
    closed = [_closed(k, 0.5) for k in socks]
    assert sum(closed) >= 24 and not any(closed[-10:]), closed   # the oldest went, the newest stayed
    lines = [ln for ln in s.log().splitlines() if "closed" in ln and "connection" in ln]
    assert 1 <= len(lines) <= 10, lines                          # rate-limited, not one line a connection


def test_a_gpu_fault_ends_requests_with_503_and_the_process_exits(tiny_gguf, tmp_path):
    """VK_ERROR_DEVICE_LOST under a running step (the device layer's fault hook,
    VKENGINE_FAULT_INJECT): the stream in flight ends with a 503 error event
    naming it, new requests and /health get 503, and the process exits with
    status 3 for its supervisor, one error line and no traceback in its log."""
    import json
    import os

    from .serving import ServerProcess
    env = {**os.environ, "VKENGINE_FAULT_INJECT": "device_lost:40"}
    s = ServerProcess(["--model", str(tiny_gguf), "--ctx", str(CTX), "--parallel", "2"], tmp_path / "log", env=env)
    try:
        events = []
        with httpx.stream("POST", s.url + "/completion", json={"prompt": "Once upon a time", "n_predict": 200,
                                                               "stream": True, "ignore_eos": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
        last = events[-1]
        assert "error" in last and last["error"]["code"] == 503, last
        assert "VK_ERROR_DEVICE_LOST" in last["error"]["message"]
        try:
            h = httpx.get(s.url + "/health", timeout=5)
            assert h.status_code == 503 and "DEVICE_LOST" in h.json()["error"]
            g = httpx.post(s.url + "/completion", json={"prompt": "hi", "n_predict": 2}, timeout=5)
            assert g.status_code == 503
        except httpx.TransportError:
            pass                                                   # (already exiting)
        assert s.proc.wait(timeout=60) == 3
    finally:
        s.stop()
    log = s.log()
    assert "Traceback" not in log and "exiting with status 3" in log
