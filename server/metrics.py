"""Prometheus metrics of one server (its own registry: no global state).

Written from the engine thread (tokens, steps, slot use) and the event loop
(HTTP requests); prometheus-client's metrics are thread-safe."""
from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the /metrics route)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# The Kubernetes Gateway API Inference Extension's model server protocol
# (kubernetes-sigs/gateway-api-inference-extension docs/proposals/003-model-server-protocol): the gauges
# its endpoint picker (and llm-d's) scrapes to route among model server pods, under vLLM's names, the
# picker's defaults. KV-cache utilization is a fraction (1 = full), as vLLM reports it; older pickers read
# it as vllm:gpu_cache_usage_perc, so both are written.
GATEWAY_WAITING = "vllm:num_requests_waiting"
GATEWAY_RUNNING = "vllm:num_requests_running"
GATEWAY_KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class Metrics:
    def __init__(self, n_slots: int, max_live: int, n_ctx: int = 0):
        """n_ctx: positions a device KV slot holds (KV-cache utilization is the
        live sequences' positions over n_slots x n_ctx)."""
        r = self.registry = CollectorRegistry()
        self.kv_capacity = n_slots * n_ctx
        p = "vkengine_"
        self.http = Counter(p + "http_requests", "HTTP requests by route and status", ["route", "status"],
                            registry=r)
        self.requests = Counter(p + "requests", "Generation requests by how they ended", ["finish"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter(p + "prompt_tokens_cached", "Prompt tokens reused from the prefix cache",
                                     registry=r)
        self.generated = Counter(p + "generated_tokens", "Tokens generated", registry=r)
        self.steps = Counter(p + "engine_steps", "Engine steps run", registry=r)
        self.step_rows = Counter(p + "engine_step_rows", "Token rows processed in engine steps", registry=r)
        self.step_seconds = Histogram(p + "engine_step_seconds", "Duration of one engine step", buckets=_LATENCY,
                                      registry=r)
        self.ttft_s = Histogram(p + "time_to_first_token_seconds", "From request arrival to its first token",
                                buckets=_LATENCY, registry=r)
        self.itl_s = Histogram(p + "inter_token_seconds", "Between consecutive tokens of one request",
                               buckets=_LATENCY, registry=r)
        self.drafted = Counter(p + "spec_draft_tokens", "Drafts verified (--mtp speculative decoding)", registry=r)
        self.accepted = Counter(p + "spec_accepted_tokens", "Drafts accepted (--mtp speculative decoding)",
                                registry=r)
        self.queue = Gauge(p + "queue_depth", "Requests waiting for admission", registry=r)
        self.live = Gauge(p + "sequences_live", "Sequences admitted (resident or parked)", registry=r)
        self.parked = Gauge(p + "sequences_parked", "Live sequences parked in host memory", registry=r)
        self.slots_used = Gauge(p + "slots_used", "Device KV slots holding a live sequence", registry=r)
        Gauge(p + "slots_total", "Device KV slots", registry=r).set(n_slots)
        Gauge(p + "parallel", "Sequences served at once (--parallel)", registry=r).set(max_live)
        self.preemptions = Gauge(p + "preemptions", "Sequences parked to make room (since start)", registry=r)
        self.active = Gauge(p + "requests_active", "Generation requests accepted and not yet ended", registry=r)
        self.host_cache = Gauge(p + "host_cache_entries", "Finished sequences parked on the host (prefix cache)",
                                registry=r)
        # memory the engine holds: at idle these return to their level after startup, but for the bounded
        # pool of free parking buffers and the host prefix cache (a soak test checks it)
        self.buffer_bytes = Gauge(p + "buffer_bytes", "Bytes of the engine's Vulkan buffers by memory kind",
                                  ["kind"], registry=r)
        self.buffers = Gauge(p + "buffers", "The engine's Vulkan buffers", registry=r)
        self.pool_buffers = Gauge(p + "kv_pool_buffers", "Free host buffers kept for parking KV rows", registry=r)
        self.pool_bytes = Gauge(p + "kv_pool_bytes", "Bytes of the free parking buffers", registry=r)
        self.parked_handles = Gauge(p + "kv_parked", "Parked KV copies held (parked sequences, host prefix cache)",
                                    registry=r)
        self.parked_bytes = Gauge(p + "kv_parked_bytes", "Bytes of the parked KV copies held", registry=r)
        self.compiling = Gauge(p + "pipelines_compiling", "Pipelines the driver is still building after startup "
                               "(their steps run on stand-in kernels until then)", registry=r)
        self.programs = Gauge(p + "recorded_programs", "Engine steps recorded for replay (one per shape, LRU)",
                              registry=r)
        self.deferred = Gauge(p + "programs_deferred", "Engine steps the start left to record while idle (one "
                              "met before then is recorded when first run, in its request's time)", registry=r)
        self.evicted = Counter(p + "programs_evicted", "Recorded steps the program cache dropped to stay within "
                               "its size (one needed again is recorded again)", registry=r)
        self._evicted_seen = 0
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Device KV-cache positions held by live sequences, "
                              "over all slots' positions (0..1; a finished sequence's rows kept for prefix reuse "
                              "do not count: they are given up when a slot is needed)", registry=r)
        self.gw_waiting = Gauge(GATEWAY_WAITING, "Requests waiting for admission (the Gateway API Inference "
                                "Extension's TotalQueuedRequests; = vkengine_queue_depth)", registry=r)
        self.gw_running = Gauge(GATEWAY_RUNNING, "Requests admitted and being served, resident or parked "
                                "(TotalRunningRequests; = vkengine_sequences_live)", registry=r)
        self.gw_kv = [Gauge(name, "KV-cache utilization, 0..1 (KVCacheUtilization; = "
                            "vkengine_kv_cache_usage_ratio)", registry=r) for name in GATEWAY_KV_USAGE]
        self.startup_s = Gauge(p + "startup_seconds", "Where the server's startup went, by phase (imports: "
                               "the process's age when the model began to load)", ["phase"], registry=r)
        ProcessCollector(registry=r)       # process_resident_memory_bytes, open fds, ... (Linux)

    def startup(self, phases) -> None:
        for name, seconds in phases:
            self.startup_s.labels(name).set(seconds)

    # engine thread
    def step(self, rows: int, seconds: float) -> None:
        self.steps.inc()
        self.step_rows.inc(rows)
        self.step_seconds.observe(seconds)

    def ttft(self, seconds: float) -> None:
        self.ttft_s.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl_s.observe(seconds)

    def speculated(self, drafted: int, accepted: int) -> None:
        self.drafted.inc(drafted)
        self.accepted.inc(accepted)

    def finished(self, job, finish: str) -> None:
        self.requests.labels(finish).inc()
        self.prompt_tokens.inc(job.seq.n_prompt or len(job.seq.tokens))
        self.cached_tokens.inc(job.seq.cache_hit)
        self.generated.inc(job.n_generated)

    def state(self, snap: dict, inbox: int) -> None:
        waiting = snap["waiting"] + inbox
        self.queue.set(waiting)
        self.live.set(snap["live"])
        self.gw_waiting.set(waiting)
        self.gw_running.set(snap["live"])
        if self.kv_capacity:
            used = sum(s["n_cached"] for s in snap["slots"] if s["is_processing"])
            usage = min(1.0, used / self.kv_capacity)
            self.kv_usage.set(usage)
            for g in self.gw_kv:
                g.set(usage)
        self.parked.set(snap["parked"])
        self.slots_used.set(sum(s["is_processing"] for s in snap["slots"]))
        self.preemptions.set(snap["preemptions"])
        self.active.set(snap.get("active", 0))
        self.host_cache.set(snap["host_cache"])
        mem = snap.get("memory")
        if mem:
            self.buffer_bytes.labels("device").set(mem["device_bytes"])
            self.buffer_bytes.labels("host").set(mem["host_bytes"])
            self.buffers.set(mem["buffers"])
            self.pool_buffers.set(mem["pool_buffers"])
            self.pool_bytes.set(mem["pool_bytes"])
            self.parked_handles.set(mem["parked_handles"])
            self.parked_bytes.set(mem["parked_bytes"])
            self.programs.set(mem["programs"])
            self.deferred.set(mem.get("programs_deferred", 0))
            dropped = mem.get("programs_evicted", 0) - self._evicted_seen   # (the engine's count since start)
            if dropped > 0:
                self.evicted.inc(dropped)
                self._evicted_seen += dropped
            self.compiling.set(mem.get("pipelines_compiling", 0))

    # event loop
    def http_request(self, route: str, status: int) -> None:
        self.http.labels(route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
