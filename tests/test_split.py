"""A model split across devices by layers (vkengine/split.py, issue 36), tested
without two GPUs: each part on a Vulkan device of its own over the one
physical device (two kp managers; lavapipe here, one H200 in the GPU kit).
The split engine gives the whole engine's logits bit for bit (the kernels of
every layer are the same, only the residual stream crosses through the host),
for prompts in chunks, batched decode rows, parked and restored sequences,
and the server's runner with interleaved requests."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vkengine.device import Device
from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.errors import VkEngineError
from vkengine.models.base import Part
from vkengine.serving.runner import GenRequest, Runner
from vkengine.serving.sampling import SamplingParams
from vkengine.serving.scheduler import SchedulerConfig
from vkengine.split import SplitEngine, parse_split, plan_parts

from .serving import serve, tiny_gguf, tiny_model  # noqa: F401 (shared fixtures)
from .test_models_qwen35 import PROMPT, qwen35_loaded, qwen35_models  # noqa: F401 (shared fixtures)


@pytest.fixture(scope="module")
def devices(device):
    """Three more Vulkan devices on the test device's physical one (parts' own)."""
    devs = [Device(device.info.index) for _ in range(3)]
    yield devs
    for d in devs:
        d.close()


@pytest.fixture(scope="module")
def window_models(tmp_path_factory, tokenizer_source):
    """Tiny gemma2, gemma3 and gpt-oss models (sliding-window layers in rings; gpt-oss: MXFP4 experts)."""
    from vkengine.model import load_model
    from vkengine.tools.synth.llama import synth_llama

    from .test_models_gemma import CONFIGS
    from .test_models_gptoss import CONFIG
    out = tmp_path_factory.mktemp("synth-split")
    specs = {**{a: (c, "q8_0") for a, c in CONFIGS.items()}, "gpt-oss": (CONFIG, "mxfp4")}
    return {a: load_model(synth_llama(c, q, seed=3, out_dir=out, name=f"{a}-split", workers=1,
                                      tokenizer_from=tokenizer_source, formats=("gguf",))["gguf"])
            for a, (c, q) in specs.items()}


@pytest.fixture
def model_of(request, tiny_model, qwen35_loaded):   # noqa: F811
    def get(name):
        if name == "smollm2":   # the embedded model (30 layers: three parts)
            return request.getfixturevalue("smollm2")
        if name in ("gemma2", "gemma3", "gpt-oss"):
            return request.getfixturevalue("window_models")[name]
        return tiny_model if name == "llama" else qwen35_loaded(name)
    return get


# -- planning ---------------------------------------------------------------------------

def test_plan_parts():
    assert plan_parts(30, [1, 1]) == [Part(0, 15, 30), Part(15, 30, 30)]
    assert plan_parts(4, [3, 1]) == [Part(0, 3, 4), Part(3, 4, 4)]
    assert plan_parts(10, [1, 2, 1]) == [Part(0, 2, 10), Part(2, 8, 10), Part(8, 10, 10)]
    # every device at least one layer, whatever the proportions
    assert plan_parts(3, [0, 1, 0]) == [Part(0, 1, 3), Part(1, 2, 3), Part(2, 3, 3)]
    assert plan_parts(4, [100, 1]) == [Part(0, 3, 4), Part(3, 4, 4)]
    p = Part(2, 4, 4)
    assert p.last and not p.first and p.owns(3) and p.owns(4) and not p.owns(1)   # (4: an MTP block)
    assert not Part(0, 2, 4).owns(4)
    with pytest.raises(VkEngineError, match="cannot be split across 3"):
        plan_parts(2, [1, 1, 1])
    with pytest.raises(VkEngineError, match="at least two"):
        plan_parts(4, [1])


def test_parse_split():
    assert parse_split(None, 3) == [1.0, 1.0, 1.0]
    assert parse_split("3,2", 2) == [3.0, 2.0]
    for bad, msg in (("3", "1 proportions for 2"), ("a,b", "comma-separated"), ("-1,2", "non-negative"),
                     ("0,0", "not all zero"), ("nan,1", "non-negative")):
        with pytest.raises(VkEngineError, match=msg):
            parse_split(bad, 2)


# -- the engine --------------------------------------------------------------------------

def _pair(device, devices, model, n_parts=2, split=None, **kw):
    cfg = EngineConfig(**{"n_slots": 3, "n_ctx": 96, "max_batch": 16, "max_out": 8, **kw})
    return Engine(model, device, cfg), SplitEngine(model, devices[:n_parts], cfg, split)


@pytest.mark.parametrize("name,n_parts,split", [("llama", 2, None), ("smollm2", 3, [1, 2, 1]), ("qwen35", 2, None),
                                                ("qwen35", 3, [1, 1, 2]), ("qwen35moe", 2, [1, 3]),
                                                ("gemma2", 3, None), ("gemma3", 2, [1, 2]), ("gpt-oss", 2, None)])
def test_split_logits_equal_whole(device, devices, model_of, name, n_parts, split):
    """Prompt chunks, then decode rows of several sequences in one step: the
    split engine's logits are the whole engine's, bit for bit (gemma, gpt-oss:
    prompts past the sliding window, each part's ring layers its own)."""
    m = model_of(name)
    whole, parted = _pair(device, devices, m, n_parts, split)
    try:
        assert [p.args.part for p in parted.parts] == plan_parts(m.args.n_layer, split or [1] * n_parts)
        rng = np.random.default_rng(3)
        prompts = [list(rng.integers(0, m.args.n_vocab, n)) for n in (37, 5, 20)]
        for e in (whole, parted):   # (slot s: prompt s in chunks of max_batch)
            for s, p in enumerate(prompts):
                e.prefill(p, s, readback=Readback.NONE)
        outs = []
        for e in (whole, parted):
            got = [e.step([7, 8, 9], [len(p) for p in prompts], [0, 1, 2], [0, 1, 2], Readback.LOGITS)]
            for i in range(3):   # greedy decode of all three, a step for all
                toks = e.step([int(t) for t in got[-1].argmax(1)], [len(p) + 1 + i for p in prompts], [0, 1, 2],
                              [0, 1, 2], Readback.LOGITS)
                got.append(toks)
            outs.append(got)
        for a, b in zip(*outs):
            np.testing.assert_array_equal(a, b)
    finally:
        whole.close()
        parted.close()


def test_split_boundary_norm_as_whole(device, devices, model_of):
    """On the GPUs' decode path (split-K matvecs with the RMSNorm split between
    a residual add and its readers, forced here on lavapipe) the part before
    the boundary computes the next layer's norm as the whole model does and
    hands h' with its sums of squares over: decode logits bit for bit."""
    import dataclasses as dc

    from vkengine.kernels import Caps

    from .test_models import GPU_DECODE
    m = model_of("llama")
    caps = dc.replace(Caps.detect(device), **GPU_DECODE, xq8_in=False)
    cfg = EngineConfig(n_slots=2, n_ctx=96, max_batch=16, max_out=8)
    whole = Engine(m, device, cfg, caps=caps)
    parted = SplitEngine(m, devices[:2], cfg, caps=[caps, caps])
    try:
        assert parted.parts[0].hands_norm(1) and parted.parts[0].hands_norm(2)
        ids = m.tokenizer.encode(PROMPT)[:10]
        got = []
        for e in (whole, parted):
            rows = [e.step([t, t], [p, p], [0, 1], [0, 1], Readback.LOGITS) for p, t in enumerate(ids)]
            rows.append(e.step([ids[0]], [len(ids)], [1], [0], Readback.LOGITS))
            got.append(rows)
        for a, b in zip(*got):
            np.testing.assert_array_equal(a, b)
        labels = [op.label for prog in parted.parts[0]._programs.values() for op in prog.ops if op.kind == "dispatch"]
        assert any(lb.endswith("x<-ff+rms_norm_parts") for lb in labels), labels   # (the boundary's, split)
    finally:
        whole.close()
        parted.close()


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_split_parks_each_part(device, devices, model_of, name):
    """A sequence parked from a slot, other sequences run there, then restored to
    another slot: it continues as it would have (each part parks its own
    layers' share), and a prefix copy serves a second sequence."""
    m = model_of(name)
    whole, parted = _pair(device, devices, m)
    try:
        rng = np.random.default_rng(5)
        p = list(rng.integers(0, m.args.n_vocab, 23))
        want = whole.prefill(p, 0, readback=Readback.LOGITS)
        want2 = whole.step([4], [23], [0], [0], Readback.LOGITS)
        parted.prefill(p, 0, readback=Readback.NONE)
        parked = parted.kv.park(0, 23)
        assert parked.length == 23 and len(parked.parts) == 2
        assert parked.buffer.nbytes == parted.kv.park_bytes(0, 23)
        parted.prefill(list(rng.integers(0, m.args.n_vocab, 30)), 0, readback=Readback.NONE)   # slot 0 reused
        parted.kv.restore(parked, 2)
        assert parted.kv.reusable_parked(parked, 23) == 23
        np.testing.assert_array_equal(parted.step([4], [23], [2], [0], Readback.LOGITS), want2)
        parted.kv.copy_prefix(2, 1, 24)
        assert parted.kv.reusable_prefix(2, 24) == 24
        np.testing.assert_array_equal(parted.step([9], [24], [1], [0], Readback.LOGITS),
                                      whole.step([9], [24], [0], [0], Readback.LOGITS))
        # a pooled buffer too small for one part's share: that part's is replaced, the other's reused
        small = parted.kv.park(1, 3)
        again = parted.kv.park(2, 20, into=small.buffer)
        assert again.parts[0].buffer is not small.parts[0].buffer or again.parts[1].buffer is not small.parts[1].buffer
        assert all(b.nbytes >= parted.kv.states[i].park_bytes(2, 20) for i, b in enumerate(again.buffer.parts))
        parted.kv.free(again.buffer)
        parted.kv.free(parked.buffer)
        assert want is not None
    finally:
        whole.close()
        parted.close()


def test_split_chained_on_the_host(device, devices, model_of):
    """Decode steps chained to the step in flight (Engine.submit's chain): the
    split engine takes the tokens on the host, and every step's tokens are the
    whole engine's; the results come back in submission order."""
    m = model_of("qwen35")
    whole, parted = _pair(device, devices, m)
    try:
        outs = []
        for e in (whole, parted):
            for s in range(3):
                e.prefill([5 + s, 6, 7, 8], s, readback=Readback.NONE)
            got = []
            e.submit([1, 2, 3], [4, 4, 4], [0, 1, 2], [0, 1, 2])
            for p in range(5, 9):   # each chained to the one before, two in flight (row order reversed once)
                chain = [2, 1, 0] if p == 6 else [0, 1, 2]
                e.submit([0, 0, 0], [p] * 3, [0, 1, 2] if p != 6 else [2, 1, 0], [0, 1, 2], chain=chain)
                got.append(e.collect().tolist())
            got.append(e.collect().tolist())
            assert e.in_flight == 0
            outs.append(got)
        assert outs[0] == outs[1]
        with pytest.raises(RuntimeError, match="needs a step in flight that reads its tokens"):
            parted.submit([0], [9], [0], [0], chain=[0])
    finally:
        whole.close()
        parted.close()


def test_split_bad_input_moves_nothing(device, devices, model_of):
    """A step the last part refuses (an output row past the rows) is refused
    before any part runs: a hybrid model's recurrent state still continues."""
    m = model_of("qwen35")
    whole, parted = _pair(device, devices, m)
    try:
        p = list(range(5, 17))
        want = whole.prefill(p, 0, readback=Readback.LOGITS)
        with pytest.raises(ValueError, match="output row out of range"):
            parted.step(p, range(12), [0] * 12, [12], Readback.LOGITS)
        with pytest.raises(RuntimeError, match="a chained step needs a step in flight"):
            parted.submit([1], [0], [0], [0], chain=[0])
        np.testing.assert_array_equal(parted.prefill(p, 0, readback=Readback.LOGITS), want)
    finally:
        whole.close()
        parted.close()


def test_split_refusals(device, devices, model_of):
    m = model_of("llama")
    with pytest.raises(VkEngineError, match="cannot be split across 3"):
        SplitEngine(dataclasses.replace(m, args=dataclasses.replace(m.args, n_layer=2)), devices[:3])
    q = model_of("qwen35moe")
    with pytest.raises(VkEngineError, match="--fixed-experts records expert choices on one device"):
        SplitEngine(dataclasses.replace(q, args=dataclasses.replace(q.args, fixed_experts=True)), devices[:2])

    class Unsplittable(type(m.arch)):   # an architecture whose graph does not take a part
        splittable = False
    with pytest.raises(VkEngineError, match="Unsplittable models cannot be split across devices yet"):
        SplitEngine(dataclasses.replace(m, arch=Unsplittable()), devices[:2])


# -- the server's runner ------------------------------------------------------------------

def _requests(m):
    tok = m.tokenizer
    greedy = SamplingParams()
    return [GenRequest(tok.encode(PROMPT), 14, greedy, ignore_eos=True),
            GenRequest(tok.encode("Once upon a time, in a land far away,") * 3, 10, greedy, ignore_eos=True),
            GenRequest(tok.encode("def fib(n):\n    return"), 9, SamplingParams(temperature=0.9, top_k=20, seed=5),
                       ignore_eos=True),
            GenRequest(tok.encode("1, 2, 3, 4, 5, 6, 7, 8,"), 12, greedy, ignore_eos=True, n_probs=2)]


def _run(eng, cfg, reqs, arrive, draft=0):
    runner = Runner(eng, cfg, mtp_draft=draft)
    events = [[] for _ in reqs]
    jobs = [runner.make_job(r, events[i].append) for i, r in enumerate(reqs)]
    for turn in range(2000):
        for i, a in enumerate(arrive):
            if a == turn:
                runner.add(jobs[i])
        if not runner.step() and turn > max(arrive):
            break
    runner.settle()
    assert all(j.done for j in jobs)
    return [[e.token for e in ev if e.token is not None] for ev in events], runner


@pytest.mark.parametrize("name,mode", [("llama", "batch"), ("qwen35", "slices"), ("qwen35moe", "batch")])
def test_split_runner_interleaved(device, devices, model_of, name, mode):
    """The server's runner over a split engine: interleaved requests (a
    chunked prompt, a sampled one, log-probabilities; in slices mode each
    sequence parked and restored across its parts) get the whole engine's tokens."""
    m = model_of(name)
    slots = 2 if mode == "batch" else 1
    whole, parted = _pair(device, devices, m, n_slots=slots, max_batch=24)
    try:
        cfg = SchedulerConfig(n_slots=slots, max_live=4, step_tokens=16, quantum=3,
                              newcomer_first=mode == "slices", host_cache=2)
        reqs = _requests(m)
        arrive = [0, 1, 3, 6]
        want, _ = _run(whole, cfg, reqs, arrive)
        got, runner = _run(parted, cfg, reqs, arrive)
        assert got == want
        assert runner.chained_steps > 0   # (chained on the host: SplitEngine.submit)
        if mode == "slices":
            assert runner.sched.stats["parks"] > 0 and runner.sched.stats["restores"] > 0
    finally:
        whole.close()
        parted.close()


@pytest.mark.parametrize("name", ["llama", "qwen35"])
def test_split_runner_prompt_ahead(device, devices, model_of, name):
    """A lone long prompt over a split engine: its next chunk is submitted
    while the one before is still in flight (the first part runs it beside the
    last part's), and the replies are the whole engine's."""
    m = model_of(name)
    whole, parted = _pair(device, devices, m, n_slots=2, max_batch=16)
    try:
        cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=8)
        tok = m.tokenizer
        reqs = [GenRequest(tok.encode(PROMPT) * 4, 6, ignore_eos=True),
                GenRequest(tok.encode("Once upon a time") * 3, 5, ignore_eos=True)]
        want, plain = _run(whole, cfg, reqs, [0, 30])
        got, runner = _run(parted, cfg, reqs, [0, 30])
        assert got == want
        assert plain.ahead_steps == 0 and runner.ahead_steps >= 3, runner.ahead_steps
        # beside a running stream (prompt rows in steps of their own), no chunk goes ahead: the stream's
        # next decode step would wait behind it
        cfg = dataclasses.replace(cfg, prompt_apart=True)
        reqs = [GenRequest(tok.encode("Once upon a time"), 30, ignore_eos=True),
                GenRequest(tok.encode(PROMPT) * 3, 5, ignore_eos=True)]
        want, _ = _run(whole, cfg, reqs, [0, 3])
        got, runner = _run(parted, cfg, reqs, [0, 3])
        assert got == want and runner.ahead_steps == 0
    finally:
        whole.close()
        parted.close()


