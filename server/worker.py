"""The engine thread: the one thread that touches the device. It owns a Runner
(vkengine.serving.runner: schedule -> run -> postprocess) and moves requests
in and events out: requests enter and leave through an inbox (submit, cancel)
that the thread drains between collecting a step and composing the next, so a
client that goes away frees its slot at the next step; each request's events
go to its own `emit` callback (the HTTP layer passes one that feeds an asyncio
queue through `loop.call_soon_threadsafe`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TextIO

from vkengine.engine import Engine
from vkengine.errors import DeviceFault, VkEngineError
from vkengine.serving.runner import Event, GenRequest, Job, Runner
from vkengine.serving.scheduler import SchedulerConfig

log = logging.getLogger("vkengine.server")

__all__ = ["Event", "GenRequest", "Job", "QueueFull", "Unavailable", "Worker"]


class QueueFull(VkEngineError):
    """Every slot is busy and the queue is full: try again later (HTTP 503)."""


class Unavailable(VkEngineError):
    """The server is shutting down (HTTP 503)."""


class Worker:
    def __init__(self, engine: Engine, cfg: SchedulerConfig, metrics=None, step_log: str | None = None,
                 mtp_draft: int = 0):
        """step_log: a file to append a JSON line per engine step to (Runner's step_log);
        mtp_draft: drafts a step of greedy requests' speculative decoding (Runner's)."""
        self._log_file: TextIO | None = open(step_log, "a", buffering=1 << 16) if step_log else None
        self._inbox: deque[tuple[str, Job]] = deque()
        self.runner = Runner(engine, cfg, metrics, self._log_file, arrivals=lambda: bool(self._inbox),
                             mtp_draft=mtp_draft)
        self.eng, self.cfg, self.metrics = engine, self.runner.cfg, metrics
        self._cv = threading.Condition()
        self._active = 0                  # submitted and not finished (live + waiting)
        self._accepting = True
        self._deadline: float | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.fault: str | None = None     # why the device failed (then the worker ends; see _loop)
        self.on_fault: Callable[[str], object] | None = None   # told once, from the engine thread
        self._publish()

    @property
    def sched(self):
        return self.runner.sched

    # -- called from any thread (the event loop) ---------------------------
    def submit(self, req: GenRequest, emit: Callable[[Event], object]) -> Job:
        def emit_and_count(ev: Event) -> None:
            if ev.finish is not None:
                with self._cv:
                    self._active -= 1
            emit(ev)
        job = self.runner.make_job(req, emit_and_count)
        with self._cv:
            if self.fault is not None:
                raise Unavailable(f"{self.fault}; the server is stopping")
            if not self._accepting:
                raise Unavailable("the server is shutting down")
            if self._active >= self.cfg.max_live + self.cfg.max_queue:
                raise QueueFull(f"all {self.cfg.max_live} sequences are busy and {self.cfg.max_queue} "
                                "requests are queued; retry later")
            self._active += 1
            self._inbox.append(("submit", job))
            self._cv.notify()
        return job

    def cancel(self, job: Job) -> None:
        with self._cv:
            self._inbox.append(("cancel", job))
            self._cv.notify()

    def drain(self, grace: float) -> None:
        """Shutdown: refuse new requests; cancel what is still running after `grace` seconds."""
        with self._cv:
            self._accepting = False
            self._deadline = time.monotonic() + grace
            self._cv.notify()

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def active(self) -> int:
        return self._active

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vkengine-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # -- the engine thread ---------------------------------------------------
    def _loop(self) -> None:
        r = self.runner
        while True:
            with self._cv:
                while not self._inbox and r.idle and not self._stopping:
                    if self._log_file is not None:
                        self._log_file.flush()   # idle: the lines so far reach the file
                    if self.eng.deferred:
                        break
                    self._cv.wait()
                stopping = self._stopping
                idle = not self._inbox and r.idle and not stopping
            if stopping:
                r.settle()
                self._drain_inbox()
                r.cancel_all("the server is shutting down")
                if self._log_file is not None:
                    self._log_file.close()
                return
            if idle:   # nothing to run: record a step the start left for now (Engine.record_deferred)
                try:
                    self._record_deferred()
                except DeviceFault as e:
                    self._device_failed(str(e))
                    return
                continue
            try:
                if not self.run_once():
                    with self._cv:
                        self._cv.wait(0.01)
            except DeviceFault as e:              # nothing on the device can be trusted: end all, stop
                self._device_failed(str(e))
                return
            except Exception:                     # keep serving others; fail what was running
                log.exception("engine step failed")
                r.settle()
                r.cancel_all("internal error in the engine step (see the server log)", "error")

    def _record_deferred(self) -> None:
        try:
            done = self.eng.record_deferred()
        except DeviceFault:
            raise
        except Exception:   # (those steps are then recorded when first run, as without the start's list)
            log.exception("recording a deferred step failed")
            self.eng.drop_deferred()
            done = False
        if done or not self.eng.deferred:
            self._publish()   # (/metrics' programs_deferred falls while the server idles)
        else:   # (all still compiling: look again in a while)
            with self._cv:
                self._cv.wait(0.05)

    def _device_failed(self, why: str) -> None:
        """A GPU fault: every request ends with a 503 naming it, nothing new is
        taken, /health says so, and on_fault (the server: exit non-zero, for its
        supervisor to restart the process; re-creating a lost Vulkan device
        in-process would mean rebuilding every buffer and pipeline kp holds,
        which a fresh process does more surely) is told."""
        log.error("%s: ending every request; the server stops", why)
        with self._cv:
            self.fault = why
            self._accepting = False
        r = self.runner
        r.inflight.clear()                   # (their results are gone with the device)
        if r.spec is not None:
            r.spec.forget()
        r.held = None
        self._drain_inbox()
        r.cancel_all(f"{why}; the server is stopping (its supervisor restarts it)")
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self.on_fault is not None:
            self.on_fault(why)

    def run_once(self) -> bool:
        """One turn of the runner, with the inbox drained between collecting a
        step and composing the next (newcomers join that step). False when
        there was nothing to run."""
        r = self.runner
        ran = r.collect()
        self._drain_inbox()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            r.deliver()                          # what was generated still reaches its client
            r.cancel_all("the server is shutting down")
        submitted = r.submit_next()
        r.deliver()
        self._publish()
        return ran or submitted

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Tests: run steps on the calling thread until every request is done."""
        for _ in range(max_steps):
            if not self.run_once() and self.runner.idle and not self._inbox:
                return
        raise RuntimeError("requests did not finish")

    def _drain_inbox(self) -> None:
        while True:
            with self._cv:
                if not self._inbox:
                    return
                kind, job = self._inbox.popleft()
            if kind == "submit":
                self.runner.add(job)
            else:
                self.runner.cancel(job)

    def _publish(self) -> None:
        snap = self.runner.sched.snapshot()
        snap["active"] = self._active
        snap["memory"] = self.runner.memory()
        self.snapshot = snap
        if self.metrics:
            self.metrics.state(snap, len(self._inbox))
