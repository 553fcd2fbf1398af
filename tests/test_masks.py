"""Grammars' token masks on the device (issue 33): Engine.submit(masked=True)
chooses each output row's token among those its bitmask allows, its masks
given with the step or after it (a chained step's, computed while its forward
runs); the runner masks greedy and device-drawn rows there, still chaining,
with the tokens the host path gives."""
from __future__ import annotations

import json

import numpy as np
import pytest

from server.worker import Event, GenRequest, Worker
from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.kernels import Kernels
from vkengine.serving.constrain import compile_grammar
from vkengine.serving.sampling import SamplingParams
from vkengine.serving.scheduler import SchedulerConfig

from .serving import CTX, tiny_gguf, tiny_model  # noqa: F401  (fixtures)

TEXTS = ("The history of the city begins", "Once upon a time", "Q: 2+2=? A:")


@pytest.fixture(scope="module")
def eng(device, tiny_model):
    return Engine(tiny_model, device, EngineConfig(n_slots=3, n_ctx=CTX, max_batch=64, max_out=3, max_in_flight=3,
                                                   device_sampling=True))


def _bits(allowed: np.ndarray, V: int) -> np.ndarray:
    """bool (rows, V) -> uint32 words (rows, mask_words)"""
    W = Kernels.mask_words(V)
    pad = np.zeros((allowed.shape[0], W * 32), bool)
    pad[:, :V] = allowed
    return np.packbits(pad.reshape(len(pad), -1, 8)[:, :, ::-1], axis=-1).reshape(len(pad), W, 4)[:, :, ::-1] \
        .copy().view(">u4").reshape(len(pad), W).astype(np.uint32)


def _prompts(tiny_model):
    return [tiny_model.tokenizer.encode(t) for t in TEXTS]


def _rows(ids_list):
    toks, pos, slots, outs = [], [], [], []
    for s, ids in enumerate(ids_list):
        toks += ids
        pos += range(len(ids))
        slots += [s] * len(ids)
        outs.append(len(toks) - 1)
    return toks, pos, slots, outs


def test_bits_helper_matches_llguidance_layout():
    a = np.zeros((1, 70), bool)
    a[0, [0, 33, 69]] = True
    w = _bits(a, 70)
    assert list(w[0]) == [1, 2, 32]


def test_masked_argmax_is_the_best_allowed_token(eng, tiny_model):
    V = tiny_model.args.n_vocab
    toks, pos, slots, outs = _rows(_prompts(tiny_model))
    lg = eng.step(toks, pos, slots, outs, Readback.LOGITS)
    rng = np.random.default_rng(3)
    allowed = np.ones((3, V), bool)
    allowed[1] = rng.random(V) < 0.01           # a sparse grammar
    allowed[1, V - 1] = True                     # the last, partial word
    allowed[2] = True
    allowed[2, np.argsort(lg[2])[-5:]] = False   # the five best forbidden
    eng.submit(toks, pos, slots, outs, Readback.ARGMAX, masked=True, masks=_bits(allowed, V))
    got = eng.collect()
    want = np.where(allowed, lg, -np.inf).argmax(-1)
    assert list(got) == list(want)
    assert got[0] == lg[0].argmax()


@pytest.mark.parametrize("poll", [False, True])
def test_chained_masked_steps_take_masks_after_the_step_before(eng, tiny_model, poll):
    """Two decode steps chained on the device, the second's masks given after
    the first is collected (as the runner does), against the same tokens chosen
    on the host from the logits; poll: collect() watches for the tokens in host
    memory before the fence wait (Options.poll_picks)."""
    eng.poll_picks = poll
    V = tiny_model.args.n_vocab
    prompts = _prompts(tiny_model)
    toks, pos, slots, outs = _rows(prompts)
    rng = np.random.default_rng(5)
    masks = [rng.random((3, V)) < 0.3 for _ in range(3)]
    # the host's way: logits, mask, argmax, one step at a time
    want, cur = [], eng.step(toks, pos, slots, outs, Readback.LOGITS)
    lens = [len(p) for p in prompts]
    for k in range(3):
        t = np.where(masks[k], cur, -np.inf).argmax(-1)
        want.append(list(t))
        if k < 2:
            cur = eng.step(list(t), [n + k for n in lens], [0, 1, 2], [0, 1, 2], Readback.LOGITS)
    # the device's: prompt step masked (masks at once), then two chained masked steps
    eng.submit(toks, pos, slots, outs, Readback.ARGMAX, masked=True, masks=_bits(masks[0], V))
    eng.submit([0, 0, 0], lens, [0, 1, 2], [0, 1, 2], Readback.ARGMAX, chain=[0, 1, 2], masked=True)
    with pytest.raises(RuntimeError, match="submit_masks"):
        eng.submit([0, 0, 0], [n + 1 for n in lens], [0, 1, 2], [0, 1, 2], Readback.ARGMAX, chain=[0, 1, 2])
    got = [list(eng.collect())]
    eng.submit_masks(_bits(masks[1], V))
    eng.submit([0, 0, 0], [n + 1 for n in lens], [0, 1, 2], [0, 1, 2], Readback.ARGMAX, chain=[0, 1, 2],
               masked=True)
    got.append(list(eng.collect()))
    eng.submit_masks(_bits(masks[2], V))
    got.append(list(eng.collect()))
    eng.poll_picks = False
    assert got == want


