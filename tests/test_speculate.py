"""MTP speculative decoding inside the runner (vkengine/serving/speculate.py),
on tiny random qwen35 / qwen35moe models (lavapipe): every request's tokens
equal those of the same requests run without drafts (greedy ones, and sampled,
grammar-held and log-probability-reporting ones beside them), with requests arriving while others decode, in batch mode
(several slots) and slices mode (one slot, sequences parked on the host in
turns), with drafts the model rejects, drafts forced right, and drafts right in
part (rolled back mid-step)."""
from __future__ import annotations

import dataclasses
import io
import json

import pytest

from vkengine.engine import Engine, EngineConfig
from vkengine.errors import VkEngineError
from vkengine.model import load_model
from vkengine.options import Options
from vkengine.serving.constrain import compile_grammar
from vkengine.serving.runner import Event, GenRequest, Runner
from vkengine.serving.sampling import SamplingParams
from vkengine.serving.scheduler import SchedulerConfig
from vkengine.serving.speculate import Speculator, prepare_turns, turn_keys

from .test_models_qwen35 import ARCHES, PROMPT, qwen35_loaded, qwen35_models  # noqa: F401 (shared fixtures)
from .test_synth_mtp_accept import accept_models  # noqa: F401 (shared fixture)

ROWS = 12      # a verify step's rows (snapshot and output rows of the engine)


def _engine(device, model, n_slots=3, rows=ROWS, **kw):
    model = dataclasses.replace(model, args=dataclasses.replace(model.args, mtp_snap_rows=rows))
    return Engine(model, device, EngineConfig(**{"n_slots": n_slots, "n_ctx": 96, "max_batch": 24,
                                                 "max_out": max(rows, n_slots), **kw}))


def _requests(m):
    tok = m.tokenizer
    texts = [PROMPT, "Once upon a time, in a land far away,", "def fib(n):\n    return",
             "1, 2, 3, 4, 5, 6, 7, 8,"]
    greedy = SamplingParams()
    sampled = SamplingParams(temperature=0.9, top_k=20, seed=5)
    return [GenRequest(tok.encode(texts[0]), 20, greedy, ignore_eos=True),
            GenRequest(tok.encode(texts[1]) * 3, 14, greedy, ignore_eos=True),   # a chunked prompt (> max_batch)
            GenRequest(tok.encode(texts[2]), 11, sampled, ignore_eos=True),       # decodes beside them unspeculated
            GenRequest(tok.encode(texts[3]), 17, greedy, ignore_eos=True, stop=("\n\n",))]


def _unspeculated(m):
    """Greedy requests that do not speculate: a grammar's (its mask on the
    device) and one whose log-probabilities are reported (logits on the host)."""
    tok = m.tokenizer
    g = compile_grammar(tok, "gbnf", 'root ::= [a-z ]+ "." [a-z ]*', "grammar")
    return [GenRequest(tok.encode("Say it in words:"), 9, grammar=g, ignore_eos=True),
            GenRequest(tok.encode("Numbers: 1, 2,"), 7, n_probs=3, ignore_eos=True)]


def _run(eng, cfg, reqs, arrive, draft=0, spec_cls=None, step_log=None):
    """Each request's tokens and finish: request i is added before turn arrive[i]."""
    runner = Runner(eng, cfg, mtp_draft=draft, step_log=step_log)
    if spec_cls is not None:
        runner.spec = spec_cls(eng, draft)
        runner.spec.bind(runner)
    events: list[list[Event]] = [[] for _ in reqs]
    jobs = [runner.make_job(r, events[i].append) for i, r in enumerate(reqs)]
    turn = 0
    while turn < 2000:
        for i, a in enumerate(arrive):
            if a == turn:
                runner.add(jobs[i])
        if not runner.step() and turn > max(arrive):
            break
        turn += 1
    runner.settle()
    assert all(j.done for j in jobs), "a request never ended"
    out = [([e.token for e in ev if e.token is not None], ev[-1].finish) for ev in events]
    return out, jobs, runner