def test_split_speculative(device, devices, model_of):
    """MTP drafts over a split qwen35 (the MTP block on the last part, each
    part's recurrent state rolled back on a rejected draft): the tokens of
    plain greedy decoding."""
    m = model_of("qwen35")
    m = dataclasses.replace(m, args=dataclasses.replace(m.args, mtp_snap_rows=6))
    whole, parted = _pair(device, devices, m, n_slots=2, max_out=6, max_batch=24)
    try:
        cfg = SchedulerConfig(n_slots=2, max_live=2, step_tokens=16)
        reqs = [r for r in _requests(m) if r.n_probs == 0]
        want, _ = _run(whole, cfg, reqs, [0, 0, 2])
        got, runner = _run(parted, cfg, reqs, [0, 0, 2], draft=2)
        assert got == want
        assert runner.spec is not None and runner.spec.steps > 0
        # (bench --mtp --profile on it: the verify step over every part, the MTP block on the last alone)
        from vkengine.tools.bench import mtp_step_kinds
        for n, outs, pass_, hmap, first in mtp_step_kinds(2, 8).values():
            prof = parted.profile(n, len(outs), runs=1, start_pos=first(0), pass_=pass_, hmap=hmap)
            assert prof and any(lb.startswith("mul_mat") for lb, _, _ in prof)
    finally:
        whole.close()
        parted.close()


