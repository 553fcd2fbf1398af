"""vkengine on Ray Serve: replicas across GPUs and machines behind one
OpenAI-compatible ingress (issue 35).

- `VkReplica` (a deployment, one replica per GPU): the engine thread and
  scheduler of `vkengine serve` (server.main.build_worker), on the Vulkan device
  of the GPU Ray assigns it. Its `generate` streams a request's events.
- `VkIngress` (a deployment with an HTTP ingress): the same Starlette app as
  `vkengine serve` (server.app.create_app: routes, validation, streaming and
  error semantics), whose worker is `RemoteWorker`: requests go to replicas
  through a deployment handle, their events come back as a stream, a client
  that goes away cancels the handle's call (and so the request on its replica),
  and a replica that dies mid-request ends the reply with an error event.
- `PrefixRouter` (Ray Serve's request-router interface) sends a request to the
  replica that last served the longest run of its prompt's leading token
  blocks, where that replica's prefix cache most likely still holds them,
  unless its queue is longer than the least-loaded candidate's by more than
  `imbalance` requests; otherwise (and for a new prefix) Ray's power of two
  choices. Token blocks rather than text: the replicas' prefix cache matches
  token ids, and a chat template renders equal messages to equal ids.

`vkengine serve --replicas N` runs it on a local Ray instance;
`serve run docs/ray-serve.yaml` (or `serve deploy`) on a cluster, with
`app_builder` as the import path (docs/ray-serve.md).
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from vkengine.errors import VkEngineError
from vkengine.serving.runner import Event, GenRequest

log = logging.getLogger("vkengine.server")

APP_NAME = "vkengine"


def parse_args(argv: list[str]):
    """`vkengine serve`'s flags (the model's and the server's) for a replica or the ingress."""
    import argparse

    from vkengine.options import add_model_args

    from .options import add_serve_args
    p = argparse.ArgumentParser(prog="vkengine serve (Ray replica)")
    add_model_args(p)
    add_serve_args(p)
    return p.parse_args(argv)


# -- the replica ---------------------------------------------------------------
@dataclass
class JobFacts:
    """What the ingress's reply reads of a finished job (server/formats.py Reply.timings, final)."""
    cache_hit: int = 0
    prompt_s: float | None = None     # submit -> first token, on the replica
    decode_s: float | None = None     # first -> last token
    stop_type: str = "none"
    stop_word: str = ""
    spec: bool = False                # drafted by the MTP block (--mtp): its drafts verified and accepted
    drafted: int = 0
    accepted: int = 0