def test_masked_draws_stay_in_the_mask(eng, tiny_model):
    V = tiny_model.args.n_vocab
    toks, pos, slots, outs = _rows(_prompts(tiny_model))
    lg = eng.step(toks, pos, slots, outs, Readback.LOGITS)
    allowed = np.zeros((3, V), bool)
    for r in range(3):                           # every token but the 20 best, and a few of those
        allowed[r] = True
        allowed[r, np.argsort(lg[r])[-20:-2]] = False
    for u in np.linspace(0.0, 0.99, 12):
        samp = [(1.5, 64, 1.0, 0.0, float(u))] * 3
        eng.submit(toks, pos, slots, outs, Readback.SAMPLE, sampling=samp, masked=True, masks=_bits(allowed, V))
        got = eng.collect()
        assert all(allowed[r, got[r]] for r in range(3)), (u, got)


def test_masked_step_misuse_is_refused(eng, tiny_model):
    V = tiny_model.args.n_vocab
    toks, pos, slots, outs = _rows(_prompts(tiny_model)[:1])
    with pytest.raises(ValueError, match="LOGITS"):
        eng.submit(toks, pos, slots, outs, Readback.LOGITS, masked=True)
    with pytest.raises(ValueError, match="words"):
        eng.submit(toks, pos, slots, outs, Readback.ARGMAX, masked=True, masks=np.zeros((1, 3), np.uint32))
    with pytest.raises(RuntimeError, match="never given"):
        eng.collect()
    eng.submit_masks(np.full((1, Kernels.mask_words(V)), -1, np.int32))
    eng.collect()
    with pytest.raises(RuntimeError, match="waits for its masks"):
        eng.submit_masks(np.zeros((1, Kernels.mask_words(V)), np.uint32))


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _run(device, model, reqs, cfg, **eng_kw):
    eng = Engine(model, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=64, max_out=cfg.n_slots,
                                             max_in_flight=3, **eng_kw))
    w = Worker(eng, cfg)
    events: list[list[Event]] = [[] for _ in reqs]
    for i, r in enumerate(reqs):
        w.submit(r, events[i].append)
        w.run_once()
    w.run_until_idle()
    return [[e.token for e in evs if e.token is not None] for evs in events], events, w


def test_runner_masks_on_the_device_and_still_chains(device, tiny_model):
    """Constrained greedy requests beside unconstrained ones: masked on the
    device (no logits read back), decode steps still chained, the JSON valid,
    and every request's tokens those of the host path (logprobs asked: the
    host masks and picks) and, for the unconstrained ones, of running alone."""
    tok = tiny_model.tokenizer
    g = compile_grammar(tok, "json_schema", SCHEMA, "json_schema")
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16, quantum=8)
    prompts = [tok.encode(t) for t in TEXTS]
    reqs = [GenRequest(prompts[0], 60, SamplingParams(), grammar=g),
            GenRequest(prompts[1], 20, SamplingParams(), ignore_eos=True),
            GenRequest(prompts[2], 60, SamplingParams(), grammar=g)]
    dev, evs, w = _run(device, tiny_model, reqs, cfg)
    assert w.runner.chained_steps > 0
    host, _, _ = _run(device, tiny_model, [GenRequest(r.prompt, r.max_tokens, r.sampling, ignore_eos=r.ignore_eos,
                                                      grammar=r.grammar, n_probs=1) for r in reqs], cfg)
    assert dev == host
    alone, _, _ = _run(device, tiny_model, [reqs[1]], SchedulerConfig(n_slots=1, max_live=1, step_tokens=16))
    assert dev[1] == alone[0]
    for i in (0, 2):
        text = tok.decode(dev[i])
        assert evs[i][-1].finish == "stop", text
        assert set(json.loads(text)) == {"name", "age", "tags"}


def test_runner_masks_device_drawn_rows(device, tiny_model):
    """Sampled constrained requests drawn on the device (device_sampling): the
    mask holds there too, so every reply parses, chained as greedy ones."""
    tok = tiny_model.tokenizer
    g = compile_grammar(tok, "json_schema", SCHEMA, "json_schema")
    cfg = SchedulerConfig(n_slots=3, max_live=3, step_tokens=16, quantum=8)
    reqs = [GenRequest(tok.encode(TEXTS[i % 3]), 60, SamplingParams(temperature=1.0, seed=i), grammar=g)
            for i in range(3)]
    toks, evs, w = _run(device, tiny_model, reqs, cfg, device_sampling=True)
    assert w.runner.chained_steps > 0
    for t, e in zip(toks, evs):
        assert e[-1].finish == "stop"
        json.loads(tok.decode(t))


def test_an_older_llguidance_takes_one_end_of_turn_id(monkeypatch, tiny_model):
    """llguidance 1.6 (the GPU kit's) takes one eos_token id, not a list: the
    tokenizer view is built with the first end-of-turn id, and grammars compile
    and constrain (run 43: every grammar failed to compile there)."""
    import copy

    import llguidance

    from vkengine.serving import constrain
    real, given = llguidance.LLTokenizer, []

    def old_api(*a, eos_token=None, **kw):
        if isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        given.append(eos_token)
        return real(*a, eos_token=eos_token, **kw)
    monkeypatch.setattr(llguidance, "LLTokenizer", old_api)
    tok = copy.copy(tiny_model.tokenizer)
    if "_llg" in tok.__dict__:
        object.__delattr__(tok, "_llg")
    g = compile_grammar(tok, "gbnf", 'root ::= "yes" | "no"', "grammar")
    assert given == [min(tok.eot_ids)]
    # and it constrains: the greedy choice under the mask, token by token, spells an allowed answer
    c = constrain.Constraint(tok, g)
    rng = np.random.default_rng(0)
    out: list[int] = []
    while not c.stopped and len(out) < 8:
        t = int(np.argmax(c.apply(rng.standard_normal(tiny_model.args.n_vocab).astype(np.float32))))
        assert c.take(t)
        out.append(t)
    assert c.stopped and tok.decode(out) in ("yes", "no")