# -- the command line and the server ---------------------------------------------------------

def test_split_flags_refused(tmp_path):
    import subprocess
    import sys

    def run(*flags):
        return subprocess.run([sys.executable, "-m", "vkengine.cli", "generate", "hi", "-n", "1", *flags],
                              capture_output=True, text=True, timeout=120)
    for flags, msg in ((["--tensor-split", "1,1"], "--tensor-split needs --devices"),
                       (["--device", "0", "--devices", "0,0"], "not both"),
                       (["--devices", "0"], "two or more device indices"),
                       (["--devices", "0,x"], "comma-separated Vulkan device indices"),
                       (["--devices", "0,0", "-ts", "1,1,1"], "3 proportions for 2 devices")):
        r = run(*flags)
        assert r.returncode == 2 and msg in r.stderr, (flags, r.stderr)
        assert "Traceback" not in r.stderr


def test_split_server_concurrent_clients(serve, device):
    """`vkengine serve --devices D,D`: four concurrent clients get the tokens
    the unsplit server gives each alone (real HTTP, batch mode)."""
    import concurrent.futures

    import httpx
    d = device.info.index
    prompts = ["Once upon a time", "The quick brown fox", "def main():", "1, 2, 3,"]

    def ask(url, p):
        r = httpx.post(url + "/completion", json={"prompt": p, "n_predict": 12, "temperature": 0,
                                                   "ignore_eos": True, "cache_prompt": False}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    whole = serve("--parallel", "4", "--device", str(d))
    alone = [ask(whole.url, p) for p in prompts]
    split = serve("--parallel", "4", "--devices", f"{d},{d}", "--tensor-split", "1,1")
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        together = list(ex.map(lambda p: ask(split.url, p), prompts))
    assert together == alone
    assert "split across 2 devices" in split.log()


def test_split_fits_where_one_device_does_not_smollm2(device, devices, smollm2):
    """With each device's memory capped (VKENGINE_MEMORY_MIB: a smaller GPU's
    stand-in) below the model's weights, one device refuses the model and a
    split across three loads it, each part counting only its own weights."""
    from vkengine.options import Options
    mf = smollm2.file
    weights = sum(mf.tensor_bytes(n) for n in mf.tensor_names()) >> 20   # MiB (~100 for the Q4_1 135M)
    cfg = EngineConfig(n_ctx=64, max_batch=8, options=Options(memory_mib=int(weights * 0.6)))
    with pytest.raises(VkEngineError, match="the weights alone do not fit.*--devices"):
        Engine(smollm2, device, cfg)
    parted = SplitEngine(smollm2, devices[:3], cfg)
    try:
        assert parted.step([1, 2, 3], [0, 1, 2], [0, 0, 0], [2]).shape == (1,)
    finally:
        parted.close()


def test_split_embeddings(device, devices, model_of):
    """Embeddings (every row's final-normed hidden state, read back from the last part) as the whole model's."""
    m = model_of("qwen35")
    whole, parted = _pair(device, devices, m, embeddings=True)
    try:
        ids = m.tokenizer.encode(PROMPT)[:12]
        a = whole.step(ids, range(len(ids)), [0] * len(ids), [], Readback.NONE | Readback.HIDDEN)
        b = parted.step(ids, range(len(ids)), [0] * len(ids), [], Readback.NONE | Readback.HIDDEN)
        np.testing.assert_array_equal(a[1], b[1])
        assert a[1].shape == (len(ids), m.args.n_embd)
    finally:
        whole.close()
        parted.close()
