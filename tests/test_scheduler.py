"""The scheduler alone, with a fake runner whose "model" reads its KV cache.

The fake KV cache stores each row's token at (slot, position); the fake model's
next token is a hash of everything in the slot up to the row's position. So a
sequence's tokens equal those it gets alone only if every row it attends to
holds exactly its own history: a wrong park, restore, prefix copy or position
shows up as a different token, an unwritten row as an assertion.
"""
from __future__ import annotations

import hashlib
import random

import pytest

from vkengine.serving.scheduler import Scheduler, SchedulerConfig, Seq

V = 1000


def next_token(history: list[int]) -> int:
    return int.from_bytes(hashlib.blake2b(repr(history).encode(), digest_size=4).digest(), "little") % V


def alone(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class FakeRunner:
    def __init__(self, n_slots: int, ctx: int = 512):
        self.slots = [[None] * ctx for _ in range(n_slots)]
        self.handles: dict[int, list] = {}
        self._next = 0
        self.steps: list[list[tuple[int, int]]] = []     # (slot, position) rows of each step
        self.first: dict[int, int] = {}                   # request -> step of its first token

    # KVMover
    def park(self, slot, length):
        self._next += 1
        self.handles[self._next] = list(self.slots[slot][:length])
        assert None not in self.handles[self._next], "parked an unwritten row"
        return self._next

    def restore(self, handle, slot, length):
        rows = self.handles[handle]
        assert length <= len(rows)
        self.slots[slot][:length] = rows[:length]

    def copy(self, src, dst, length):
        assert src != dst
        self.slots[dst][:length] = self.slots[src][:length]

    def release(self, handle):
        del self.handles[handle]

    def reusable(self, source, n):   # a KV cache: any prefix of its rows
        return n

    # the engine
    def step(self, tokens, positions, slots, out_rows):
        self.steps.append(list(zip(slots, positions)))
        for t, p, s in zip(tokens, positions, slots):
            self.slots[s][p] = t
        out = []
        for r in out_rows:
            hist = self.slots[slots[r]][:positions[r] + 1]
            assert None not in hist, "attended to an unwritten row"
            out.append(next_token(hist))
        return out


def drive(cfg: SchedulerConfig, requests, cancel_at=None, check=None):
    """requests: (arrival step, prompt, n tokens). Returns tokens per request and the runner."""
    fr = FakeRunner(cfg.n_slots)
    sch = Scheduler(cfg, fr)
    seqs: list[Seq | None] = [None] * len(requests)
    out = [[] for _ in requests]
    step = 0
    while step < 10_000:
        for i, (at, prompt, n) in enumerate(requests):
            if at == step:
                seqs[i] = sch.add(Seq(list(prompt), data=i))
            if cancel_at and cancel_at.get(i) == step and seqs[i] is not None:
                sch.cancel(seqs[i])
        batch = sch.schedule()
        if batch is None:
            if sch.idle and all(s is not None for s in seqs):
                break
            step += 1
            continue
        # within the budget: step_tokens while sequences decode, max_prompt_rows of prompt rows otherwise
        decoding = any(not w.prompt for w in batch.work)
        if cfg.prompt_apart:   # decode rows and prompt rows each within the budget (two engine steps)
            dec, pro = batch.split()
            assert dec is None or len(dec.tokens) <= cfg.step_tokens
            assert pro is None or len(pro.tokens) <= (cfg.step_tokens if decoding else cfg.max_prompt_rows)
        else:
            assert len(batch.tokens) <= (cfg.step_tokens if decoding else cfg.max_prompt_rows)
        res = fr.step(batch.tokens, batch.positions, batch.slots, batch.out_rows)
        sch.postprocess(batch)
        if check:
            check(sch, batch)
        for seq, tok in zip(batch.out_seqs, res):
            i = seq.data
            sch.append(seq, tok)
            out[i].append(tok)
            fr.first.setdefault(i, len(fr.steps) - 1)
            if len(out[i]) == requests[i][2]:
                sch.finish(seq)
        step += 1
    assert sch.idle
    return out, fr, sch


def _prompts(rng: random.Random, n: int, shared: list[int] = ()) -> list[list[int]]:
    return [list(shared) + [rng.randrange(V) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


MODES = {
    "batch": SchedulerConfig(n_slots=4, max_live=4, step_tokens=16, quantum=8),
    "batch-preempt": SchedulerConfig(n_slots=2, max_live=4, step_tokens=16, quantum=3),
    "batch-apart": SchedulerConfig(n_slots=4, max_live=4, step_tokens=16, quantum=8, prompt_apart=True),
    "slices-q1": SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=1, newcomer_first=True,
                                 host_cache=2),
    "slices-q4": SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=4, newcomer_first=True,
                                 host_cache=2),
    "slices-q8": SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=8, newcomer_first=True),
    "serial": SchedulerConfig(n_slots=1, max_live=1, step_tokens=16, quantum=8),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_interleaved_tokens_equal_alone(mode):
    rng = random.Random(mode)
    prompts = _prompts(rng, 6)
    reqs = [(i * 3, p, 5 + 4 * i) for i, p in enumerate(prompts)]
    out, fr, sch = drive(MODES[mode], reqs)
    for (_, p, n), got in zip(reqs, out):
        assert got == alone(p, n)
    assert not fr.handles or MODES[mode].host_cache, "parked buffers leaked"
    assert len(fr.handles) <= MODES[mode].host_cache


@pytest.mark.parametrize("mode", list(MODES))
def test_prefix_cache_reuses_and_stays_exact(mode):
    rng = random.Random(1)
    system = [rng.randrange(V) for _ in range(30)]
    prompts = _prompts(rng, 5, shared=system)
    # the first finishes before the others arrive; the others overlap
    reqs = [(0, prompts[0], 3)] + [(60 + 2 * i, p, 6) for i, p in enumerate(prompts[1:])]
    out, fr, sch = drive(MODES[mode], reqs)
    for (_, p, n), got in zip(reqs, out):
        assert got == alone(p, n)
    assert sch.stats["cache_tokens"] >= 30 * 4 or mode == "slices-q8" and sch.stats["cache_tokens"] >= 30


def test_same_prompt_twice_reuses_all_but_the_last_token():
    cfg = MODES["batch"]
    p = list(range(50))
    out, fr, sch = drive(cfg, [(0, p, 4), (40, p, 4)])
    assert out[0] == out[1] == alone(p, 4)
    assert sch.stats["cache_tokens"] == 49
    assert sch.stats["copies"] == 0            # the finished slot itself was taken


def test_a_prompts_last_token_is_a_prompt_row():
    """A prompt whose cached prefix leaves one token: that row is a prompt row
    (Batch.split puts it with the prompt chunks, which the worker runs on the
    prompt path), not a decode row."""
    cfg = MODES["batch-apart"]
    p = list(range(50))
    parts = []

    def check(sch, batch):
        parts.append(tuple(None if b is None else [(w.seq.data, len(w.tokens)) for w in b.work]
                           for b in batch.split()))
    out, fr, sch = drive(cfg, [(0, p, 4), (40, p, 4)], check=check)
    assert out[0] == out[1] == alone(p, 4)
    assert sch.stats["cache_tokens"] == 49
    assert (None, [(1, 1)]) in parts            # the second request's one prompt row, on its own


def test_prompt_chunks_take_the_whole_budget_when_apart():
    """prompt_apart: decode rows run in a step of their own, so a newcomer's
    chunks take all of step_tokens beside them (not what the decode rows leave)."""
    for apart, want in ((False, 8 - 2), (True, 8)):
        cfg = SchedulerConfig(n_slots=4, max_live=4, step_tokens=8, quantum=8, prompt_apart=apart)
        chunks = []

        def check(sch, batch):
            dec, pro = batch.split()
            if dec is not None and pro is not None:
                chunks.append(len(pro.tokens))
        out, fr, sch = drive(cfg, [(0, [1, 2, 3], 30), (1, [4, 5], 30), (5, list(range(100)), 3)], check=check)
        assert out[2] == alone(list(range(100)), 3)
        assert max(chunks) == want, (apart, chunks)


@pytest.mark.parametrize("apart", [False, True])
def test_a_lone_prompt_takes_prompt_tokens(apart):
    """prompt_tokens: with no sequence decoding, a prompt runs in chunks of up
    to prompt_tokens rows (the engine's own prefill speed); once a stream
    decodes, a newcomer's chunks are back to step_tokens."""
    cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=8, quantum=8, prompt_tokens=64, prompt_apart=apart)
    long_prompt = list(range(150))
    out, fr, sch = drive(cfg, [(0, long_prompt, 40), (6, list(range(500, 600)), 3)])
    assert out[0] == alone(long_prompt, 40) and out[1] == alone(list(range(500, 600)), 3)
    assert [len(s) for s in fr.steps[:3]] == [64, 64, 22]          # alone: chunks of 64
    later = [s for s in fr.steps[3:] if any(slot == 1 for slot, _ in s)]
    assert later and all(sum(slot == 1 for slot, _ in s) <= 8 for s in later)   # beside a stream: <= 8


