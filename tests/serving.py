"""Fixtures shared by the server tests: the tiny synthetic model (random
weights, SmolLM2's real tokenizer), written once per session."""
from __future__ import annotations

import pytest

from vkengine.model import load_model
from vkengine.synth import config_for, synth_llama

CTX = 512


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    out = synth_llama(config_for("tiny", None), "q8_0", 0, tmp_path_factory.mktemp("tiny"), "tiny",
                      formats=("gguf",), workers=1)
    return out["gguf"]


@pytest.fixture(scope="session")
def tiny_model(tiny_gguf):
    return load_model(tiny_gguf)