@pytest.mark.parametrize("arch,mode", [("qwen35", "batch"), ("qwen35moe", "batch"), ("qwen35", "slices")])
def test_speculative_tokens_equal_plain(device, qwen35_loaded, arch, mode):
    m = qwen35_loaded(arch)
    slots = 3 if mode == "batch" else 1
    eng = _engine(device, m, n_slots=slots)
    cfg = SchedulerConfig(n_slots=slots, max_live=3, step_tokens=16, quantum=3, newcomer_first=mode == "slices",
                          host_cache=3)   # (finished sequences' state kept on the host: the follow-up's prefix)
    reqs = _requests(m) + _unspeculated(m)
    arrive = [0, 2, 3, 9, 1, 5]
    first, _, _ = _run(eng, cfg, reqs[:1], [0])
    # the conversation's next turn, once the first reply is done: its state is reused (the prefix cache)
    reqs.append(GenRequest(list(reqs[0].prompt) + first[0][0] + m.tokenizer.encode(" And then"), 10,
                           ignore_eos=True))
    arrive.append(60)
    want, _, _ = _run(eng, cfg, reqs, arrive)
    got, jobs, runner = _run(eng, cfg, reqs, arrive, draft=2)
    assert got == want
    assert [j.spec for j in jobs] == [True, True, False, True, False, False, True]
    assert sum(j.drafted for j in jobs) >= 10 and runner.spec.steps > 0
    # (from the first turn's finished state, or from it still running, parked, in slices mode)
    assert jobs[-1].seq.cache_hit > len(reqs[0].prompt)
    if mode == "slices":
        assert runner.sched.stats["parks"] > 0 and runner.sched.stats["restores"] > 0


def test_verify_steps_beside_device_draws_and_host_logits(device, qwen35_loaded):
    """A verify step that also holds a row drawn on the device (as on GPUs), one
    whose logits the host reads (n_probs) and a grammar's (its mask then applied
    on the host) reads the logits and keeps the device's draw for that row, as
    the runner's own steps do: every request's tokens equal those without drafts."""
    m = qwen35_loaded("qwen35")
    eng = _engine(device, m, n_slots=4, device_sampling=True)
    cfg = SchedulerConfig(n_slots=4, max_live=4, step_tokens=16)
    tok = m.tokenizer
    reqs = [GenRequest(tok.encode(PROMPT), 14, ignore_eos=True),
            GenRequest(tok.encode("Once upon a time"), 10, SamplingParams(temperature=1.5, top_k=40, seed=3),
                       ignore_eos=True),
            GenRequest(tok.encode("Numbers: 1, 2,"), 10, n_probs=3, ignore_eos=True),
            _unspeculated(m)[0]]
    want, _, _ = _run(eng, cfg, reqs, [0, 0, 0, 0])
    got, jobs, runner = _run(eng, cfg, reqs, [0, 0, 0, 0], draft=2)
    assert got == want
    assert [j.spec for j in jobs] == [True, False, False, False] and jobs[1].on_device and jobs[3].masked
    assert runner.spec.steps >= 8 and jobs[0].drafted > 0


class _Forced(Speculator):
    """The MTP block's drafts replaced before each verify step by the true
    continuation (right) or by it with the second draft wrong (half), so that
    verify steps accept all drafts or roll back mid-step. (The drafts are
    replaced on the host, so no verify step reads them on the device: each
    turn's runs after the MTP steps' drafts reach the host.)"""
    truth: dict[int, list[int]] = {}
    half = False

    def _submit_verify(self, dec, on_device=False):
        return None if on_device else super()._submit_verify(dec)

    def turn(self, batch):
        for w in batch.work:
            job = w.seq.data
            if job.drafts and job.mtp_at == w.start + 1:
                t = self.truth[id(job.req)]
                job.drafts = list(t[job.mtp_at:job.mtp_at + len(job.drafts)])
                if self.half and len(job.drafts) > 1:
                    job.drafts[1] = (job.drafts[1] + 1) % self.e.n_vocab
        super().turn(batch)


@pytest.mark.parametrize("half", [False, True])
def test_forced_drafts_keep_tokens(device, qwen35_loaded, half):
    m = qwen35_loaded("qwen35")
    eng = _engine(device, m)
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    reqs = [r for i, r in enumerate(_requests(m)) if i != 2]
    arrive = [0, 1, 4]
    want, _, _ = _run(eng, cfg, reqs, arrive)
    _Forced.truth = {id(r): list(r.prompt) + toks for r, (toks, _) in zip(reqs, want)}
    _Forced.half = half
    got, jobs, runner = _run(eng, cfg, reqs, arrive, draft=3, spec_cls=_Forced)
    assert got == want
    drafted, accepted = sum(j.drafted for j in jobs), sum(j.accepted for j in jobs)
    assert drafted >= 10
    if half:
        assert 0 < accepted < drafted     # the second draft always rejected: rolled back after row 1
    else:
        assert accepted == drafted
        n_tokens = sum(len(t) for t, _ in want)
        assert runner.spec.steps <= n_tokens // 2    # several tokens a verify step


