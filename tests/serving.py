"""Fixtures shared by the server tests: the tiny synthetic model (random
weights, SmolLM2's real tokenizer), written once per session."""
from __future__ import annotations

import pytest

from vkengine.model import load_model
from vkengine.tools.synth.llama import config_for, synth_llama

CTX = 512


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tokenizer_source):
    out = synth_llama(config_for("tiny", None), "q8_0", 0, tmp_path_factory.mktemp("tiny"), "tiny",
                      formats=("gguf",), workers=1, tokenizer_from=tokenizer_source)
    return out["gguf"]


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf):
    return load_model(tiny_gguf)


def sse_events(resp) -> list:
    """A streamed reply's `data:` objects (JSON, or the string "[DONE]")."""
    import json
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`vkengine serve` in a subprocess on a free port (real HTTP, real engine)."""

    def __init__(self, args: list[str], log_path, ready_timeout: float = 300.0, launcher: list[str] | None = None,
                 env: dict | None = None):
        import subprocess
        import sys
        import time
        from pathlib import Path

        import httpx
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "wb")
        root = Path(__file__).resolve().parent.parent
        launcher = launcher or ["-m", "vkengine.cli"]
        self.proc = subprocess.Popen([sys.executable, *launcher, "serve", "--port", str(self.port), *args],
                                     cwd=root, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become ready:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> int:
        import signal
        import subprocess
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def serve(tiny_gguf, tmp_path_factory):
    """serve(*flags) -> a running ServerProcess on the tiny model, stopped at the
    module's end (servers kept to the session's end held ~5 GB by its last modules)."""
    procs = []

    def start(*flags, model=str(tiny_gguf), ctx=CTX, template: str | None = None):
        """template: a chat template's text, served with --chat-template-file."""
        base = [] if model is None else ["--model", model]
        if template is not None:
            f = tmp_path_factory.mktemp("tmpl") / "chat.jinja"
            f.write_text(template)
            base += ["--chat-template-file", str(f)]
        p = ServerProcess([*base, "--ctx", str(ctx), *flags],
                          tmp_path_factory.mktemp("server") / "server.log")
        procs.append(p)
        return p
    yield start
    for p in procs:
        p.stop()
