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
    p.add_argument("--quant", default="q8_0", help=f"one of {', '.join(QUANTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--name", default=None, help="file name stem (default: <arch>-<shape>)")
    p.add_argument("--formats", default="gguf,hf", help="gguf, hf or both (comma separated)")
    p.add_argument("--workers", type=int, default=None)
    p.add_argument("--tokenizer-from", default=None,
                   help="GGUF whose tokenizer to copy (default: the embedded SmolLM2)")


def synth_main(args) -> int:
    formats = tuple(f.strip() for f in args.formats.split(",") if f.strip())
    bad = set(formats) - {"gguf", "hf"}
    if bad or not formats:
        raise VkEngineError(f"--formats takes gguf and/or hf, got {args.formats!r}")
    name = args.name or f"{args.arch}-{args.shape if not args.config else 'custom'}"
    tok = Path(args.tokenizer_from) if args.tokenizer_from else None
    if args.arch in ("qwen35", "qwen35moe"):
        qc = qwen35.config_for(args.arch, args.shape, args.config)
        out = qwen35.synth_qwen35(qc, args.quant, args.seed, Path(args.out), name, formats, args.workers, tok)
    else:
        lc = llama.config_for(args.shape, args.config, args.arch)
        out = llama.synth_llama(lc, args.quant, args.seed, Path(args.out), name, formats, args.workers, tok)
    for k, v in out.items():
        print(f"{k}: {v}")
    return 0
