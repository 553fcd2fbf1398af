"""llama.cpp's side of a parity run: two modes of llama-server that should give
the same tokens but differ numerically, each run twice on every prompt.

Mode A is llama-server's defaults; mode B turns flash attention off and uses
64-token batches (shared/notes/parity.md). The modes come from two endpoints
the user started, or from one endpoint address where the harness starts
llama-server itself, once per mode.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from vkengine.errors import VkEngineError
from vkengine.model import Model
from vkengine.tokenizer import Tokenizer

from . import llamacpp
from .llamacpp import Client, Completion, Log

MODE_ARGS = {"A": (), "B": ("-fa", "off", "-b", "64", "-ub", "64")}


def mode_args(name: str, cache: tuple[str, str] = ("f16", "f16")) -> tuple[str, ...]:
    """llama-server's arguments for a mode with the KV cache types (K, V) the
    engine runs: -ctk/-ctv where not f16. A quantized V cache needs flash
    attention (llama-server refuses it otherwise), so both modes then take
    -fa on, and mode B differs from A only in its 64-token batches."""
    args = MODE_ARGS[name]
    if cache == ("f16", "f16"):
        return args
    if cache[1] != "f16":   # (mode B's "-fa off" replaced)
        args = ("-fa", "on", *(args[2:] if args[:1] == ("-fa",) else args))
    return (*args, "-ctk", cache[0], "-ctv", cache[1])


@dataclass
class ModeResult:
    name: str
    endpoint: str
    command: list[str] | None        # None: a server the user started
    build_info: str | None
    runs: list[list[Completion]] = field(default_factory=list)   # [repeat][prompt]
    args: tuple[str, ...] = ()       # the mode's arguments (mode_args) where the harness started it

    def describe(self) -> dict:
        return {"endpoint": self.endpoint, "command": self.command,
                "args": list(self.args) if self.command else None,
                "started_by": "parity harness" if self.command else "user",
                "build_info": self.build_info}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as one printable character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def piece_bytes(tok: Tokenizer) -> Callable[[int], bytes]:
    """A token's bytes as llama-server prints them (token_to_piece with
    special=false: control tokens print nothing; a SentencePiece vocabulary's
    byte tokens <0xXX> their byte and U+2581 a space)."""
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    spm = tok.hf.token_to_id("<0x00>") is not None

    def piece(i: int) -> bytes:
        if i in tok.special_ids:
            return b""
        s = tok.token_text(i)
        if spm:
            m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", s)
            return bytes([int(m.group(1), 16)]) if m else s.replace("\u2581", " ").encode()
        if all(ch in byte_of for ch in s):
            return bytes(byte_of[ch] for ch in s)
        return s.encode()            # user-defined tokens are stored as plain text
    return piece


def check_model(client: Client, model: Model) -> dict:
    """Fail early when an endpoint serves another model than --model."""
    props = client.props()
    served = Path(str(props.get("model_path") or "")).name
    if served != model.path.name:
        raise VkEngineError(f"model mismatch: {client.url} serves {served or '(unknown)'}, but --model is "
                            f"{model.path.name}; start llama-server with -m {model.path}")
    meta = client.model_meta()
    ours = {"n_vocab": model.args.n_vocab, "n_embd": model.args.n_embd}
    for key, want in ours.items():
        if key in meta and int(meta[key]) != int(want):
            raise VkEngineError(f"model mismatch: {client.url} reports {key}={meta[key]}, {model.path.name} "
                                f"has {want}")
    return props


def check_tokens(ours: Sequence[int], theirs: Sequence[int], what: str, url: str) -> None:
    if list(ours) != list(theirs):
        i = next((k for k, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise VkEngineError(
            f"tokenizer mismatch on {what}: at token {i} vkengine has {list(ours[i:i + 4])}, llama-server at "
            f"{url} has {list(theirs[i:i + 4])}; the two would not start from the same ids")


@contextmanager
def mode_endpoints(endpoint: str | None, endpoint_b: str | None, model_path: Path,
                   log: Log, cache: Path | None = None, exe: Path | None = None,
                   extra: tuple[str, ...] = (), kv_cache: tuple[str, str] = ("f16", "f16")
                   ) -> Iterator[Iterator[tuple[str, str, list | None]]]:
    """Yield an iterator of (mode, url, command): the user's two endpoints as
    they are, or llama-server started by us at `endpoint` (or a free port when
    it is None or "auto"), stopped and restarted for mode B. `exe` is another
    llama-server build (default: ours, built on demand); `extra` arguments go to
    both modes (e.g. -ngl 99 for a GPU build); kv_cache: the KV cache types (K,
    V) both modes run with (mode_args; the user's own endpoints must have been
    started with them)."""
    if endpoint_b:
        if not endpoint or endpoint == "auto":
            raise VkEngineError("--endpoint-b needs --endpoint (mode A) as well")
        yield iter([("A", endpoint, None), ("B", endpoint_b, None)])
        return
    host, port = "127.0.0.1", None
    if endpoint and endpoint != "auto":
        u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        host, port = u.hostname or host, u.port
        if port and llamacpp.port_in_use(host, port):
            raise VkEngineError(
                f"{endpoint} is already serving: the harness restarts llama-server itself between the two "
                "modes, so give it a free address, or give both modes as --endpoint and --endpoint-b")
    exe = exe or llamacpp.ensure_built(cache, log)
    live: list[llamacpp.ServerProcess] = []

    def modes():
        for name in MODE_ARGS:
            args = mode_args(name, kv_cache)
            srv = llamacpp.start_server(exe, model_path, port=port, host=host, extra=(*extra, *args), log=log)
            live.append(srv)
            try:
                yield name, srv.url, srv.cmd
            finally:
                srv.stop()

    try:
        yield modes()
    finally:
        for s in live:
            s.stop()


def collect(modes: Iterator[tuple[str, str, list | None]], model: Model, texts: Sequence[tuple[str, bool]],
            labels: Sequence[str], n_predict: int, n_probs: int, repeats: int,
            log: Log, kv_cache: tuple[str, str] = ("f16", "f16")) -> tuple[list[list[int]], list[ModeResult]]:
    """Tokenize every prompt through mode A's endpoint (checked against our
    tokenizer and mode B's), then run both modes `repeats` times."""
    ids: list[list[int]] | None = None
    results = []
    for name, url, cmd in modes:
        with Client(url) as c:
            props = check_model(c, model)
            mine = [c.tokenize(t, add) for t, add in texts]
            for lab, (t, add), theirs in zip(labels, texts, mine):
                check_tokens(model.tokenizer.encode(t, add_special=add), theirs, f"prompt {lab!r}", url)
            if ids is None:
                ids = mine
            elif mine != ids:
                raise VkEngineError(f"mode {name} at {url} tokenizes the prompts differently from mode A")
            res = ModeResult(name, url, cmd, props.get("build_info"), args=mode_args(name, kv_cache))
            piece, anchor = piece_bytes(model.tokenizer), c.tokenize(".", add_special=False)
            if len(anchor) != 1:
                raise VkEngineError(f"{url} does not tokenize '.' as one token; cannot recover skipped probabilities")
            for r in range(repeats):
                res.runs.append([c.complete(p, n_predict, n_probs, piece, anchor[0]) for p in ids])
                log(f"llama.cpp mode {name} run {r + 1}/{repeats}: {len(ids)} prompts done")
            results.append(res)
    if ids is None or len(results) != 2:
        raise VkEngineError("no llama.cpp modes ran")
    return ids, results
