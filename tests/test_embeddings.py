"""Embeddings (issue 33): every row's final-normed hidden state read back
(Readback.HIDDEN) against the numpy reference; pooled (mean / cls / last) and
normalized through the runner beside generating requests, whose tokens stay
those they have alone; prompts over several steps and parked mid-prompt."""
from __future__ import annotations

import numpy as np
import pytest

from server.worker import Event, GenRequest, Worker
from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.errors import VkEngineError
from vkengine.serving.embed import Pool, normalize
from vkengine.serving.sampling import SamplingParams
from vkengine.serving.scheduler import SchedulerConfig

from .ref_llama import RefLlama
from .serving import CTX, serve, tiny_gguf, tiny_model  # noqa: F401  (fixtures)
from .test_worker import alone

TEXTS = ("The history of the city begins", "Once upon a time there was a small village by the sea, and",
         "Q: 2+2=? A:", "def f(x):\n    return x * 2\n" * 3)


def _close(got, want, rel=2e-3):
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


@pytest.fixture(scope="module")
def emb_engine(device, tiny_model):
    return Engine(tiny_model, device, EngineConfig(n_slots=2, n_ctx=CTX, max_batch=64, max_out=2, embeddings=True))


def test_hidden_rows_match_numpy_reference(tiny_model, emb_engine):
    m, eng = tiny_model, emb_engine
    ids = m.tokenizer.encode(TEXTS[1])
    toks, hid = eng.step(ids, range(len(ids)), [0] * len(ids), [len(ids) - 1], Readback.ARGMAX | Readback.HIDDEN)
    assert hid.shape == (len(ids), m.args.n_embd)
    want = RefLlama(m.file, m.args).hidden(ids)
    _close(hid, want)
    # the same rows in two steps (a chunked prompt), and the token as without HIDDEN
    k = len(ids) // 2
    _, h1 = eng.step(ids[:k], range(k), [1] * k, [], Readback.HIDDEN)
    t2, h2 = eng.step(ids[k:], range(k, len(ids)), [1] * (len(ids) - k), [len(ids) - k - 1],
                      Readback.ARGMAX | Readback.HIDDEN)
    _close(np.concatenate([h1, h2]), want)
    assert list(t2) == list(toks) == list(eng.step(ids, range(len(ids)), [0] * len(ids), [len(ids) - 1]))


def test_hidden_needs_an_embeddings_engine(device, tiny_model):
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=64, max_batch=16, max_out=1))
    with pytest.raises(VkEngineError, match="embeddings=True"):
        eng.step([1, 2], [0, 1], [0, 0], [1], Readback.ARGMAX | Readback.HIDDEN)


def test_normalize_as_llama_cpp():
    v = np.array([3.0, -4.0, 0.0], np.float32)
    assert np.allclose(normalize(v, 2), [0.6, -0.8, 0.0])
    assert np.allclose(normalize(v, 1), v / 7)
    assert np.allclose(normalize(v, 0), v / (4 / 32760))
    assert np.allclose(normalize(v, -1), v)
    assert np.allclose(normalize(v, 3), v / (27 + 64) ** (1 / 3))
    assert not normalize(np.zeros(3), 2).any()


def _want(ref: RefLlama, ids, pooling, norm=2):
    h = ref.hidden(ids)
    v = {"mean": h.mean(0), "cls": h[0], "last": h[-1]}[pooling]
    return normalize(v, norm)


@pytest.mark.parametrize("cfg", [SchedulerConfig(n_slots=2, max_live=4, step_tokens=16, quantum=4),
                                 SchedulerConfig(n_slots=1, max_live=4, step_tokens=8, quantum=2,
                                                 newcomer_first=True, host_cache=2)],
                         ids=["batch", "slices-preempt"])
def test_runner_embeddings_beside_generation(device, tiny_model, cfg):
    """Embedding requests (each pooling, a prompt over several steps) among
    generating ones: vectors as the reference's, the generated tokens as alone."""
    m = tiny_model
    tok = m.tokenizer
    ref = RefLlama(m.file, m.args, n_ctx=CTX)
    eng = Engine(m, device, EngineConfig(n_slots=cfg.n_slots, n_ctx=CTX, max_batch=64, max_out=cfg.n_slots,
                                         embeddings=True))
    ref_eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=64, max_out=1))
    w = Worker(eng, cfg)
    reqs = [GenRequest(tok.encode(TEXTS[0]), 12, SamplingParams(), ignore_eos=True),
            GenRequest(tok.encode(TEXTS[1]), 0, embed="mean"),
            GenRequest(tok.encode(TEXTS[3]), 0, embed="last", embd_normalize=-1),
            GenRequest(tok.encode(TEXTS[2]), 9, SamplingParams(temperature=0.8, seed=3), ignore_eos=True),
            GenRequest(tok.encode(TEXTS[3]), 0, embed="cls", embd_normalize=1)]
    events: list[list[Event]] = [[] for _ in reqs]
    for i, r in enumerate(reqs):
        w.submit(r, events[i].append)
        w.run_once()
    w.run_until_idle()
    for r, evs in zip(reqs, events):
        assert evs[-1].finish == "stop" if r.embed else evs[-1].finish == "length"
        if r.embed:
            assert len(evs) == 1 and evs[0].embedding is not None and evs[0].token is None
            _close(evs[0].embedding, _want(ref, list(r.prompt), r.embed, r.embd_normalize))
        else:
            assert [e.token for e in evs if e.token is not None] == alone(ref_eng, r.prompt, r.max_tokens,
                                                                           r.sampling)[0]
    if cfg.n_slots == 1:
        assert w.sched.stats["preemptions"] > 0


