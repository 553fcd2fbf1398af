"""HTTP routes (Starlette): llama-server's /completion, /tokenize, /detokenize,
/health, /props, /slots; OpenAI's /v1/completions, /v1/chat/completions,
/v1/models; Prometheus /metrics. Streaming replies are server-sent events.

This layer knows requests, validation, SSE framing, auth and limits; it hands
token ids to the worker and formats what comes back. A client that goes away
(streaming or not) cancels its request, which frees its slot at the next step.
"""
from __future__ import annotations

import asyncio
import base64
import dataclasses
import functools
import hmac
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from vkengine.errors import VkEngineError
from vkengine.model import Model
from vkengine.serving.constrain import Grammar, compile_grammar

from . import reasoning, schemas
from . import tools as tool_calls
from .formats import Format, LlamaCompletion, OpenAIChat, OpenAICompletion, Reply
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .schemas import Generation, HTTPError
from .worker import GenRequest, QueueFull, Unavailable, Worker

log = logging.getLogger("vkengine.server")

OPEN_PATHS = {"/health", "/v1/health"}      # answered without an API key (load balancers probe them)


@dataclass
class ServerState:
    worker: Worker
    model: Model
    n_ctx: int
    metrics: Metrics
    max_tokens: int = 4096
    max_body: int = 1 << 20
    retry_after: int = 1
    parallel: int = 1
    mode: str = "batch"
    kv_cache: tuple[str, str] = ("f16", "f16")   # the KV cache's K and V types (--cache-type-k, --cache-type-v)
    pooling: str | None = None            # --embeddings: how /v1/embeddings pools (mean, cls, last); None: off
    reasoning_format: str = "auto"        # --reasoning-format: reasoning_content apart (auto) or in content (none)

    @property
    def model_id(self) -> str:
        return self.model.name

    @functools.cached_property
    def bytes_per_token(self) -> int:
        """An upper bound on the bytes of text one token covers: the longest
        vocabulary entry in UTF-8 (its own spelling is never shorter than the
        text it stands for, but for Unicode normalization), doubled, plus slack."""
        vocab = self.model.tokenizer.hf.get_vocab(with_added_tokens=True)
        return 2 * max(len(t.encode("utf-8")) for t in vocab) + 8

    def check_fits(self, text: str, field: str) -> None:
        """A text too long for the context, refused before tokenizing it (which
        holds the GIL for ~0.5 s a MiB and would stall every other request)."""
        n = len(text.encode("utf-8", "surrogatepass"))
        # (bytes_per_token is at least 10: a text within 10 bytes a position never reads the vocabulary, which a
        # first request paid for, ~60 ms on a 49k vocabulary)
        if n > self.n_ctx * 10 and n > self.n_ctx * self.bytes_per_token:
            raise schemas.bad(field, f"has {n} bytes of text, more than the context's {self.n_ctx} tokens can hold "
                                     f"(a token covers at most {self.bytes_per_token} bytes): send a shorter prompt")


# -- SSE ---------------------------------------------------------------------
def sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(Response):
    """Streams an async iterator of str as text/event-stream while listening for
    the client going away (whatever the ASGI server's spec version): then the
    iterator is closed, which cancels its request."""
    media_type = "text/event-stream"

    def __init__(self, chunks, headers: dict | None = None):
        self.chunks = chunks
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            async with anyio.create_task_group() as tg:
                async def watch():
                    await wait_disconnect(receive)
                    tg.cancel_scope.cancel()
                tg.start_soon(watch)
                try:
                    async for chunk in self.chunks:
                        await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:                      # the client went away mid-send
                    pass
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.chunks.aclose()


# -- helpers -------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed its connection before its request was read (499)."""