def test_prompt_ms_sizes_chunks_by_their_measured_cost():
    """prompt_ms: beside decoding streams, a newcomer's chunk takes what the
    measured cost of a prompt row fits in prompt_ms, between step_tokens and
    prompt_tokens; nothing measured yet: step_tokens."""
    cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=8, quantum=8, prompt_tokens=64, prompt_ms=20.0,
                          prompt_apart=True)
    sch = Scheduler(cfg, FakeRunner(2))
    assert sch.prompt_budget(0) == 64 and sch.prompt_budget(1) == 8
    sch.observe_prompt(32, 0.032)            # 1 ms a row: 20 rows fit 20 ms
    assert sch.prompt_budget(1) == 20
    sch.observe_prompt(10, 0.001)            # cheaper rows: a moving average, capped at prompt_tokens
    assert 20 < sch.prompt_budget(1) <= 64
    for _ in range(20):
        sch.observe_prompt(100, 0.001)
    assert sch.prompt_budget(1) == 64
    for _ in range(20):
        sch.observe_prompt(1, 1.0)           # dear rows: never below step_tokens
    assert sch.prompt_budget(1) == 8
    with pytest.raises(ValueError, match="prompt_tokens"):
        SchedulerConfig(prompt_tokens=-1).validate()


def test_prompt_ms_chunks_are_whole_granules():
    """prompt_granule: a chunk sized by prompt_ms is rounded down to whole
    granules (the rows the engine's tiled matmuls pad a step to), so that no
    padded rows are paid for; below one granule it stays as measured."""
    cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=8, quantum=8, prompt_tokens=2048, prompt_ms=100.0,
                          prompt_granule=256).validate()
    sch = Scheduler(cfg, FakeRunner(2))
    sch.observe_prompt(530, 0.1)                     # 530 rows fit 100 ms
    assert sch.prompt_budget(1) == 512
    sch = Scheduler(cfg, FakeRunner(2))
    sch.observe_prompt(100, 0.1)                     # 1 ms a row: 100 rows, less than a granule
    assert sch.prompt_budget(1) == 100
    with pytest.raises(ValueError):
        SchedulerConfig(n_slots=1, max_live=1, step_tokens=8, prompt_granule=0).validate()


