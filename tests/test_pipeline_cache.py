"""Pipelines created on threads and kept between processes (issue 35, cold start):
the device's one VkPipelineCache (patches/kp/0002), saved to a file and loaded
by the next Device; pipelines compiled on worker threads and resolved when a
program is recorded."""
from __future__ import annotations

import struct
from concurrent.futures import Future

import numpy as np
import pytest

from vkengine.device import Device, pipeline_cache_dir, pipeline_threads
from vkengine.errors import VkEngineError
from vkengine.kernels import Kernels, Region


def _adds(dev: Device, kernels: Kernels, n: int = 4096, copies: int = 6):
    """A program of `copies` independent adds, each on its own buffers (so each
    its own pipeline), and the expected outputs."""
    prog = dev.program()
    outs = []
    for i in range(copies):
        b = dev.buffer(2 * n * 4, "device", f"act{i}")
        dev.upload(b, np.full(n, i, np.float32))
        kernels.add(prog, Region(b, 0, n), n, Region(b, 0, n), n, Region(b, n, n), n, n, 1)
        outs.append((b, 2.0 * i))
    return prog, outs


def _check(dev: Device, outs) -> None:
    for o, want in outs:
        got = dev.download(o, o.nbytes // 2, dtype=np.float32)
        assert (got == want).all(), (o.name, got[:4], want)


def test_pipelines_compile_on_threads_and_resolve_when_recorded(tmp_path, monkeypatch):
    monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", "4")
    with Device(pipeline_cache=tmp_path) as dev:
        kernels = Kernels(dev)
        prog, outs = _adds(dev, kernels)
        pending = list(dev._algorithms.values())
        assert len(pending) == 6 and all(isinstance(a, Future) for a in pending)   # on the pipeline threads
        prog.run()   # recording waits for them
        _check(dev, outs)
        prog.run()
        _check(dev, outs)


def test_settle_reports_what_the_start_waited_for(tmp_path, monkeypatch):
    """settle() waits for the pipelines without a stand-in and says for how long and
    which finished last (the startup log's pipeline_report: what a fresh driver's
    start spends its time on)."""
    monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", "4")
    monkeypatch.setenv("VKENGINE_PIPELINE_DELAY", "add:0.4")
    with Device(pipeline_cache=tmp_path) as dev:
        prog, outs = _adds(dev, Kernels(dev), copies=3)
        assert dev.settle(0.0, stand_in=lambda name: False) == set()
        wait, last = dev.settle_wait
        assert wait >= 0.3 and last == "add"
        report = dev.pipeline_report()
        assert report.startswith("3 pipelines created") and "on 4 thread(s)" in report and "(the last: add)" in report
        prog.run()
        _check(dev, outs)


def test_a_pipeline_on_other_buffers_is_built_once_the_first_is(tmp_path, monkeypatch):
    """The same shader with the same constants bound to other buffers (a
    matmul over each weight arena) is created once the first is built, from
    the pipeline cache it filled, instead of compiling beside it: the delay
    hook compiles a shader once as a driver with a cache would, so the twins
    each take milliseconds where three at once would take the delay each
    (where the driver's cache serves twins: not lavapipe's, Device.share_twins)."""
    monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", "4")
    monkeypatch.setenv("VKENGINE_PIPELINE_DELAY", "add:0.5")
    with Device(pipeline_cache=tmp_path) as dev:
        dev.share_twins = True   # (lavapipe's default is off: it compiles each twin anew)
        prog, outs = _adds(dev, Kernels(dev), copies=3)
        algs = list(dev._algorithms.values())
        assert len(algs) == 3 and all(isinstance(a, Future) for a in algs)
        prog.run()
        _check(dev, outs)
        times = sorted((a, b) for name, a, b in dev.pipeline_times if name == "add")
        assert len(times) == 3
        (a0, b0), twins = times[0], times[1:]
        assert b0 - a0 >= 0.45
        assert all(a >= b0 and b - a < 0.25 for a, b in twins), times
        assert not dev._compiling   # (each first let go once built)


def test_pipelines_with_a_stand_in_compile_after_the_others():
    """The pipeline threads take a kernel with a stand-in (Kernels.has_stand_in:
    a start records another while it builds) only after every other queued one,
    so that a fresh driver's start waits for what it needs first; shutdown still
    runs every job queued before it."""
    import threading

    from vkengine.device import _Workers
    pool = _Workers(1, "t")
    gate, order = threading.Event(), []
    pool.submit(gate.wait)                         # (holds the one thread while the others queue)
    done = [pool.submit(order.append, "mul_mc2h_256x256_q4_0", low=True), pool.submit(order.append, "rms_norm"),
            pool.submit(order.append, "attention_mc2_d128", low=True), pool.submit(order.append, "mul_mvk")]
    gate.set()
    pool.shutdown(wait=True)
    assert all(f.done() for f in done)
    assert order == ["rms_norm", "mul_mvk", "mul_mc2h_256x256_q4_0", "attention_mc2_d128"]
    with Device(pipeline_cache=None) as dev:
        Kernels(dev)
        assert dev.deferrable("mul_mc2h_128x256_q4_0") and not dev.deferrable("mul_mvk_q4_0")


def test_a_buffer_freed_while_its_pipeline_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", "2")
    with Device(pipeline_cache=tmp_path) as dev:
        kernels = Kernels(dev)
        prog, outs = _adds(dev, kernels, copies=4)
        dev.free(outs[0][0])   # waits for that pipeline, then drops it with the buffer
        assert dev.n_pipelines == 3
        prog2, outs2 = _adds(dev, kernels, copies=2)
        prog2.run()
        _check(dev, outs2)


def _header(data: bytes) -> tuple[int, int, int]:
    """(header size, header version, vendor id) of VkPipelineCacheHeaderVersionOne."""
    return struct.unpack_from("<III", data)


def test_the_pipeline_cache_is_saved_and_the_next_device_loads_it(tmp_path, monkeypatch):
    monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", "1")   # also the path without threads
    with Device(pipeline_cache=tmp_path) as dev:
        f = dev.pipeline_cache_file
        assert f is not None and f.parent == tmp_path and not f.exists()
        prog, outs = _adds(dev, Kernels(dev), copies=2)
        prog.run()
        _check(dev, outs)
        written = dev.save_pipeline_cache()
        assert written > 0 and f.stat().st_size == written
        size, version, vendor = _header(f.read_bytes())
        assert size >= 32 and version == 1 and vendor == dev.info.vendor_id
        assert dev.save_pipeline_cache() == 0   # nothing new since
    assert not list(tmp_path.glob("*.tmp"))
    with Device(pipeline_cache=tmp_path) as dev2:
        assert dev2.pipeline_cache_file == f
        assert dev2.pipeline_cache_loaded == f.stat().st_size
        prog, outs = _adds(dev2, Kernels(dev2), copies=2)
        prog.run()
        _check(dev2, outs)


@pytest.mark.parametrize("content", ["garbage", "other-vendor"])
def test_a_foreign_or_broken_cache_file_is_ignored_and_replaced(tmp_path, content):
    with Device(pipeline_cache=tmp_path) as probe:
        f = probe.pipeline_cache_file
        vendor = probe.info.vendor_id
    assert f is not None
    if content == "garbage":
        f.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8).tobytes())
    else:   # a well-formed header of another vendor's driver, with an entry the driver must not use
        f.write_bytes(struct.pack("<IIII", 32, 1, vendor ^ 0x1234, 7) + bytes(16) + b"\x01" * 256)
    with Device(pipeline_cache=tmp_path) as dev:
        assert dev.pipeline_cache_loaded < f.stat().st_size
        prog, outs = _adds(dev, Kernels(dev), copies=2)
        prog.run()
        _check(dev, outs)
        assert dev.save_pipeline_cache() > 0
    size, version, got_vendor = _header(f.read_bytes())
    assert (version, got_vendor) == (1, vendor)


def test_pipeline_cache_and_threads_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("VKENGINE_PIPELINE_CACHE", "off")
    assert pipeline_cache_dir() is None
    with Device() as dev:
        assert dev.pipeline_cache_file is None and dev.save_pipeline_cache() == 0
    monkeypatch.setenv("VKENGINE_PIPELINE_CACHE", str(tmp_path / "p"))
    assert pipeline_cache_dir() == tmp_path / "p"
    monkeypatch.delenv("VKENGINE_PIPELINE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pipeline_cache_dir() == tmp_path / "xdg" / "vkengine" / "pipelines"
    monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", "3")
    assert pipeline_threads() == 3
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv("VKENGINE_PIPELINE_THREADS", bad)
        with pytest.raises(VkEngineError, match="VKENGINE_PIPELINE_THREADS"):
            pipeline_threads()
