"""`vkengine synth`: deterministic random-weight models with the shapes of real
ones, as GGUF files (llama.cpp runs the very same file) and Hugging Face
folders holding the same function. One module per family (llama.py: llama,
qwen2, qwen3; qwen35.py) over the shared writer (writer.py)."""
from __future__ import annotations

from pathlib import Path

from ...errors import VkEngineError
from . import llama, qwen35
from .writer import QUANTS

ARCHES = (*llama.ARCHES, "qwen35", "qwen35moe")


def add_synth_args(p) -> None:
    p.add_argument("--arch", default="llama", choices=list(ARCHES))
    p.add_argument("--shape", default="tiny",
                   help=f"llama, qwen2, qwen3, phi3: one of {', '.join(llama.SHAPES)} (qwen2: qwen2.5-0.5b, "
                   "qwen3: qwen3-0.6b, phi3: phi3-mini); llama, qwen3moe: tiny-moe, qwen3-30b-a3b; "
                   "qwen35: tiny, 0.8B, 4B; qwen35moe: tiny, 35B-A3B")
    p.add_argument("--config", default=None, help="JSON (inline or a file) of the family's config fields instead "
                   "of --shape")
    p.add_argument("--quant", default="q8_0", help=f"one of {', '.join(QUANTS)} (models of 2^28 weights or more: "
                   "q4_0 and q8_0 matrices drawn as random blocks, not as Gaussian weights quantized)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", default=None, help="file name stem (default: <arch>-<shape>)")
    p.add_argument("--formats", default="gguf,hf", help="gguf, hf or both (comma separated)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--tokenizer-from", default=None,
                   help="GGUF whose tokenizer to copy (default: the embedded SmolLM2)")
    p.add_argument("--mtp-accept", action="store_true",
                   help="qwen35, qwen35moe: a model whose MTP block drafts exactly the main model's next greedy "
                   "tokens, so speculative decoding (--mtp) accepts nearly every draft: for measuring its "
                   "mechanics, as random weights' drafts are never accepted. Every block adds zero to the "
                   "residual stream (the output is a function of the last token; all matmuls and the expert "
                   "choice still run); default name <arch>-<shape>-mtp-accept")


def synth_main(args) -> int:
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    bad = set(formats) - {"gguf", "hf"}
    if bad or not formats:
        raise VkEngineError(f"--formats takes gguf and/or hf, got {args.formats!r}")
    # a model made with --mtp-accept must not take the plain model's file name
    name = args.name or (f"{args.arch}-{args.shape if not args.config else 'custom'}"
                         + ("-mtp-accept" if args.mtp_accept else ""))
    tok = Path(args.tokenizer_from) if args.tokenizer_from else None
    if args.arch in ("qwen35", "qwen35moe"):
        qc = qwen35.config_for(args.arch, args.shape, args.config)
        out = qwen35.synth_qwen35(qc, args.quant, args.seed, Path(args.out), name, formats, args.workers, tok,
                                  mtp_accept=args.mtp_accept)
    else:
        if args.mtp_accept:
            raise VkEngineError(f"--mtp-accept: {args.arch} has no MTP block (qwen35 and qwen35moe have one)")
        lc = llama.config_for(args.shape, args.config, args.arch)
        out = llama.synth_llama(lc, args.quant, args.seed, Path(args.out), name, formats, args.workers, tok)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0
