"""Command-line options of `vkengine serve` (registered into the vkengine CLI
through the entry point `vkengine.commands: serve`) and `python -m server`.
Nothing heavy is imported here: `vkengine --help` loads this module."""
import os

from vkengine.options import add_model_args


def register(sub) -> None:
    """The `serve` subcommand of the vkengine CLI."""
    p = sub.add_parser("serve", help="HTTP server (llama-server and OpenAI compatible)")
    add_model_args(p)
    add_serve_args(p)
    p.set_defaults(fn=serve)


def serve(args) -> int:
    from .main import serve_main
    return serve_main(args)


def add_serve_args(p) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--parallel", "-np", type=int, default=4, help="sequences served at once")
    p.add_argument("--mode", choices=["batch", "slices"], default="batch",
                   help="batch: running sequences decode together in one step, KV resident in per-slot "
                        "buffers; slices: one sequence on the device at a time, the others parked on the host")
    p.add_argument("--quantum", type=int, default=8,
                   help="steps a sequence keeps the device before yielding to one that waits "
                        "(slices: every turn; batch: only when --parallel exceeds --slots)")
    p.add_argument("--slots", type=int, default=None,
                   help="batch mode: KV slots resident on the device (default --parallel); fewer slots "
                        "than --parallel parks sequences on the host in turns")
    p.add_argument("--step-tokens", type=int, default=64,
                   help="token rows per engine step: decode rows plus prompt chunks (chunked prefill); "
                        "bounds how long a newcomer's prompt can delay running streams (replaces --batch)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt rows of a step while no sequence is decoding beside it: a lone prompt prefills "
                        "in chunks this large (default: 2048 on GPUs, --step-tokens on a CPU)")
    p.add_argument("--prompt-ms", type=float, default=None,
                   help="while sequences decode: a newcomer's prompt chunk may take as many rows as fit this many "
                        "milliseconds at the measured cost of a prompt row (at least --step-tokens, at most "
                        "--prompt-tokens, in whole tiles of the prompt matmuls), which bounds the running "
                        "streams' gap while it lasts (default: 100 on GPUs, 0 on a CPU); 0: --step-tokens rows")
    p.add_argument("--min-prefix", type=int, default=8,
                   help="shortest cached prompt prefix worth copying from another slot (prefix cache)")
    p.add_argument("--host-cache", type=int, default=-1,
                   help="finished sequences kept parked in host memory for the prefix cache "
                        "(default: 4 in slices mode, 0 in batch mode, where free slots hold the cache)")
    p.add_argument("--api-key", default=os.environ.get("VKENGINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' (default: $VKENGINE_API_KEY; the environment keeps "
                        "the key out of the process list)")
    p.add_argument("--allowed-hosts", default=None, metavar="NAMES",
                   help="Host header names answered besides loopback names and the bound address, comma separated "
                        "('*': any; bound to 0.0.0.0 or :: without this flag: any): a web page cannot reach a local "
                        "server through DNS rebinding")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to send a request's headers (from its opening or its previous "
                        "reply) before it is closed")
    p.add_argument("--max-connections", type=int, default=0,
                   help="open connections kept at most; past it the oldest one still sending its headers is "
                        "closed (default: the file-descriptor limit less 128, at most 4096)")
    p.add_argument("--cors", default=None, help="allowed CORS origin(s), comma separated (off unless given)")
    p.add_argument("--chat-template-file", default=None, metavar="PATH",
                   help="a jinja chat template in place of the model's (as llama-server's)")
    from .reasoning import MODES
    p.add_argument("--reasoning-format", choices=MODES, default="auto",
                   help="chat replies of models that reason first (<think> blocks: Qwen3, QwQ, the R1 distills; "
                        "gpt-oss's analysis channel): auto (or deepseek) gives the reasoning as reasoning_content "
                        "apart from content, as llama-server does; none leaves the reply's text as it is")
    p.add_argument("--embeddings", action="store_true",
                   help="serve /v1/embeddings and /embedding (pooled final-normed hidden states, as llama-server's "
                        "--embeddings); generation stays on")
    p.add_argument("--pooling", choices=["mean", "cls", "last"], default=None,
                   help="how --embeddings pools a prompt's rows (default: the GGUF's pooling_type, else mean)")
    p.add_argument("--mtp", action="store_true",
                   help="greedy requests decode speculatively with the model's own multi-token-prediction block "
                        "(Qwen3.5 nextn tensors): --draft tokens drafted a step and verified in one step of the "
                        "model, the output unchanged; other requests decode as usual beside them")
    p.add_argument("--draft", type=int, default=2, help="tokens drafted per sequence and step with --mtp")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond --parallel (then 503)")
    p.add_argument("--max-tokens", type=int, default=4096, help="upper bound of n_predict/max_tokens")
    p.add_argument("--max-body", type=int, default=1 << 20, help="request body limit in bytes")
    p.add_argument("--step-log", default=os.environ.get("VKENGINE_STEP_LOG"), metavar="PATH",
                   help="append a JSON line per engine step (rows, prompt rows, chained, submit -> collected and "
                        "wait times in ms) to PATH: where a server's time goes (default: $VKENGINE_STEP_LOG)")
    p.add_argument("--replicas", type=int, default=0,
                   help="serve through Ray Serve (pip install 'vkengine[ray]') with this many engine replicas "
                        "behind one ingress, prefix-aware routing between them (docs/ray-serve.md); "
                        "0: one process, no Ray")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="with --replicas: Ray GPUs each replica takes (default 1 where Ray sees GPUs, else 0; "
                        "a fraction stands several replicas on one GPU)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM before they are cancelled")
