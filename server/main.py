"""`vkengine serve`: load the model, build the engine and the scheduler for the
chosen mode, and run uvicorn until a signal; then drain gracefully."""
from __future__ import annotations

import dataclasses
import importlib
import logging
import sys
import threading
from pathlib import Path
from typing import Any

from vkengine.errors import VkEngineError
from vkengine.options import Options, device_index
from vkengine.serving.scheduler import SchedulerConfig

from .metrics import Metrics
from .worker import Worker

log = logging.getLogger("vkengine.server")

# --prompt-tokens' default on GPUs: a lone prompt's chunk (8B Q4_0 on the H200 prefilled a 16k prompt at
# 6,492 tok/s in chunks of 2048 against 1,157 in chunks of 64, issue 31)
PROMPT_TOKENS_GPU = 2048
# --prompt-ms' default on GPUs: with streams running, a newcomer's chunk takes what fits 100 ms (H200, 8B
# Q4_0, 4 streams beside 4 newcomers with 8k-token prompts: at the fixed 64 rows the newcomers waited 15.3 s
# for their first token, against llama-server's 4.2-4.8 s, whose streams paused up to 1.26 s; notes.md run 27)
PROMPT_MS_GPU = 100.0
# modules imported while the first steps' pipelines compile (the driver's work, the GIL free) instead of
# before the model loads or on a first request (issue 35): the HTTP side (uvicorn, starlette through the
# app; ~75 ms of the start's imports on this project's CPU machine), and what a first request would
# import (anyio's asyncio backend: starlette's worker threads; numpy.random: the sampler; utf-8-sig: the
# JSON body's decoder; ~45 ms of a first request's 170 on lavapipe)
WARM_MODULES = ("uvicorn", f"{__package__}.app", f"{__package__}.guard", "anyio._backends._asyncio",
                "numpy.random", "encodings.utf_8_sig")


def _warm_up(model) -> None:
    """WARM_MODULES imported and the model's tokenizer built (load_model's
    defer_tokenizer), on a thread while the first steps' pipelines compile."""
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:   # (another anyio or numpy: the request imports what it needs)
            pass
    model.warm_tokenizer()   # (its error raised again where the start reads it, after the pipelines)


def scheduler_config(args, gpu: bool = False) -> tuple[SchedulerConfig, int]:
    """(scheduler config, device KV slots) for the flags (gpu: the device is
    one, which the defaults of --prompt-tokens and --prompt-ms follow)."""
    if args.parallel < 1:
        raise VkEngineError("--parallel must be >= 1")
    if args.quantum < 1:
        raise VkEngineError("--quantum must be >= 1")
    if args.mode == "slices":
        # the seed design: one sequence on the device at a time, the others parked on the host
        n_slots, newcomer_first = 1, True
        host_cache = 4 if args.host_cache < 0 else args.host_cache
    else:
        n_slots = args.slots or args.parallel
        if not 1 <= n_slots <= args.parallel:
            raise VkEngineError("--slots must be between 1 and --parallel")
        newcomer_first, host_cache = False, max(0, args.host_cache)
    step = args.step_tokens
    if step < n_slots:
        raise VkEngineError(f"--step-tokens ({step}) must be at least the number of slots ({n_slots})")
    prompt = getattr(args, "prompt_tokens", None)
    if prompt is None:
        prompt = max(step, PROMPT_TOKENS_GPU) if gpu else step
    if prompt < step:
        raise VkEngineError(f"--prompt-tokens ({prompt}) must be at least --step-tokens ({step})")
    prompt_ms = getattr(args, "prompt_ms", None)
    if prompt_ms is None:
        prompt_ms = PROMPT_MS_GPU if gpu else 0.0
    if prompt_ms < 0:
        raise VkEngineError("--prompt-ms must be >= 0")
    cfg = SchedulerConfig(n_slots=n_slots, max_live=args.parallel, step_tokens=step, quantum=args.quantum,
                          max_queue=args.max_queue, newcomer_first=newcomer_first, min_prefix=args.min_prefix,
                          host_cache=host_cache, prompt_tokens=prompt, prompt_ms=prompt_ms)
    return cfg.validate(), n_slots


def _draining_server(config, worker: Worker, grace: float):
    """uvicorn that, on the shutdown signal, first tells the worker to stop
    taking requests and to end what is still running after the grace period;
    in-flight replies then finish (or end with an error event) before the
    connections close. (A class made here: uvicorn is imported while the
    engine's pipelines compile, not before the model loads.)"""
    import uvicorn

    class _Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            worker.drain(grace)
            await super().shutdown(sockets)

    return _Server(config)


