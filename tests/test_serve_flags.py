"""`vkengine serve`'s scheduling flags, before any model loads."""
from __future__ import annotations

import argparse

import pytest

from server.main import PROMPT_MS_GPU, PROMPT_TOKENS_GPU, scheduler_config
from server.options import add_serve_args
from vkengine.errors import VkEngineError
from vkengine.options import add_model_args


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_args(p)
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_prompt_tokens_default_follows_the_device():
    cfg, _ = scheduler_config(_args("--step-tokens", "32"))
    assert cfg.max_prompt_rows == 32 and cfg.prompt_ms == 0           # a CPU: prompt steps as any step
    cfg, _ = scheduler_config(_args("--step-tokens", "32"), gpu=True)
    assert cfg.max_prompt_rows == PROMPT_TOKENS_GPU                    # a GPU: a lone prompt in large chunks
    assert cfg.prompt_ms == PROMPT_MS_GPU                              # and a newcomer's chunk held to a time
    cfg, _ = scheduler_config(_args("--step-tokens", "32", "--prompt-ms", "0"), gpu=True)
    assert cfg.prompt_ms == 0
    cfg, _ = scheduler_config(_args("--prompt-tokens", "512", "--prompt-ms", "25"), gpu=True)
    assert cfg.max_prompt_rows == 512 and cfg.prompt_ms == 25


@pytest.mark.parametrize("argv,msg", [
    (("--step-tokens", "64", "--prompt-tokens", "32"), "--prompt-tokens \\(32\\) must be at least --step-tokens"),
    (("--prompt-ms", "-1"), "--prompt-ms must be >= 0"),
    (("--parallel", "4", "--step-tokens", "2"), "must be at least the number of slots"),
])
def test_bad_scheduling_flags_are_named(argv, msg):
    with pytest.raises(VkEngineError, match=msg):
        scheduler_config(_args(*argv))
