"""The engine thread: the one thread that touches the device. It turns the
scheduler's batches into `Engine.step` calls, samples each sequence's next token
with its own `Sampler` (so draws never depend on what else ran in the step),
applies the output rules (`OutputStream`: detokenization, EOS, stop strings,
token budget) and hands each request its events through the request's own
`emit` callback (the HTTP layer passes one that feeds an asyncio queue through
`loop.call_soon_threadsafe`).

Requests enter and leave through an inbox (submit, cancel) that the engine
thread drains before every step, so a client that goes away frees its slot at
the next step.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import numpy as np

from vkengine.engine import Engine
from vkengine.errors import VkEngineError
from vkengine.generate import OutputStream
from vkengine.kernels import Kernels
from vkengine.sampling import Sampler, SamplingParams, top_order

from .scheduler import Batch, Scheduler, SchedulerConfig, Seq

log = logging.getLogger("vkengine.server")


class QueueFull(VkEngineError):
    """Every slot is busy and the queue is full: try again later (HTTP 503)."""


class Unavailable(VkEngineError):
    """The server is shutting down (HTTP 503)."""


@dataclass(frozen=True)
class GenRequest:
    prompt: Sequence[int]                 # token ids
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n_probs: int = 0                      # top tokens (with log-probabilities) reported per token
    use_cache: bool = True                # reuse a cached prefix of the prompt


@dataclass
class Event:
    text: str = ""
    token: int | None = None
    logprob: float | None = None          # of `token`, under the model's distribution (n_probs > 0)
    top: list[tuple[int, float]] | None = None   # (token, logprob) of the n_probs most likely
    finish: str | None = None             # stop | length | cancelled | error
    error: str | None = None


@dataclass(eq=False)
class Job:
    """One request inside the worker."""
    req: GenRequest
    emit: Callable[[Event], None]
    seq: Seq
    sampler: Sampler
    out: OutputStream
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    n_generated: int = 0
    finish: str | None = None
    stop_type: str = "none"               # llama-server's: eos | word | limit | none
    done: bool = False
    on_device: bool = False               # its tokens are drawn on the device (Worker.submit)

    @property
    def needs_logits(self) -> bool:
        """Its rows read their logits back (the host samples or reports log-probabilities)."""
        return not self.on_device and (self.req.sampling.needs_logits or self.req.n_probs > 0)

    def sampling_row(self) -> tuple[float, int, float, float, float]:
        """Its output row's sampling params for Engine.submit(sampling=...): a
        draw on the device takes the next uniform of the request's generator
        (one a token, as Sampler's draw takes), so its tokens do not depend on
        the steps it shares; other rows are greedy there (their token is taken
        on the host when they need one)."""
        if not self.on_device:
            return (0.0, 1, 1.0, 0.0, 0.0)
        return self.req.sampling.device_row(self.sampler.uniform())


class Step(NamedTuple):
    """A step on the device, as the engine thread tracks it."""
    batch: Batch
    outs: list[Seq]               # the sequences of its output rows, in row order
    readback: str                 # argmax | logits | none
    t_submit: float
    chained: bool                 # its tokens come from the step before it, on the device
    prompt: bool = False          # prompt rows only (Engine.tiled_prompts: decode rows ran apart)


class EngineKV:
    """The scheduler's KVMover over the engine's KV cache; parked rows go to
    host-visible buffers that are pooled and reused."""

    def __init__(self, eng: Engine, keep: int = 8):
        self.eng, self.keep = eng, keep
        self.pool: list = []
        self.held: dict[int, object] = {}     # handles parked and not yet released, by id

    def park(self, slot: int, length: int):
        need = length * self.eng.kv.bytes_per_position()
        fit = [b for b in self.pool if b.nbytes >= need]
        buf = min(fit, key=lambda b: b.nbytes) if fit else None
        if buf is not None:
            self.pool.remove(buf)
        handle = self.eng.kv.park(slot, length, into=buf)
        self.held[id(handle)] = handle
        return handle

    def restore(self, handle, slot: int, length: int) -> None:
        self.eng.kv.restore(handle, slot, length)

    def reusable(self, source: tuple, length: int) -> int:
        """How many of the first `length` positions of a prefix source (("slot", i)
        or ("host", handle)) can be reused: all of them for a KV cache; for a
        hybrid model's state only `length` itself, and only where the recurrent
        state covers exactly that many positions (it cannot be cut shorter)."""
        kv = self.eng.kv
        if not hasattr(kv, "reusable_prefix"):
            return length
        if source[0] == "slot":
            return kv.reusable_prefix(source[1], length)
        return kv.reusable_parked(source[1], length)

    def copy(self, src: int, dst: int, length: int) -> None:
        self.eng.kv.copy_prefix(src, dst, length)

    def release(self, handle) -> None:
        del self.held[id(handle)]
        self.pool.append(handle.buffer)
        if len(self.pool) > self.keep:
            self.eng.device.free(self.pool.pop(0))


def top_logprobs(row: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """log-softmax of a logits row: (ids of the n largest, all log-probabilities)."""
    x = row.astype(np.float64)
    lp = x - x.max()
    lp -= np.log(np.exp(lp).sum())
    return top_order(x, n) if n > 0 else np.zeros(0, np.int64), lp


class Worker:
    def __init__(self, engine: Engine, cfg: SchedulerConfig, metrics=None):
        self.eng = engine
        # where the engine pads prompt steps to its tiled matmuls, a step's
        # decode rows and prompt rows run as two engine steps (decode rows on
        # the matvecs, as alone: tokens independent of who else runs)
        if getattr(engine, "tiled_prompts", False) and not cfg.prompt_apart:
            cfg = dataclasses.replace(cfg, prompt_apart=True)
        self.cfg = cfg
        self.kv = EngineKV(engine)
        self.sched = Scheduler(cfg, self.kv)
        self.metrics = metrics
        self._inbox: deque[tuple[str, Job]] = deque()
        self._cv = threading.Condition()
        self._active = 0                  # submitted and not finished (live + waiting)
        self._accepting = True
        self._deadline: float | None = None
        self._inflight: deque[Step] = deque()  # steps on the device, oldest first
        self.chain = engine.can_chain        # chain greedy decode steps (see run_once)
        # steps on the device at once: the running one and the chained ones queued behind it
        self.depth = engine.max_in_flight if self.chain else 1
        self.chained_steps = 0
        self.device_sampling = getattr(engine, "can_sample", False)   # sampled replies drawn on the device
        self._finish_after: list[Seq] = []    # failed while their row was on the device
        self._stopping = False
        self._thread: threading.Thread | None = None
        # VKENGINE_STEP_LOG=PATH: a JSON line per collected step (rows, prompt rows, outputs,
        # chained, submit -> collected and the wait inside collect, in ms): where a server's
        # time goes between steps (the host late, the device busy, newcomers' prompt steps)
        path = os.environ.get("VKENGINE_STEP_LOG")
        self._step_log = open(path, "a", buffering=1 << 16) if path else None
        self._t0 = time.perf_counter()
        self._publish()

    @property
    def prompt_apart(self) -> bool:
        """Whether a step's decode rows and prompt rows run as two engine steps."""
        return self.cfg.prompt_apart

    # -- called from any thread (the event loop) ---------------------------
    def submit(self, req: GenRequest, emit: Callable[[Event], None]) -> Job:
        prompt = [int(t) for t in req.prompt]
        if not prompt:
            raise VkEngineError("the prompt is empty")
        if len(prompt) >= self.eng.n_ctx:
            raise VkEngineError(f"the prompt has {len(prompt)} tokens; the context length is {self.eng.n_ctx}")
        out = OutputStream(self.eng.model.tokenizer, req.max_tokens, req.stop, req.ignore_eos)
        job = Job(req, emit, Seq(prompt, use_cache=req.use_cache), Sampler(req.sampling), out)
        # drawn on the device, where steps chain (no log-probabilities: they need the logits)
        job.on_device = (self.device_sampling and req.sampling.drawn_on_device(Kernels.SAMPLE_K)
                         and req.n_probs == 0)
        job.seq.data = job
        with self._cv:
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
        while True:
            with self._cv:
                while not self._inbox and self.sched.idle and not self._inflight and not self._stopping:
                    if self._step_log is not None:
                        self._step_log.flush()   # idle: the lines so far reach the file
                    self._cv.wait()
                stopping = self._stopping
            if stopping:
                self._settle()
                self._drain_inbox()
                self._cancel_all("the server is shutting down")
                if self._step_log is not None:
                    self._step_log.close()
                return
            try:
                if not self.run_once():
                    with self._cv:
                        self._cv.wait(0.01)
            except Exception:                     # keep serving others; fail what was running
                log.exception("engine step failed")
                self._settle()
                self._cancel_all("internal error in the engine step (see the server log)", "error")

    def _settle(self) -> None:
        """Let a step still on the device finish (its results are dropped: every
        sequence is cancelled next)."""
        self._finish_after.clear()
        while self._inflight:
            batch = self._inflight.popleft().batch
            try:
                self.eng.collect()
            except Exception:
                log.exception("engine step failed")
            self.sched.postprocess(batch)

    def run_once(self) -> bool:
        """One turn of the pipeline: collect the oldest step on the device (its
        tokens are chosen and appended at once), then drain the inbox, compose
        and submit the next step, and only then do the per-token host work of
        the collected step (detokenizing, stop strings, events, metrics) while
        the GPU runs. A token that ends its sequence (end of turn, token budget,
        context) and any token of a request with stop strings is delivered
        before the next step is composed, so a finished sequence never enters
        it.

        Chaining: when the newest step on the device is greedy decode of
        running sequences only and nobody waits to be admitted, the step after
        it is submitted before the oldest is collected, reading its tokens
        from the device's greedy output, so the GPU goes from step to step
        without waiting for the host; up to the engine's max_in_flight steps
        (the server's engine: 3, so two wait behind the running one and a
        host that is late by up to a step costs the GPU nothing). A sequence
        whose token turns out to end it had a row in each chained step: the
        rows are computed, their tokens dropped; its slot keeps the tokens it
        has (Scheduler.finish). False when there was nothing to run."""
        late: list[tuple[Job, int, Event, float]] = []
        ran = bool(self._inflight)
        if ran:
            while len(self._inflight) < self.depth and self._chain():
                pass
            self._collect_oldest(late)
        self._drain_inbox()
        if self._deadline is not None and time.monotonic() >= self._deadline:
            for job, tok, ev, now in late:      # what was generated still reaches its client
                self._guard(job.seq, self._deliver, job, tok, ev, now)
            late = []
            self._cancel_all("the server is shutting down")
        batch = None
        if not self._inflight:
            # Only with nothing on the device: a step composed beside one in
            # flight could not hold that step's sequences (their tokens are not
            # back yet), so the live sequences would split into groups that take
            # turns in steps of fewer rows, each costing nearly a full step
            # (bench/serve_sim.py: at C = 4, 2-row steps, 58% of the device's
            # rate). Running streams keep the device busy through chained steps.
            batch = self.sched.schedule()
        if batch is not None:
            if self.prompt_apart:
                for part, prompt in zip(batch.split(), (False, True)):
                    if part is not None:
                        self._submit(part, prompt, late)
            else:
                self._submit(batch, batch.has_prompt, late)
        for job, tok, ev, now in late:
            self._guard(job.seq, self._deliver, job, tok, ev, now)
        self._publish()
        return ran or batch is not None

    def _submit(self, batch: Batch, prompt: bool, late: list) -> None:
        """Submit a composed step (or one of its two parts: Batch.split)."""
        outs = batch.out_seqs
        readback, sampling = self._readback(outs)
        if any(s.data.needs_logits for s in outs):
            readback = "sample+logits" if readback == "sample" else "logits"
        logits = ("logits", "sample+logits")
        if self._inflight and (readback in logits or self._inflight[-1].readback in logits):
            self._collect_oldest(late)     # a step that reads logits back runs alone (the other part)
        self.eng.submit(batch.tokens, batch.positions, batch.slots, batch.out_rows, readback,
                        sampling=sampling, prompt=prompt)
        self._inflight.append(Step(batch, outs, readback, time.perf_counter(), False, prompt))

    @staticmethod
    def _readback(outs: list[Seq]) -> tuple[str, list | None]:
        """A step's readback as far as its rows' tokens go ("sample" when one
        is drawn on the device, else "argmax") and its sampling rows."""
        if any(s.data.on_device for s in outs):
            return "sample", [s.data.sampling_row() for s in outs]
        return "argmax", None

    def _chain(self) -> bool:
        """Submit the decode step that follows the newest one in flight, if it
        may (run_once); whether it did."""
        batch, outs, readback, _, _, prompt = self._inflight[-1]
        if not self.chain or prompt or readback not in ("argmax", "sample") or self._inbox or \
                (self.sched.waiting and len(self.sched.live) < self.cfg.max_live):
            return False

        def done(seq: Seq) -> bool:       # the newest token in flight is certainly its last
            job = seq.data
            ahead = sum(1 for st in self._inflight for s in st.outs if s is seq)   # its tokens in flight
            made = len(seq.tokens) - seq.n_prompt + ahead
            return job.done or made >= job.req.max_tokens or len(seq.tokens) + ahead - 1 >= self.eng.n_ctx
        nxt = self.sched.chain(batch, done)
        if nxt is None:
            return False
        index = {id(s): j for j, s in enumerate(outs)}
        chain = [index[id(w.seq)] for w in nxt.work]
        n = len(nxt.work)
        readback, sampling = self._readback(nxt.out_seqs)
        self.eng.submit([0] * n, nxt.positions, nxt.slots, list(range(n)), readback, chain=chain, sampling=sampling)
        self._inflight.append(Step(nxt, nxt.out_seqs, readback, time.perf_counter(), True))
        self.chained_steps += 1
        return True

    def _collect_oldest(self, late: list) -> None:
        """Wait for the oldest step on the device, account for its rows, and
        choose and append its tokens (those that may end a sequence are
        delivered at once, the others queued in `late`)."""
        batch, outs, readback, t0, chained, _ = self._inflight.popleft()
        t_wait = time.perf_counter()
        res = self.eng.collect()
        now = time.perf_counter()
        if self._step_log is not None:
            self._log_step(batch, outs, chained, t0, t_wait, now)
        if self.metrics:
            self.metrics.step(sum(len(w.tokens) for w in batch.work), now - t0)
        self.sched.postprocess(batch)
        for seq in self._finish_after:
            if not any(w.seq is seq for st in self._inflight for w in st.batch.work):
                self.sched.finish(seq)
        self._finish_after = [q for q in self._finish_after if q.state != "finished"]
        if readback == "sample+logits":      # (tokens, logits): a pair a row
            res = list(zip(*res))
        for seq, r in zip(outs, res if res is not None else ()):
            self._guard(seq, self._take, seq.data, r, readback, now, late)
        if self._inflight and self._inflight[0].chained:    # the chained step now knows its tokens
            for w in self._inflight[0].batch.work:
                if w.tokens == [None] and len(w.seq.tokens) > w.start:
                    w.tokens = [w.seq.tokens[w.start]]

    def _log_step(self, batch: Batch, outs: list[Seq], chained: bool, t0: float, t_wait: float,
                  now: float) -> None:
        rows = sum(len(w.tokens) for w in batch.work)
        prompt = sum(len(w.tokens) for w in batch.work if w.prompt)
        self._step_log.write(json.dumps({
            "t_ms": round((t0 - self._t0) * 1e3, 3), "rows": rows, "prompt_rows": prompt, "outs": len(outs),
            "chained": chained, "in_flight": len(self._inflight) + 1, "dt_ms": round((now - t0) * 1e3, 3),
            "wait_ms": round((now - t_wait) * 1e3, 3)}) + "\n")

    def _guard(self, seq: Seq, fn, *args) -> None:
        """One request's sampling or detokenizing failed: fail it alone, the others run on."""
        try:
            fn(*args)
        except Exception:
            log.exception("request %d failed", seq.id)
            job = seq.data
            if not job.done:
                self._end(job, "error", "", error="internal error in this request (see the server log)")
            if any(w.seq is seq for st in self._inflight for w in st.batch.work):
                self._finish_after.append(seq)  # its row is on the device: free the slot once that step is in
            else:
                self.sched.finish(seq)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Tests: run steps on the calling thread until every request is done."""
        for _ in range(max_steps):
            if not self.run_once() and self.sched.idle and not self._inbox and not self._inflight:
                return
        raise RuntimeError("requests did not finish")

    def _drain_inbox(self) -> None:
        while True:
            with self._cv:
                if not self._inbox:
                    return
                kind, job = self._inbox.popleft()
            if kind == "submit":
                if job.req.max_tokens == 0:
                    self._end(job, "length", "")
                else:
                    self.sched.add(job.seq)
            elif not job.done:
                self.sched.cancel(job.seq)
                self._end(job, "cancelled", "")

    def _take(self, job: Job, r, readback: str, now: float, late: list) -> None:
        """Choose the token of a collected output row and append it to its
        sequence (the next step needs it); deliver it now if it may end the
        sequence, else queue it in `late`."""
        seq = job.seq
        if job.done:
            return
        ev = Event()
        if readback == "sample+logits":
            t, r = r
            if job.on_device:
                readback, r = "sample", t
        if readback in ("argmax", "sample"):
            tok = int(r)
        else:
            tok = job.sampler(r, seq.tokens) if job.req.sampling.needs_logits else int(np.argmax(r))
            if job.req.n_probs:
                ids, lp = top_logprobs(r, job.req.n_probs)
                ev.logprob, ev.top = float(lp[tok]), [(int(i), float(lp[i])) for i in ids]
        self.sched.append(seq, tok)
        if job.out.may_finish(tok) or len(seq.tokens) - 1 >= self.eng.n_ctx:
            self._deliver(job, tok, ev, now)
        else:
            late.append((job, tok, ev, now))

    def _deliver(self, job: Job, tok: int, ev: Event, now: float) -> None:
        """The token's text, finish and event (the token is already appended)."""
        seq = job.seq
        if job.done:
            return
        job.n_generated += 1
        if self.metrics:
            if job.t_first is None:
                self.metrics.ttft(now - job.t_submit)
            else:
                self.metrics.inter_token(now - job.t_last)
        job.t_first = job.t_first or now
        job.t_last = now
        text, finish = job.out.push(tok)
        if finish is None and len(seq.tokens) - 1 >= self.eng.n_ctx:
            text += job.out.truncated()
            finish = "length"
        ev.text, ev.token = text, tok
        if finish is not None:
            job.stop_type = ("limit" if finish == "length" else
                             "word" if job.out.stop_word is not None else "eos")
            self.sched.finish(seq)
            self._end(job, finish, text, ev)
        else:
            self._emit(job, ev)

    def _end(self, job: Job, finish: str, text: str, ev: Event | None = None, error: str | None = None) -> None:
        ev = ev or Event(text=text)
        ev.finish, ev.error = finish, error
        job.finish, job.done = finish, True
        with self._cv:
            self._active -= 1
        if self.metrics:
            self.metrics.finished(job, finish)
        self._emit(job, ev)

    def _emit(self, job: Job, ev: Event) -> None:
        try:
            job.emit(ev)
        except Exception:                          # the request's loop is gone: nobody is listening
            log.debug("dropped an event of a finished request", exc_info=True)

    def _cancel_all(self, why: str, finish: str = "cancelled") -> None:
        for seq in [*self.sched.waiting, *self.sched.live]:
            job = seq.data
            self.sched.finish(seq)
            if not job.done:
                self._end(job, finish, "", error=why)

    def memory(self) -> dict:
        """What the engine holds (for /metrics; a soak checks it returns to its idle level)."""
        dev = self.eng.device
        alloc = dev.allocated_bytes
        return {"device_bytes": alloc["device"], "host_bytes": alloc["host"], "buffers": dev.n_buffers,
                "pool_buffers": len(self.kv.pool), "pool_bytes": sum(b.nbytes for b in self.kv.pool),
                "parked_handles": len(self.kv.held), "programs": self.eng.n_programs,
                "parked_bytes": sum(h.buffer.nbytes for h in self.kv.held.values())}

    def _publish(self) -> None:
        snap = self.sched.snapshot()
        snap["active"] = self._active
        snap["memory"] = self.memory()
        self.snapshot = snap
        if self.metrics:
            self.metrics.state(snap, len(self._inbox))