def embedding_pooling(model, flag: str | None) -> str:
    """--pooling, else the GGUF's {arch}.pooling_type (llama.cpp's: 1 mean, 2 cls, 3 last), else mean."""
    from vkengine.serving.embed import GGUF_POOLING, check_pooling
    if flag is not None:
        return check_pooling(flag)
    arch = model.file.meta("general.architecture", None)
    kind = model.file.meta(f"{arch}.pooling_type", None) if arch else None
    if kind is not None and int(kind) not in GGUF_POOLING:
        raise VkEngineError(f"the model's pooling_type {kind} is not one vkengine pools (mean, cls, last): "
                            "give --pooling")
    return GGUF_POOLING[int(kind)] if kind is not None else "mean"


@dataclasses.dataclass
class Built:
    """A server's engine side, loaded (build_worker)."""
    model: Any
    device: Any
    engine: Any
    cfg: SchedulerConfig
    metrics: Metrics
    pooling: str | None


def build_worker(args) -> tuple[Worker, Built]:
    """The model, device, engine and engine thread (not started) for the flags:
    a `vkengine serve` process's, or one Ray replica's (server/ray_app.py)."""
    from vkengine.device import Device
    from vkengine.engine import Engine, EngineConfig
    from vkengine.kernels import KVTypes
    from vkengine.model import load_model
    from vkengine.options import split_devices
    from vkengine.startup import StartupClock
    clock = StartupClock()
    scheduler_config(args)   # the flags' errors before the model loads
    split = split_devices(args)
    mtp = getattr(args, "mtp", False)
    kv_types = KVTypes(args.cache_type_k, args.cache_type_v)
    model = load_model(args.model, defer_tokenizer=True)   # (built by the warm-up thread below)
    if mtp:
        from vkengine.serving.speculate import check_mtp
        check_mtp(model, args.draft)
    if args.chat_template_file:
        try:
            model.tokenizer.chat_template = Path(args.chat_template_file).read_text()
        except OSError as e:
            raise VkEngineError(f"--chat-template-file: {e}") from None
    pooling = embedding_pooling(model, args.pooling) if args.embeddings else None
    clock.mark("model file")
    # one device, or (--devices) the first of a split model's: their kind sets the scheduler's defaults
    devs = [Device(i) for i in split] if split is not None else [Device(device_index(args))]
    for d in devs:
        d.save_at_exit()   # what requests compiled after startup, for the next start
    dev = devs[0]
    clock.mark("device")
    cfg, n_slots = scheduler_config(args, gpu=dev.info.type != "cpu")
    options = Options.from_env()
    caps, max_out = None, n_slots
    if mtp:   # verify steps: every slot's token and its drafts, each row computed as alone, snapshots for all
        from vkengine.kernels import Caps
        from vkengine.serving.speculate import verify_rows
        caps = [Caps.detect(d, options) for d in devs]
        rows = min(verify_rows(c, n_slots, args.draft) for c in caps)
        model = dataclasses.replace(model, args=dataclasses.replace(model.args, mtp_snap_rows=rows))
        max_out = max(n_slots, rows)
    ecfg = EngineConfig(n_slots=n_slots, n_ctx=args.ctx, max_batch=cfg.max_prompt_rows, max_out=max_out,
                        max_in_flight=3, options=options, kv_types=kv_types, embeddings=args.embeddings,
                        defer_fill=True)   # (the weights uploaded while the first steps' pipelines compile)
    if split is not None:   # the layers across the devices (vkengine.split)
        from vkengine.split import SplitEngine, parse_split
        eng: Any = SplitEngine(model, devs, ecfg, parse_split(args.tensor_split, len(devs)), caps)
        log.info("%s: %s", model.name, eng.describe())
    else:
        eng = Engine(model, dev, ecfg, caps=caps[0] if caps else None)
    clock.mark("weights and buffers")
    if eng.max_batch < cfg.step_tokens:
        raise VkEngineError(f"--step-tokens {cfg.step_tokens} does not fit the device's buffers; "
                            f"use at most {eng.max_batch}")
    if eng.max_batch < cfg.max_prompt_rows:
        if args.prompt_tokens is not None:
            raise VkEngineError(f"--prompt-tokens {cfg.prompt_tokens} does not fit the device's buffers; "
                                f"use at most {eng.max_batch}")
        cfg = dataclasses.replace(cfg, prompt_tokens=eng.max_batch)
    # the steps of a first request now, the others by the engine thread while it has nothing to run; meanwhile
    # (the driver compiling, the GIL free) the tokenizer and the modules the HTTP side and a first request need
    warm = threading.Thread(target=_warm_up, args=(model,), name="vkengine-warm", daemon=True)
    warm.start()
    n_rec = eng.prepare_decode(n_slots, cfg.step_tokens, defer=True)
    warm.join()
    _ = model.tokenizer   # (an invalid vocabulary's error here, before the server answers /health)
    clock.mark("pipelines and recording")   # (drivers compile a pipeline when it is created: on first use)
    log.info("recorded %d decode and prompt steps ahead, %d more when idle (%d pipelines, slowest: %s; %s; weights "
             "uploaded in %.2f s meanwhile; saved pipelines: %s%s); startup: %s", n_rec, len(eng.deferred),
             dev.n_pipelines, dev.slowest_pipelines(), dev.pipeline_report(), dev.fill_s,
             f"{dev.pipeline_cache_loaded} bytes loaded from {dev.pipeline_cache_file}"
             if dev.pipeline_cache_loaded else "none",
             f"; still compiling, their steps on stand-in kernels until built: {', '.join(sorted(dev.slow))}"
             if dev.slow_pending else "", clock.summary())
    metrics = Metrics(n_slots, cfg.max_live, eng.n_ctx)
    metrics.startup(clock.phases)
    worker = Worker(eng, cfg, metrics, step_log=args.step_log, mtp_draft=args.draft if mtp else 0)
    if mtp:   # a lone stream's speculative turns, recorded by the engine thread while it has nothing to run
        from vkengine.serving.speculate import prepare_turns
        prepare_turns(eng, args.draft, defer=True)
    return worker, Built(model, dev, eng, worker.cfg, metrics, pooling)


