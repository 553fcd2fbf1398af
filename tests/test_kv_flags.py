"""--cache-type-k / --cache-type-v at every front end (vkengine generate, bench,
serve; parity run): the values they take, the one-line errors of the others,
and a q8_0 cache reaching the engine through the CLI and the server (its
greedy tokens are those of an engine built with it in-process)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from parity.cli import parser as parity_parser
from parity.reference import mode_args
from vkengine.cli import build_parser
from vkengine.engine import Engine, EngineConfig
from vkengine.kernels import KVTypes
from vkengine.model import load_model
from vkengine.serving.generate import generate
from vkengine.tools.synth.llama import SynthConfig, synth_llama

from .serving import serve, tiny_gguf  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def hd64_gguf(tmp_path_factory, tokenizer_source):
    """A tiny llama with 64-wide heads (a q8_0 cache's rows are 64-value units)."""
    out = synth_llama(SynthConfig(n_embd=128, n_layer=2, n_head=2, n_head_kv=1, n_ff=160, n_ctx=256), "q8_0",
                      seed=3, out_dir=tmp_path_factory.mktemp("hd64"), name="hd64", formats=("gguf",), workers=1,
                      tokenizer_from=tokenizer_source)
    return out["gguf"]


@pytest.mark.parametrize("argv", [["generate", "hi"], ["bench"], ["serve"]])
def test_front_ends_take_the_cache_types(argv):
    p = build_parser()
    a = p.parse_args(argv)
    assert (a.cache_type_k, a.cache_type_v) == ("f16", "f16")
    a = p.parse_args([*argv, "--cache-type-k", "q8_0", "-ctv", "q8_0"])
    assert (a.cache_type_k, a.cache_type_v) == ("q8_0", "q8_0")
    a = parity_parser().parse_args(["run", "-ctk", "q8_0"])
    assert (a.cache_type_k, a.cache_type_v) == ("q8_0", "f16")


@pytest.mark.parametrize("argv", [["generate", "--cache-type-k", "q4_0", "hi"], ["serve", "--cache-type-v", "bf16"],
                                  ["bench", "-ctk", "Q8_0"]])
def test_other_cache_types_are_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "the KV cache can be f16 or q8_0 (llama-server's other cache types, such as q4_0, are not" in err
    assert "Traceback" not in err


def test_parity_refuses_other_cache_types(capsys):
    with pytest.raises(SystemExit):
        parity_parser().parse_args(["run", "--cache-type-k", "q4_1"])
    assert "the KV cache can be f16 or q8_0" in capsys.readouterr().err


def test_llama_server_modes_follow_the_cache_types():
    """llama-server refuses a quantized V cache without flash attention: both
    modes then run with -fa on (mode B keeps its 64-token batches)."""
    assert mode_args("A") == () and mode_args("B") == ("-fa", "off", "-b", "64", "-ub", "64")
    assert mode_args("A", ("q8_0", "q8_0")) == ("-fa", "on", "-ctk", "q8_0", "-ctv", "q8_0")
    assert mode_args("B", ("q8_0", "q8_0")) == ("-fa", "on", "-b", "64", "-ub", "64", "-ctk", "q8_0", "-ctv", "q8_0")
    assert mode_args("B", ("q8_0", "f16")) == ("-fa", "off", "-b", "64", "-ub", "64", "-ctk", "q8_0", "-ctv", "f16")


def _greedy(device, path, n: int, kv: KVTypes) -> tuple[list[int], str]:
    """n greedy tokens of PROMPT and their text, from an engine built in-process as the CLI builds it."""
    m = load_model(path)
    eng = Engine(m, device, EngineConfig(n_ctx=256, kv_types=kv))
    try:
        steps = list(generate(eng, m.tokenizer.encode(PROMPT), n, ignore_eos=True))
        return [s.token for s in steps], "".join(s.text for s in steps)
    finally:
        eng.close()


def test_cli_generate_with_a_q8_cache(device, hd64_gguf, tiny_gguf):  # noqa: F811
    """The CLI's text is the in-process q8_0 engine's; a model whose heads
    cannot be q8_0 rows is a one-line error (exit 2)."""
    cmd = [sys.executable, "-m", "vkengine.cli", "generate", "-n", "6", "--ignore-eos"]
    r = subprocess.run([*cmd, "--model", str(hd64_gguf), "-ctk", "q8_0", "-ctv", "q8_0", PROMPT],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    _, text = _greedy(device, hd64_gguf, 6, KVTypes("q8_0", "q8_0"))
    assert r.stdout == PROMPT + text + "\n"
    r = subprocess.run([*cmd, "--model", str(tiny_gguf), "--cache-type-v", "q8_0", PROMPT],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "error: a q8_0 KV cache needs a head size that is a multiple of 64, and this model's is 16: "
        "use --cache-type-k f16 --cache-type-v f16")


def test_server_with_a_q8_cache(device, serve, hd64_gguf):  # noqa: F811
    """/props reports the cache's types; greedy tokens over HTTP are the
    in-process q8_0 engine's."""
    srv = serve("--cache-type-k", "q8_0", "--cache-type-v", "q8_0", "--parallel", "2", model=str(hd64_gguf), ctx=256)
    props = httpx.get(srv.url + "/props").json()
    assert (props["cache_type_k"], props["cache_type_v"]) == ("q8_0", "q8_0")
    r = httpx.post(srv.url + "/completion", json={"prompt": PROMPT, "n_predict": 6, "temperature": 0,
                                                  "ignore_eos": True, "return_tokens": True}, timeout=300).json()
    assert r["tokens"] == _greedy(device, hd64_gguf, 6, KVTypes("q8_0", "q8_0"))[0]
