"""Helpers for the fault, bad-input and security tests over real HTTP: the
server's metrics, a raw request that the test drops when it likes (a client
going away), and the idle check that the soak (bench/soak.py) also makes."""
from __future__ import annotations

import importlib.util
import json
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

_spec = importlib.util.spec_from_file_location("vkengine_soak", Path(__file__).resolve().parent.parent / "bench" /
                                               "soak.py")
soak = sys.modules.setdefault("vkengine_soak", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(soak)

scrape = soak.scrape


def metric(url: str, name: str, **labels) -> float:
    return soak.total(scrape(url), name, **labels)


def wait_for(cond, what: str, timeout: float = 180.0, every: float = 0.05):
    """Poll cond() until it is truthy (its value is returned). The timeout only
    bounds a hang; nothing here asserts how fast the server is."""
    end = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every)


def slots(url: str) -> list[dict]:
    return httpx.get(url + "/slots", timeout=30).json()


def assert_idle_and_no_leak(url: str, start: dict[str, float]) -> dict[str, float]:
    """Wait until nothing runs; then slots, sequences, parked copies, queue and
    buffers must be back where they were at `start` (a scrape at idle)."""
    end = soak.wait_idle(url, 180)
    assert end is not None, "the server did not go idle"
    bad = [f"{what}: {val}" for what, ok, val in soak.leak_checks(start, end) if not ok]
    assert not bad, bad
    assert all(not s["is_processing"] for s in slots(url))
    return end


class RawRequest:
    """A POST over a plain socket: the test reads what it wants and closes the
    socket whenever it likes, as a client that goes away does."""

    def __init__(self, url: str, path: str, body: dict | bytes, headers: dict | None = None):
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=120)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\nConnection: close\r\n{head}\r\n".encode() + data)
        self.buf = b""

    def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed before {marker!r}; got {self.buf[-300:]!r}")
            self.buf += chunk
        return self.buf

    def read_all(self) -> bytes:
        while chunk := self.sock.recv(65536):
            self.buf += chunk
        return self.buf

    def close(self) -> None:
        self.sock.close()