def test_context_end_and_budget(device, qwen35_loaded):
    """Drafts stop at the context length and at max_tokens: the reply ends as without them."""
    m = qwen35_loaded("qwen35")
    eng = _engine(device, m, n_slots=2, n_ctx=40)
    cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=16)
    ids = m.tokenizer.encode(PROMPT)
    reqs = [GenRequest(ids, 100, ignore_eos=True), GenRequest(ids[:5], 3, ignore_eos=True)]
    want, _, _ = _run(eng, cfg, reqs, [0, 0])
    _Forced.truth = {id(r): list(r.prompt) + toks for r, (toks, _) in zip(reqs, want)}
    _Forced.half = False
    got, _, _ = _run(eng, cfg, reqs, [0, 0], draft=3, spec_cls=_Forced)
    assert got == want
    assert want[0][1] == "length" and len(want[0][0]) == 40 - len(ids) + 1


def test_speculation_needs_an_mtp_block_and_rows(device, qwen35_loaded):
    m = qwen35_loaded("qwen35")
    eng = _engine(device, m, rows=1, n_slots=1)
    with pytest.raises(VkEngineError, match="snapshot rows"):
        Runner(eng, SchedulerConfig(n_slots=1, max_live=1), mtp_draft=2)
    with pytest.raises(VkEngineError, match="--draft"):
        Speculator(_engine(device, m, n_slots=1), 0)


@pytest.mark.parametrize("arch", ARCHES)
def test_drafts_accepted_with_the_mtp_accept_model(device, accept_models, arch):
    """`synth --mtp-accept`'s model: its own MTP block's drafts are accepted
    (nearly) always, in several sequences' verify steps at once, and the tokens
    stay those of plain decoding."""
    m = load_model(accept_models[arch]["gguf"])
    eng = _engine(device, m)
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    reqs = [r for i, r in enumerate(_requests(m)) if i != 2]
    arrive = [0, 1, 4]
    want, _, _ = _run(eng, cfg, reqs, arrive)
    log = io.StringIO()
    got, jobs, runner = _run(eng, cfg, reqs, arrive, draft=3, step_log=log)
    assert got == want
    drafted, accepted = sum(j.drafted for j in jobs), sum(j.accepted for j in jobs)
    assert drafted >= 20 and accepted >= 0.9 * drafted, (accepted, drafted)
    assert runner.spec.steps <= sum(len(t) for t, _ in want) // 2
    assert runner.spec.chained > 0    # (verify steps that read their drafts on the device: Speculator.ahead)
    verify = [x for x in map(json.loads, log.getvalue().splitlines()) if "drafted" in x]   # the step log's lines
    assert len(verify) == runner.spec.steps and sum(x["drafted"] for x in verify) == drafted
    assert sum(x["accepted"] for x in verify) == accepted and all(x["dt_ms"] >= x["wait_ms"] >= 0 for x in verify)


def test_no_room_for_drafts_runs_plain_chained_steps(device, qwen35_loaded):
    """More sequences decoding than a verify step has rows for drafts: their
    steps run as the runner's own (chained), and drafting resumes when a
    sequence leaves; the tokens stay those of plain decoding."""
    m = qwen35_loaded("qwen35")
    eng = _engine(device, m, n_slots=3, rows=3)            # three decode rows leave none for drafts
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    reqs = [r for i, r in enumerate(_requests(m)) if i != 2]
    want, _, _ = _run(eng, cfg, reqs, [0, 0, 0])
    got, jobs, runner = _run(eng, cfg, reqs, [0, 0, 0], draft=2)
    assert got == want
    assert runner.chained_steps > 0 and runner.spec.steps > 0 and sum(j.drafted for j in jobs) > 0


