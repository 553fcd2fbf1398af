"""Speculative decoding inside the runner (the server's, generate()'s: the CLI's
`generate --mtp`) with the model's own multi-token-prediction block (Qwen3.5's
`nextn.*` tensors; the pairing of rows follows llama.cpp's
common/speculative.cpp: the MTP block at position p takes token p and the main
model's final-normed hidden state of p - 1, zeros at position 0). Greedy
requests speculate (`Job.spec`); the others decode as usual, in the same
steps. Output: exactly the plain greedy tokens, because the main model
verifies every draft and a row of a step is computed as it would be alone
(rows below Kernels.step_thresholds; tests/test_speculate.py checks it
against runs without drafts, interleaved, in batch and slices modes).

A runner turn whose batch holds a speculating sequence with prompt rows or
room for drafts (Runner.submit_next, Speculator.wants) runs here:

1. The decode rows: one verify step holds, per speculating sequence, its
   pending token t_p and its drafts d_1..d_k (positions p..p+k), and one row per
   other sequence; every row's token comes back, each row's final-normed
   hidden state stays in `hn`, and the recurrent state after each row in
   snapshot rows (vkengine/state.py). Drafts are accepted while d_{i+1} equals
   the greedy token of row i; a sequence that rejected some has its recurrent
   state rolled back to the snapshot of its last accepted row (one program for
   all, not waited for: what follows queues behind it). The accepted tokens
   then go through the runner's _take one by one (stop strings, EOS,
   max_tokens end a reply mid-way as without drafts).
2. The MTP block catches up, for all those sequences in one step, on the
   positions accepted (row q: token q and the hidden state of q - 1); its last
   row drafts the next position, and further drafts chain the block on its own
   hidden state, one step for all sequences per draft. Each of these steps
   also leaves its drafts in the device's draft words (Pass.drafts_at), and
   where the next turn is again a verify step of decode rows alone (nobody
   waiting to join, no prompt rows, no logits read back), it is composed and
   submitted at once behind them, its draft rows' tokens read there
   (Engine.submit's draft_rows; Speculator.ahead): the device goes from the
   drafts to the next verify step without the host's round trip, and the
   runner's next turn collects it (resume). The host gets the same drafts from
   the MTP steps' readback, so it accepts against what the device ran.
3. The prompt rows: a step of their own (the runner's prompt_apart) keeping
   every row's hidden state, then the MTP block over the same positions, so
   that its KV rows follow the prompt; a prompt that is done gets drafts as in 2.

What a verify step may hold: its rows must stay below the row counts where
the kernels change and within the state's snapshot rows and the engine's
output rows (`Speculator.rows`; `verify_rows` sizes a server's engine for its
slots). When the step's decode rows leave no room, drafts are cut, the most
first, down to none; a sequence with no room for drafts skips the MTP block
that round (its later drafts are then worse, never its output), and a step
with no room for any runs as the runner's own (chained, as without --mtp).

Drafts are host data on the Job, so a parked sequence keeps them, and the
runner parks one KV row more (EngineKV.extra: the MTP block's row of the
pending token). The MTP block's rows for a prefix reused from the cache are
those of the sequence that left it (stale if it did not speculate): drafts
can be worse there too, the output not.
"""
from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..device import Program
from ..engine import _DRAFTS, MAIN, Engine, Pass, Readback
from ..errors import VkEngineError
from ..kernels import Caps, Kernels
from ..model import Model
from .scheduler import Batch, Work

if TYPE_CHECKING:
    from .runner import Job, Runner


def check_mtp(model: Model, draft: int) -> None:
    """The flags' errors of drafting `draft` tokens with the model's MTP block
    (--mtp --draft), before its weights load."""
    if draft < 1:
        raise VkEngineError("--draft must be >= 1")
    if not model.args.n_nextn:
        raise VkEngineError(f"{model.name} has no MTP block (nextn tensors) to draft with: drop --mtp")


def verify_rows(caps: Caps, n_slots: int, draft: int) -> int:
    """Rows a server's verify step should hold (its state's snapshot rows and
    its engine's output rows): every slot's pending token and `draft` drafts,
    below the row counts where the kernels change (at most the tiled matmuls'
    threshold and attention on cooperative matrices' less one)."""
    bound = min(Kernels.thresholds_of(caps, None), default=1 << 30) - 1
    return max(1, min(n_slots * (draft + 1), bound))


def block_ahead_on(engine: Engine) -> bool:
    """Whether speculative turns on this engine submit the MTP block behind the
    verify step ahead (Options.mtp_block_ahead; Speculator._submit_block_ahead):
    where steps chain on the device."""
    return bool(engine.cfg.options.mtp_block_ahead and getattr(engine, "device_chains", False))


def spec_drafts_on(engine: Engine) -> bool:
    """Whether the block ahead is followed by the chained drafts of its all-accepted
    rows (Options.mtp_spec_drafts; Speculator._submit_spec_drafts)."""
    return block_ahead_on(engine) and bool(engine.cfg.options.mtp_spec_drafts)


def mtp_ring_depth(engine: Engine, draft: int) -> int:
    """The MTP steps a turn keeps in flight (Engine.reserve_mtp): the block and
    draft - 1 chained drafts, and with the block ahead the next block too (and
    with the drafts after it, those draft - 1 steps more)."""
    if not block_ahead_on(engine):
        return draft
    return 2 * draft if spec_drafts_on(engine) else draft + 1


