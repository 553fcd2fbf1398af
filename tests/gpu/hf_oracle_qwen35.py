"""Oracle 3 for the hybrid models: Hugging Face transformers against vkengine.

Runs where transformers (5.x, with Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM)
and a Vulkan device are available (the GPU machine; not part of `make test`):

    python3 tests/gpu/hf_oracle_qwen35.py                      # tiny qwen35 + qwen35moe, synthesized here
    python3 tests/gpu/hf_oracle_qwen35.py --shape 0.8B --arch qwen35 --quant f16
    python3 tests/gpu/hf_oracle_qwen35.py --hf /path/to/Qwen3.5-0.8B   # a real checkpoint folder

For each model it loads the Hugging Face folder with transformers (weights put
in with load_state_dict, so no checkpoint-name conversion is involved), runs
one forward pass over the prompt in float32, runs vkengine on the same folder
(and, for synthesized models, on the GGUF twin), and prints the max |logit
error| relative to the largest logit and the top-1 agreement. Exit status 1 when
an error exceeds --tol (default 2e-3 of the largest logit; vkengine keeps K/V
in f16, transformers in f32).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPT = "The quick brown fox jumps over the lazy dog. 1234567, and then"


def hf_logits(folder: Path, ids: list[int]) -> np.ndarray:
    import torch
    import transformers
    from safetensors.torch import load_file
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["architectures"][0]
    if arch.endswith("ForConditionalGeneration"):   # a multimodal checkpoint: use its text model
        arch = arch.replace("ForConditionalGeneration", "ForCausalLM")
    cls = getattr(transformers, arch)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config = getattr(config, "text_config", None) or config
    config._attn_implementation = "eager"
    if hasattr(config, "quantization_config"):      # (MXFP4 experts: dequantized below, by transformers)
        del config.quantization_config
    model = cls(config).to(torch.float32).eval()
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    for k in [k for k in sd if k.endswith("_blocks")]:
        # gpt-oss's MXFP4 experts through transformers' own dequantization (integrations/mxfp4.py)
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
        base = k[: -len("_blocks")]
        sd[base] = convert_moe_packed_tensors(sd.pop(k), sd.pop(base + "_scales"), dtype=torch.float32)
        want = dict(model.named_parameters())[base].shape
        if sd[base].shape != want:
            raise SystemExit(f"{folder}: transformers dequantized {base} to {tuple(sd[base].shape)}, its "
                             f"parameter is {tuple(want)}")
    sd = {k.replace("model.language_model.", "model."): v.float() for k, v in sd.items()
          if not k.startswith(("mtp.", "model.mtp.", "model.visual."))}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        missing = [k for k in missing if k != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise SystemExit(f"{folder}: state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float().numpy()


def vk_logits(path: Path, ids: list[int], device) -> np.ndarray:
    from vkengine.engine import Engine, EngineConfig, Readback
    from vkengine.model import load_model
    m = load_model(path)
    eng = Engine(m, device, EngineConfig(n_slots=1, n_ctx=max(256, len(ids) + 1), max_batch=max(64, len(ids)),
                                         max_out=len(ids)))
    try:
        return eng.step(ids, range(len(ids)), [0] * len(ids), range(len(ids)), Readback.LOGITS)
    finally:
        eng.close()


def report(name: str, got: np.ndarray, want: np.ndarray, tol: float) -> bool:
    scale = float(np.abs(want).max())
    err = float(np.abs(got - want).max())
    top1 = float((got.argmax(-1) == want.argmax(-1)).mean())
    ok = err <= tol * scale
    print(f"{name}: max |logit error| {err:.4g} ({err / scale:.2e} of max |logit| {scale:.3g}), "
          f"top-1 agreement {100 * top1:.1f}% over {len(want)} positions  {'OK' if ok else 'FAIL'}")
    return ok


def check_synth(name: str, out: dict, quant: str, prompt: str, device, tol: float) -> bool:
    """A synthesized model's HF folder and GGUF twin (synth's output dict) against
    transformers on the folder."""
    from vkengine.model import load_model
    ids = load_model(out["hf"]).tokenizer.encode(prompt)
    want = hf_logits(out["hf"], ids)
    ok = report(f"{name} HF folder", vk_logits(out["hf"], ids, device), want, tol)
    if json.loads((out["hf"] / "config.json").read_text()).get("model_type") == "gpt_oss":
        # (its GGUF takes llama.cpp's rounded YaRN correction range, the folder its exact one: not compared)
        report(f"{name} GGUF {quant} (YaRN range rounded: for information)", vk_logits(out["gguf"], ids, device),
               want, tol)
        return ok
    return report(f"{name} GGUF {quant}", vk_logits(out["gguf"], ids, device), want, tol) and ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, default=None, help="a Hugging Face Qwen3.5 folder (default: synthesize)")
    ap.add_argument("--arch", choices=["qwen35", "qwen35moe", "both"], default="both")
    ap.add_argument("--shape", default="tiny")
    ap.add_argument("--quant", default="q8_0", help="GGUF type of the synthesized model (the HF copy holds the "
                    "same dequantized weights)")
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF to take the tokenizer from")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--tol", type=float, default=2e-3)
    ap.add_argument("--device", type=int, default=None)
    args = ap.parse_args()
    import os

    from vkengine.device import Device
    from vkengine.model import load_model
    from vkengine.tools.synth.qwen35 import config_for, synth_qwen35
    tok_src = args.tokenizer_from or (Path(os.environ["VKENGINE_TOKENIZER_GGUF"])
                                      if os.environ.get("VKENGINE_TOKENIZER_GGUF") else None)
    device = Device(args.device)
    print(f"device: {device.info.name}")
    ok = True
    if args.hf is not None:
        ids = load_model(args.hf).tokenizer.encode(args.prompt)
        ok = report(f"{args.hf.name} (HF folder)", vk_logits(args.hf, ids, device), hf_logits(args.hf, ids), args.tol)
        return 0 if ok else 1
    arches = ["qwen35", "qwen35moe"] if args.arch == "both" else [args.arch]
    with tempfile.TemporaryDirectory() as tmp:
        for arch in arches:
            out = synth_qwen35(config_for(arch, args.shape, None), args.quant, 0, Path(tmp), f"{arch}-{args.shape}",
                               tokenizer_from=tok_src)
            ok &= check_synth(f"{arch}-{args.shape}", out, args.quant, args.prompt, device, args.tol)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