def test_a_request_caps_its_drafts(device, accept_models):
    """GenRequest.draft_max (llama-server's speculative.n_max): 0 decodes
    without drafts, 1 drafts one token a step; the tokens stay the same."""
    m = load_model(accept_models["qwen35"]["gguf"])
    eng = _engine(device, m)
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    ids = m.tokenizer.encode(PROMPT)
    reqs = [GenRequest(ids, 16, ignore_eos=True, draft_max=d) for d in (None, 1, 0)]
    want, _, _ = _run(eng, cfg, reqs, [0, 0, 0])
    got, jobs, _ = _run(eng, cfg, reqs, [0, 0, 0], draft=3)
    assert got == want
    assert [j.spec for j in jobs] == [True, True, False] and jobs[2].drafted == 0
    assert jobs[0].drafted > jobs[1].drafted > 0
    assert jobs[1].drafted <= 8     # one draft a step: at most 2 of its 16 tokens a step (the first: the prompt's)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("ahead", [False, True, "spec"])
def test_verify_steps_follow_the_mtp_steps_on_the_device(device, accept_models, arch, ahead):
    """A lone stream: every verify step after the first is submitted behind the
    MTP steps that draft it, reading their drafts on the device (Engine.submit's
    draft_rows; Speculator.ahead), and the tokens stay those of plain decoding;
    a request arriving meanwhile joins at the next turn, and its tokens are its own.
    ahead: Options.mtp_block_ahead (the default), the next MTP block behind that verify step too;
    "spec": with Options.mtp_spec_drafts, the all-accepted row's 2 drafts behind that block."""
    m = load_model(accept_models[arch]["gguf"])
    eng = _engine(device, m, options=Options(mtp_block_ahead=bool(ahead), mtp_spec_drafts=ahead == "spec"))
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    ids = m.tokenizer.encode(PROMPT)
    reqs = [GenRequest(ids, 25, ignore_eos=True)]
    want, _, _ = _run(eng, cfg, reqs, [0])
    seen = []     # steps in flight after each submit
    submit = eng.submit

    def counted(*a, **kw):
        submit(*a, **kw)
        seen.append(eng.in_flight)

    eng.submit = counted
    got, jobs, runner = _run(eng, cfg, reqs, [0], draft=3)
    del eng.submit
    assert got == want and jobs[0].accepted >= 0.9 * jobs[0].drafted > 0
    assert runner.spec.chained == runner.spec.steps - 1 > 0, (runner.spec.chained, runner.spec.steps)
    # the turn's MTP block and its 2 chained drafts on a ring of their own (Engine.reserve_mtp), the next
    # verify step behind them (and with the block ahead, the next block behind that; with spec, its 2 drafts
    # too, on a ring of 6): 4 (5, 7) steps in flight at once, past the hybrid state's max_in_flight of 2
    depth, most = {False: (3, 4), True: (4, 5), "spec": (6, 7)}[ahead]
    assert eng.max_in_flight == 2 and eng.mtp_depth == depth and max(seen) == most, \
        (eng.max_in_flight, eng.mtp_depth, max(seen))
    assert (runner.spec.spec_used > 0) == (ahead == "spec")
    late = GenRequest(m.tokenizer.encode("def fib(n):"), 9, ignore_eos=True)
    want2, _, _ = _run(eng, cfg, [reqs[0], late], [0, 3])
    got2, _, runner = _run(eng, cfg, [reqs[0], late], [0, 3], draft=3)
    assert got2 == want2 and got2[0] == want[0] and runner.spec.chained > 0


def test_a_reply_ending_mid_turn_behind_a_verify_step_ahead(device, accept_models):
    """A stop string met among a verify step's accepted tokens, with the next
    verify step already on the device (submitted before the tokens were
    taken): the reply ends where plain decoding ends it, the rows ahead are
    dropped, and a follow-up sharing its prefix (the slot's state reused, or
    not, by its lengths) gets plain decoding's tokens."""
    m = load_model(accept_models["qwen35"]["gguf"])
    eng = _engine(device, m)
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16, host_cache=2)
    tok = m.tokenizer
    ids = tok.encode(PROMPT)
    (plain, _), = _run(eng, cfg, [GenRequest(ids, 30, ignore_eos=True)], [0])[0]
    stop = tok.decode(plain[9:11])
    assert stop and stop not in tok.decode(plain[:9])
    reqs = [GenRequest(ids, 30, ignore_eos=True, stop=(stop,))]
    want, _, _ = _run(eng, cfg, reqs, [0])
    assert want[0][1] == "stop" and len(want[0][0]) < 30
    got, jobs, runner = _run(eng, cfg, reqs, [0], draft=3)
    assert got == want and runner.spec.chained > 0 and jobs[0].accepted > 0
    follow = GenRequest(ids + want[0][0] + tok.encode(" and"), 8, ignore_eos=True)
    want2, _, _ = _run(eng, cfg, [reqs[0], follow], [0, 40])
    got2, _, _ = _run(eng, cfg, [reqs[0], follow], [0, 40], draft=3)
    assert got2 == want2


