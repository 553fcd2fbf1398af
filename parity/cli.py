"""`parity` command line: run, note, serve-reference, report, build-reference.

Configuration enters here and is passed down; a VkEngineError prints as one
`error: ...` line (exit 2), never a traceback.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from vkengine.errors import VkEngineError
from vkengine.options import add_cache_args, device_list


def cmd_run(args) -> int:
    from .run import RunConfig, run_parity
    cfg = RunConfig(model=args.model, prompts=args.prompts, n_predict=args.n_predict, n_probs=args.n_probs,
                    endpoint=args.endpoint, endpoint_b=args.endpoint_b, out=args.out, note=args.note,
                    device=args.device, devices=tuple(args.devices) if args.devices else None,
                    tensor_split=args.tensor_split, repeats=args.repeats,
                    server=Path(args.server) if args.server else None, server_args=tuple(args.server_args.split()),
                    cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v)
    art = run_parity(cfg)
    if art["verdict"] != "PASS" and not args.note:
        print("warning: below a bar and no --note given: the artifact carries no deviation note", file=sys.stderr)
    return 0


def cmd_serve_reference(args) -> int:
    from vkengine.model import default_model_path

    from . import llamacpp
    exe = llamacpp.ensure_built()
    model = Path(args.model) if args.model else default_model_path()
    if not model.is_file():
        raise VkEngineError(f"model file {model} does not exist")
    srv = llamacpp.start_server(exe, model, port=args.port, host=args.host, extra=args.extra,
                                timeout=args.timeout)
    print(f"llama-server {llamacpp.RELEASE} ready at {srv.url} (Ctrl-C stops it; log: {srv.log_path})", flush=True)
    # SIGTERM ends the server too, not just Ctrl-C
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = srv.proc.wait()
        raise VkEngineError(f"llama-server exited with code {code}:\n{srv.log_tail()}")
    except KeyboardInterrupt:
        return 0
    finally:
        srv.stop()


def _interrupt(*_):
    raise KeyboardInterrupt


def cmd_build_reference(args) -> int:
    from . import llamacpp
    print(llamacpp.ensure_built())
    return 0


def cmd_note(args) -> int:
    """Write (or replace) an artifact's deviation note after reading its figures."""
    import datetime as dt
    import json

    from .run import SCHEMA, write_atomic
    path = Path(args.artifact)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise VkEngineError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise VkEngineError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise VkEngineError(f"{path} is not a parity artifact (schema {SCHEMA})")
    text = args.text.strip()
    if not text:
        raise VkEngineError("the note is empty")
    doc["note"] = text
    doc["note_written"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    write_atomic(path, doc)
    print(f"noted {path}")
    return 0


def cmd_report(args) -> int:
    from .report import render
    print(render(Path(args.folder)))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="parity", description="Token parity of vkengine against llama.cpp.")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="compare greedy tokens with llama-server and write a JSON artifact")
    r.add_argument("--endpoint", default="auto",
                   help="llama-server for mode A (defaults). Without --endpoint-b the harness starts "
                        "llama-server itself at this address (or a free port: auto), once per mode")
    r.add_argument("--endpoint-b", help="llama-server for mode B (started with -fa off -b 64 -ub 64)")
    r.add_argument("--model", help="GGUF file both sides run (default: the embedded SmolLM2-135M Q4_1)")
    r.add_argument("--prompts", default="default", help="prompt set name (parity/prompts/NAME.json) or a JSON file")
    r.add_argument("--n-predict", type=int, default=32, help="greedy tokens per prompt")
    r.add_argument("--n-probs", type=int, default=8, help="llama.cpp's top-N candidates per position")
    r.add_argument("--repeats", type=int, default=2, help="runs of each llama.cpp mode (determinism check)")
    r.add_argument("--out", help="artifact path, e.g. docs/parity/NAME.json")
    r.add_argument("--server", default=None, help="llama-server binary to start (default: the harness's CPU build)")
    r.add_argument("--server-args", default="", help="extra llama-server arguments for both modes, given as "
                   "--server-args='-ngl 99'")
    r.add_argument("--note", help="deviation note recorded in the artifact (required reading when below a bar)")
    r.add_argument("--device", type=int, default=None,
                   help="Vulkan device index (default: VKENGINE_DEVICE or the best)")
    r.add_argument("--devices", type=device_list, default=None, metavar="I,J[,...]",
                   help="our side's model split across these devices by layers (vkengine's --devices)")
    r.add_argument("--tensor-split", "-ts", default=None, metavar="P,Q[,...]",
                   help="with --devices: each device's share of the layers")
    add_cache_args(r)   # both sides: llama-server started with -ctk/-ctv (and -fa on for a q8_0 V cache)
    r.set_defaults(fn=cmd_run)

    s = sub.add_parser("serve-reference", help="build (once) and start llama-server on the CPU",
                       description="Extra llama-server arguments go after `--`.")
    s.add_argument("--model", help="GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8081)
    s.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for /health")
    s.set_defaults(fn=cmd_serve_reference)

    b = sub.add_parser("build-reference", help="build llama-server (once) and print its path")
    b.set_defaults(fn=cmd_build_reference)

    n = sub.add_parser("note", help="write an artifact's deviation note after reading its figures")
    n.add_argument("artifact", help="a parity run's JSON artifact")
    n.add_argument("text", help="the note (what the figures below a bar mean, with evidence)")
    n.set_defaults(fn=cmd_note)

    rep = sub.add_parser("report", help="render DIR/README.md and DIR/history.svg from the artifacts in DIR")
    rep.add_argument("folder", nargs="?", default="docs/parity")
    rep.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:                       # llama-server's own flags, passed through untouched
        k = argv.index("--")
        argv, extra = argv[:k], argv[k + 1:]
    args = parser().parse_args(argv)
    args.extra = extra
    if extra and args.cmd != "serve-reference":
        print("error: arguments after `--` are for serve-reference only", file=sys.stderr)
        return 2
    try:
        if args.cmd == "run":
            from vkengine.options import split_devices
            split_devices(args)   # (--device with --devices, --tensor-split alone: refused)
        if args.cmd == "run" and args.device is None and args.devices is None and os.environ.get("VKENGINE_DEVICE"):
            if not os.environ["VKENGINE_DEVICE"].isdigit():
                raise VkEngineError(f"VKENGINE_DEVICE={os.environ['VKENGINE_DEVICE']!r} is not a device index")
            args.device = int(os.environ["VKENGINE_DEVICE"])
        return args.fn(args)
    except VkEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