def test_runner_refuses_embeddings_when_off(device, tiny_model):
    eng = Engine(tiny_model, device, EngineConfig(n_slots=1, n_ctx=64, max_batch=16, max_out=1))
    w = Worker(eng, SchedulerConfig(n_slots=1, max_live=1, step_tokens=16))
    with pytest.raises(VkEngineError, match="--embeddings"):
        w.submit(GenRequest([1, 2, 3], 0, embed="mean"), lambda ev: None)


def test_pool_rows_in_order():
    p = Pool("mean", 4)
    p.add(0, np.ones((2, 3)))
    with pytest.raises(RuntimeError, match="out of order"):
        p.add(3, np.ones((1, 3)))
    p.add(2, 3 * np.ones((2, 3)))
    assert p.complete and np.allclose(p.vector(), 2.0)


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def emb_server(serve):
    return serve("--parallel", "2", "--step-tokens", "16", "--embeddings", "--pooling", "mean", "--max-queue", "4")


def test_v1_embeddings_with_the_openai_client(emb_server, tiny_model):
    """The official client (its default asks for base64), many inputs (more than
    --parallel + --max-queue: the server feeds them in a window), a float reply,
    and generation beside it untouched."""
    import httpx
    import openai
    ref = RefLlama(tiny_model.file, tiny_model.args, n_ctx=CTX)
    tok = tiny_model.tokenizer
    client = openai.OpenAI(base_url=emb_server.url + "/v1", api_key="none", max_retries=0)
    texts = [TEXTS[i % len(TEXTS)] + f" {i}" for i in range(9)]
    r = client.embeddings.create(model="x", input=texts)
    assert [d.index for d in r.data] == list(range(9))
    n_tok = sum(len(tok.encode(t)) for t in texts)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tok
    for t, d in zip(texts, r.data):
        _close(np.asarray(d.embedding, np.float32), _want(ref, tok.encode(t), "mean"))
    one = client.embeddings.create(model="x", input=TEXTS[2], encoding_format="float")
    assert np.allclose(one.data[0].embedding, r.data[2].embedding if texts[2] == TEXTS[2] else
                       _want(ref, tok.encode(TEXTS[2]), "mean"), atol=1e-5)
    ids = tok.encode(TEXTS[0])
    by_ids = httpx.post(emb_server.url + "/v1/embeddings", json={"input": ids}, timeout=60).json()
    _close(np.asarray(by_ids["data"][0]["embedding"]), _want(ref, ids, "mean"))
    g = httpx.post(emb_server.url + "/completion", json={"prompt": TEXTS[0], "n_predict": 4, "temperature": 0},
                   timeout=60)
    assert g.status_code == 200 and g.json()["tokens_predicted"] == 4


def test_llama_server_embedding_route(emb_server, tiny_model):
    """llama-server's /embedding: "content", a list of vectors per input, embd_normalize."""
    import httpx
    ref = RefLlama(tiny_model.file, tiny_model.args, n_ctx=CTX)
    tok = tiny_model.tokenizer
    r = httpx.post(emb_server.url + "/embedding", json={"content": [TEXTS[1], TEXTS[2]], "embd_normalize": -1},
                   timeout=60)
    assert r.status_code == 200, r.text
    j = r.json()
    assert [e["index"] for e in j] == [0, 1] and all(len(e["embedding"]) == 1 for e in j)
    _close(np.asarray(j[1]["embedding"][0]), _want(ref, tok.encode(TEXTS[2]), "mean", -1))
    # ids and text mixed: one prompt (text after ids takes no BOS)
    mixed = httpx.post(emb_server.url + "/embeddings", json={"content": [tok.encode(TEXTS[0])[0], " world"]},
                       timeout=60).json()
    want_ids = [tok.encode(TEXTS[0])[0], *tok.encode(" world", add_special=False)]
    _close(np.asarray(mixed[0]["embedding"][0]), _want(ref, want_ids, "mean"))


