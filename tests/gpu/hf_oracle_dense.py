"""Transformers as the oracle for the llama-family architectures (llama, qwen2,
qwen3, and with experts qwen3moe and Mixtral-style llama):
tests/gpu/hf_oracle_qwen35.py's method on `vkengine synth` models.

    python3 tests/gpu/hf_oracle_dense.py                            # tiny qwen2 + qwen3, synthesized here
    python3 tests/gpu/hf_oracle_dense.py --arch qwen3moe,llama --shape tiny-moe   # the MoE ones
    python3 tests/gpu/hf_oracle_dense.py --arch qwen3 --shape qwen3-0.6b --quant q8_0
    python3 tests/gpu/hf_oracle_dense.py --arch gemma3 --config '{"n_embd": 64, ..., "window": 8}'
    python3 tests/gpu/hf_oracle_dense.py --arch gpt-oss --shape gpt-oss-tiny --quant mxfp4
    python3 tests/gpu/hf_oracle_dense.py --hf /path/to/Qwen2.5-0.5B-Instruct

Each model: the Hugging Face folder through transformers (float32, eager
attention; the class its config names: Qwen2ForCausalLM, Qwen3ForCausalLM,
Qwen3MoeForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM,
GptOssForCausalLM (MXFP4 experts dequantized by transformers'
convert_moe_packed_tensors), LlamaForCausalLM) against vkengine on the same
folder and on its GGUF twin; max |logit error| relative to the largest logit
and top-1 agreement. Exit status 1 when an error exceeds --tol (default 2e-3
of the largest logit). The synthesized MoE folders hold the
experts fused as transformers 5 keeps them (mlp.experts.gate_up_proj,
down_proj).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_oracle_qwen35 import PROMPT, check_synth, hf_logits, report, vk_logits  # noqa: E402 (same dir)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf", type=Path, default=None, help="a Hugging Face folder (default: synthesize)")
    ap.add_argument("--arch", default="qwen2,qwen3",
                    help="comma-separated: llama, qwen2, qwen3, qwen3moe, phi3, gemma2, gemma3, gpt-oss")
    ap.add_argument("--shape", default="tiny", help="a `vkengine synth` shape (e.g. qwen3-0.6b, qwen2.5-0.5b)")
    ap.add_argument("--config", default=None, help="`vkengine synth --config` JSON instead of --shape")
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--tokenizer-from", type=Path, default=None)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--tol", type=float, default=2e-3)
    ap.add_argument("--device", type=int, default=None)
    ap.add_argument("--keep", type=Path, default=None,
                    help="synthesize into this folder and keep the files (e.g. for `parity run` on the GGUF after)")
    args = ap.parse_args()

    from vkengine.device import Device
    from vkengine.model import load_model
    from vkengine.tools.synth.llama import config_for, synth_llama
    tok_src = args.tokenizer_from or (Path(os.environ["VKENGINE_TOKENIZER_GGUF"])
                                      if os.environ.get("VKENGINE_TOKENIZER_GGUF") else None)
    device = Device(args.device)
    print(f"device: {device.info.name}")
    if args.hf is not None:
        ids = load_model(args.hf).tokenizer.encode(args.prompt)
        ok = report(f"{args.hf.name} (HF folder)", vk_logits(args.hf, ids, device), hf_logits(args.hf, ids), args.tol)
        return 0 if ok else 1
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch.split(","):
            c = config_for(args.shape, args.config, arch)
            out = synth_llama(c, args.quant, 0, args.keep or Path(tmp), f"{arch}-{args.shape}",
                              tokenizer_from=tok_src)
            ok &= check_synth(f"{arch}-{args.shape}", out, args.quant, args.prompt, device, args.tol)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