async def read_json(request: Request, limit: int) -> dict:
    cl = request.headers.get("content-length")
    if cl and cl.isdigit() and int(cl) > limit:
        raise HTTPError(413, f"the request body has {cl} bytes; the limit is {limit} (--max-body)")
    chunks, n = [], 0
    try:
        async for c in request.stream():
            n += len(c)
            if n > limit:
                raise HTTPError(413, f"the request body exceeds {limit} bytes (--max-body)")
            chunks.append(c)
    except ClientDisconnect:         # gone mid-body (or its chunked framing broke): nobody to answer
        raise ClientGone() from None
    return schemas.parse_json(b"".join(chunks))


def _prompt_ids(st: ServerState, gen: Generation) -> tuple[list[int], str, bool]:
    tok = st.model.tokenizer
    if gen.messages is not None:
        msgs, extra = gen.messages, {}
        for k, (v, fld) in gen.template_vars.items():   # a variable the template never reads: dropped unsaid
            if not tool_calls.template_reads(tok.chat_template, k):
                raise schemas.bad(fld, f"sets {k!r}, which this model's chat template does not read")
            extra[k] = v
        if tool_calls.knows_tools(tok.chat_template):
            if gen.tools is not None:
                extra["tools"] = list(gen.tools.functions)          # type: ignore[attr-defined]
        elif gen.tools is not None or any(m.get("tool_calls") or m["role"] == "tool" for m in msgs):
            msgs = tool_calls.fallback_messages(msgs, gen.tools)     # type: ignore[arg-type]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, **extra)
        if not gen.truncate:
            st.check_fits(text, "messages")
        ids = tok.encode(text)
        if len(ids) > 1 and tok.bos_id is not None and ids[0] == ids[1] == tok.bos_id:
            ids = ids[1:]                     # the template wrote BOS itself
    elif isinstance(gen.prompt, str):
        if not gen.truncate:
            st.check_fits(gen.prompt, "prompt")
        text, ids = gen.prompt, tok.encode(gen.prompt)
    else:
        ids = list(gen.prompt or [])
        text = tok.decode(ids)
    if not ids:
        raise schemas.bad("prompt", "is empty (it has no tokens)")
    if gen.grammar is not None and not isinstance(gen.grammar, Grammar):
        kind, spec, source = gen.grammar
        try:
            gen.grammar = compile_grammar(tok, kind, spec, source)     # type: ignore[assignment]
        except VkEngineError as e:
            msg = str(e)
            raise schemas.bad(source, msg.removeprefix(f"'{source}' ")) from None
    truncated = False
    if len(ids) >= st.n_ctx:
        if not gen.truncate or gen.n_keep < 0:
            field = "messages" if gen.messages is not None else "prompt"
            raise schemas.bad(field, f"has {len(ids)} tokens; the context holds {st.n_ctx} (send a shorter "
                                     "prompt, or \"truncate\": true to keep its start (n_keep) and end)")
        # llama-server's rule: keep the first n_keep tokens and the end, half a context in all
        keep = min(gen.n_keep, st.n_ctx // 4)
        tail = st.n_ctx // 2 - keep
        ids = ids[:keep] + ids[len(ids) - tail:]
        truncated = True
    return ids, text, truncated


async def _events(q: asyncio.Queue, reply: Reply, fmt: Format):
    """The request's JSON objects, as events come in."""
    for obj in fmt.start():
        yield obj
    while True:
        ev = await q.get()
        reply.add(ev)
        if ev.finish is not None and reply.failed:
            yield reply.error_body()
            return
        for obj in fmt.event(ev):
            yield obj
        if ev.finish is not None:
            break
    for obj in fmt.final():
        yield obj


def _reasoning(st: ServerState, gen: Generation, prompt_text: str):
    """The reply's reasoning apart from its answer (server/reasoning.py), where the
    model's template writes one and neither --reasoning-format nor the request's
    reasoning_format says none."""
    fmt = gen.reasoning_format or st.reasoning_format
    mode = reasoning.mode_for(st.model.tokenizer.chat_template)
    return reasoning.ReasoningSplit(mode, prompt_text) if mode and fmt != "none" else None


async def generate(request: Request, st: ServerState, gen: Generation, kind: str) -> Response:
    # tokenizing (and rendering a chat template) may take a while for long prompts: off the event loop
    ids, text, truncated = await anyio.to_thread.run_sync(_prompt_ids, st, gen)
    budget = gen.max_tokens if gen.max_tokens is not None else st.max_tokens
    req = GenRequest(ids, budget, gen.sampling, gen.stop, gen.ignore_eos, gen.n_probs, gen.cache_prompt,
                     grammar=gen.grammar, logit_bias=gen.logit_bias, draft_max=gen.draft_max)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    job = st.worker.submit(req, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
    reply = Reply(st.model_id, text, len(ids), truncated, job=job)
    tok = st.model.tokenizer
    cls = {"llama": LlamaCompletion, "completion": OpenAICompletion, "chat": OpenAIChat}[kind]
    fmt = cls(reply, lambda t: tok.decode([t]), gen.stream, gen.return_tokens, gen.include_usage)
    if isinstance(fmt, OpenAIChat):
        fmt.tools = gen.tools
        fmt.reasoning = _reasoning(st, gen, text)

    def cancel() -> None:
        if reply.finish is None:
            st.worker.cancel(job)
    return await _respond(request, _events(q, reply, fmt), gen.stream, kind != "llama", cancel)


async def _respond(request: Request, objs, stream: bool, done_marker: bool, cancel) -> Response:
    """A generation's JSON objects as an SSE stream (ending with `data: [DONE]`
    on OpenAI's routes), or its last object as the response; cancel() stops
    what still runs when the client goes away. An object with an "error" is
    the failure's response."""
    if stream:
        async def chunks():
            try:
                async for obj in objs:
                    yield sse(obj)
                if done_marker:
                    yield sse("[DONE]")
            finally:
                cancel()
        return SSEResponse(chunks())

    async def collect():
        return [obj async for obj in objs]
    task = asyncio.ensure_future(collect())
    watch = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():                        # the client went away
            task.cancel()
            cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=499)
    out = task.result()
    if "error" in out[-1]:
        return JSONResponse(out[-1], status_code=out[-1]["error"]["code"])
    return JSONResponse(out[-1])


async def generate_n(request: Request, st: ServerState, gen: Generation, kind: str) -> Response:
    """OpenAI's n > 1: n choices of one prompt. The first choice is submitted
    alone and the others once it has its first token, so that they copy its
    prompt's KV rows through the prefix cache (the prompt is prefilled once);
    choice i samples with seed + i (reproducible per choice when a seed is
    given). Streamed chunks carry their choice's index; the usage counts the
    prompt once and every choice's tokens."""
    ids, text, truncated = await anyio.to_thread.run_sync(_prompt_ids, st, gen)
    budget = gen.max_tokens if gen.max_tokens is not None else st.max_tokens
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    tok = st.model.tokenizer
    cls = {"completion": OpenAICompletion, "chat": OpenAIChat}[kind]
    replies = [Reply(st.model_id, text, len(ids), truncated) for _ in range(gen.n)]
    fmts = [cls(r, lambda t: tok.decode([t]), gen.stream, gen.return_tokens, gen.include_usage, index=i)
            for i, r in enumerate(replies)]
    for f in fmts[1:]:
        f.id = fmts[0].id                                                   # type: ignore[attr-defined]
    for f in fmts:
        if isinstance(f, OpenAIChat):
            f.tools = gen.tools
            f.reasoning = _reasoning(st, gen, text)
    jobs: list = [None] * gen.n

    def submit(i: int) -> None:
        sp = gen.sampling if gen.sampling.seed is None else dataclasses.replace(gen.sampling,
                                                                               seed=gen.sampling.seed + i)
        req = GenRequest(ids, budget, sp, gen.stop, gen.ignore_eos, gen.n_probs, gen.cache_prompt,
                         grammar=gen.grammar, logit_bias=gen.logit_bias, draft_max=gen.draft_max)
        def emit(ev, i: int = i) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (i, ev))
        jobs[i] = replies[i].job = st.worker.submit(req, emit)

    def cancel_all() -> None:
        for j, r in zip(jobs, replies):
            if j is not None and r.finish is None:
                st.worker.cancel(j)

    submit(0)                    # (a full queue: the 503 before anything is sent)

    def usage() -> dict:
        n_gen = sum(len(r.tokens) for r in replies)
        return {"prompt_tokens": len(ids), "completion_tokens": n_gen, "total_tokens": len(ids) + n_gen}

    async def objs():
        for f in fmts:
            for obj in f.start():
                yield obj
        done, rest = 0, False
        while done < gen.n:
            i, ev = await q.get()
            if not rest:
                rest = True
                try:
                    for k in range(1, gen.n):
                        submit(k)
                except (QueueFull, Unavailable) as e:
                    cancel_all()
                    yield {"error": {"code": 503, "message": f"choice {k}: {e}", "type": "unavailable_error"}}
                    return
            replies[i].add(ev)
            if ev.finish is not None and replies[i].failed:
                cancel_all()
                yield replies[i].error_body()
                return
            for obj in fmts[i].event(ev):
                yield obj
            done += ev.finish is not None
        finals = [f.final() for f in fmts]
        if gen.stream:
            if finals[0]:
                yield {**finals[0][0], "usage": usage()}
            return
        whole = finals[0][0]
        yield {**whole, "choices": [c for fin in finals for c in fin[0]["choices"]], "usage": usage()}

    return await _respond(request, objs(), gen.stream, True, cancel_all)