class ReplicaServer:
    """One replica's engine: build_worker's worker, and the events of one
    request as an async iterator (the deployment's streaming method)."""

    def __init__(self, args, replica_id: str = "local"):
        """args: `vkengine serve`'s flags (an argparse namespace)."""
        import copy

        from .main import build_worker
        args = copy.copy(args)
        if getattr(args, "devices", None) is not None:   # a split model: the GPUs Ray assigned, in order
            ids = assigned_devices()
            if len(ids) >= len(args.devices):
                args.devices = ids[:len(args.devices)]
        elif args.device is None:
            args.device = assigned_device()
        self.replica_id = replica_id
        self.worker, self.info = build_worker(args)
        self.worker.start()
        self.served = 0
        self.finished: dict[str, int] = {}
        self.cached_tokens = 0
        self._reporter: asyncio.Task | None = None

    async def report_forever(self, hub, every: float = 1.0) -> None:
        """Send this replica's /metrics text and slots to the hub every `every` seconds
        (the ingress's /metrics and /slots show every replica's)."""
        while True:
            try:
                snap = self.worker.snapshot
                await hub.report.remote(self.replica_id, self.info.metrics.render().decode(),
                                        [{**s, "replica": self.replica_id} for s in snap["slots"]])
            except Exception as e:          # (the hub restarting: the next report goes through)
                log.warning("metrics report failed: %s", e)
            await asyncio.sleep(every)

    async def generate(self, req: GenRequest):
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        job = self.worker.submit(req, lambda ev: loop.call_soon_threadsafe(q.put_nowait, ev))
        self.served += 1
        done = False
        try:
            while True:
                ev: Event = await q.get()
                if ev.finish is None:
                    yield ev, None
                    continue
                done = True
                self.finished[ev.finish] = self.finished.get(ev.finish, 0) + 1
                self.cached_tokens += job.seq.cache_hit
                facts = JobFacts(cache_hit=job.seq.cache_hit, stop_type=job.stop_type,
                                 stop_word=job.out.stop_word or "",
                                 prompt_s=None if job.t_first is None else job.t_first - job.t_submit,
                                 decode_s=None if job.t_first is None or job.t_last is None
                                 else job.t_last - job.t_first,
                                 spec=job.spec, drafted=job.drafted, accepted=job.accepted)
                yield ev, facts
                return
        finally:
            if not done:              # the caller went away (its handle call cancelled): free the slot
                self.worker.cancel(job)
                self.finished["cancelled"] = self.finished.get("cancelled", 0) + 1

    def describe(self) -> dict:
        import ray
        return {"replica": self.replica_id, "actor": ray.get_runtime_context().get_actor_name(),
                "pid": os.getpid(), "active": self.worker.active, "served": self.served,
                "finished": dict(self.finished), "cached_tokens": self.cached_tokens,
                "accepting": self.worker.accepting, "fault": self.worker.fault}

    def check_health(self) -> None:
        if self.worker.fault is not None:
            raise RuntimeError(self.worker.fault)

    def __del__(self) -> None:
        """(Ray Serve's graceful shutdown: its in-flight requests have had
        graceful_shutdown_timeout_s) the engine thread ends what is left."""
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.stop(timeout=5.0)


def assigned_device() -> int | None:
    """The Vulkan device of the GPU Ray assigned this replica: the index of Ray's
    GPU id among the node's (Vulkan lists a node's NVIDIA GPUs in the order CUDA
    does without CUDA_DEVICE_ORDER; other vendors' order is the driver's), None
    where Ray assigned none (fractional or CPU replicas: the best device)."""
    import ray
    ids = ray.get_gpu_ids()
    return int(ids[0]) if ids else None


def assigned_devices() -> list[int]:
    """The Vulkan devices of every GPU Ray assigned this replica (assigned_device's rule)."""
    import ray
    return [int(i) for i in ray.get_gpu_ids()]


# -- metrics across replicas ------------------------------------------------------
HUB_MAX_AGE = 10.0          # seconds a replica's report counts (a dead replica's goes after this)
STARTUP_GRACE = 300.0       # seconds the ingress waits for a first replica's report before /health says so


class MetricsHub:
    """A Ray actor (one an application, named) holding each replica's latest
    /metrics text and slots, which the ingress reads."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, str, list]] = {}

    def report(self, replica: str, text: str, slots: list) -> None:
        self.reports[replica] = (time.monotonic(), text, slots)

    def collect(self) -> dict[str, tuple[str, list]]:
        now = time.monotonic()
        self.reports = {r: v for r, v in self.reports.items() if now - v[0] <= HUB_MAX_AGE}
        return {r: (text, slots) for r, (_t, text, slots) in self.reports.items()}


def metrics_hub(app_name: str):
    """The application's MetricsHub, created by whoever asks first."""
    import ray
    return ray.remote(num_cpus=0)(MetricsHub).options(
        name=f"vkengine-metrics-{app_name}", namespace="vkengine", get_if_exists=True,
        lifetime="detached").remote()