def turn_keys(engine: Engine, draft: int) -> list[tuple]:
    """The programs (Engine._program's arguments) of a lone greedy sequence's
    speculative turns with `draft` drafts, on an engine whose MTP steps have a
    ring of their own (Engine.reserve_mtp; none otherwise): its verify step of
    the pending token and the drafts on each main params buffer, reading the
    drafts from the host (a first turn) or on the device (a turn behind the MTP
    steps, Speculator.ahead); the MTP block over the 1..draft+1 positions a turn
    may accept, on the ring's first buffer, and its chained drafts on the next
    ones (where a turn of `draft` MTP steps puts them). With the block ahead
    (block_ahead_on), the turns after the first also: the block over all k + 1
    rows behind each verify step, its drafts in the top draft words, the first
    chained draft from the row each acceptance count leaves, the next ones, and
    the verify steps reading them, on every buffer of the ring (the block keeps
    steps in flight, so the ring does not restart a turn). What other shapes
    meet (several sequences, a reply's last turns) is recorded when first run."""
    e = engine
    if not getattr(e, "mtp_depth", 0) or e.mtp_depth < mtp_ring_depth(e, draft) or not e.args.last_part:
        return []
    A, k = Readback.ARGMAX, draft
    verify = Pass(hidden_rows=True, snapshots=True)
    keys: list[tuple] = []
    for buf in range(e.n_main):
        keys.append((k + 1, k + 1, A, buf, (-1, *range(_DRAFTS, _DRAFTS + k)), verify))
        keys.append((k + 1, k + 1, A, buf, (), verify))
    for n in range(k + 1, 0, -1):
        keys.append((n, 1, A, e.n_main, (), Pass(mtp=True, hidden="hn", drafts_at=0)))
    for d in range(1, k):
        keys.append((1, 1, A, e.n_main + d, (0,), Pass(mtp=True, hidden="mtp_hn", drafts_at=d)))
    if block_ahead_on(e):
        at = e.layout.draft_words - (k + 1)     # (Speculator._submit_block_ahead's words for a lone sequence)
        ring = range(e.n_main, e.n_main + e.mtp_depth)
        for a in range(k + 1):   # (the drafts the turn before accepted)
            for buf in range(e.n_main):
                keys.append((k + 1, k + 1, A, buf, (-1, _DRAFTS + at + a, *range(_DRAFTS, _DRAFTS + k - 1)), verify))
            for buf in ring:
                keys.append((1, 1, A, buf, (a,), Pass(mtp=True, hidden="mtp_hn", drafts_at=0)))
        for buf in ring:
            keys.append((k + 1, k + 1, A, buf, tuple(range(k + 1)), Pass(mtp=True, hidden="hn", drafts_at=at)))
            for d in range(1, k - 1):
                keys.append((1, 1, A, buf, (0,), Pass(mtp=True, hidden="mtp_hn", drafts_at=d)))
        if spec_drafts_on(e) and k > 1:   # (the drafts of the all-accepted row behind the block, and the
            low = at - (k - 1)            # verify steps reading them: _submit_spec_drafts' words)
            for buf in range(e.n_main):
                keys.append((k + 1, k + 1, A, buf, (-1, _DRAFTS + at + k, *range(_DRAFTS + low, _DRAFTS + low + k - 1)),
                             verify))
            for buf in ring:
                for d in range(1, k):
                    keys.append((1, 1, A, buf, (k,) if d == 1 else (0,),
                                 Pass(mtp=True, hidden="mtp_hn", drafts_at=low + d - 1)))
    return keys


def prepare_turns(engine: Engine, draft: int, defer: bool = False) -> int:
    """Record turn_keys' programs now (`vkengine generate --mtp`: its decode
    rate then holds no recordings, ~10-50 ms each on a large model), or, with
    defer, leave them to the server's engine thread for its idle time
    (Engine.deferred, after prepare_decode's). Reserves the MTP steps' ring
    first (Engine.reserve_mtp). Returns how many were not recorded yet."""
    engine.reserve_mtp(mtp_ring_depth(engine, draft))
    todo = [k for k in turn_keys(engine, draft) if k not in engine._programs]
    if defer:
        engine.deferred.extend(todo)
    else:
        for k in todo:
            engine._program(*k).prepare()
    return len(todo)


@dataclass
class _BlockAhead:
    """An MTP block submitted behind a verify step ahead (Speculator._submit_block_ahead)."""
    verify: _Verify
    segs: list[tuple]      # (job, its first row in the block, its verify row's position) a sequence
    rows: int
    at: int                # the draft word of the block's first row
    t0: float


@dataclass
class _SpecDrafts:
    """The chained drafts submitted behind a block ahead, from each sequence's
    row as if its verify step accepted every draft (Speculator._submit_spec_drafts):
    for each job its drafting row of the block, its words (the block's first, then
    one a step), and each step's (jobs, rows) in submit order."""
    block: _BlockAhead
    rows: dict[int, int]          # id(job) -> its all-accepted row of the block
    words: dict[int, list[int]]   # id(job) -> the draft words of its drafts
    steps: list[tuple[list, int, float]]
    low: int                      # the lowest draft word they take


@dataclass
class _Verify:
    """A verify step on the device: its decode rows, each work's (work, first
    row, drafts verified, speculates), its rows, readback and submit time."""
    dec: Batch
    plan: list[tuple[Work, int, int, bool]]
    rows: int
    readback: Readback
    t0: float