def test_decoders_advance_in_every_step_of_a_long_prefill():
    cfg = SchedulerConfig(n_slots=4, max_live=4, step_tokens=8, quantum=8)
    long_prompt = list(range(200))

    def check(sch, batch):
        # every resident sequence that has started decoding has a row in every step
        decoding = [s for s in sch.live if s.slot is not None and len(s.tokens) > s.n_prompt]
        in_batch = {id(w.seq) for w in batch.work}
        assert all(id(s) in in_batch for s in decoding)

    out, fr, sch = drive(cfg, [(0, [1, 2, 3], 40), (1, [4, 5], 40), (5, long_prompt, 3)], check=check)
    assert out[2] == alone(long_prompt, 3)
    assert max(len(s) for s in fr.steps) <= 8
    # the long prompt was split into chunks that shared steps with decode rows
    mixed = [s for s in fr.steps if len({slot for slot, _ in s}) > 1 and len(s) == 8]
    assert len(mixed) >= 200 // 8 - 2


def test_short_newcomer_does_not_wait_for_a_long_prefill():
    cfg = SchedulerConfig(n_slots=4, max_live=4, step_tokens=8, quantum=8)
    long_prompt, short = list(range(400)), [7, 8, 9, 10, 11]
    out, fr, sch = drive(cfg, [(0, long_prompt, 2), (3, short, 2)])
    # the long prompt needs 50 steps of 8 rows; the short one shares the rows from its arrival (step 3)
    assert fr.first[1] <= 4 and fr.first[0] > 45
    assert out == [alone(long_prompt, 2), alone(short, 2)]