@pytest.mark.parametrize("drafts", ["accepted", "rejected"])
def test_requests_ended_while_a_verify_step_is_ahead(device, accept_models, qwen35_loaded, drafts):
    """With a verify step on the device ahead of the host (Speculator.ahead):
    one request cancelled (its rows dropped, the other's tokens stay plain
    decoding's), then every request ended at once (cancel_all, as a deadline
    does), and the runner goes on serving a new request; with drafts the model
    accepts, and with drafts it rejects (each verify step then rolls back,
    a slot left by then has nothing to roll back)."""
    m = load_model(accept_models["qwen35"]["gguf"]) if drafts == "accepted" else qwen35_loaded("qwen35")
    eng = _engine(device, m)
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    ids = m.tokenizer.encode(PROMPT)
    reqs = [GenRequest(ids, 40, ignore_eos=True), GenRequest(m.tokenizer.encode("def fib(n):"), 24, ignore_eos=True)]
    want, _, _ = _run(eng, cfg, reqs, [0, 0])
    runner = Runner(eng, cfg, mtp_draft=3)
    events: list[list[Event]] = [[], []]
    jobs = [runner.make_job(r, events[i].append) for i, r in enumerate(reqs)]
    for j in jobs:
        runner.add(j)
    for _ in range(200):
        runner.step()
        if runner.spec.ahead is not None and len(jobs[0].seq.tokens) > len(ids) + 4:
            break
    assert runner.spec.ahead is not None
    runner.cancel(jobs[0])
    for _ in range(400):
        if jobs[1].done:
            break
        runner.step()
    assert jobs[0].finish == "cancelled" and [e.token for e in events[1] if e.token is not None] == want[1][0]
    more = [runner.make_job(r, lambda e: None) for r in reqs]
    for j in more:
        runner.add(j)
    for _ in range(200):
        runner.step()
        if runner.spec.ahead is not None or runner.held is not None:
            break
    assert runner.spec.ahead is not None or runner.held is not None
    runner.cancel_all("stopping")
    assert all(j.done for j in more)
    last: list[Event] = []
    job = runner.make_job(GenRequest(ids, 12, ignore_eos=True), last.append)
    runner.add(job)
    for _ in range(200):
        if job.done:
            break
        runner.step()
    runner.settle()
    assert [e.token for e in last if e.token is not None] == want[0][0][:12]