@dataclass
class _Segment:
    """A sequence's rows of an MTP block step: tokens at positions start..,
    row r reading the hidden state hmap[r] (of `hn` or `mtp_hn`)."""
    job: Job
    start: int
    tokens: list[int]
    hmap: list[int]
    draft: bool            # its last row drafts the position after it
    zero_first: bool = False   # position 0: its hidden state is zeros (no previous position)


class Speculator:
    """One runner's speculative turns (the module's docstring), up to `draft`
    drafts a sequence and step, over its engine's MTP block."""

    def __init__(self, engine: Engine, draft: int):
        e = engine
        check_mtp(e.model, draft)
        if not e.arch.has_mtp(e.args, e.weights):
            raise VkEngineError(f"{e.model.name}: its MTP block's weights did not load")
        if not hasattr(e.kv, "commit_snapshots"):   # (a HybridState, or a split model's parts of them)
            raise VkEngineError(f"{e.model.name}: speculative decoding here rolls back a hybrid model's state")
        self.e, self.k, self.state = e, draft, e.kv
        # the MTP block submitted behind a verify step ahead (Options.mtp_block_ahead; _submit_block_ahead)
        self.block_ahead_on = block_ahead_on(e)
        # a turn's MTP steps (the block and draft - 1 chained drafts) in flight at once, the next verify
        # step behind them (_verify), and with block_ahead_on the next block behind that
        e.reserve_mtp(mtp_ring_depth(e, draft))
        self.rows = min(e.kv.snap_rows, e.max_out, e.exact_rows)
        if self.rows < 2:
            raise VkEngineError("the engine's state keeps no snapshot rows for verify steps: build it from model "
                                "args with mtp_snap_rows (verify_rows) and max_out at least that")
        z = e.scratch.region("mtp_zero")     # the zero hidden state of position 0
        e.device.upload(z.buf, np.zeros(e.scratch.widths["mtp_zero"], np.float32), z.off * 4)
        self.steps = 0                     # verify steps run
        self.mtp_steps = 0                 # MTP block steps run
        self.chained = 0                   # verify steps submitted behind the MTP steps (drafts on the device)
        self.blocks_ahead = 0              # MTP blocks run behind a verify step ahead and drafted from
        self.ahead: _Verify | None = None  # the verify step submitted ahead, which the next turn collects
        # where this turn's MTP steps leave each drafting job's drafts on the device (Pass.drafts_at), and
        # the device's draft words they have taken
        self._src: dict[int, list[int]] = {}
        self._draft_words = 0
        self._rollback: Program | None = None   # a rollback submitted, not yet waited for (_drain)
        # MTP block steps in flight: (the jobs their output rows draft for, rows, submitted at, and which
        # output row drafts for each job where not the i-th: a block submitted ahead's)
        self._pending: deque[tuple[Sequence[Job | None], int, float, list[int] | None]] = deque()
        self._block_ahead: _BlockAhead | None = None   # the MTP block behind the verify step ahead
        self.spec_on = spec_drafts_on(e)
        self._spec: _SpecDrafts | None = None           # the drafts behind that block (mtp_spec_drafts)
        self.spec_used = 0                 # sequences' turns that took those drafts
        self.spec_turns = 0                # turns whose spec drafts went behind the block
        self.full_turns = 0                # verified turns in which every speculating sequence took all its drafts
        self._words_cap: int | None = None   # (_words: the spec steps' words are above it)

    def bind(self, runner: Runner) -> None:
        self.r = runner

    # -- a turn -------------------------------------------------------------------------
    def wants(self, batch: Batch) -> bool:
        """Whether the batch needs a speculative turn: a speculating sequence's
        prompt rows (the MTP block follows them), or room for drafts beside its
        decode rows. Otherwise (more sequences decode than leave room for any
        draft) the runner's own turn runs it, chained steps and all, and those
        sequences' drafts resume, from stale MTP rows, when room returns."""
        dec, pro = batch.split()
        if pro is not None and any(w.seq.data.spec for w in pro.work):
            return True
        return dec is not None and any(self._room(dec.work))

    def turn(self, batch: Batch) -> None:
        dec, pro = batch.split()
        self._drain()
        if dec is not None:
            v = self._submit_verify(dec)
            assert v is not None
            self._verify(v, may_chain=pro is None)
        if pro is not None:
            self._prompt(pro)

    def _room(self, work: list[Work]) -> list[int]:
        """The drafts each decode row's sequence may verify this step (0 for
        those that do not speculate): what its reply and the context leave,
        cut (the largest first) until the step fits self.rows."""
        room = [self._drafts_after(w.seq.data, w.start) if w.seq.data.spec else 0 for w in work]
        over = len(work) + sum(room) - self.rows
        while over > 0 and any(room):
            i = max(range(len(room)), key=lambda j: room[j])
            room[i] -= 1
            over -= 1
        return room

    def _submit_verify(self, dec: Batch, on_device: bool = False) -> _Verify | None:
        """Submit the verify step of the decode rows (the module's docstring, 1).
        on_device: the drafts are those the MTP steps still in flight leave on
        the device (self._src), so the step follows them without their
        drafts reaching the host first; None where that cannot be (a sequence
        whose drafts are not all there, a step that reads logits back)."""
        r, e = self.r, self.e
        room = self._room(dec.work)
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        outs = []
        draft_rows: list[tuple[int, int]] = []
        plan: list[tuple[Work, int, int, bool]] = []   # (work, first row, drafts verified, speculates now)
        for w, n in zip(dec.work, room):
            job: Job = w.seq.data
            ready = job.spec and job.mtp_at == w.start + 1
            if on_device:
                src = self._src.get(id(job), [])
                m = min(n, len(src)) if ready else 0
                if m and min(src[:m]) < 0:
                    return None
                draft_rows += [(len(tokens) + 1 + i, src[i]) for i in range(m)]
                rows = [int(w.tokens[0])] + [0] * m
            else:
                m = min(n, len(job.drafts)) if ready else 0
                rows = [int(w.tokens[0])] + job.drafts[:m]
            off = len(tokens)
            tokens += rows
            positions += range(w.start, w.start + len(rows))
            slots += [self._slot(w.seq)] * len(rows)
            outs += [w.seq] * len(rows)
            plan.append((w, off, m, n > 0))
        if on_device and any(s.data.needs_logits for s in outs):   # (it would read logits back, so run alone)
            return None
        readback, sampling, masked = r._step_readback(outs)     # (each row drawn on the device takes its u)
        pass_ = Pass(hidden_rows=any(p[3] for p in plan), snapshots=any(p[2] for p in plan))
        while not e.has_room(pass_) and self._pending:   # (MTP steps in flight, oldest first)
            self._collect()
        t0 = time.perf_counter()
        if draft_rows:
            e.submit(tokens, positions, slots, range(len(tokens)), readback, sampling=sampling, masked=masked,
                     masks=r._masks(outs) if masked else None, pass_=pass_, draft_rows=draft_rows)
        else:   # (a split model's submit takes no draft_rows)
            e.submit(tokens, positions, slots, range(len(tokens)), readback, sampling=sampling, masked=masked,
                     masks=r._masks(outs) if masked else None, pass_=pass_)
        return _Verify(dec, plan, len(tokens), readback, t0)

    def resume(self) -> None:
        """Finish the verify step submitted ahead (Runner.submit_next)."""
        v, self.ahead = self.ahead, None
        assert v is not None
        self._verify(v, may_chain=True)

    def settle(self) -> None:
        """Let what is on the device finish, dropping the verify step ahead's results (Runner.settle)."""
        self._drain()
        v, self.ahead = self.ahead, None
        if v is not None:
            self.e.collect()
            self.r.sched.postprocess(v.dec)
        if self._block_ahead is not None:   # (behind it)
            self._block_ahead = None
            self.e.collect()
        if self._spec is not None:   # (behind the block)
            for _ in self._spec.steps:
                self.e.collect()
            self._spec = None

    def drain(self) -> None:
        """Collect the MTP steps still in flight (and wait for a rollback), before
        the runner submits a step of its own: its collect takes the oldest step
        on the device as its own. (MTP steps have a ring and a limit of their own,
        Engine.reserve_mtp, so nothing else stops a plain step from queueing
        behind them.)"""
        self._drain()

    def forget(self) -> None:
        """The device is gone: nothing on it will be collected (the worker's device fault)."""
        self.ahead, self._rollback, self._block_ahead, self._spec = None, None, None, None
        self._pending.clear()

    def _verify(self, v: _Verify, may_chain: bool) -> None:
        """Collect a verify step, accept and take its tokens, then run the MTP
        block on what was accepted; may_chain: then, where the next turn is a
        verify step of the same kind, submit it behind the MTP steps, reading
        their drafts on the device (self.ahead; the runner's next turn finishes
        it), so that the device goes from the drafts to the next verify step
        without waiting for the host."""
        r, e = self.r, self.e
        plan = v.plan
        self._drain()          # (the MTP steps before it: their drafts reach the host)
        t_wait = time.perf_counter()
        res = e.collect()
        now = time.perf_counter()
        self.steps += 1
        if v.readback == Readback.SAMPLE | Readback.LOGITS:      # (tokens, logits): a pair a row
            res = list(zip(*res))
        greedy = [self._token(x, v.readback) for x in res]
        accepted: dict[int, int] = {}
        rollbacks = []
        for w, off, m, _ in plan:
            drafts = w.seq.data.drafts[:m]
            assert len(drafts) == m, "a verify step's drafts never reached the host"
            n_acc = 0
            while n_acc < m and drafts[n_acc] == greedy[off + n_acc]:
                n_acc += 1
            accepted[id(w.seq)] = n_acc
            if m:
                w.seq.data.all_accepted = n_acc == m   # (the spec drafts' policy: _submit_spec_drafts)
            # the state after its last accepted row (a sequence ended while its step ahead ran, by
            # cancel_all or a failure, has no slot left to roll back: its rows are dropped)
            if n_acc < m and w.seq.slot is not None:
                rollbacks.append((self._slot(w.seq), off + n_acc, w.start + n_acc + 1))
        # the MTP block over each speculating sequence's accepted positions (p+1 ..: its tokens are the
        # greedy ones of rows 0..n_acc) goes to the device first (it reads
        # no recurrent state, so the rollback may follow it); the rest of the host's work overlaps it
        segs: list[_Segment] = []
        for w, off, _, speculates in plan:
            job = w.seq.data
            job.drafts = []
            if speculates and not job.done and w.seq.slot is not None:
                n_acc = accepted[id(w.seq)]
                segs.append(_Segment(job, w.start + 1, greedy[off:off + n_acc + 1],
                                     list(range(off, off + n_acc + 1)), True))
        if any(m for _, _, m, _ in plan) and all(accepted[id(w.seq)] == m for w, _, m, _ in plan):
            self.full_turns += 1
        ba, self._block_ahead = self._block_ahead, None
        if ba is not None and ba.verify is v:
            self._drafts_after_block(ba, segs, accepted)
        else:
            assert ba is None and self._spec is None, "a block ahead behind another verify step than the one collected"
            self._mtp(segs, "hn")
        if rollbacks:   # (on one device: not waited for; the next verify step queues behind it)
            if getattr(e, "device_chains", False):
                assert self._rollback is None   # (waited for by _drain, before this step was collected)
                self._rollback = self.state.commit_snapshots(rollbacks, wait=False)
            else:
                self.state.commit_snapshots(rollbacks)
        if r.metrics:
            r.metrics.step(v.rows, now - v.t0)
        self._log(v.rows, sum(p[2] for p in plan), sum(accepted.values()), v.t0, t_wait, now)
        r.sched.postprocess(v.dec, accepted)
        # the next verify step at once, behind the MTP steps, where the same sequences go on (their tokens'
        # host work below then overlaps both)
        early = may_chain and self._chain_ahead(v, res, accepted)
        for w, off, m, _ in plan:
            job = w.seq.data
            n_acc = accepted[id(w.seq)]
            if m:
                job.drafted += m
                job.accepted += n_acc
                if r.metrics:
                    r.metrics.speculated(m, n_acc)
            for i in range(n_acc + 1):   # its tokens in order, as a step each would have given them
                if job.done:
                    break
                r._guard(w.seq, r._take, job, res[off + i], v.readback, now)
        r.deliver()     # (their text and events while the MTP block's steps run)
        if early:
            return
        if may_chain and self._pending and not r._arrivals() and \
                not (r.sched.waiting and len(r.sched.live) < r.cfg.max_live):
            nxt = r.sched.schedule()
            if nxt is not None:
                dec, pro = nxt.split()
                ahead = (self._submit_verify(dec, on_device=True)
                         if dec is not None and pro is None and self.wants(nxt) else None)
                if ahead is not None:
                    self.ahead = ahead
                    self.chained += 1
                    self._submit_block_ahead(ahead)
                    return
                r.held = nxt   # (the runner's next turn runs it, once the drafts are on the host)
        self._drain()

    def _chain_ahead(self, v: _Verify, res, accepted: dict[int, int]) -> bool:
        """Before the verify step's tokens are taken: where every live sequence
        was in it and goes on (nobody waits to join, no grammar's mask needs
        its token taken first, no logits read back), submit the next verify step
        behind the MTP steps, each sequence's row at its next position with the
        token it is known to get (a sequence whose reply ends on a token taken
        now has its rows run and dropped, as the runner's chained steps: its
        slot's state then covers them, which Scheduler.finish and the state's
        lengths account for). Whether it did (self.ahead)."""
        r, e = self.r, self.e
        if not self._pending or v.readback not in (Readback.ARGMAX, Readback.SAMPLE) or r._arrivals() or \
                r.sched.waiting and len(r.sched.live) < r.cfg.max_live:
            return False
        mine = {id(w.seq) for w in v.dec.work}
        if any(id(s) not in mine for s in r.sched.live):
            return False
        work: list[Work] = []
        for w, off, _, _ in v.plan:
            job, seq = w.seq.data, w.seq
            if job.masked or job.dead_end or not w.output or len(w.tokens) != 1:
                return False
            n_acc = accepted[id(seq)]
            made = len(seq.tokens) - seq.n_prompt + n_acc + 1    # its reply's tokens once these are taken
            if job.done or seq.cancelled or seq.slot is None or made >= job.req.max_tokens or \
                    len(seq.tokens) + n_acc >= e.n_ctx:
                continue
            work.append(Work(seq, w.start + n_acc + 1, [int(res[off + n_acc])], True))
        if not work:
            return False
        for w in work:
            w.seq.inflight += 1
        ahead = self._submit_verify(Batch(work), on_device=True) if self.wants(Batch(work)) else None
        if ahead is None:
            for w in work:
                w.seq.inflight -= 1
            return False
        self.ahead = ahead
        self.chained += 1
        self._submit_block_ahead(ahead)
        return True

    def _prompt(self, pro: Batch) -> None:
        r = self.r
        spec = any(w.seq.data.spec for w in pro.work)
        r._submit(pro, True, Pass(hidden_rows=True) if spec else MAIN)
        r._collect_oldest()
        r.deliver()     # (a finished prompt's first token does not wait for the MTP block)
        segs: list[_Segment] = []
        off = 0
        for w in pro.work:
            job, seq = w.seq.data, w.seq
            c0, c1 = w.start, w.start + len(w.tokens)
            if job.spec and not job.done:
                # position q pairs token q with the hidden state of q - 1; this chunk's rows give those of
                # c0..c1-1, so positions c0+1..c1 (0..c1 from the start, zeros before position 0) where
                # token q is known: c1's is the next chunk's first or, after the last chunk, the reply's first
                a = 0 if c0 == 0 else c0 + 1
                b = min(c1, len(seq.tokens) - 1, self.e.n_ctx - 1)
                if b >= a:
                    segs.append(_Segment(job, a, seq.tokens[a:b + 1],
                                         [off + max(q - 1 - c0, 0) for q in range(a, b + 1)],
                                         w.output and b == len(seq.tokens) - 1, zero_first=a == 0))
            off += len(w.tokens)
        self._mtp(segs, "hn")
        self._drain()

    # -- the MTP block ------------------------------------------------------------------
    def _mtp(self, segs: list[_Segment], hidden: str, keep_src: bool = False) -> None:
        """Run the MTP block over the segments (in steps of at most max_batch
        rows and max_out drafting rows, a zero-first segment first in its step)
        and draft: after each step, its drafting sequences' further drafts
        chain on `mtp_hn` before anything else overwrites it. keep_src: other
        sequences' drafts of this turn are already on the device (self._src)."""
        e = self.e
        if keep_src:
            self._draft_words = 0
        else:
            self._src, self._draft_words = {}, 0
        if not self._pending:   # (the block on the MTP ring's first buffer, as prepare_turns records it)
            e.restart_mtp_ring()
        pieces: list[_Segment] = []
        for s in segs:   # (a segment longer than a step: pieces, the last one drafting)
            for i in range(0, len(s.tokens), e.max_batch):
                n = min(e.max_batch, len(s.tokens) - i)
                pieces.append(_Segment(s.job, s.start + i, s.tokens[i:i + n], s.hmap[i:i + n],
                                       s.draft and i + n == len(s.tokens), s.zero_first and i == 0))
        step: list[_Segment] = []
        for s in pieces:
            rows = sum(len(x.tokens) for x in step)
            outs = sum(x.draft for x in step)
            if step and (s.zero_first or rows + len(s.tokens) > e.max_batch or outs + s.draft > e.max_out):
                self._mtp_step(step, hidden)
                step = []
            step.append(s)
        if step:
            self._mtp_step(step, hidden)

    def _mtp_step(self, step: list[_Segment], hidden: str) -> None:
        """One MTP block step over the segments, then (submitted behind it, each
        taking its tokens from the step before on the device: Engine.submit's
        chain) the further drafts of its drafting sequences: the block at each
        draft's position with that draft and its own hidden state, one step for
        all per draft."""
        tokens = [t for s in step for t in s.tokens]
        positions = [s.start + i for s in step for i in range(len(s.tokens))]
        slots = [self._slot(s.job.seq) for s in step for _ in s.tokens]
        hmap = [h for s in step for h in s.hmap]
        rows, n = [], 0            # (the drafting segments' last rows)
        for s in step:
            n += len(s.tokens)
            if s.draft:
                rows.append(n - 1)
        jobs = [s.job for s in step if s.draft]
        for s in step:
            if s.draft:
                s.job.drafts = []
                s.job.mtp_at = s.start + len(s.tokens)     # the position its first draft is for
        self._submit(tokens, positions, slots, rows, Readback.ARGMAX if rows else Readback.NONE,
                     Pass(mtp=True, hidden=hidden, zero_first=step[0].zero_first, drafts_at=self._words(jobs)),
                     hmap, jobs)
        self._chain_drafts(jobs, list(range(len(jobs))), rows)

    def _draft_steps(self, jobs: list[Job], outs: list[int], rows: list[int],
                     first: dict[int, int]) -> list[tuple[list[Job], list[int], list[int], list[int]]]:
        """The steps of the further drafts of `jobs`, whose first drafts the MTP
        step before them chose at its output rows outs[i] from its rows rows[i],
        first[id(job)] the position of a job's first draft: the block at each
        draft's position with that draft (Engine.submit's chain) and its own
        hidden state (mtp_hn), one step for all per draft. Each step's (jobs,
        positions, chain, hmap)."""
        want = {id(j): self._drafts_after(j, first[id(j)] - 1) for j in jobs}
        steps: list[tuple[list[Job], list[int], list[int], list[int]]] = []
        d = 1
        while True:
            keep = [i for i, j in enumerate(jobs) if want[id(j)] > d]   # (indices into the step before's jobs)
            if not keep:
                return steps
            jobs = [jobs[i] for i in keep]
            steps.append((jobs, [first[id(j)] + d - 1 for j in jobs], [outs[i] for i in keep], [rows[i] for i in keep]))
            outs = rows = list(range(len(keep)))
            d += 1

    def _chain_drafts(self, jobs: list[Job], outs: list[int], rows: list[int]) -> None:
        """Submit the further drafts of `jobs` (_draft_steps; each job's first
        draft is for its mtp_at), their drafts left in this turn's words."""
        for sj, positions, chain, hmap in self._draft_steps(jobs, outs, rows, {id(j): j.mtp_at for j in jobs}):
            self._submit([0] * len(sj), positions, [self._slot(j.seq) for j in sj], range(len(sj)), Readback.ARGMAX,
                         Pass(mtp=True, hidden="mtp_hn", drafts_at=self._words(sj)), hmap, sj, chain=chain)

    def _submit_block_ahead(self, v: _Verify) -> None:
        """With Options.mtp_block_ahead: submit the MTP block behind the verify
        step ahead at once, over every row of each speculating sequence's token
        and drafts (tokens: the verify step's greedy ones, chained on the device;
        hidden rows: its rows), each row's draft read back and left in the top
        draft words. Whatever a sequence accepts, the block's rows up to its last
        accepted one are the rows the block would run once the host knew
        (position q: token q, the hidden state of q - 1), and that row drafts
        the next position; the rows past it only write KV rows of the MTP layer
        past the sequence, which a later block writes before anything reads them.
        So the device goes from the verify step to the block without waiting
        for the host; the chained drafts follow when the host knows which row
        drafts (_drafts_after_block)."""
        e = self.e
        if not self.block_ahead_on or not v.readback.tokens or v.readback & Readback.LOGITS or \
                any(w.seq.data.masked for w, *_ in v.plan):   # (a masked step's tokens come from its second program)
            return
        segs: list[tuple[Job, int, int]] = []   # (job, its first row in the block, its verify row's position)
        tokens_rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for w, off, m, speculates in v.plan:
            job = w.seq.data
            if not speculates or w.seq.slot is None:
                continue
            segs.append((job, len(tokens_rows), w.start))
            tokens_rows += range(off, off + m + 1)
            positions += range(w.start + 1, w.start + m + 2)
            slots += [self._slot(w.seq)] * (m + 1)
        n = len(tokens_rows)
        dw = e.layout.draft_words
        # (the top of the draft words: a turn's chained drafts take them from 0, at most k - 1 a sequence)
        at = dw - n
        if not segs or n > min(e.max_batch, e.max_out) or at < len(segs) * max(0, self.k - 1) or \
                max(positions) >= e.n_ctx:
            return
        while not e.has_room(Pass(mtp=True)) and self._pending:
            self._collect()
        if not e.has_room(Pass(mtp=True)):
            return
        e.submit([0] * n, positions, slots, range(n), Readback.ARGMAX, chain=tokens_rows, hmap=tokens_rows,
                 pass_=Pass(mtp=True, hidden="hn", drafts_at=at))
        self.mtp_steps += 1
        self._block_ahead = _BlockAhead(v, segs, n, at, time.perf_counter())
        if self.spec_on:
            self._submit_spec_drafts(self._block_ahead, {id(w.seq.data): m for w, _, m, _ in v.plan})

    def _submit_spec_drafts(self, ba: _BlockAhead, verified: dict[int, int]) -> None:
        """With Options.mtp_spec_drafts: behind the block ahead, each drafting
        sequence's further drafts from the block's row of its last draft, as if
        the verify step accepted every draft (_chain_drafts' steps, the block's
        hidden rows and tokens chained on the device), their drafts in the words
        below the block's. Where the verify step does accept them all,
        _drafts_after_block takes these (so the device goes from the block to
        the drafts without the host); elsewhere their rows only wrote MTP-layer
        KV rows past the sequence and their drafts are dropped. All steps or
        none: they need the MTP ring's room for every one (mtp_ring_depth).
        Only where every sequence in the block took all its drafts in its last
        verified turn: a sequence that rejects one runs the block again and the
        spec steps were device time for nothing (up to ~0.7 ms a turn on the
        35B-A3B), and the spec steps overwrite the block's hidden rows, so one
        sequence that does not take them sends every other one back to the
        block too. Acceptance runs in streaks: after a turn that took every
        draft the next likely does."""
        e = self.e
        if not all(job.all_accepted for job, _, _ in ba.segs):
            return
        jobs = [job for job, _, _ in ba.segs]
        rows = [first + verified.get(id(job), 0) for job, first, _ in ba.segs]
        starts = {id(job): start + verified.get(id(job), 0) + 2 for job, _, start in ba.segs}
        steps = self._draft_steps(jobs, rows, rows, starts)   # (the block's output rows are all its rows)
        if not steps:
            return
        low = ba.at - sum(len(sj) for sj, *_ in steps)
        corrective = len(ba.segs) * max(0, self.k - 1)   # (the words _chain_drafts takes from 0 where they fail)
        if low < corrective or len(steps) > e.mtp_depth - 1 - len(self._pending) or not e.has_room(Pass(mtp=True)):
            return
        row_of = {id(j): r for j, r in zip(jobs, rows)}
        # (the jobs of the first step: those with a second draft at least)
        spec = _SpecDrafts(ba, {id(j): row_of[id(j)] for j in steps[0][0]}, {}, [], low)
        w = low
        for sj, positions, chain, hmap in steps:
            for i, j in enumerate(sj):
                spec.words.setdefault(id(j), []).append(w + i)
            e.submit([0] * len(sj), positions, [self._slot(j.seq) for j in sj], range(len(sj)), Readback.ARGMAX,
                     pass_=Pass(mtp=True, hidden="mtp_hn", drafts_at=w), hmap=hmap, chain=chain)
            spec.steps.append((sj, len(sj), time.perf_counter()))
            self.mtp_steps += 1
            w += len(sj)
        self._spec = spec
        self.spec_turns += 1

    def _drafts_after_block(self, ba: _BlockAhead, segs: list[_Segment], accepted: dict[int, int]) -> None:
        """The verify step behind which the block ran is collected: each drafting
        sequence's first draft is the block's row at its last accepted position
        (read back by _collect, left on the device at that row's draft word), and
        its further drafts chain on that row's hidden state (_chain_drafts)."""
        self._src, self._draft_words = {}, 0
        self.blocks_ahead += 1
        spec, self._spec = self._spec, None
        assert spec is None or spec.block is ba
        drafting = {id(s.job) for s in segs}     # (the sequences _mtp would have run: not done, in a slot)
        jobs: list[Job] = []
        rows: list[int] = []
        for job, first, start in ba.segs:
            if id(job) not in drafting:
                continue
            n_acc = accepted[id(job.seq)]
            if spec is not None:   # (a draft rejected, where its further drafts would need the block's
                r = spec.rows.get(id(job))   # hidden rows: its spec drafts are not its drafts; _mtp below)
                more = self._drafts_after(job, start + n_acc + 1) > 1
                if (r is not None and r != first + n_acc) or (r is None and more):
                    continue
            job.drafts = []
            job.mtp_at = start + n_acc + 2      # (the position its first draft is for)
            jobs.append(job)
            rows.append(first + n_acc)
            self._src[id(job)] = [ba.at + first + n_acc] + (spec.words.get(id(job), []) if spec is not None else [])
        # (the block is the oldest step in flight now: the verify step before it was collected, and so were
        # the MTP steps before that)
        self._pending.appendleft((jobs, ba.rows, ba.t0, rows))
        if spec is None:
            self._chain_drafts(jobs, rows, rows)   # (the block's output rows are all its rows)
            return
        # the spec steps behind it give their drafts to the sequences that accepted every draft; the others
        # run the block again over what they accepted (the spec steps overwrote the block's hidden rows,
        # mtp_hn), its chained drafts in the words below the spec steps'
        taken = {id(j) for j in jobs}
        self.spec_used += len(taken)
        for sj, n, t0 in spec.steps:
            self._pending.append(([j if id(j) in taken else None for j in sj], n, t0, None))
        rest = [sg for sg in segs if id(sg.job) not in taken]
        if rest:
            self._words_cap = spec.low
            self._mtp(rest, "hn", keep_src=True)
            self._words_cap = None

    def _words(self, jobs: list[Job]) -> int:
        """Where an MTP step drafting for `jobs` (its output rows, in order)
        leaves their drafts on the device (Pass.drafts_at; self._src), or -1
        where it does not: an engine that does not chain steps on its device
        (a split model), or this turn's draft words used up."""
        n = len(jobs)
        dw = self.e.layout.draft_words if getattr(self.e, "device_chains", False) else 0
        if self._words_cap is not None:
            dw = min(dw, self._words_cap)
        at = self._draft_words if n and self._draft_words + n <= dw else -1
        if at >= 0:
            self._draft_words += n
        for i, j in enumerate(jobs):
            self._src.setdefault(id(j), []).append(at + i if at >= 0 else -1)
        return at

    def _submit(self, tokens, positions, slots, out_rows, readback: Readback, pass_: Pass, hmap, jobs: list[Job],
                chain: list[int] | None = None) -> None:
        """Submit an MTP block step whose output rows draft for `jobs` (in
        order), collecting the oldest first when the engine has as many in
        flight as it takes; a chained step follows the one it reads at once."""
        e = self.e
        while not e.has_room(pass_) and self._pending:   # (Engine.reserve_mtp: a turn's MTP steps all at once)
            self._collect()
        e.submit(tokens, positions, slots, out_rows, readback, pass_=pass_, hmap=hmap, chain=chain)
        self._pending.append((jobs, len(tokens), time.perf_counter(), None))
        self.mtp_steps += 1

    def _collect(self) -> None:
        jobs, n, t0, pick = self._pending.popleft()
        got = self.e.collect()
        if self.r.metrics:
            self.r.metrics.step(n, time.perf_counter() - t0)
        if got is not None and pick is not None:
            got = [got[i] for i in pick]
        for j, t in zip(jobs, got if got is not None else ()):
            if j is not None:   # (a spec step's row of a job that did not accept every draft)
                j.drafts.append(int(t))

    def _drain(self) -> None:
        while self._pending:
            self._collect()
        if self._rollback is not None:   # (done before the steps behind it)
            self._rollback.wait()
            self._rollback = None

    def _drafts_after(self, job: Job, p: int) -> int:
        """Drafts worth verifying after a sequence's pending token at position p:
        --draft (less where the request asks: speculative.n_max), less what its
        reply (that token is its (p + 1 - n_prompt)-th) and the context (the
        drafts' rows and the MTP block's next row below n_ctx) leave."""
        most = self.k if job.req.draft_max is None else min(self.k, job.req.draft_max)
        left = job.req.max_tokens - (p + 1 - job.seq.n_prompt)     # tokens still to come
        return max(0, min(most, left - 1, self.e.n_ctx - 2 - p))

    def _slot(self, seq) -> int:
        """The engine slot of a resident sequence."""
        assert seq.slot is not None
        return self.r.kv.slots[seq.slot]

    @staticmethod
    def _token(x, readback: Readback) -> int:
        """A verify row's greedy token, as Runner._take chooses it for a greedy
        request (from the logits where the step read them back)."""
        if readback & Readback.LOGITS:
            lg = x[1] if readback & Readback.SAMPLE else x
            return int(np.argmax(lg))
        return int(x)

    def _log(self, rows: int, drafted: int, accepted: int, t0: float, t_wait: float, now: float) -> None:
        """A verify step's line in the runner's step log (its fields, and the drafts)."""
        log = self.r.step_log
        if log is not None:
            log.write(json.dumps({"t_ms": round((t0 - self.r._t0) * 1e3, 3), "rows": rows, "prompt_rows": 0,
                                  "outs": rows, "chained": False, "in_flight": 1,
                                  "dt_ms": round((now - t0) * 1e3, 3), "wait_ms": round((now - t_wait) * 1e3, 3),
                                  "drafted": drafted, "accepted": accepted}) + "\n")
