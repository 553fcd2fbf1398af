"""The scheduler: which sequences run in the next engine step, in which KV slot,
and how many of their tokens. Pure Python (no kp, no HTTP): the runner
(runner.py) calls `schedule()`, runs the returned `Batch` as an engine step,
and reports sampled tokens back (nano-vllm's schedule -> run ->
postprocess). Tests drive it with a fake runner.

Sequences move WAITING -> LIVE (admitted; at most `max_live` of them) and, while
live, are either resident (own one of `n_slots` device KV slots) or parked (KV
rows copied to host memory through `KVMover.park`). Every step:

1. cancelled sequences leave, freeing their slot or parked buffer;
2. waiting sequences are admitted in arrival order while fewer than `max_live`
   are live;
3. live sequences without a slot get one: a free slot if any, else a resident
   that has had its turn (`quantum` steps since it got its slot) is parked and
   its slot given away. Newcomers go first when `newcomer_first` (slices mode:
   prefill on arrival), otherwise first come, first served;
4. the batch: one row for every resident sequence that is decoding, then
   prompt chunks of the others in the remaining rows of `step_tokens`
   (chunked prefill: a newcomer never stalls running streams for more than one
   bounded step): the oldest prompt is guaranteed an even share, the rest goes
   to the prompts with the fewest rows left (shortest remaining first), so a
   short newcomer's first token does not wait for the long prompts before it,
   and prompts of equal length finish one after another instead of all
   together at the end. With nobody decoding, prompt
   chunks take up to `prompt_tokens` rows (a lone prompt at the engine's
   prefill speed); with streams running and `prompt_ms` set, as many rows as
   the measured cost of a prompt row fits in prompt_ms.

Prefix cache: a slot keeps the KV rows and token list of the sequence that
finished in it. A newcomer takes the free slot whose rows share the longest
prefix with its prompt, or copies that prefix from any slot (running or free),
parked sequence or host cache entry (`host_cache` finished sequences parked on
the host; used in slices mode, where the device holds one slot).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

WAITING, LIVE, FINISHED = "waiting", "live", "finished"


class KVMover(Protocol):
    """What the scheduler needs from the runner to move KV rows."""
    def park(self, slot: int, length: int) -> Any: ...           # rows [0, length) of a slot -> host handle
    def restore(self, handle: Any, slot: int, length: int) -> None: ...  # rows [0, length) of a handle -> slot
    def copy(self, src: int, dst: int, length: int) -> None: ...   # rows [0, length) slot -> slot
    def release(self, handle: Any) -> None: ...                  # the handle's host buffer is free again
    # how many of the first n positions of ("slot", i) or ("host", handle) a newcomer may take
    # (n for a KV cache; a recurrent state only at its own length)
    def reusable(self, source: tuple, n: int) -> int: ...


@dataclass(frozen=True)
class SchedulerConfig:
    n_slots: int = 4            # KV slots on the device
    max_live: int = 4           # sequences admitted at once (--parallel)
    step_tokens: int = 128      # token rows per step (>= n_slots)
    quantum: int = 64           # steps a resident keeps its slot before it may be parked for a waiting one
    max_queue: int = 64         # sequences waiting for admission
    newcomer_first: bool = False
    min_prefix: int = 8         # shortest prefix worth copying from another slot or the host
    host_cache: int = 0         # finished sequences kept parked on the host for the prefix cache
    # prompt rows run in a step of their own (Batch.split; the worker does it where the engine pads
    # prompt steps to its tiled matmuls, Engine.tiled_prompts): prompt chunks then share all of
    # step_tokens, not what the decode rows leave
    prompt_apart: bool = False
    # prompt rows a step may take while no resident sequence decodes: a lone
    # prompt prefills in chunks this large, at the engine's own prefill speed
    # (0: step_tokens)
    prompt_tokens: int = 0
    # while sequences decode: their prompt neighbours' rows are held to what
    # fits this many milliseconds at the measured cost of a prompt row
    # (Scheduler.observe_prompt), between step_tokens and prompt_tokens, so
    # a newcomer's chunk is bounded by its time, not by a fixed count (0: off,
    # step_tokens)
    prompt_ms: float = 0.0
    # rows a prompt step's tiled matmuls pad to (Engine.prompt_granule): a chunk
    # sized by prompt_ms is rounded down to whole granules (a 530-row chunk ran
    # the 8B's matmuls on 768 padded rows, 0.21 ms a row against 0.15 for 512:
    # notes.md run 37); 1: any count
    prompt_granule: int = 1

    @property
    def max_prompt_rows(self) -> int:
        return max(self.step_tokens, self.prompt_tokens)

    def validate(self) -> SchedulerConfig:
        if self.n_slots < 1 or self.max_live < 1 or self.quantum < 1 or self.max_queue < 0:
            raise ValueError("n_slots, max_live and quantum must be >= 1, max_queue >= 0")
        if self.step_tokens < self.n_slots:
            raise ValueError(f"step_tokens ({self.step_tokens}) must be >= n_slots ({self.n_slots}): "
                             "every resident sequence decodes in every step")
        if self.prompt_tokens < 0 or self.prompt_ms < 0 or self.prompt_granule < 1:
            raise ValueError("prompt_tokens and prompt_ms must be >= 0, prompt_granule >= 1")
        return self


@dataclass(eq=False)
class Seq:
    tokens: list[int]                # prompt, then generated tokens
    use_cache: bool = True
    data: Any = None                 # the runner's per-request state
    id: int = 0
    n_prompt: int = 0
    state: str = WAITING
    n_cached: int = 0                # positions [0, n_cached) have KV rows (in its slot or parked)
    slot: int | None = None
    parked: Any = None               # KVMover handle while parked
    turn: int = 0                    # steps since it got its slot
    ready: int = 0                   # tick since which it waits for a slot
    cache_hit: int = 0               # prompt positions reused from the prefix cache
    preempted: int = 0               # times parked to make room
    cancelled: bool = False
    inflight: int = 0                # positions in steps scheduled and not yet postprocessed

    @property
    def taken(self) -> int:
        """Positions that steps have run or are running: the next step starts here."""
        return self.n_cached + self.inflight

    @property
    def pending(self) -> int:
        """Positions that no step has taken yet."""
        return len(self.tokens) - self.taken


@dataclass
class Work:
    seq: Seq
    start: int                       # position of the first token
    tokens: list[Any]                # token ids; [None]: a chained row's, which the device takes from the step before
    output: bool                     # this chunk ends at the sequence's last token: sample the next

    @property
    def prompt(self) -> bool:
        """Whether these are prompt tokens (a chunk never spans prompt and generated ones)."""
        return self.start < self.seq.n_prompt


@dataclass
class Batch:
    work: list[Work]

    @property
    def tokens(self) -> list[Any]:
        return [t for w in self.work for t in w.tokens]

    @property
    def positions(self) -> list[int]:
        return [w.start + i for w in self.work for i in range(len(w.tokens))]

    @property
    def slots(self) -> list[int]:
        return [w.seq.slot for w in self.work for _ in w.tokens if w.seq.slot is not None]

    @property
    def out_rows(self) -> list[int]:
        rows, n = [], 0
        for w in self.work:
            n += len(w.tokens)
            if w.output:
                rows.append(n - 1)
        return rows

    @property
    def out_seqs(self) -> list[Seq]:
        return [w.seq for w in self.work if w.output]

    @property
    def has_prompt(self) -> bool:
        """Whether a row of this batch is a prompt token."""
        return any(w.prompt for w in self.work)

    def split(self) -> tuple[Batch | None, Batch | None]:
        """(decode rows, prompt rows): this batch as two, either None when empty."""
        dec = [w for w in self.work if not w.prompt]
        pro = [w for w in self.work if w.prompt]
        return (Batch(dec) if dec else None), (Batch(pro) if pro else None)


@dataclass
class _Entry:
    """A host prefix-cache entry: KV rows of `tokens`, parked."""
    tokens: list[int]
    handle: Any
    used: int


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVMover):
        self.cfg = cfg.validate()
        self.kv = kv
        self.waiting: deque[Seq] = deque()
        self.live: list[Seq] = []
        self.owner: list[Seq | None] = [None] * cfg.n_slots
        self.slot_tokens: list[list[int]] = [[] for _ in range(cfg.n_slots)]   # cache of a free slot
        self.slot_used: list[int] = [0] * cfg.n_slots
        self.host: list[_Entry] = []
        self._ids = itertools.count(1)
        self._tick = 0
        self.stats = {"preemptions": 0, "cache_tokens": 0, "parks": 0, "restores": 0, "copies": 0}
        self.row_seconds: float | None = None   # measured cost of a prompt row (observe_prompt)

    def observe_prompt(self, rows: int, seconds: float) -> None:
        """A step of `rows` prompt rows took `seconds` on the device: the cost of
        a prompt row that prompt_ms divides (a moving average of the last few)."""
        if rows <= 0 or seconds <= 0:
            return
        per = seconds / rows
        self.row_seconds = per if self.row_seconds is None else 0.75 * self.row_seconds + 0.25 * per

    def prompt_budget(self, n_decoding: int) -> int:
        """Prompt rows the next step may take beside n_decoding decode rows."""
        cfg = self.cfg
        if n_decoding == 0:
            return cfg.max_prompt_rows
        budget = cfg.step_tokens - (0 if cfg.prompt_apart else n_decoding)
        if cfg.prompt_ms and self.row_seconds:
            fits = min(cfg.max_prompt_rows, int(cfg.prompt_ms / 1e3 / self.row_seconds))
            if fits >= cfg.prompt_granule:   # whole granules: padded rows cost as much as real ones
                fits -= fits % cfg.prompt_granule
            budget = max(budget, fits)
        return budget

    # -- requests --------------------------------------------------------
    def add(self, seq: Seq) -> Seq:
        """Queue a sequence (the runner enforces the queue's length limit, where requests arrive)."""
        if not seq.tokens:
            raise ValueError("a sequence needs at least one token")
        seq.id = seq.id or next(self._ids)
        seq.n_prompt = len(seq.tokens)
        seq.state = WAITING
        seq.ready = self._next_tick()
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: Seq) -> None:
        seq.cancelled = True

    def append(self, seq: Seq, token: int) -> None:
        """A token sampled from the sequence's last output row."""
        seq.tokens.append(int(token))

    def finish(self, seq: Seq) -> None:
        """The sequence is done; its slot keeps its KV rows as a cache entry."""
        if seq.state == LIVE:
            self.live.remove(seq)
        elif seq.state == WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.slot is not None:
            s = seq.slot
            self.owner[s] = None
            # rows still on the device count: they are written before any later step reads the slot
            # (a chained row of a sequence that has just ended takes its last token)
            self.slot_tokens[s] = seq.tokens[:seq.taken]
            self.slot_used[s] = self._next_tick()
            seq.slot = None
        if seq.parked is not None:
            self.kv.release(seq.parked)
            seq.parked = None
        seq.state = FINISHED

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.live

    # -- the step --------------------------------------------------------
    def schedule(self) -> Batch | None:
        """Decide the next step (moving KV rows as needed); None when nothing can run."""
        for seq in [s for s in (*self.waiting, *self.live) if s.cancelled]:
            self.finish(seq)
        while self.waiting and len(self.live) < self.cfg.max_live:
            seq = self.waiting.popleft()
            seq.state = LIVE
            self.live.append(seq)
        self._place()
        return self._compose()

    def postprocess(self, batch: Batch, accepted: dict[int, int] | None = None) -> None:
        """The batch ran: its rows now have KV. accepted[id(seq)]: the drafts a
        speculative step ran after a sequence's row and accepted (its positions
        beyond the work's tokens that now have KV too; vkengine.serving.speculate)."""
        for w in batch.work:
            w.seq.n_cached += len(w.tokens) + (accepted.get(id(w.seq), 0) if accepted else 0)
            w.seq.inflight -= len(w.tokens)
        for seq in {id(w.seq): w.seq for w in batch.work}.values():
            seq.turn += 1

    def _place(self) -> None:
        needers = [s for s in self.live if s.slot is None]
        if self.cfg.newcomer_first:
            needers.sort(key=lambda s: (s.n_cached > 0 or s.parked is not None, s.ready))
        else:
            needers.sort(key=lambda s: s.ready)
        for seq in needers:
            free = [i for i in range(self.cfg.n_slots) if self.owner[i] is None]
            if not free:
                victim = self._victim(newcomer=seq.n_cached == 0 and seq.parked is None)
                if victim is None:
                    break
                free = [self._park(victim)]
            self._assign(seq, free)

    def _victim(self, newcomer: bool) -> Seq | None:
        """The resident that has had its slot longest among those whose turn is over."""
        def over(s: Seq) -> bool:
            if s.turn >= self.cfg.quantum:
                return True
            # slices: a newcomer's prefill starts at once, but never cuts into another's prefill
            return newcomer and self.cfg.newcomer_first and s.turn >= 1 and s.pending <= 1
        # a sequence with a row on the device stays: its parked copy would miss that row
        cands = [s for s in self.live if s.slot is not None and s.inflight == 0 and over(s)]
        return max(cands, key=lambda s: (s.turn, -s.ready), default=None)

    def _park(self, seq: Seq) -> int:
        """Preempt a resident: its rows go to the host; returns the freed slot."""
        s = seq.slot
        assert s is not None
        if seq.n_cached > 0:
            seq.parked = self.kv.park(s, seq.n_cached)
            self.stats["parks"] += 1
        self.owner[s] = None
        self.slot_tokens[s] = []          # its rows live on in the parked copy
        self.slot_used[s] = self._next_tick()
        seq.slot = None
        seq.ready = self._next_tick()
        seq.preempted += 1
        self.stats["preemptions"] += 1
        return s

    def _assign(self, seq: Seq, free: list[int]) -> None:
        if seq.parked is not None or seq.n_cached > 0:       # resume exactly where it stopped
            dst = min(free, key=lambda i: (len(self.slot_tokens[i]) > 0, self.slot_used[i]))
            self._evict(dst)
            if seq.parked is not None:
                self.kv.restore(seq.parked, dst, seq.n_cached)
                self.kv.release(seq.parked)
                seq.parked = None
                self.stats["restores"] += 1
        else:
            dst = self._reuse_prefix(seq, free)
        self.owner[dst] = seq
        self.slot_tokens[dst] = []
        seq.slot = dst
        seq.turn = 0

    def _reuse_prefix(self, seq: Seq, free: list[int]) -> int:
        """Pick a free slot for a newcomer and bring in the longest cached prefix of its prompt."""
        limit = len(seq.tokens) - 1 if seq.use_cache else 0    # the last prompt token must run

        def reuse(source: tuple, cached: list[int]) -> int:   # positions of `source` the newcomer may take
            return self.kv.reusable(source, min(common_prefix(cached, seq.tokens), limit))
        own = {i: reuse(("slot", i), self.slot_tokens[i]) for i in free}
        dst = max(free, key=lambda i: (own[i], not self.slot_tokens[i], -self.slot_used[i]))
        best = own[dst]
        source: tuple[str, Any] | None = None
        entry: _Entry | None = None
        if limit >= self.cfg.min_prefix:
            for i, o in enumerate(self.owner):
                if o is not None:
                    n = reuse(("slot", i), o.tokens[:o.n_cached])
                    if n > best and n >= self.cfg.min_prefix:
                        best, source = n, ("slot", i)
                elif i != dst:
                    n = reuse(("slot", i), self.slot_tokens[i])
                    if n > best and n >= self.cfg.min_prefix:
                        best, source = n, ("slot", i)
            for s in self.live:
                if s.parked is not None:
                    n = reuse(("host", s.parked), s.tokens[:s.n_cached])
                    if n > best and n >= self.cfg.min_prefix:
                        best, source = n, ("host", s.parked)
            for e in self.host:
                n = reuse(("host", e.handle), e.tokens)
                if n > best and n >= self.cfg.min_prefix:
                    best, source, entry = n, ("host", e.handle), e
        if entry is not None and source is not None and source[1] is entry.handle:
            entry.used = self._next_tick()
        if source is not None or best < len(self.slot_tokens[dst]):
            self._evict(dst)
        if source is not None:
            if source[0] == "slot":
                self.kv.copy(source[1], dst, best)
                self.stats["copies"] += 1
            else:
                self.kv.restore(source[1], dst, best)
                self.stats["restores"] += 1
        seq.n_cached = seq.cache_hit = best
        self.stats["cache_tokens"] += best
        return dst

    def _evict(self, slot: int) -> None:
        """A free slot's cached rows are about to be overwritten: keep them on the host if asked."""
        toks = self.slot_tokens[slot]
        if self.cfg.host_cache and len(toks) >= self.cfg.min_prefix and \
                not any(common_prefix(e.tokens, toks) == len(toks) for e in self.host):
            self.host.append(_Entry(toks, self.kv.park(slot, len(toks)), self._next_tick()))
            self.stats["parks"] += 1
            if len(self.host) > self.cfg.host_cache:
                old = min(self.host, key=lambda e: e.used)
                self.host.remove(old)
                self.kv.release(old.handle)
        self.slot_tokens[slot] = []

    def _compose(self) -> Batch | None:
        residents = [s for s in self.live if s.slot is not None and s.pending > 0]
        # running streams: a row every step (a prompt's last token is a prompt row, not one of these)
        decoding: list[Seq] = []
        prefilling: list[Seq] = []
        for s in residents:
            (decoding if s.pending == 1 and s.taken >= s.n_prompt else prefilling).append(s)
        prefilling.sort(key=lambda s: s.ready)
        budget = self.prompt_budget(len(decoding))
        # prompt rows: an even share for the oldest (no prompt waits forever behind shorter ones), the
        # rest shortest remaining first (ties: arrival), which minimises the mean time to first token
        rows = {id(s): 0 for s in prefilling}
        if prefilling and budget > 0:
            oldest = prefilling[0]
            rows[id(oldest)] = min(oldest.pending, max(1, budget // len(prefilling)))
            budget -= rows[id(oldest)]
            for s in sorted(prefilling, key=lambda s: (s.pending - rows[id(s)], s.ready)):
                n = min(s.pending - rows[id(s)], budget)
                rows[id(s)] += n
                budget -= n
        work = [Work(s, s.taken, s.tokens[s.taken:], True) for s in decoding]
        for s in prefilling:
            n, start = rows[id(s)], s.taken
            if n:
                work.append(Work(s, start, s.tokens[start:start + n], start + n == len(s.tokens)))
        for w in work:
            w.seq.inflight += len(w.tokens)
        return Batch(work) if work else None

    def chain(self, batch: Batch, done) -> Batch | None:
        """The decode step that follows `batch` (still on the device) for its
        output sequences, before their tokens are known: one row each at the
        next position, whose token the device takes from `batch`'s greedy output
        (Work.tokens is [None] until the runner learns it). `done(seq)` says
        that the token `batch` is producing is certainly the sequence's last
        (token budget, context): such sequences are left out. None when nothing
        can follow (a row of `batch` is a prompt chunk, or none would run)."""
        if any(not w.output or len(w.tokens) != 1 for w in batch.work):
            return None
        work = [Work(w.seq, w.start + 1, [None], True) for w in batch.work
                if w.seq.state == LIVE and not w.seq.cancelled and w.seq.slot is not None and not done(w.seq)]
        if not work:
            return None
        for w in work:
            w.seq.inflight += 1
        return Batch(work)

    def prompt_ahead(self, batch: Batch) -> Batch | None:
        """The prompt step that follows `batch` (still on the device) when
        `batch` holds prompt rows only and none of them outputs: each of its
        sequences' next chunk, as long as this one (the one reaching its
        prompt's end outputs its last row), for an engine whose parts can start
        a step before the one in flight is done (a split model: its first part
        runs the next chunk while its last runs this one). No placement: the
        sequences keep their slots. None when a row of `batch` outputs or
        nothing follows."""
        if any(w.output for w in batch.work):
            return None
        work = []
        for w in batch.work:
            s = w.seq
            if s.state != LIVE or s.cancelled or s.slot is None or s.pending <= 0:
                continue
            start = s.taken
            n = min(len(w.tokens), s.pending)
            work.append(Work(s, start, s.tokens[start:start + n], start + n == len(s.tokens)))
        for w in work:
            w.seq.inflight += len(w.tokens)
        return Batch(work) if work else None

    def _next_tick(self) -> int:
        self._tick += 1
        return self._tick

    # -- introspection (/slots, metrics) -------------------------------------
    def snapshot(self) -> dict:
        slots = []
        for i, o in enumerate(self.owner):
            slots.append({"id": i, "is_processing": o is not None, "id_task": o.id if o else None,
                          "n_cached": o.n_cached if o else len(self.slot_tokens[i]),
                          "n_prompt": o.n_prompt if o else 0,
                          "n_decoded": len(o.tokens) - o.n_prompt if o else 0})
        return {"slots": slots, "waiting": len(self.waiting), "live": len(self.live),
                "parked": sum(s.parked is not None for s in self.live), "host_cache": len(self.host),
                **self.stats}
