"""`vkengine serve --mtp` through real HTTP on the tiny random qwen35 model
(lavapipe): concurrent clients, greedy and sampled, get the tokens they get
alone without drafts (batch and slices modes), the drafts show in /metrics
and in llama-server's timings, and a model without an MTP block is refused
at startup with a clear error."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from vkengine.engine import Engine, EngineConfig
from vkengine.serving.generate import generate
from vkengine.serving.sampling import SamplingParams

from .serving import CTX, serve, tiny_gguf  # noqa: F401  (fixtures)
from .test_models_qwen35 import qwen35_loaded, qwen35_models  # noqa: F401  (fixtures)
from .test_server import _metric, complete

PROMPTS = ["The history of the city begins", "Once upon a time", "Write a list of fruits:\n1.", "Q: 2+2=? A:"]
SAMPLING = [dict(temperature=0.0), dict(temperature=0.9, seed=7), dict(temperature=0.0), dict(temperature=0.0)]
N = [24, 12, 18, 9]


@pytest.fixture(scope="module")
def alone(device, qwen35_loaded):
    m = qwen35_loaded("qwen35")
    eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=CTX, max_batch=64, max_out=1))

    def run(prompt: str, n: int, **sampling) -> tuple[list[int], str]:
        steps = list(generate(eng, m.tokenizer.encode(prompt), n, SamplingParams(**sampling), ignore_eos=True))
        return [s.token for s in steps], "".join(s.text for s in steps)
    return run


@pytest.mark.parametrize("mode", ["batch", "slices"])
def test_mtp_server_clients_get_their_alone_tokens(serve, qwen35_models, alone, mode):
    srv = serve("--mtp", "--draft", "2", "--parallel", "3", "--mode", mode, "--quantum", "2", "--step-tokens", "16",
                model=str(qwen35_models["qwen35"]["gguf"]))
    assert "MTP drafts 2 a step" in srv.log()

    def client(i):
        return complete(srv.url, i % 2 == 1, prompt=PROMPTS[i], n_predict=N[i], ignore_eos=True, **SAMPLING[i])
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(client, range(4)))
    for i, (toks, text, final) in enumerate(got):
        assert (toks, text) == alone(PROMPTS[i], N[i], **SAMPLING[i])
        t = final["timings"]
        if SAMPLING[i]["temperature"] == 0:
            assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
        else:
            assert "draft_n" not in t          # a sampled reply decodes without drafts
    assert _metric(srv.url, "vkengine_spec_draft_tokens_total") >= sum(N[i] for i in (0, 2, 3)) // 2
    assert _metric(srv.url, "vkengine_spec_accepted_tokens_total") >= 0
    if mode == "batch":   # llama-server's speculative.n_max: 0 decodes without drafts, same tokens
        toks, text, final = complete(srv.url, False, prompt=PROMPTS[0], n_predict=N[0], ignore_eos=True,
                                     temperature=0, **{"speculative.n_max": 0})
        assert (toks, text) == alone(PROMPTS[0], N[0], temperature=0.0) and "draft_n" not in final["timings"]
        r = httpx.post(srv.url + "/completion", json={"prompt": "x", "speculative.n_max": -1})
        assert r.status_code == 400 and "speculative.n_max" in r.json()["error"]["message"]


def test_mtp_needs_an_mtp_block(tiny_gguf, tmp_path):
    r = subprocess.run([sys.executable, "-m", "vkengine.cli", "serve", "--model", str(tiny_gguf), "--mtp"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "has no MTP block" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "vkengine.cli", "serve", "--model", str(tiny_gguf), "--mtp",
                        "--draft", "0"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--draft must be >= 1" in r.stderr, r.stderr