@pytest.mark.parametrize("body,field", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [1.5]}, "input"),
    ({"input": [[1, 2], {"a": 1}]}, "input[1]"), ({"input": [10 ** 9]}, "input"),
    ({"input": "x", "dimensions": 3}, "dimensions"), ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "embd_normalize": -2}, "embd_normalize"), ({"input": "word " * 600}, "input"),
    ({}, "input")])
def test_embedding_bad_input_is_400_naming_it(emb_server, body, field):
    import httpx
    r = httpx.post(emb_server.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"], r.json()
    assert httpx.get(emb_server.url + "/health", timeout=10).status_code == 200


def test_embeddings_off_is_501(serve):
    import httpx
    srv = serve("--parallel", "1")
    r = httpx.post(srv.url + "/v1/embeddings", json={"input": "hello"}, timeout=60)
    assert r.status_code == 501 and "--embeddings" in r.json()["error"]["message"]


@pytest.mark.slow
def test_embeddings_agree_with_llama_server(device, smollm2, llama_server_exe, tmp_path):
    """The embedded SmolLM2 (real weights): our pooled, normalized embeddings
    against llama-server --embeddings on the same GGUF, mean and last pooling."""
    import httpx

    from parity import llamacpp
    eng = Engine(smollm2, device, EngineConfig(n_slots=1, n_ctx=256, max_batch=64, max_out=1, embeddings=True))
    tok = smollm2.tokenizer
    texts = ["The capital of France is Paris.", "A quick brown fox jumps over the lazy dog", "def f(x): return x"]
    for pooling in ("mean", "last"):
        srv = llamacpp.start_server(llama_server_exe, smollm2.path, extra=["--embeddings", "--pooling", pooling],
                                    log_dir=tmp_path)
        try:
            r = httpx.post(srv.url + "/v1/embeddings", json={"input": texts}, timeout=120).json()
            tok_r = [httpx.post(srv.url + "/tokenize", json={"content": t, "add_special": True}, timeout=60)
                     .json()["tokens"] for t in texts]
        finally:
            srv.stop()
        for t, ids_peer, d in zip(texts, tok_r, r["data"]):
            ids = tok.encode(t)
            assert ids == ids_peer
            _, hid = eng.step(ids, range(len(ids)), [0] * len(ids), [len(ids) - 1], Readback.ARGMAX | Readback.HIDDEN)
            p = Pool(pooling, len(ids))
            p.add(0, hid)
            ours, peer = normalize(p.vector(), 2), np.asarray(d["embedding"], np.float32)
            cos = float(ours @ peer / np.linalg.norm(peer))
            print(f"{pooling} {t!r}: cosine {cos:.6f}, max |diff| {float(np.abs(ours - peer).max()):.2e}")
            assert cos > 0.998, f"{pooling} {t!r}: cosine {cos:.5f}"   # (0.9992-0.9999 on lavapipe vs CPU)
            assert float(np.abs(ours - peer).max()) < 0.03


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "gpt-oss", "qwen35"])
def test_hidden_rows_are_what_the_output_matrix_reads(device, tmp_path, tokenizer_source, arch):
    """Every architecture's final_norm: its hidden rows times the output matrix
    (tied: the embeddings) are the logits the same step returns."""
    from vkengine.model import load_model
    from vkengine.tools.synth.llama import config_for, synth_llama
    from vkengine.tools.synth.qwen35 import SHAPES, synth_qwen35
    from vkengine.tools.synth.writer import tokenizer_meta
    if arch == "qwen35":
        path = synth_qwen35(SHAPES[("qwen35", "tiny")], "f32", seed=5, out_dir=tmp_path, name="q", workers=1,
                            formats=("gguf",), tmeta=tokenizer_meta(tokenizer_source))["gguf"]
    else:
        import dataclasses
        c = config_for("gpt-oss-tiny" if arch == "gpt-oss" else "tiny", None, arch)
        if arch == "gemma3":
            c = dataclasses.replace(c, tied=True, head_size=16, window=8)
        path = synth_llama(c, "f32", 5, tmp_path, "m", formats=("gguf",), workers=1,
                           tokenizer_from=tokenizer_source)["gguf"]
    m = load_model(path)
    eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=64, max_batch=16, max_out=16, embeddings=True))
    ids = m.tokenizer.encode(TEXTS[0])[:12]
    lg, hid = eng.step(ids, range(len(ids)), [0] * len(ids), range(len(ids)), Readback.LOGITS | Readback.HIDDEN)
    out = m.file.tensor("output.weight" if m.file.has("output.weight") else "token_embd.weight").as_f32()
    _close(hid @ out.T, lg, rel=5e-3)
