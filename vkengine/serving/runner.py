"""The runner: requests in, tokens out, over one engine. Its turn is
nano-vllm's schedule -> run -> postprocess, pipelined: collect the oldest step
on the device (choose and append its tokens), compose and submit the next step,
then do the collected step's host work (detokenizing, stop strings, events)
while the GPU runs. The server's worker thread (server/worker.py), generate()
and the parity harness all run requests through it.

Each request samples with its own Sampler (so draws never depend on what else
ran in the step), and its events reach it through its own `emit` callback.
Greedy decode steps (and sampled ones drawn on the device) are chained: the
next step is submitted before the previous one's tokens reach the host.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TextIO

import numpy as np

from ..engine import MAIN, Engine, Pass, Readback
from ..errors import VkEngineError
from ..kernels import Kernels
from .embed import Pool, check_normalize, normalize
from .output import OutputStream
from .sampling import Sampler, SamplingParams, top_order
from .scheduler import LIVE, Batch, Scheduler, SchedulerConfig, Seq

log = logging.getLogger("vkengine.runner")


@dataclass(frozen=True)
class GenRequest:
    prompt: Sequence[int]                 # token ids
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    n_probs: int = 0                      # top tokens (with log-probabilities) reported per token
    use_cache: bool = True                # reuse a cached prefix of the prompt
    suppress: frozenset[int] = frozenset()   # tokens never generated (a -inf logit bias, as llama.cpp's ignore_eos)
    logits: bool = False                  # each event carries the logits row its token was chosen from
    grammar: Any = None                   # constrain.Grammar: its tokens held to it (masked on the host)
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token, added to its logit; -inf: never), on the host
    embed: str | None = None              # an embedding (pooling: mean, cls, last) instead of tokens
    embd_normalize: int = 2               # its normalization (llama-server's embd_normalize)
    draft_max: int | None = None          # MTP drafts a step at most (0: none; None: the runner's mtp_draft)

    @property
    def host_logits(self) -> bool:
        """The host must see its logits rows whatever its sampling (to report,
        bias or return them; a grammar's mask applies on the device, see Job.masked)."""
        return self.n_probs > 0 or bool(self.suppress) or self.logits or bool(self.logit_bias)


@dataclass
class Event:
    text: str = ""
    token: int | None = None
    logprob: float | None = None          # of `token`, under the model's distribution (n_probs > 0)
    top: list[tuple[int, float]] | None = None   # (token, logprob) of the n_probs most likely
    finish: str | None = None             # stop | length | cancelled | error
    error: str | None = None
    logits: np.ndarray | None = None      # the row `token` was chosen from (GenRequest.logits)
    embedding: np.ndarray | None = None   # an embedding request's vector (with finish "stop")


@dataclass(eq=False)
class Job:
    """One request inside the runner."""
    req: GenRequest
    emit: Callable[[Event], object]
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
    on_device: bool = False               # its tokens are drawn on the device (Runner.make_job)
    failure: BaseException | None = None  # what failed it (finish "error"), for callers that re-raise
    constraint: Any = None                # constrain.Constraint of req.grammar
    pool: Pool | None = None              # an embedding request's pooled hidden states
    masked: bool = False                  # its grammar's mask applies on the device (Engine.submit masked)
    dead_end: bool = False                # its grammar allowed nothing for its row in flight
    spec: bool = False                    # decoded speculatively with the model's MTP block (speculate.py)
    drafts: list[int] = field(default_factory=list)   # the MTP block's drafts for its next positions
    mtp_at: int = -1                      # the position of drafts[0]
    drafted: int = 0                      # drafts verified so far
    accepted: int = 0                     # of which accepted
    all_accepted: bool = True             # its last verified drafts were all accepted (none verified yet: True)

    @property
    def needs_logits(self) -> bool:
        """Its rows read their logits back (the host samples, masks or reports them)."""
        r = self.req
        return self.pool is None and not self.on_device and (r.sampling.needs_logits or r.host_logits or
                                                              (self.constraint is not None and not self.masked))

    def sampling_row(self) -> tuple[float, int, float, float, float]:
        """Its output row's sampling params for Engine.submit(sampling=...): a
        draw on the device takes the next uniform of the request's generator
        (one a token, as Sampler's draw takes), so its tokens do not depend on
        the steps it shares; other rows are greedy there (their token is taken
        on the host when they need one)."""
        if not self.on_device:
            return (0.0, 1, 1.0, 0.0, 0.0)
        return self.req.sampling.device_row(self.sampler.uniform())


class InFlight(NamedTuple):
    """A step on the device, as the runner tracks it."""
    batch: Batch
    outs: list[Seq]               # the sequences of its output rows, in row order
    readback: Readback
    t_submit: float
    chained: bool                 # its tokens come from the step before it, on the device
    prompt: bool = False          # prompt rows only (Engine.tiled_prompts: decode rows ran apart)
    masked: bool = False          # its rows' tokens chosen under token masks (Engine.submit masked)


class RunnerMetrics(Protocol):
    """What the runner reports (the server's Prometheus metrics implement it)."""
    def step(self, rows: int, seconds: float) -> None: ...
    def ttft(self, seconds: float) -> None: ...
    def inter_token(self, seconds: float) -> None: ...
    def finished(self, job: Job, finish: str) -> None: ...
    def speculated(self, drafted: int, accepted: int) -> None: ...


class EngineKV:
    """The scheduler's KVMover over the engine's per-sequence state; the
    scheduler's slot i is the engine's slot slots[i]. Parked rows go to
    host-visible buffers that are pooled and reused."""

    def __init__(self, eng: Engine, slots: Sequence[int], keep: int = 8, extra: int = 0):
        """extra: KV rows parked beyond a sequence's length (1 with MTP drafts:
        the MTP block's row of the pending token, which it has already run)."""
        self.eng, self.slots, self.keep, self.extra = eng, list(slots), keep, extra
        self.pool: list = []
        self.held: dict[int, Any] = {}     # handles parked and not yet released, by id
        self.asked: dict[int, int] = {}    # the length each handle was parked for, by id

    def park(self, slot: int, length: int):
        rows = min(length + self.extra, self.eng.n_ctx)
        need = self.eng.kv.park_bytes(self.slots[slot], rows)
        fit = [b for b in self.pool if b.nbytes >= need]
        buf = min(fit, key=lambda b: b.nbytes) if fit else None
        if buf is not None:
            self.pool.remove(buf)
        handle = self.eng.kv.park(self.slots[slot], rows, into=buf)
        self.held[id(handle)] = handle
        self.asked[id(handle)] = length
        return handle

    def restore(self, handle, slot: int, length: int) -> None:
        """Rows [0, length) of a handle into a slot: all it holds when length is
        what it was parked for (a sequence resuming; its extra rows too)."""
        whole = length == self.asked.get(id(handle), handle.length)
        self.eng.kv.restore(handle, self.slots[slot], handle.length if whole else length)

    def reusable(self, source: tuple, length: int) -> int:
        """How many of the first `length` positions of a prefix source (("slot", i)
        or ("host", handle)) can be reused: all of them for a KV cache; for a
        recurrent state only `length` itself, and only where it covers exactly
        that many positions (it cannot be cut shorter)."""
        if source[0] == "slot":
            return self.eng.kv.reusable_prefix(self.slots[source[1]], length)
        return self.eng.kv.reusable_parked(source[1], length)

    def copy(self, src: int, dst: int, length: int) -> None:
        self.eng.kv.copy_prefix(self.slots[src], self.slots[dst], length)

    def release(self, handle) -> None:
        del self.held[id(handle)]
        self.asked.pop(id(handle), None)
        self.pool.append(handle.buffer)
        if len(self.pool) > self.keep:
            self.eng.kv.free(self.pool.pop(0))


def top_logprobs(row: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """log-softmax of a logits row: (ids of the n largest, all log-probabilities)."""
    x = row.astype(np.float64)
    lp = x - x.max()
    lp -= np.log(np.exp(lp).sum())
    return top_order(x, n) if n > 0 else np.zeros(0, np.int64), lp


class Runner:
    def __init__(self, engine: Engine, cfg: SchedulerConfig, metrics: RunnerMetrics | None = None,
                 step_log: TextIO | None = None, slots: Sequence[int] | None = None,
                 arrivals: Callable[[], bool] = lambda: False, mtp_draft: int = 0):
        """slots: the engine's slots the scheduler's cfg.n_slots map to (default
        0..n_slots-1). step_log: a JSON line per collected step (rows, prompt
        rows, outputs, chained, submit -> collected and the wait inside
        collect, in ms). arrivals(): whether requests are waiting to be added
        (a decode step is then not chained, so they join the next one).
        mtp_draft: greedy requests decode speculatively with the model's MTP
        block, up to this many drafts a step (vkengine.serving.speculate; the
        engine's state needs snapshot rows for them)."""
        spec = None
        if mtp_draft:
            from .speculate import Speculator
            spec = Speculator(engine, mtp_draft)
            # a verify step's rows are decode rows alone: prompt chunks run in steps of their own
            cfg = dataclasses.replace(cfg, prompt_apart=True)
        # where the engine pads prompt steps to its tiled matmuls, a step's
        # decode rows and prompt rows run as two engine steps (decode rows on
        # the matvecs, as alone: tokens independent of who else runs)
        if engine.tiled_prompts and not cfg.prompt_apart:
            cfg = dataclasses.replace(cfg, prompt_apart=True)
        if cfg.prompt_granule == 1 and engine.prompt_granule > 1:   # chunks of whole tiles (prompt_budget)
            cfg = dataclasses.replace(cfg, prompt_granule=engine.prompt_granule)
        self.eng, self.cfg, self.metrics, self.step_log = engine, cfg, metrics, step_log
        self.kv = EngineKV(engine, slots if slots is not None else range(cfg.n_slots), extra=1 if spec else 0)
        if len(self.kv.slots) != cfg.n_slots or not all(0 <= s < engine.n_slots for s in self.kv.slots):
            raise ValueError(f"the scheduler's {cfg.n_slots} slots need as many of the engine's "
                             f"0..{engine.n_slots - 1}")
        self.sched = Scheduler(cfg, self.kv)
        self._arrivals = arrivals
        self.inflight: deque[InFlight] = deque()   # steps on the device, oldest first
        self.chain = engine.can_chain        # chain decode steps (see collect)
        # a lone prompt's next chunk submitted before this one is collected (see collect): where the engine
        # overlaps steps (a split model: its first part runs the next chunk while its last runs this one)
        self.ahead = getattr(engine, "overlaps_steps", False) and spec is None
        # steps on the device at once: the running one and the chained ones queued behind it
        self.depth = engine.max_in_flight if self.chain or self.ahead else 1
        self.chained_steps = 0
        self.ahead_steps = 0
        self.device_sampling = engine.can_sample   # sampled replies drawn on the device
        self._late: list[tuple[Job, int, Event, float]] = []   # tokens collected, their host work pending
        self._finish_after: list[Seq] = []    # failed while their row was on the device
        self._t0 = time.perf_counter()
        self._last_collect = 0.0
        self._mask_pending = False    # the newest step in flight is masked and waits for its masks
        self.spec = spec
        self.held: Batch | None = None   # a batch composed ahead (by the speculator), run by the next turn
        if spec is not None:
            spec.bind(self)

    @property
    def prompt_apart(self) -> bool:
        """Whether a step's decode rows and prompt rows run as two engine steps."""
        return self.cfg.prompt_apart

    @property
    def idle(self) -> bool:
        return self.sched.idle and not self.inflight and self.held is None and \
            (self.spec is None or self.spec.ahead is None)

    # -- requests -----------------------------------------------------------------
    def make_job(self, req: GenRequest, emit: Callable[[Event], object]) -> Job:
        """A checked request, ready for add() (on any thread: it touches no runner state)."""
        prompt = [int(t) for t in req.prompt]
        if not prompt:
            raise VkEngineError("the prompt is empty")
        if len(prompt) >= self.eng.n_ctx:
            raise VkEngineError(f"the prompt has {len(prompt)} tokens; the context length is {self.eng.n_ctx} "
                                "(use a shorter prompt or a larger --ctx)")
        if any(not 0 <= t < self.eng.n_vocab for t in req.suppress):
            raise VkEngineError(f"suppressed token ids must be in 0..{self.eng.n_vocab - 1}")
        if any(not 0 <= t < self.eng.n_vocab for t, _ in req.logit_bias):
            raise VkEngineError(f"'logit_bias' token ids must be in 0..{self.eng.n_vocab - 1}")
        if req.embed is not None:
            if self.eng.hidden_host is None:
                raise VkEngineError("this server does not compute embeddings: start it with --embeddings")
            check_normalize(req.embd_normalize)
        out = OutputStream(self.eng.model.tokenizer, req.max_tokens, req.stop, req.ignore_eos)
        # (an embedding runs every prompt position: a cached prefix has no hidden states to pool)
        job = Job(req, emit, Seq(prompt, use_cache=req.use_cache and req.embed is None), Sampler(req.sampling), out)
        if req.embed is not None:
            job.pool = Pool(req.embed, len(prompt))
        if req.grammar is not None:
            from .constrain import Constraint
            job.constraint = Constraint(self.eng.model.tokenizer, req.grammar)
        # drawn on the device, where steps chain (not where the host must see the logits)
        job.on_device = (self.device_sampling and req.sampling.drawn_on_device(Kernels.SAMPLE_K)
                         and not req.host_logits)
        # a grammar's mask on the device where its token is chosen there (greedy, or drawn on the device)
        job.masked = job.constraint is not None and not req.host_logits and \
            (job.on_device or not req.sampling.needs_logits)
        job.spec = (self.spec is not None and not req.sampling.needs_logits and not req.host_logits
                    and job.constraint is None and job.pool is None and req.draft_max != 0)
        job.seq.data = job
        return job

    def add(self, job: Job) -> None:
        if job.req.max_tokens == 0 and job.pool is None:
            self._end(job, "length", "")
        else:
            self.sched.add(job.seq)

    def cancel(self, job: Job) -> None:
        """The request leaves at the next step (its slot is freed then)."""
        if not job.done:
            self.sched.cancel(job.seq)
            self._end(job, "cancelled", "")

    def cancel_all(self, why: str, finish: str = "cancelled") -> None:
        for seq in [*self.sched.waiting, *self.sched.live]:
            job = seq.data
            self.sched.finish(seq)
            if not job.done:
                self._end(job, finish, "", error=why)

    # -- the turn -------------------------------------------------------------------
    def step(self) -> bool:
        """One turn (collect, submit_next, deliver); False when there was nothing to run."""
        ran = self.collect()
        submitted = self.submit_next()
        self.deliver()
        return ran or submitted

    def collect(self) -> bool:
        """Chain steps behind the newest one where it may, then collect the oldest
        step on the device: its tokens are chosen and appended at once (those
        that may end a sequence delivered at once, the others queued for
        deliver()). False when nothing was on the device.

        Chaining: when the newest step on the device is a decode step of
        running sequences whose tokens are chosen on the device and nobody
        waits to be admitted, the step after it is submitted before the oldest
        is collected, reading its tokens from the device, so the GPU goes from
        step to step without waiting for the host; up to the engine's
        max_in_flight steps (a server's engine: 3, so a host that is late by up
        to a step costs the GPU nothing). A sequence whose token turns out to
        end it had a row in each chained step: the rows are computed, their
        tokens dropped; its slot keeps the tokens it has (Scheduler.finish)."""
        if not self.inflight:
            return False
        while len(self.inflight) < self.depth and (self._chain() or self._prompt_ahead()):
            pass
        self._collect_oldest()
        return True

    def submit_next(self) -> bool:
        """Compose and submit the next step, only with nothing on the device: a
        step composed beside one in flight could not hold that step's
        sequences (their tokens are not back yet), so the live sequences
        would split into groups taking turns in steps of fewer rows, each
        costing nearly a full step (bench/serve_sim.py). Running streams keep
        the device busy through chained steps."""
        if self.inflight:
            return False
        if self.spec is not None and self.spec.ahead is not None:
            self.spec.resume()       # (its verify step, submitted behind the turn before's MTP steps)
            return True
        batch, self.held = self.held, None
        if batch is not None and any(w.seq.state != LIVE or w.seq.slot is None for w in batch.work):
            self._unhold(batch)    # (a sequence ended since it was composed: cancel_all, a failure)
            batch = None
        if batch is None:
            batch = self.sched.schedule()
        if batch is None:
            return False
        if self.spec is not None and self.spec.wants(batch):
            # (synchronous, but for the next verify step where it may follow at once: Speculator._verify)
            self.spec.turn(batch)
            return True
        if self.spec is not None:   # (its MTP steps off the device first: collect takes the oldest step as ours)
            self.spec.drain()
        if self.prompt_apart:
            for part, prompt in zip(batch.split(), (False, True)):
                if part is not None:
                    self._submit(part, prompt)
        else:
            self._submit(batch, batch.has_prompt)
        return True

    @staticmethod
    def _unhold(batch: Batch) -> None:
        """A batch composed and never run: its rows are no longer in flight."""
        for w in batch.work:
            w.seq.inflight -= len(w.tokens)

    def deliver(self) -> None:
        """The host work of the tokens collected: text, stop rules, events."""
        late, self._late = self._late, []
        for job, tok, ev, now in late:
            self._guard(job.seq, self._deliver, job, tok, ev, now)

    def settle(self) -> None:
        """Let the steps still on the device finish and drop their results (every
        sequence is cancelled next, or the caller is done with the runner)."""
        self._finish_after.clear()
        if self.spec is not None:
            self.spec.settle()
        if self.held is not None:   # (composed, never run)
            self._unhold(self.held)
            self.held = None
        if self._mask_pending:       # (its tokens are dropped: any masks will do)
            self.eng.submit_masks(np.full((len(self.inflight[-1].outs), self.eng.layout.mask_words), -1, np.int32))
            self._mask_pending = False
        while self.inflight:
            batch = self.inflight.popleft().batch
            try:
                self.eng.collect()
            except Exception:
                log.exception("engine step failed")
            self.sched.postprocess(batch)

    # -- steps ------------------------------------------------------------------------
    def _submit(self, batch: Batch, prompt: bool, pass_: Pass = MAIN) -> None:
        """Submit a composed step (or one of its two parts: Batch.split); pass_:
        the forward it runs (a speculating sequence's prompt keeps its rows'
        hidden states for the MTP block)."""
        outs = batch.out_seqs
        readback, sampling, masked = self._step_readback(outs)
        if any(w.seq.data.pool is not None for w in batch.work):
            readback |= Readback.HIDDEN   # an embedding's rows: every row's hidden state comes back
        alone = Readback.LOGITS | Readback.HIDDEN
        if self.inflight and (readback & alone or self.inflight[-1].readback & alone):
            self._collect_oldest()     # a step that reads logits or hidden states back runs alone (the other part)
        self.eng.submit(batch.tokens, batch.positions, self._slots(batch), batch.out_rows, readback,
                        sampling=sampling, prompt=prompt, masked=masked, masks=self._masks(outs) if masked else None,
                        pass_=pass_)
        self.inflight.append(InFlight(batch, outs, readback, time.perf_counter(), False, prompt, masked))

    @classmethod
    def _step_readback(cls, outs: list[Seq]) -> tuple[Readback, list | None, bool]:
        """A step's readback for the sequences of its output rows (a sequence once
        per row), its sampling rows, and whether grammars' masks apply on the
        device: tokens chosen or drawn on the device (_readback), and the logits
        too where a row's request needs them, the host then choosing every token
        but those drawn on the device."""
        readback, sampling = cls._readback(outs)
        if any(s.data.needs_logits for s in outs):
            readback |= Readback.LOGITS
            if readback & Readback.ARGMAX:   # the host chooses every token of a step that reads logits
                readback = Readback.LOGITS
        # grammars' masks on the device: every row's token is known here, so are its masks
        masked = bool(readback.tokens and not readback & Readback.LOGITS and any(s.data.masked for s in outs))
        return readback, sampling, masked

    def _masks(self, outs: list[Seq]) -> np.ndarray:
        """The token masks of a masked step's output rows, from each grammar's
        state after its tokens so far (rows without one, or whose request has
        ended: all ones). A grammar that allows nothing marks its request's
        dead end (Job.dead_end), which ends it when the row is collected."""
        m = np.full((len(outs), self.eng.layout.mask_words), 0xFFFFFFFF, np.uint32)
        for row, seq in zip(m, outs):
            job = seq.data
            if job.masked and not job.done and not job.dead_end and job.constraint is not None:
                if not self._guard_value(seq, job.constraint.mask_into, row):
                    job.dead_end = True
                    row[:] = 0xFFFFFFFF
        return m

    def _guard_value(self, seq: Seq, fn, *args) -> bool:
        """_guard for a call whose value counts (False when it failed)."""
        box: list = []
        self._guard(seq, lambda: box.append(fn(*args)))
        return bool(box and box[0])

    def _slots(self, batch: Batch) -> list[int]:
        return [self.kv.slots[s] for s in batch.slots]

    @staticmethod
    def _readback(outs: list[Seq]) -> tuple[Readback, list | None]:
        """A step's readback as far as its rows' tokens go (SAMPLE when one is
        drawn on the device, else ARGMAX) and its sampling rows."""
        if any(s.data.on_device for s in outs):
            return Readback.SAMPLE, [s.data.sampling_row() for s in outs]
        return Readback.ARGMAX, None

    def _chain(self) -> bool:
        """Submit the decode step that follows the newest one in flight, if it
        may (collect); whether it did."""
        batch, outs, readback, _, _, prompt, _ = self.inflight[-1]
        if not self.chain or prompt or self._mask_pending or readback not in (Readback.ARGMAX, Readback.SAMPLE) or \
                self._arrivals() or \
                (self.sched.waiting and len(self.sched.live) < self.cfg.max_live):
            return False

        def done(seq: Seq) -> bool:       # the newest token in flight is certainly its last
            job = seq.data
            ahead = sum(1 for st in self.inflight for s in st.outs if s is seq)   # its tokens in flight
            made = len(seq.tokens) - seq.n_prompt + ahead
            return job.done or made >= job.req.max_tokens or len(seq.tokens) + ahead - 1 >= self.eng.n_ctx
        nxt = self.sched.chain(batch, done)
        if nxt is None:
            return False
        index = {id(s): j for j, s in enumerate(outs)}
        chain = [index[id(w.seq)] for w in nxt.work]
        n = len(nxt.work)
        readback, sampling = self._readback(nxt.out_seqs)
        # a grammar's mask follows its token in flight: given once the step before is collected
        masked = any(s.data.masked for s in nxt.out_seqs)
        self.eng.submit([0] * n, nxt.positions, self._slots(nxt), list(range(n)), readback, chain=chain,
                        sampling=sampling, masked=masked)
        self._mask_pending = masked
        self.inflight.append(InFlight(nxt, nxt.out_seqs, readback, time.perf_counter(), True, False, masked))
        self.chained_steps += 1
        return True

    def _prompt_ahead(self) -> bool:
        """Submit the next chunks of the prompts of the newest step in flight
        when that step outputs nothing, every live sequence is in it and the
        engine overlaps steps (Scheduler.prompt_ahead); whether it did. Not
        while a newcomer waits for a place (it is admitted once the device is
        free), nor beside running streams (their next decode step would wait
        behind the chunks)."""
        batch = self.inflight[-1].batch
        if not self.ahead or self._mask_pending or self._arrivals() or \
                (self.sched.waiting and len(self.sched.live) < self.cfg.max_live):
            return False
        mine = {id(w.seq) for w in batch.work}
        if any(id(s) not in mine for s in self.sched.live):
            return False
        nxt = self.sched.prompt_ahead(batch)
        if nxt is None:
            return False
        self._submit(nxt, True)
        self.ahead_steps += 1
        return True

    def _collect_oldest(self) -> None:
        """Wait for the oldest step on the device, account for its rows, and
        choose and append its tokens."""
        batch, outs, readback, t0, chained, prompt, _ = self.inflight.popleft()
        t_wait = time.perf_counter()
        res = self.eng.collect()
        now = time.perf_counter()
        if prompt:   # its device time: from its submit or the step before it, whichever ended later, over the
            # rows its matmuls ran (padded: a GPU runs a prompt step of 28 rows as one of the tiled matmuls'
            # 256; counting 28 made a row look 10x dearer, so the newcomers' chunks beside streams started at
            # 64 rows and took ~25 steps to grow to what prompt_ms fits: notes.md runs 36, 37)
            rows = sum(len(w.tokens) for w in batch.work if w.prompt)
            self.sched.observe_prompt(self.eng.prompt_cost_rows(rows), now - max(t0, self._last_collect))
        self._last_collect = now
        if self.step_log is not None:
            self._log_step(batch, outs, chained, t0, t_wait, now)
        if self.metrics:
            self.metrics.step(sum(len(w.tokens) for w in batch.work), now - t0)
        self.sched.postprocess(batch)
        for seq in self._finish_after:
            if not any(w.seq is seq for st in self.inflight for w in st.batch.work):
                self.sched.finish(seq)
        self._finish_after = [q for q in self._finish_after if q.state != "finished"]
        if readback & Readback.HIDDEN:   # the embeddings' rows, pooled as they come
            res, hid = res
            readback &= ~Readback.HIDDEN
            row = 0
            for w in batch.work:
                job = w.seq.data
                if job.pool is not None and not job.done:
                    self._guard(w.seq, job.pool.add, w.start, hid[row:row + len(w.tokens)])
                row += len(w.tokens)
        if readback == Readback.SAMPLE | Readback.LOGITS:      # (tokens, logits): a pair a row
            res = list(zip(*res))
        for seq, r in zip(outs, res if res is not None else ()):
            self._guard(seq, self._take, seq.data, r, readback, now)
        if self._mask_pending:   # the chained step behind it: its rows' grammars have taken their tokens now
            self.eng.submit_masks(self._masks(self.inflight[-1].outs))
            self._mask_pending = False
        if self.inflight and self.inflight[0].chained:    # the chained step now knows its tokens
            for w in self.inflight[0].batch.work:
                if w.tokens == [None] and len(w.seq.tokens) > w.start:
                    w.tokens = [w.seq.tokens[w.start]]

    def _log_step(self, batch: Batch, outs: list[Seq], chained: bool, t0: float, t_wait: float,
                  now: float) -> None:
        assert self.step_log is not None
        rows = sum(len(w.tokens) for w in batch.work)
        prompt = sum(len(w.tokens) for w in batch.work if w.prompt)
        self.step_log.write(json.dumps({
            "t_ms": round((t0 - self._t0) * 1e3, 3), "rows": rows, "prompt_rows": prompt, "outs": len(outs),
            "chained": chained, "in_flight": len(self.inflight) + 1, "dt_ms": round((now - t0) * 1e3, 3),
            "wait_ms": round((now - t_wait) * 1e3, 3)}) + "\n")

    # -- tokens and events --------------------------------------------------------------
    def _guard(self, seq: Seq, fn, *args) -> None:
        """One request's sampling or detokenizing failed: fail it alone, the others run on."""
        try:
            fn(*args)
        except Exception as e:
            log.exception("request %d failed", seq.id)
            job = seq.data
            job.failure = e
            if not job.done:
                self._end(job, "error", "", error="internal error in this request (see the server log)")
            if any(w.seq is seq for st in self.inflight for w in st.batch.work):
                self._finish_after.append(seq)  # its row is on the device: free the slot once that step is in
            else:
                self.sched.finish(seq)

    def _take(self, job: Job, r, readback: Readback, now: float) -> None:
        """Choose the token of a collected output row and append it to its
        sequence (the next step needs it); deliver it now if it may end the
        sequence, else queue it for deliver()."""
        seq = job.seq
        if job.done:
            return
        if job.pool is not None:   # an embedding: its prompt has run
            vec = normalize(job.pool.vector(), job.req.embd_normalize)
            self.sched.finish(seq)
            self._end(job, "stop", "", Event(embedding=vec))
            return
        ev = Event()
        if readback == Readback.SAMPLE | Readback.LOGITS:   # this row's token, or its logits
            t, lg = r
            # (a masked row in a step that reads logits: its mask applies on the host, and the host draws)
            readback, r = (Readback.SAMPLE, t) if job.on_device and not job.masked else (Readback.LOGITS, lg)
        if readback.tokens:
            tok = int(r)
            if job.dead_end:    # its grammar allowed nothing: the row's token is not one
                self.sched.finish(seq)
                self._end(job, "stop", "")
                return
            if job.constraint is not None and not job.constraint.take(tok):
                self.sched.finish(seq)
                self._end(job, "error", "", error=f"the grammar of '{job.constraint.source}' refused token {tok}")
                return
        else:
            req = job.req
            if req.logits:
                ev.logits = r
            if req.logit_bias:
                r = r.copy()
                for t, b in req.logit_bias:
                    r[t] += b
            if job.constraint is not None:
                r = job.constraint.apply(r)
            if req.suppress:
                r = r.copy()
                r[list(req.suppress)] = -np.inf
            if (req.logit_bias or req.suppress or job.constraint is not None) and not np.isfinite(r).any():
                # every token banned or outside the grammar (with ignore_eos: all but an end): nothing may follow
                self.sched.finish(seq)
                self._end(job, "stop", "")
                return
            tok = job.sampler(r, seq.tokens) if req.sampling.needs_logits else int(np.argmax(r))
            if job.constraint is not None and not job.constraint.take(tok):
                self.sched.finish(seq)
                self._end(job, "error", "", error=f"the grammar of '{job.constraint.source}' refused token {tok}")
                return
            if req.n_probs:
                ids, lp = top_logprobs(r, req.n_probs)
                ev.logprob, ev.top = float(lp[tok]), [(int(i), float(lp[i])) for i in ids]
        self.sched.append(seq, tok)
        if job.out.may_finish(tok) or len(seq.tokens) - 1 >= self.eng.n_ctx or \
                (job.constraint is not None and job.constraint.stopped):
            self._deliver(job, tok, ev, now)
        else:
            self._late.append((job, tok, ev, now))

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
                self.metrics.inter_token(now - (job.t_last or now))
        job.t_first = job.t_first or now
        job.t_last = now
        text, finish = job.out.push(tok)
        if finish is None and job.constraint is not None and job.constraint.stopped:
            finish = "stop"                  # the grammar is complete: nothing may follow
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
        if self.metrics:
            self.metrics.finished(job, finish)
        self._emit(job, ev)

    @staticmethod
    def _emit(job: Job, ev: Event) -> None:
        try:
            job.emit(ev)
        except Exception:                          # the request's loop is gone: nobody is listening
            log.debug("dropped an event of a finished request", exc_info=True)

    # -- introspection ---------------------------------------------------------------------
    def memory(self) -> dict:
        """What the engine holds (for /metrics; a soak checks it returns to its idle level)."""
        devs = getattr(self.eng, "devices", [self.eng.device])   # (a split model: every part's device)
        alloc = [d.allocated_bytes for d in devs]
        return {"device_bytes": sum(a["device"] for a in alloc), "host_bytes": sum(a["host"] for a in alloc),
                "buffers": sum(d.n_buffers for d in devs),
                "pool_buffers": len(self.kv.pool), "pool_bytes": sum(b.nbytes for b in self.kv.pool),
                "parked_handles": len(self.kv.held), "programs": self.eng.n_programs,
                "programs_deferred": len(self.eng.deferred), "programs_evicted": self.eng.programs_evicted,
                "parked_bytes": sum(h.buffer.nbytes for h in self.kv.held.values()),
                "pipelines_compiling": sum(len(d.slow) for d in devs)}
