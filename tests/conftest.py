"""Shared fixtures. The Vulkan device is created once per session; a test that
needs Vulkan fails (never skips) when there is no device: CI must run them."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from vkengine.device import Device
from vkengine.kernels import Caps, Kernels, Region

POISON = np.uint32(0x7FC00000)   # a quiet NaN: unwritten outputs fail comparisons


@pytest.fixture(scope="session")
def device():
    idx = os.environ.get("VKENGINE_DEVICE")
    dev = Device(int(idx) if idx else None)
    yield dev
    dev.close()


@pytest.fixture(scope="session")
def tokenizer_source():
    """GGUF to copy the tokenizer from when synthesizing models: the embedded
    SmolLM2 by default; a tokenizer-only GGUF on machines without it (GPU runs)."""
    p = os.environ.get("VKENGINE_TOKENIZER_GGUF")
    return Path(p) if p else None


@pytest.fixture(scope="session")
def kernels(device):
    return Kernels(device)


def kernels_for(device, tiled_from: int | None = -1, **caps) -> Kernels:
    """Kernels of the device with some capabilities set (Caps fields), e.g. the
    GPUs' split-K matvecs on lavapipe; tiled_from as Caps.detect takes it."""
    return Kernels(device, dataclasses.replace(Caps.detect(device, tiled_from=tiled_from), **caps))


def with_caps(kernels: Kernels, **caps) -> Kernels:
    """The same kernels with some capabilities changed."""
    return Kernels(kernels.device, dataclasses.replace(kernels.caps, **caps))


@pytest.fixture
def rng(request):
    # fresh inputs each run, but reproducible from the printed seed on failure
    # (VKENGINE_TEST_SEED=<seed> replays it)
    seed = int(os.environ.get("VKENGINE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"seed={seed}")
    return np.random.default_rng(seed)


class Workspace:
    """An activation buffer (device-local, poisoned), a params buffer (host) and
    a weight buffer, with helpers to place arrays and read them back."""

    def __init__(self, device, act_words=4 << 20, weight_words=1 << 20, params_words=1 << 14):
        self.device = device
        self.act = device.buffer(act_words * 4, "device", "test-act")
        self.weights = device.buffer(weight_words * 4, "device", "test-weights")
        self.params = device.buffer(params_words * 4, "host", "test-params")
        self._act_next = 0
        self._w_next = 0
        device.upload(self.act, np.full(act_words, POISON, np.uint32))
        self.params.array()[:] = POISON

    def close(self):
        for b in (self.act, self.weights, self.params):
            self.device.free(b)

    def _take(self, attr, words):
        off = getattr(self, attr)
        setattr(self, attr, off + (words + 3) // 4 * 4)
        return off

    def act_region(self, words, data=None) -> Region:
        r = Region(self.act, self._take("_act_next", words), words)
        if data is not None:
            self.device.upload(self.act, np.ascontiguousarray(data).reshape(-1).view(np.uint32), r.off * 4)
        return r

    def weight_region(self, data) -> Region:
        a = np.ascontiguousarray(data).reshape(-1).view(np.uint32)
        r = Region(self.weights, self._take("_w_next", a.size), a.size)
        self.device.upload(self.weights, a, r.off * 4)
        return r

    def read(self, r: Region, dtype=np.float32) -> np.ndarray:
        return self.device.download(r.buf, r.off * 4, r.words * 4, np.uint8).view(dtype)


@pytest.fixture
def ws(device):
    w = Workspace(device)
    yield w
    w.close()


# -- llama.cpp as the reference peer (tests/test_parity.py, test_llamacpp_agreement.py)

def _log(msg: str) -> None:
    # straight to the terminal: the first build takes about 15 minutes and
    # pytest would otherwise hold the line until the test ends
    print(f"\n[llama.cpp] {msg}", file=sys.__stderr__, flush=True)


@pytest.fixture(scope="session")
def llama_server_exe():
    """llama-server 11434, built from PyPI's sdist when the cache lacks it
    (never skipped: CI builds it here on a fresh machine). VKENGINE_LLAMA_SERVER
    points at another build (the Vulkan one on the GPU machine)."""
    env = os.environ.get("VKENGINE_LLAMA_SERVER")
    if env:
        return Path(env)
    from parity import llamacpp
    return llamacpp.ensure_built(log=_log)


@pytest.fixture(scope="session")
def smollm2():
    from vkengine.model import load_model
    return load_model(None)


def _start(exe, model, mode, tmp_path_factory):
    from parity import llamacpp, reference
    return llamacpp.start_server(exe, model.path, extra=reference.MODE_ARGS[mode],
                                 log_dir=tmp_path_factory.mktemp(f"llama-server-{mode}"), log=_log)


@pytest.fixture(scope="session")
def reference_server(llama_server_exe, smollm2, tmp_path_factory):
    """llama-server in parity mode A (its defaults) on the embedded model."""
    srv = _start(llama_server_exe, smollm2, "A", tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reference_server_b(llama_server_exe, smollm2, tmp_path_factory):
    """llama-server in parity mode B (-fa off -b 64 -ub 64)."""
    srv = _start(llama_server_exe, smollm2, "B", tmp_path_factory)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reference_client(reference_server):
    from parity.llamacpp import Client
    with Client(reference_server.url) as c:
        yield c


@pytest.fixture(scope="session")
def smollm2_engine(smollm2, device):
    from parity.engine_side import engine_config
    from vkengine.engine import Engine
    # the harness's own configuration, with room for prompts up to 480 tokens
    eng = Engine(smollm2, device, engine_config(480, 32, smollm2.args.n_ctx_train))
    yield eng
    eng.close()


# -- memory per test (VKENGINE_TEST_RSS_LOG=path: each test's node id and the process's resident MiB after it),
# to find what holds memory across the suite (lavapipe's device memory is the process's own)

def pytest_runtest_teardown(item, nextitem):
    path = os.environ.get("VKENGINE_TEST_RSS_LOG")
    if path:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
        with open(path, "a") as f:
            f.write(f"{rss}\t{item.nodeid}\n")