def build(args):
    """(app, state) for the flags: the model and engine are loaded here."""
    worker, b = build_worker(args)
    from .app import ServerState, create_app
    st = ServerState(worker=worker, model=b.model, n_ctx=b.engine.n_ctx, metrics=b.metrics,
                     max_tokens=args.max_tokens, max_body=args.max_body, parallel=args.parallel, mode=args.mode,
                     kv_cache=(b.engine.kv.types.k, b.engine.kv.types.v),
                     pooling=b.pooling, reasoning_format=args.reasoning_format)
    from .app import allowed_hosts
    return create_app(st, api_key=args.api_key, cors=args.cors,
                      hosts=allowed_hosts(args.host, args.allowed_hosts)), st, b.device


def default_max_connections() -> int:
    """Open connections kept at most: the file-descriptor limit less room for the
    model's files, the device and logs."""
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, min(4096, (soft if soft != resource.RLIM_INFINITY else 4096) - 128))


def serve_main(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.header_timeout <= 0 or (args.max_connections and args.max_connections < 8) or args.max_connections < 0:
        raise VkEngineError("--header-timeout must be > 0 and --max-connections 0 (the default) or >= 8")
    if args.max_tokens < 1 or args.max_body < 1 or args.max_queue < 0:
        raise VkEngineError("--max-tokens and --max-body must be >= 1, --max-queue >= 0")
    if args.api_key is not None and not args.api_key.strip():
        raise VkEngineError("--api-key (or VKENGINE_API_KEY) is empty: give a key, or leave it out for no auth")
    if getattr(args, "replicas", 0):
        try:
            import ray  # noqa: F401

            from .ray_app import serve_replicas
        except ImportError:
            raise VkEngineError("--replicas serves through Ray Serve: pip install 'vkengine[ray]' "
                                "(ray[serve])") from None
        return serve_replicas(args)
    app, st, dev = build(args)
    log.info("%s on %s: mode %s, parallel %d, %d device slot(s), context %d, step %d tokens, prompt steps "
             "up to %d, KV cache K %s V %s%s%s", st.model_id, dev.info.name, args.mode, args.parallel,
             st.worker.cfg.n_slots, st.n_ctx, st.worker.cfg.step_tokens, st.worker.cfg.max_prompt_rows, *st.kv_cache,
             f"; {st.worker.runner.eng.describe()}" if hasattr(st.worker.runner.eng, "describe") else "",
             f", MTP drafts {args.draft} a step (verify steps of up to {st.worker.runner.spec.rows} rows)"
             if st.worker.runner.spec is not None else "")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        log.warning("listening on %s without --api-key: anyone who can reach it can use it", args.host)
    from .guard import AcceptErrorFilter, GuardedH11Protocol
    GuardedH11Protocol.header_timeout = args.header_timeout
    GuardedH11Protocol.max_open = args.max_connections or default_max_connections()
    logging.getLogger("asyncio").addFilter(AcceptErrorFilter())
    import uvicorn
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=args.shutdown_grace + 5, lifespan="on",
                            http=GuardedH11Protocol)
    server = _draining_server(config, st.worker, args.shutdown_grace)

    def on_fault(why: str) -> None:   # (the engine thread) the failed requests' error events go out, then exit
        threading.Timer(1.0, lambda: setattr(server, "should_exit", True)).start()
    st.worker.on_fault = on_fault
    server.run()
    if st.worker.fault is not None:
        print(f"error: {st.worker.fault}; exiting with status 3 for the supervisor to restart the server",
              file=sys.stderr)
        return 3
    print("server stopped", file=sys.stderr)
    return 0