def test_newcomer_is_prefilled_on_arrival_in_slices_mode():
    # a turn is long (quantum 100), yet the newcomer does not wait for it to end
    cfg = SchedulerConfig(n_slots=1, max_live=4, step_tokens=16, quantum=100, newcomer_first=True)
    out, fr, sch = drive(cfg, [(0, [1, 2, 3], 60), (10, [7, 8, 9], 2)])
    b_prefill = next(i for i, rows in enumerate(fr.steps) if i > 0 and (0, 0) in rows)
    assert b_prefill == 10
    assert out[1] == alone([7, 8, 9], 2) and out[0] == alone([1, 2, 3], 60)
    assert sch.stats["preemptions"] == 1


def test_preempted_sequences_resume_exactly():
    cfg = SchedulerConfig(n_slots=1, max_live=3, step_tokens=4, quantum=2)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [5, 5, 5, 5, 5]]
    out, fr, sch = drive(cfg, [(0, p, 12) for p in prompts])
    assert out == [alone(p, 12) for p in prompts]
    assert sch.stats["preemptions"] > 5 and sch.stats["restores"] > 5


def test_cancel_frees_the_slot_at_the_next_step():
    cfg = SchedulerConfig(n_slots=1, max_live=1, step_tokens=8, quantum=4)
    out, fr, sch = drive(cfg, [(0, [1, 2], 1000), (2, [3, 4], 3)], cancel_at={0: 5})
    assert len(out[0]) <= 6
    assert out[1] == alone([3, 4], 3)


def test_cancel_of_parked_and_waiting_sequences_releases_everything():
    cfg = SchedulerConfig(n_slots=1, max_live=2, step_tokens=8, quantum=1)
    reqs = [(0, [1, 2], 500), (0, [3, 4], 500), (0, [5, 6], 4)]
    out, fr, sch = drive(cfg, reqs, cancel_at={0: 7, 1: 8})
    assert out[2] == alone([5, 6], 4)
    assert fr.handles == {}


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic(seed):
    """Random arrivals, lengths, shared prefixes and cancellations in random modes."""
    rng = random.Random(seed)
    n_slots = rng.choice([1, 2, 3, 4])
    cfg = SchedulerConfig(n_slots=n_slots, max_live=rng.choice([n_slots, n_slots + 2]),
                          step_tokens=rng.choice([n_slots, 8, 32]), quantum=rng.choice([1, 2, 5, 100]),
                          newcomer_first=rng.random() < 0.5, min_prefix=rng.choice([1, 4, 8]),
                          host_cache=rng.choice([0, 2]))
    system = [rng.randrange(V) for _ in range(rng.randrange(0, 20))]
    reqs, cancel = [], {}
    for i in range(rng.randrange(3, 9)):
        shared = system if rng.random() < 0.6 else []
        p = _prompts(rng, 1, shared)[0]
        reqs.append((rng.randrange(0, 60), p, rng.randrange(1, 25)))
        if rng.random() < 0.2:
            cancel[i] = reqs[-1][0] + rng.randrange(0, 20)
    out, fr, sch = drive(cfg, reqs, cancel_at=cancel)
    for i, ((_, p, n), got) in enumerate(zip(reqs, out)):
        want = alone(p, n)
        if i in cancel:
            assert got == want[:len(got)]
        else:
            assert got == want
    assert len(fr.handles) <= cfg.host_cache


def test_config_rejects_a_budget_smaller_than_the_slots():
    with pytest.raises(ValueError, match="step_tokens"):
        SchedulerConfig(n_slots=8, step_tokens=4).validate()


def test_equal_newcomers_finish_one_after_another():
    """Prompts of equal length arriving together: shortest remaining first
    finishes them in turn (the first token of the first after ~1/3 of the
    work), where an even split would hold every first token to the end."""
    cfg = SchedulerConfig(n_slots=4, max_live=4, step_tokens=8, quantum=8)
    prompts = [list(range(i, i + 40)) for i in range(3)]
    out, fr, sch = drive(cfg, [(0, p, 2) for p in prompts])
    first = [fr.first[i] for i in range(3)]
    assert first == sorted(first) and first[0] <= 40 // 8 + 2 < first[2]
    assert out == [alone(p, 2) for p in prompts]