@pytest.mark.parametrize("ahead", [False, True, "spec"])
def test_prepared_turns_leave_a_streams_turns_nothing_to_record(device, accept_models, ahead):
    """prepare_turns (`generate --mtp`; the server's idle time) records a lone
    stream's verify steps, MTP blocks and chained drafts ahead: the stream's
    turns then record nothing but its prompt's steps and its last turn's
    shorter ones, and its tokens stay those of plain decoding. ahead:
    Options.mtp_block_ahead (the default), whose turns after the first run the
    block over all 4 rows on any of the ring's 4 buffers, the first chained
    draft from any of those rows, and verify steps reading any of them; "spec":
    with Options.mtp_spec_drafts too (a ring of 6), the all-accepted row's
    drafts behind each block and the verify steps reading them."""
    m = load_model(accept_models["qwen35moe"]["gguf"])
    eng = _engine(device, m, n_slots=1, rows=4,
                  options=Options(mtp_block_ahead=bool(ahead), mtp_spec_drafts=ahead == "spec"))
    assert turn_keys(eng, 3) == []                 # (no MTP ring reserved yet)
    # 10 of the first turn's kind; ahead: verify steps (2 buffers) and first chained drafts (ring buffers)
    # for each of 4 accepted counts, and the block and the second chained draft on each ring buffer;
    # spec: verify steps (2) and 2 spec drafts on each ring buffer
    ring = 6 if ahead == "spec" else 4
    want = 10 + (4 * (2 + ring) + ring * 2 if ahead else 0) + (2 + 2 * ring if ahead == "spec" else 0)
    assert prepare_turns(eng, 3) == len(turn_keys(eng, 3)) == want and prepare_turns(eng, 3) == 0
    cfg = SchedulerConfig(n_slots=1, max_live=1, step_tokens=16)
    reqs = [GenRequest(m.tokenizer.encode(PROMPT), 30, ignore_eos=True)]
    want, _, _ = _run(eng, cfg, reqs, [0])
    recorded = []
    record = eng._record

    def counted(n, n_out, readback, *a, **kw):
        recorded.append((n, n_out, kw.get("pass_")))
        return record(n, n_out, readback, *a, **kw)

    eng._record = counted
    got, jobs, runner = _run(eng, cfg, reqs, [0], draft=3)
    del eng._record
    assert got == want and jobs[0].accepted >= 0.9 * jobs[0].drafted > 0
    assert runner.spec.chained >= 5 and (runner.spec.spec_used > 0) == (ahead == "spec")
    # only its prompt's: two chunks' steps (hidden rows kept) and the MTP block over each; no verify step
    # (snapshots), no chained draft (mtp_hn), even after the prompt's MTP steps (the ring restarts a turn)
    assert len(recorded) <= 4, recorded
    assert not any(p.snapshots or p.hidden == "mtp_hn" for _, _, p in recorded), recorded


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("spec", [False, True])
def test_block_ahead_keeps_tokens(device, accept_models, qwen35_loaded, arch, spec):
    """Options.mtp_block_ahead: the MTP block submitted behind each verify step
    ahead, over all its rows, drafting from the row of the last accepted
    position: the tokens equal plain decoding with drafts accepted (the
    always-accepted model: several sequences, arrivals, a lone stream), in part
    and rejected (random MTP weights), beside unspeculated requests (sampled,
    grammar-held, logit-reporting); the blocks ahead are used. spec
    (Options.mtp_spec_drafts): the chained drafts of the all-accepted row
    behind the block too, taken by the turns that accept every draft (the
    always-accepted model's lone stream: every turn after the first), and
    submitted only after a turn that took every draft (a lone stream with
    rejections: fewer turns than blocks ahead)."""
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16)
    for m in (load_model(accept_models[arch]["gguf"]), qwen35_loaded(arch)):
        eng = _engine(device, m, options=Options(mtp_block_ahead=True, mtp_spec_drafts=spec))
        reqs = _requests(m) + _unspeculated(m)
        arrive = [0, 2, 3, 9, 1, 5]
        want, _, _ = _run(eng, cfg, reqs, arrive)
        got, jobs, runner = _run(eng, cfg, reqs, arrive, draft=3)
        assert got == want and sum(j.drafted for j in jobs) >= 10
        greedy = [r for i, r in enumerate(_requests(m)) if i != 2]   # (every live sequence speculates: steps ahead)
        want, _, _ = _run(eng, cfg, greedy, [0, 1, 4])
        got, jobs, runner = _run(eng, cfg, greedy, [0, 1, 4], draft=3)
        assert got == want and runner.spec.blocks_ahead > 0
        lone = [GenRequest(m.tokenizer.encode(PROMPT), 25, ignore_eos=True)]
        want, _, _ = _run(eng, cfg, lone, [0])
        got, jobs, runner = _run(eng, cfg, lone, [0], draft=3)
        assert got == want and runner.spec.blocks_ahead == runner.spec.chained > 0
        if m.args.n_nextn and jobs[0].accepted:   # (the always-accepted model: every turn behind the one before)
            assert jobs[0].accepted >= 0.9 * jobs[0].drafted and runner.spec.chained == runner.spec.steps - 1
            if spec:   # (its last turns draft fewer: the reply's end)
                assert runner.spec.spec_used >= runner.spec.blocks_ahead - 3 > 0, \
                    (runner.spec.spec_used, runner.spec.blocks_ahead)
        if not spec:
            assert runner.spec.spec_used == runner.spec.spec_turns == 0
        else:   # only after a turn that took every draft (or before the first): never a rejected turn's
            assert runner.spec.spec_turns <= runner.spec.full_turns + 1, (runner.spec.spec_turns,
                                                                          runner.spec.full_turns)
            if not m.args.n_nextn or jobs[0].accepted < jobs[0].drafted:   # (random MTP weights: rejections)
                assert runner.spec.spec_turns < runner.spec.blocks_ahead, (runner.spec.spec_turns,
                                                                           runner.spec.blocks_ahead)