def merge_metrics(own: bytes, replicas: dict[str, str]) -> bytes:
    """One Prometheus text of the ingress's own metrics and every replica's, a
    `replica` label on each replica sample; a family the replicas report is
    theirs (the ingress's engine gauges stand idle), the others the ingress's
    (its HTTP requests)."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    fams: dict[str, Any] = {}
    for rid, text in sorted(replicas.items()):
        for f in text_string_to_metric_families(text):
            if f.name == "vkengine_http_requests":
                continue                  # (replicas take no HTTP; the ingress counts it)
            samples = [s._replace(labels={**s.labels, "replica": rid}) for s in f.samples]
            if f.name in fams:
                fams[f.name].samples.extend(samples)
            else:
                f.samples = samples
                fams[f.name] = f
    for f in text_string_to_metric_families(own.decode()):
        fams.setdefault(f.name, f)

    class _Collected:
        def collect(self):
            return list(fams.values())
    return generate_latest(_Collected())


# -- the ingress's worker ----------------------------------------------------------
@dataclass(eq=False)
class _Seq:
    cache_hit: int = 0


@dataclass(eq=False)
class _Out:
    stop_word: str | None = None


@dataclass(eq=False)
class RemoteJob:
    """The ingress's stand-in for a replica's Job: what server/formats.py reads
    (seq.cache_hit, the times, stop_type, out.stop_word, the drafts), filled in
    when the replica's last event arrives."""
    req: GenRequest
    seq: _Seq = field(default_factory=_Seq)
    out: _Out = field(default_factory=_Out)
    stop_type: str = "none"
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None
    spec: bool = False
    drafted: int = 0
    accepted: int = 0
    task: asyncio.Task | None = None
    response: Any = None

    def settle(self, facts: JobFacts) -> None:
        self.seq.cache_hit, self.stop_type, self.out.stop_word = facts.cache_hit, facts.stop_type, facts.stop_word
        self.spec, self.drafted, self.accepted = facts.spec, facts.drafted, facts.accepted
        if facts.prompt_s is not None:
            self.t_first = self.t_submit + facts.prompt_s
            self.t_last = self.t_first + (facts.decode_s or 0.0)


class RemoteWorker:
    """server.worker.Worker's interface over a deployment handle of replicas."""

    def __init__(self, handle, cfg, max_requests: int):
        """max_requests: accepted at once across the replicas (replicas x
        (--parallel + --max-queue)); past it submit raises QueueFull (503)."""
        self.handle, self.cfg, self.max_requests = handle, cfg, max_requests
        self._accepting = True
        self._active = 0
        self.replica_metrics: dict[str, str] = {}   # the hub's latest (poll_hub)
        self.snapshot: dict = {"slots": [], "active": 0}
        self._t_start = time.monotonic()
        self._last_seen: float | None = None        # when the hub last held a live replica's report

    @property
    def fault(self) -> str | None:
        """Why the application cannot serve now (the ingress's /health answers 503
        with it): no replica has reported for a while. Requests meanwhile wait
        for one in Ray's queue rather than fail."""
        now = time.monotonic()
        if self._last_seen is None:
            if now - self._t_start < STARTUP_GRACE:
                return None
            return f"no replica has reported in the {now - self._t_start:.0f} s since the ingress started"
        if now - self._last_seen > HUB_MAX_AGE:
            return (f"no replica is running (none reported in {now - self._last_seen:.0f} s; Ray replaces "
                    "replicas that fail)")
        return None

    def saw(self, replicas: dict, now: float | None = None) -> None:
        """The hub's latest reports (poll_hub; tests)."""
        if replicas:
            self._last_seen = time.monotonic() if now is None else now

    async def poll_hub(self, hub, every: float = 1.0) -> None:
        """Keep the replicas' metrics texts and slots (snapshot) from the hub fresh."""
        while True:
            try:
                got = await hub.collect.remote()
                self.saw(got)
                self.replica_metrics = {r: text for r, (text, _s) in got.items()}
                self.snapshot = {"slots": [s for _r, (_t, slots) in sorted(got.items()) for s in slots],
                                 "active": self._active}
            except Exception as e:
                log.warning("reading the replicas' metrics failed: %s", e)
            await asyncio.sleep(every)

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def active(self) -> int:
        return self._active

    def start(self) -> None:
        pass

    def stop(self, timeout: float = 30.0) -> None:
        self._accepting = False

    def drain(self, grace: float) -> None:
        self._accepting = False

    def submit(self, req: GenRequest, emit):
        from .worker import QueueFull, Unavailable
        if not self._accepting:
            raise Unavailable("the server is shutting down")
        if self._active >= self.max_requests:
            raise QueueFull(f"{self.max_requests} requests are running or queued across the replicas; retry later")
        job = RemoteJob(req)
        self._active += 1
        job.response = self.handle.options(stream=True).generate.remote(req)
        job.task = asyncio.get_running_loop().create_task(self._pump(job, emit))
        job.task.add_done_callback(self._done)   # (also when cancelled before it ran)
        return job

    def _done(self, _task) -> None:
        self._active -= 1

    async def _pump(self, job: RemoteJob, emit) -> None:
        from .worker import QueueFull, Unavailable
        finished = False
        try:
            async for ev, facts in job.response:
                if facts is not None:
                    job.settle(facts)
                    finished = True
                emit(ev)
                if finished:
                    return
            if not finished:
                emit(Event(finish="error", error="the replica ended the request without a last event"))
        except asyncio.CancelledError:
            raise
        except (QueueFull, Unavailable) as e:   # (raised on the replica; Ray's error is an instance of it)
            emit(Event(finish="cancelled", error=f"the replica refused the request ({type(e).__name__}): "
                                                 "retry later"))
        except Exception as e:        # the replica died, or Ray could not reach one: a clean error for the client
            log.warning("request failed on its replica: %s", e)
            emit(Event(finish="error", error=f"the replica serving this request failed ({type(e).__name__}); "
                                             "retry the request"))

    def cancel(self, job: RemoteJob) -> None:
        if job.response is not None:
            job.response.cancel()       # the replica's generate is cancelled, which cancels its job
        if job.task is not None and not job.task.done():
            job.task.cancel()


