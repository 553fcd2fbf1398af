"""Configuration at the edge: the command-line options every front end shares
(`vkengine generate/bench/serve`, `python -m server`) and the environment
variables that choose a device. Whatever is read here is passed down; no
module below reads the environment."""
from __future__ import annotations

import os

from .errors import VkEngineError


def add_model_args(p, model: bool = True) -> None:
    """--model, --ctx, --batch (with model) and --device."""
    if model:
        p.add_argument("--model", "-m", default=None,
                       help="GGUF file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct Q4_1)")
        p.add_argument("--ctx", type=int, default=None, help="context length per sequence (default min(train, 4096))")
        p.add_argument("--batch", type=int, default=256, help="tokens per prefill step")
    p.add_argument("--device", type=int, default=None, help="Vulkan device index (see `vkengine devices`); "
                   "VKENGINE_DEVICE also works")


def device_index(args) -> int | None:
    """The device the user asked for: --device, else VKENGINE_DEVICE, else None (the best one)."""
    if getattr(args, "device", None) is not None:
        return args.device
    env = os.environ.get("VKENGINE_DEVICE")
    if env:
        try:
            return int(env)
        except ValueError:
            raise VkEngineError(f"VKENGINE_DEVICE={env!r} is not a device index") from None
    return None