def _embedding_ids(st: ServerState, e: schemas.Embeddings) -> list[list[int]]:
    """Each input's tokens as llama-server takes them: text with the model's
    BOS (add_special); ids as given; ids and text mixed, text without specials
    (BOS only when the first part is text)."""
    tok = st.model.tokenizer
    out = []
    for i, p in enumerate(e.inputs):
        name = f"input[{i}]" if len(e.inputs) > 1 else "input"
        if isinstance(p, str):
            st.check_fits(p, name)
            ids = tok.encode(p)
        else:
            ids = []
            for j, part in enumerate(p):
                ids += tok.encode(part, add_special=j == 0) if isinstance(part, str) else [part]
        if not ids:
            raise schemas.bad(name, "is empty (it has no tokens)")
        if len(ids) >= st.n_ctx:
            raise schemas.bad(name, f"has {len(ids)} tokens; the context holds {st.n_ctx}")
        out.append(ids)
    return out


async def embeddings(request: Request, oai_route: bool) -> Response:
    """/v1/embeddings (OpenAI) and llama-server's /embedding, /embeddings: each
    input's final-normed hidden states pooled (--pooling) and normalized
    (embd_normalize, default euclidean). Inputs run as prompts beside
    everything else (up to --parallel of a request's at once); a request
    with llama-server's "content" gets its response shape."""
    st = _st(request)
    if st.pooling is None:
        return _error(501, "this server does not compute embeddings: start it with --embeddings", "not_supported_error")
    e = schemas.embeddings(await read_json(request, st.max_body), st.model.args.n_vocab, st.model.args.n_embd,
                           oai_route)
    all_ids = await anyio.to_thread.run_sync(_embedding_ids, st, e)
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    jobs: list = [None] * len(all_ids)
    done: list = [None] * len(all_ids)

    def submit(i: int) -> None:
        req = GenRequest(all_ids[i], 0, use_cache=False, embed=st.pooling, embd_normalize=e.normalize)

        def emit(ev, i: int = i) -> None:
            loop.call_soon_threadsafe(q.put_nowait, (i, ev))
        jobs[i] = st.worker.submit(req, emit)

    def cancel_all() -> None:
        for j, d in zip(jobs, done):
            if j is not None and d is None:
                st.worker.cancel(j)

    window = max(1, st.parallel)
    submit(0)                                      # (a full queue: the 503 before anything runs)

    async def objs():
        nxt, n_done = 1, 0
        while n_done < len(all_ids):
            while nxt < len(all_ids) and nxt - n_done < window:
                try:
                    submit(nxt)
                except (QueueFull, Unavailable) as err:
                    cancel_all()
                    yield {"error": {"code": 503, "message": f"input {nxt}: {err}", "type": "unavailable_error"}}
                    return
                nxt += 1
            i, ev = await q.get()
            if ev.finish is None:
                continue
            if ev.embedding is None:
                cancel_all()
                yield {"error": {"code": 500, "message": f"input {i}: {ev.error or ev.finish}", "type": "server_error"}}
                return
            done[i] = ev.embedding
            n_done += 1
        if not e.oai:   # llama-server's shape: a vector list per input (one vector: pooled)
            yield [{"index": i, "embedding": [v.tolist()]} for i, v in enumerate(done)]
            return
        n_tok = sum(len(ids) for ids in all_ids)
        yield {"object": "list", "model": st.model_id,
               "data": [{"object": "embedding", "index": i,
                         **({"embedding": base64.b64encode(v.astype("<f4").tobytes()).decode(),
                             "encoding_format": "base64"} if e.base64 else {"embedding": v.tolist()})}
                        for i, v in enumerate(done)],
               "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok}}

    return await _respond(request, objs(), False, False, cancel_all)


async def v1_embeddings(request: Request) -> Response:
    return await embeddings(request, oai_route=True)


async def llama_embeddings(request: Request) -> Response:
    return await embeddings(request, oai_route=False)


# -- routes --------------------------------------------------------------------
def _st(request: Request) -> ServerState:
    return request.app.state.server


async def completion(request: Request) -> Response:
    st = _st(request)
    body = await read_json(request, st.max_body)
    return await generate(request, st, schemas.completion(body, st.model.args.n_vocab, st.max_tokens), "llama")


async def v1_completions(request: Request) -> Response:
    st = _st(request)
    body = await read_json(request, st.max_body)
    gen = schemas.openai_completion(body, st.model.args.n_vocab, st.max_tokens)
    return await (generate_n if gen.n > 1 else generate)(request, st, gen, "completion")


async def v1_chat(request: Request) -> Response:
    st = _st(request)
    body = await read_json(request, st.max_body)
    gen = schemas.chat_completion(body, st.max_tokens)
    return await (generate_n if gen.n > 1 else generate)(request, st, gen, "chat")


async def apply_template(request: Request) -> Response:
    """llama-server's /apply-template: a chat request's prompt as the model's
    template renders it (tools and tool calls included), without generating."""
    st = _st(request)
    gen = schemas.chat_completion(await read_json(request, st.max_body), st.max_tokens)
    gen.grammar = None                      # (rendering only)
    _, text, _ = await anyio.to_thread.run_sync(_prompt_ids, st, gen)
    return JSONResponse({"prompt": text})


async def tokenize(request: Request) -> Response:
    st = _st(request)
    f = schemas.Fields(await read_json(request, st.max_body))
    content = f.required_text("content")
    add_special, with_pieces = f.flag("add_special", False), f.flag("with_pieces", False)
    tok = st.model.tokenizer

    def run():                                 # a body-limit's worth of text takes ~1 s: off the event loop
        ids = tok.encode(content, add_special=add_special)
        return [{"id": i, "piece": tok.decode([i])} for i in ids] if with_pieces else ids
    return JSONResponse({"tokens": await anyio.to_thread.run_sync(run)})


async def detokenize(request: Request) -> Response:
    st = _st(request)
    f = schemas.Fields(await read_json(request, st.max_body))
    ids = f.token_ids("tokens", st.model.args.n_vocab)
    return JSONResponse({"content": await anyio.to_thread.run_sync(st.model.tokenizer.decode, ids)})


async def health(request: Request) -> Response:
    fault = _st(request).worker.fault
    if fault is not None:
        return JSONResponse({"status": "error", "error": fault}, status_code=503)
    if not _st(request).worker.accepting:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def props(request: Request) -> Response:
    st = _st(request)
    tok = st.model.tokenizer
    return JSONResponse({
        "default_generation_settings": {"n_ctx": st.n_ctx, "params": {
            "n_predict": -1, "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
            "repeat_penalty": 1.0, "repeat_last_n": 64, "seed": -1}},
        "total_slots": st.parallel, "mode": st.mode, "model_path": str(st.model.path),
        "cache_type_k": st.kv_cache[0], "cache_type_v": st.kv_cache[1],
        "chat_template": tok.chat_template or "",
        "bos_token": tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
        "eos_token": tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
        "max_tokens": st.max_tokens, "max_body": st.max_body, "max_queue": st.worker.cfg.max_queue,
        "build_info": "vkengine 0.1.0", "modalities": {"vision": False}})


async def slots(request: Request) -> Response:
    st = _st(request)
    snap = st.worker.snapshot
    return JSONResponse([{**s, "n_ctx": st.n_ctx} for s in snap["slots"]])


async def models(request: Request) -> Response:
    st = _st(request)
    a = st.model.args
    return JSONResponse({"object": "list", "data": [{
        "id": st.model_id, "object": "model", "created": 0, "owned_by": "vkengine",
        "meta": {"n_ctx": st.n_ctx, "n_ctx_train": a.n_ctx_train, "n_vocab": a.n_vocab}}]})


async def metrics(request: Request) -> Response:
    return Response(_st(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


ROUTES = [
    Route("/completion", completion, methods=["POST"]),
    Route("/completions", completion, methods=["POST"]),
    Route("/v1/completions", v1_completions, methods=["POST"]),
    Route("/v1/chat/completions", v1_chat, methods=["POST"]),
    Route("/chat/completions", v1_chat, methods=["POST"]),
    Route("/v1/embeddings", v1_embeddings, methods=["POST"]),
    Route("/embedding", llama_embeddings, methods=["POST"]),
    Route("/embeddings", llama_embeddings, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/apply-template", apply_template, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/health", health), Route("/v1/health", health),
    Route("/props", props), Route("/slots", slots),
    Route("/v1/models", models), Route("/models", models),
    Route("/metrics", metrics),
]
_ROUTE_NAMES = {r.path for r in ROUTES}


# -- errors and middleware ---------------------------------------------------------
def _error(status: int, message: str, kind: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(HTTPError(status, message, kind=kind).body(), status_code=status, headers=headers)


async def on_http_error(request: Request, e: HTTPError) -> Response:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def on_busy(request: Request, e: VkEngineError) -> Response:
    retry = str(_st(request).retry_after)
    return _error(503, str(e), "unavailable_error", {"Retry-After": retry})


async def on_user_error(request: Request, e: VkEngineError) -> Response:
    return _error(400, str(e), "invalid_request_error")


async def on_starlette(request: Request, e: HTTPException) -> Response:
    return _error(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")


_gone_log = [0.0, 0]   # (last log time, requests since): one line a second at most


async def on_client_gone(request: Request, e: ClientGone) -> Response:
    import time
    _gone_log[1] += 1
    now = time.monotonic()
    if now - _gone_log[0] >= 1.0:
        log.info("%d request(s) whose client closed before sending the whole body (last: %s)", _gone_log[1],
                 request.url.path)
        _gone_log[0], _gone_log[1] = now, 0
    return Response(status_code=499)


async def on_crash(request: Request, e: Exception) -> Response:
    log.exception("unhandled error in %s", request.url.path)
    return _error(500, f"internal server error ({type(e).__name__}); see the server log", "server_error")


class AuthMiddleware:
    """Bearer API key, compared in constant time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, given = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.key):
                resp = _error(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                              "authentication_error", {"WWW-Authenticate": "Bearer"})
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


MAX_HEADER_BYTES = 16 << 10     # a request's header block (names, values), as the docs promise
MAX_TARGET_BYTES = 8 << 10      # its path and query
SIMPLE_TYPES = (b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data")
LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


class GuardMiddleware:
    """Before anything else reads a request: a header block over 16 KiB (431) or
    a target over 8 KiB (414); a Host header that names neither a loopback name,
    the address the server is bound to nor an --allowed-hosts entry (403: a web
    page's DNS rebinding); a POST body of a type a browser sends cross-origin
    without asking (text/plain, forms: 415), so that no page can fire requests
    at a local server."""

    def __init__(self, app, allowed_hosts: frozenset[str] | None):
        self.app, self.allowed = app, allowed_hosts     # None: any Host (bound to every address)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = scope["headers"]
        resp = None
        if sum(len(k) + len(v) + 4 for k, v in headers) > MAX_HEADER_BYTES:
            resp = _error(431, f"the request's headers exceed {MAX_HEADER_BYTES} bytes", "invalid_request_error")
        elif len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") > MAX_TARGET_BYTES:
            resp = _error(414, f"the request's URL exceeds {MAX_TARGET_BYTES} bytes", "invalid_request_error")
        else:
            h = dict(headers)
            host = h.get(b"host", b"").decode("latin-1").strip().lower()
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if self.allowed is not None and name and name not in self.allowed:   # (no Host: HTTP/1.0, no browser)
                resp = _error(403, f"Host {host!r} is not one this server answers (a loopback name, its address or "
                                   "--allowed-hosts)", "permission_error")
            elif scope["method"] == "POST" and h.get(b"content-type", b"").split(b";")[0].strip().lower() \
                    in SIMPLE_TYPES:
                resp = _error(415, "send the body as JSON with 'Content-Type: application/json'",
                              "invalid_request_error")
        if resp is not None:
            return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def allowed_hosts(bind: str, extra: str | None) -> frozenset[str] | None:
    """The Host names a server bound to `bind` answers: loopback names, the bound
    address and --allowed-hosts (comma separated; "*": any); None: any (bound
    to every address with no --allowed-hosts)."""
    names = {n.strip().lower() for n in (extra or "").split(",") if n.strip()}
    if "*" in names or (bind in ("0.0.0.0", "::", "") and not names):
        return None
    b = bind.lower()
    return frozenset(LOOPBACK | names | {b, f"[{b}]"})


class CountMiddleware:
    """vkengine_http_requests{route, status}."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)
        try:
            await self.app(scope, receive, send_)
        finally:
            path = scope["path"]
            self.metrics.http_request(path if path in _ROUTE_NAMES else "other", status[0])


def create_app(st: ServerState, api_key: str | None = None, cors: str | None = None,
               hosts: frozenset[str] | None = frozenset(LOOPBACK)) -> Starlette:
    @asynccontextmanager
    async def lifespan(app):
        st.worker.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(st.worker.stop)

    middleware = [Middleware(CountMiddleware, metrics=st.metrics), Middleware(GuardMiddleware, allowed_hosts=hosts)]
    if cors:
        middleware.append(Middleware(CORSMiddleware, allow_origins=[o.strip() for o in cors.split(",")],
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if api_key:
        middleware.append(Middleware(AuthMiddleware, key=api_key))
    handlers: dict[Any, Any] = {   # (Starlette types a handler by Exception, not by its own class)
        HTTPError: on_http_error, QueueFull: on_busy, Unavailable: on_busy, VkEngineError: on_user_error,
        ClientGone: on_client_gone,
        HTTPException: on_starlette, Exception: on_crash}
    app = Starlette(routes=ROUTES, middleware=middleware, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = st
    return app