# -- the application -----------------------------------------------------------------
def build_app(args, replicas: int = 1, gpus_per_replica: float = 0.0, autoscaling: dict | None = None,
              imbalance: int = 4, prefix_routing: bool = True, hosts: frozenset[str] | None = None):
    """The Ray Serve application: `replicas` VkReplica (or `autoscaling`, Ray's
    autoscaling_config: min_replicas, max_replicas, target_ongoing_requests)
    behind one VkIngress. gpus_per_replica: Ray GPUs a replica takes (1 on a GPU
    node; a fraction stands several replicas on one GPU; 0 for CPU devices).
    prefix_routing=False: Ray's default router (power of two choices) instead
    of PrefixRouter (bench/ray_scale.py compares them). hosts: the Host names
    the ingress answers (server.app.allowed_hosts; None: any)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from .main import scheduler_config
    scheduler_config(args)        # the flags' errors here, before any replica starts
    if replicas < 1 or gpus_per_replica < 0:
        raise VkEngineError("--replicas must be >= 1 and --gpus-per-replica >= 0")

    @serve.deployment(name="VkReplica", max_ongoing_requests=args.parallel + args.max_queue,
                      health_check_period_s=2, health_check_timeout_s=30, graceful_shutdown_timeout_s=5)
    class VkReplica(ReplicaServer):
        async def __init__(self, args):
            ctx = serve.get_replica_context()
            super().__init__(args, ctx.replica_id.unique_id)
            self._reporter = asyncio.get_running_loop().create_task(self.report_forever(metrics_hub(ctx.app_name)))

        async def stats(self, replica: str | None = None) -> dict:      # (replica: the router's pin)
            return self.describe()

    def make_app(handle):
        from vkengine.engine import Engine
        from vkengine.model import load_model

        from .app import ServerState, create_app
        from .main import embedding_pooling, scheduler_config
        from .metrics import Metrics
        a = args
        cfg, n_slots = scheduler_config(a)
        model = load_model(a.model)
        n_ctx = Engine.context_length(model.args, a.ctx)   # (what the replicas' engines hold)
        worker = RemoteWorker(handle, cfg, max(1, replicas) * (a.parallel + a.max_queue))

        class ClusterMetrics(Metrics):    # the ingress's own, and every replica's with its label
            def render(self) -> bytes:
                return merge_metrics(super().render(), worker.replica_metrics)
        st = ServerState(worker=worker, model=model, n_ctx=n_ctx, metrics=ClusterMetrics(n_slots, cfg.max_live, n_ctx),
                         max_tokens=a.max_tokens, max_body=a.max_body, parallel=a.parallel, mode=a.mode,
                         kv_cache=(a.cache_type_k, a.cache_type_v), reasoning_format=a.reasoning_format,
                         pooling=embedding_pooling(model, a.pooling) if a.embeddings else None)
        return create_app(st, api_key=a.api_key, cors=a.cors, hosts=hosts)

    @serve.deployment(name="VkIngress", ray_actor_options={"num_cpus": 0})
    @serve.ingress()
    class VkIngress:
        def __init__(self, replica):
            self.replica = replica

        async def __serve_build_asgi_app__(self):    # (Ray Serve calls it after __init__, on the ingress)
            app = make_app(self.replica)
            worker = app.state.server.worker
            self._poll = asyncio.get_running_loop().create_task(
                worker.poll_hub(metrics_hub(serve.get_replica_context().app_name)))
            return app

    router: dict[str, Any] = {"request_router_class": "server.ray_router:PrefixRouter",
                              "request_router_kwargs": {"imbalance": imbalance}}
    # placed by their GPUs: no CPU reservation (a replica's CPU work is one engine thread and an event loop,
    # and reserving a core each left a 2-core node no room for the ingress)
    opts: dict[str, Any] = {"ray_actor_options": {"num_gpus": gpus_per_replica, "num_cpus": 0}}
    if prefix_routing:
        opts["request_router_config"] = RequestRouterConfig(**router)
    if autoscaling:
        opts["autoscaling_config"] = autoscaling
    else:
        opts["num_replicas"] = replicas
    ingress: Any = VkIngress          # (deployments: what the decorators made of the classes)
    replica: Any = VkReplica
    return ingress.bind(replica.options(**opts).bind(args))


def app_builder(cfg: dict):
    """`serve run` / `serve deploy`'s application builder (docs/ray-serve.yaml):
    args {argv: [vkengine serve flags], replicas, gpus_per_replica, autoscaling, imbalance, prefix_routing}."""
    from .app import allowed_hosts
    args = parse_args([str(x) for x in cfg.get("argv", [])])
    # (the proxy binds what http_options say, not --host: any Host unless --allowed-hosts names some)
    return build_app(args, int(cfg.get("replicas", 1)), float(cfg.get("gpus_per_replica", 0.0)),
                     cfg.get("autoscaling"), int(cfg.get("imbalance", 4)), bool(cfg.get("prefix_routing", True)),
                     hosts=allowed_hosts("0.0.0.0", args.allowed_hosts))


def start_replicas(args, ray_init: dict | None = None, prefix_routing: bool = True) -> None:
    """The application on a local Ray instance (started here unless one runs),
    serving HTTP on --host:--port; returns once every replica is up."""
    import ray
    from ray import serve
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(ignore_reinit_error=True, include_dashboard=False, **(ray_init or {}))
    gpus = args.gpus_per_replica
    if gpus is None:   # a GPU a replica (a split model's replica: one a part) where the node has them
        each = len(args.devices) if getattr(args, "devices", None) else 1
        gpus = float(each) if ray.cluster_resources().get("GPU", 0) >= args.replicas * each else 0.0
    serve.start(http_options={"host": args.host, "port": args.port})
    from .app import allowed_hosts
    serve.run(build_app(args, args.replicas, gpus, prefix_routing=prefix_routing,
                        hosts=allowed_hosts(args.host, args.allowed_hosts)), name=APP_NAME, route_prefix="/")


def serve_replicas(args) -> int:
    """`vkengine serve --replicas N`: start_replicas, then serve until SIGINT or
    SIGTERM (handlers set first: a client can reach the ingress before serve.run
    returns, and a SIGINT then raised KeyboardInterrupt out of it, exit 130, the
    application left running on Ray)."""
    import signal
    import threading

    import ray
    from ray import serve
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        start_replicas(args)
        log.info("serving %d replicas on Ray at http://%s:%d", args.replicas, args.host, args.port)
        stop.wait()
        log.info("stopping: the replicas finish within their graceful shutdown")
    finally:
        serve.shutdown()
        ray.shutdown()
    print("server stopped", file=sys.stderr)
    return 0
