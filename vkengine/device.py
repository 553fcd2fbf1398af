"""The device boundary: the only module that imports kp (Kompute).

What lives here: picking a Vulkan device, buffers (device-local and
host-visible), uploads and downloads, a pipeline cache, and `Program`, a
recorded command sequence that is replayed as a whole (one submit per decode
step) with the barriers that its data dependencies need.

kp 0.9.0 is built from its sdist with patches/kp (see patches/kp/README.md):
they add OpDispatch (push constants as raw bytes and a workgroup count per
dispatch, so one pipeline serves every dispatch of a shader), OpBarrier (the
compute-to-compute barriers upstream kp never records), OpCopyRegion, device
feature enablement and `list_devices_info`. Upstream kp is refused with a clear
message.
"""
from __future__ import annotations

import atexit
import functools
import itertools
import logging
import os
import queue
import re
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import DeviceFault, VkEngineError

# Vulkan flag bits used in barriers (vulkan_core.h)
_STAGE_COMPUTE = 0x00000800
_STAGE_TRANSFER = 0x00001000
_STAGE_HOST = 0x00004000
_ACCESS_SHADER_READ = 0x00000020
_ACCESS_SHADER_WRITE = 0x00000040
_ACCESS_TRANSFER_READ = 0x00000800
_ACCESS_TRANSFER_WRITE = 0x00001000
_ACCESS_HOST_READ = 0x00002000

_GPU_STAGES = _STAGE_COMPUTE | _STAGE_TRANSFER
_GPU_WRITES = _ACCESS_SHADER_WRITE | _ACCESS_TRANSFER_WRITE
_GPU_ACCESS = _ACCESS_SHADER_READ | _ACCESS_SHADER_WRITE | _ACCESS_TRANSFER_READ | _ACCESS_TRANSFER_WRITE

log = logging.getLogger("vkengine.device")

_TYPE_RANK = {"discrete": 0, "integrated": 1, "virtual": 2, "cpu": 3, "other": 4}


def _import_kp():
    try:
        import kp  # noqa: PLC0415 - the one place kp is imported
    except ImportError as e:
        msg = str(e)
        if "libvulkan" in msg:
            raise VkEngineError(
                "the Vulkan loader (libvulkan.so.1) is not installed: install your GPU's Vulkan driver "
                "and the loader (Debian/Ubuntu: apt-get install libvulkan1 mesa-vulkan-drivers), "
                "or run scripts/setup.sh") from e
        raise VkEngineError(
            f"Kompute (kp) is not importable ({msg}): run scripts/setup.sh, which builds kp 0.9.0 "
            "with vkengine's patches") from e
    if not hasattr(kp, "VKENGINE_PATCHES"):
        raise VkEngineError(
            "the installed kp is upstream Kompute without vkengine's patches (no barriers between "
            "dependent dispatches): run scripts/setup.sh to build the patched kp")
    return kp


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    type: str                     # discrete | integrated | virtual | cpu | other
    api_version: str
    driver_name: str
    driver_info: str
    vendor_id: int
    subgroup_size: int
    max_storage_buffer_range: int
    max_push_constants_size: int
    max_shared_memory: int
    max_workgroup_invocations: int
    max_workgroup_count: tuple[int, int, int]
    timestamp_period_ns: float
    device_local_bytes: int
    extensions: tuple[str, ...] = ()
    # (M, N, K, A, B, C, result type, scope) of each cooperative-matrix shape
    # (VK_KHR_cooperative_matrix; component types 0 f16, 1 f32; scope 3 subgroup)
    cooperative_matrix: tuple[tuple[int, ...], ...] = ()

    # the shape mul_mc.comp multiplies in: 16 x 16 x 16, f16 operands, f32 sums, per subgroup
    COOPMAT_F16 = (16, 16, 16, 0, 0, 1, 1, 3)

    @classmethod
    def from_kp(cls, index: int, d: dict) -> DeviceInfo:
        return cls(
            index=index, name=d["name"], type=d["type"], api_version=d["api_version"],
            driver_name=d["driver_name"], driver_info=d["driver_info"], vendor_id=d["vendor_id"],
            subgroup_size=d["subgroup_size"], max_storage_buffer_range=d["max_storage_buffer_range"],
            max_push_constants_size=d["max_push_constants_size"], max_shared_memory=d["max_shared_memory"],
            max_workgroup_invocations=d["max_workgroup_invocations"],
            max_workgroup_count=tuple(d["max_workgroup_count"]),
            timestamp_period_ns=d["timestamp_period_ns"], device_local_bytes=d["device_local_bytes"],
            extensions=tuple(d["extensions"]),
            cooperative_matrix=tuple(tuple(c) for c in d.get("cooperative_matrix", ())))

    @property
    def subgroups_fixed(self) -> bool:
        """True where every compute subgroup has the reported size (NVIDIA: 32;
        lavapipe: 8). Elsewhere (AMD wave32/64, Intel SIMD8-32) kernels must not
        assume it, and the host sizes work per workgroup conservatively."""
        return self.vendor_id == 0x10DE or self.driver_name == "llvmpipe"


def list_devices() -> list[DeviceInfo]:
    kp = _import_kp()
    try:
        infos = kp.list_devices_info()
    except Exception as e:  # vk::SystemError from instance creation
        raise VkEngineError(f"Vulkan could not be initialised ({e}): is a Vulkan driver (ICD) installed?") from e
    return [DeviceInfo.from_kp(i, d) for i, d in enumerate(infos)]


def pick_device(devices: Sequence[DeviceInfo], requested: int | None = None) -> DeviceInfo:
    """The requested index, else the best by type (discrete GPU first, CPU last)."""
    if not devices:
        raise VkEngineError(
            "no Vulkan device found: install a Vulkan driver (for a CPU-only machine, Mesa's lavapipe: "
            "apt-get install mesa-vulkan-drivers)")
    if requested is not None:
        if not 0 <= requested < len(devices):
            names = ", ".join(f"{d.index}: {d.name}" for d in devices)
            raise VkEngineError(f"device {requested} does not exist; devices are {names}")
        return devices[requested]
    return min(devices, key=lambda d: (_TYPE_RANK.get(d.type, 9), d.index))


def host_available_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else free physical pages; None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(eq=False)
class Buffer:
    """A Vulkan buffer. kind "device": device-local (uploads go through a staging
    buffer); kind "host": host-visible and coherent, mapped (`array()` is a live
    numpy view, written before a submit and read after one)."""
    tensor: Any
    nbytes: int
    kind: str
    name: str
    id: int

    def array(self, dtype=np.uint32) -> np.ndarray:
        if self.kind != "host":
            raise ValueError(f"buffer {self.name} is device-local: use Device.download")
        return self.tensor.data().view(np.uint8)[: self.nbytes].view(dtype)


@dataclass
class _Op:
    kind: str                      # dispatch | barrier | copy
    args: tuple
    label: str = ""


class Program:
    """A command sequence recorded once and replayed (`run`).

    Each dispatch or copy declares the byte ranges it reads and writes; a barrier
    is recorded only when an operation touches a range that an earlier one, since
    the last barrier, wrote (read-after-write, write-after-write) or read
    (write-after-read). A program starts with a barrier against earlier
    submissions and ends with one that makes device writes visible to the host.
    """

    def __init__(self, device: Device, timestamps: bool = False):
        self.device = device
        self.ops: list[_Op] = [_Op("barrier", (_GPU_STAGES, _GPU_STAGES, _GPU_WRITES, _GPU_ACCESS), "start")]
        self._reads: list[tuple[int, int, int]] = []
        self._writes: list[tuple[int, int, int]] = []
        self._timestamps = timestamps
        self._seq: Any = None   # the kp Sequence, once recorded
        self.n_barriers = 0
        self.n_omitted = 0      # dispatches Device.omit left out
        self._transfer = False  # the device's own staging copies (Device.upload): they never wait for its fills

    @staticmethod
    def _overlaps(ranges, buf_id, a, b) -> bool:
        return any(i == buf_id and a < e and s < b for i, s, e in ranges)

    def _hazard(self, reads, writes) -> bool:
        for buf, a, b in reads:
            if self._overlaps(self._writes, buf.id, a, b):
                return True
        for buf, a, b in writes:
            if self._overlaps(self._writes, buf.id, a, b) or self._overlaps(self._reads, buf.id, a, b):
                return True
        return False

    def _track(self, reads, writes) -> None:
        if self._seq is not None:
            raise RuntimeError("program already recorded")
        if self._hazard(reads, writes):
            self.barrier()
        self._reads.extend((buf.id, a, b) for buf, a, b in reads)
        self._writes.extend((buf.id, a, b) for buf, a, b in writes)

    def barrier(self, label: str = "") -> None:
        self.ops.append(_Op("barrier", (_GPU_STAGES, _GPU_STAGES, _GPU_WRITES, _GPU_ACCESS), label))
        self._reads.clear()
        self._writes.clear()
        self.n_barriers += 1

    def dispatch(self, algorithm, push: bytes, groups: tuple[int, int, int],
                 reads: Iterable[tuple[Buffer, int, int]] = (), writes: Iterable[tuple[Buffer, int, int]] = (),
                 label: str = "") -> None:
        """Record one dispatch; reads/writes are (buffer, first byte, end byte)."""
        if any(g <= 0 for g in groups):
            return
        reads, writes = list(reads), list(writes)
        self._track(reads, writes)
        if self.device.omit is not None and self.device.omit.search(label):
            self.n_omitted += 1
            return
        self.ops.append(_Op("dispatch", (algorithm, push, groups), label))

    def copy(self, src: Buffer, dst: Buffer, src_off: int, dst_off: int, size: int, label: str = "copy") -> None:
        if size <= 0:
            return
        self._track([(src, src_off, src_off + size)], [(dst, dst_off, dst_off + size)])
        self.ops.append(_Op("copy", (src, dst, src_off, dst_off, size), label))

    def _record(self):
        kp = self.device._kp
        self.ops.append(_Op("barrier", (_GPU_STAGES, _STAGE_HOST, _GPU_WRITES, _ACCESS_HOST_READ), "to host"))
        n = len(self.ops)
        seq = self.device._mgr.sequence(0, n if self._timestamps else 0)
        for op in self.ops:
            if op.kind == "dispatch":
                alg, push, groups = op.args
                seq.record(kp.OpDispatch(self.device.resolve(alg), push, list(groups)))
            elif op.kind == "barrier":
                seq.record(kp.OpBarrier(*op.args))
            else:
                src, dst, so, do, size = op.args
                seq.record(kp.OpCopyRegion(src.tensor, dst.tensor, so, do, size))
        self._seq = seq

    def compiling(self) -> bool:
        """Whether a pipeline of this program is still being created."""
        return any(op.kind == "dispatch" and isinstance(op.args[0], Future) and not op.args[0].done()
                   for op in self.ops)

    @property
    def n_dispatches(self) -> int:
        return sum(op.kind == "dispatch" for op in self.ops)

    @property
    def recorded(self) -> bool:
        return self._seq is not None

    def prepare(self) -> None:
        """Record the command sequence now rather than on first use."""
        if self._seq is None:
            self._record()

    def _ready(self) -> None:
        """Before a submit: the program recorded (on first use), and the weights
        whose uploads were left for later uploaded (Device.fill_weights)."""
        if self._seq is None:
            self._record()
        if self.device._fills and not self._transfer:
            self.device.fill_weights()

    def run(self) -> None:
        """Submit the program and wait for it (records it on first use)."""
        if self.device.fence_spin_ns:
            self.submit()
            self._await()
            return
        self._ready()
        self._seq.eval()

    def submit(self) -> None:
        """Submit the program without waiting (wait() before reading its results
        or submitting it again)."""
        self._ready()
        self._seq.eval_async()

    def wait(self) -> None:
        """Wait for the last submit() to finish (the GIL is released meanwhile).
        A failure of the device under it raises DeviceFault."""
        try:
            self._await()
        except Exception as e:      # (kp raises what vk::Result it got as a RuntimeError)
            raise DeviceFault(f"the GPU failed: {e}") from e
        self.device.count_wait()

    def _await(self) -> None:
        """The last submit's wait: the fence polled first where
        Device.fence_spin_ns says so (patches/kp 0003), else the driver's."""
        if self.device.fence_spin_ns:
            self._seq.eval_await_spin(self.device.fence_spin_ns)
        else:
            self._seq.eval_await()

    def timings(self) -> list[tuple[str, float]]:
        """(label, microseconds) of every operation in the last run."""
        if not self._timestamps or self._seq is None:
            raise RuntimeError("program was not created with timestamps=True or has not run")
        ts = self._seq.get_timestamps()
        period = self.device.info.timestamp_period_ns
        return [(op.label or op.kind, (ts[i + 1] - ts[i]) * period / 1000.0) for i, op in enumerate(self.ops)]


def _fault_after(spec: str) -> int | None:
    if not spec:
        return None
    kind, _, n = spec.partition(":")
    if kind != "device_lost" or not n.isdigit() or int(n) < 1:
        raise VkEngineError(f"VKENGINE_FAULT_INJECT={spec!r}: expected device_lost:N (N >= 1)")
    return int(n)


def _settle_from(out: Future, fut: Future) -> None:
    """Give `out` the outcome of the finished `fut`."""
    exc = fut.exception()
    if exc is not None:
        out.set_exception(exc)
    else:
        out.set_result(fut.result())


def _pipeline_delay(spec: str) -> dict[str, float]:
    """A test's hook: VKENGINE_PIPELINE_DELAY=shader:seconds[,...] makes creating that shader's pipelines
    take that much longer, as a driver compiling a large kernel would (tests of the slow-pipeline path on
    lavapipe, whose pipelines all build in milliseconds)."""
    out: dict[str, float] = {}
    for item in filter(None, spec.split(",")):
        name, _, secs = item.partition(":")
        try:
            out[name] = float(secs)
        except ValueError:
            raise VkEngineError(f"VKENGINE_PIPELINE_DELAY={spec!r}: expected shader:seconds[,...]") from None
    return out


def pipeline_threads() -> int:
    """Threads that create pipelines (VKENGINE_PIPELINE_THREADS; default: the
    CPU's cores, at most 16). Drivers compile a pipeline when it is created, on
    the calling thread: a fresh NVIDIA driver spent 52.8 s of an 8B server's 62 s
    startup compiling one pipeline after another (docs/bench/notes.md run 37)."""
    n = _env_whole("VKENGINE_PIPELINE_THREADS", 1)
    return n if n is not None else max(1, min(16, os.cpu_count() or 1))


def _env_whole(name: str, least: int, unit: str = "") -> int | None:
    """The environment variable `name` as a whole number (of `unit`) >= least,
    None where it is unset or empty; anything else is refused with its name."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < least:
        raise VkEngineError(f"{name}={raw!r}: expected a whole number{' of ' + unit if unit else ''} >= {least}")
    return int(raw)


def fence_spin_ns() -> int:
    """How long a program's wait polls its fence before the driver's blocking
    wait (VKENGINE_FENCE_SPIN_US, microseconds; default 0: the blocking wait
    alone). A step that ends within it is seen at once rather than after the
    driver wakes the thread (patches/kp 0003); the polling holds a core, not
    the GIL. For the host's round trips a step: a split model's parts, MTP's
    verify steps, constrained decoding's masks."""
    return (_env_whole("VKENGINE_FENCE_SPIN_US", 0, "microseconds") or 0) * 1000


def pipeline_cache_dir() -> Path | None:
    """Where compiled pipelines are kept between processes: VKENGINE_PIPELINE_CACHE
    (a folder; "off" keeps none), else $XDG_CACHE_HOME/vkengine/pipelines."""
    raw = os.environ.get("VKENGINE_PIPELINE_CACHE")
    if raw is not None:
        return None if raw.strip().lower() in ("", "off", "0", "none") else Path(raw).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vkengine" / "pipelines"


class _Workers:
    """A pool of daemon threads: a pipeline still compiling when the process
    exits (a server stopped while the driver builds a large kernel) does not
    hold up its exit, as ThreadPoolExecutor's joined threads would. Jobs
    submitted `low` run after every other queued job (in order within each)."""

    def __init__(self, n: int, name: str):
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self.threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()[2]
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:
                fut.set_exception(e)

    def submit(self, fn, *args, low: bool = False, first: bool = False) -> Future:
        """fn(*args) on a thread; `first`: ahead of every queued job (a quick one another waits for)."""
        fut: Future = Future()
        self._jobs.put((-1 if first else 1 if low else 0, next(self._order), (fut, fn, args)))
        return fut

    def shutdown(self, wait: bool = True) -> None:
        """Stop the threads after the jobs queued so far (wait: until those are done)."""
        for _ in self.threads:
            self._jobs.put((2, next(self._order), None))
        if wait:
            for t in self.threads:
                t.join()


class Device:
    """One Vulkan device through kp: buffers, transfers, pipelines, programs."""

    def __init__(self, index: int | None = None, staging_bytes: int = 32 << 20,
                 pipeline_cache: Path | str | None = "default"):
        # a test's fault hook: VKENGINE_FAULT_INJECT=device_lost:N makes the N-th program wait fail as a
        # lost device would (server tests of what a GPU fault does to requests, /health and the process)
        self._fault_after = _fault_after(os.environ.get("VKENGINE_FAULT_INJECT", ""))
        self._waits = 0
        self._kp = _import_kp()
        # (patches/kp 0003: a kp without it waits as before)
        self.fence_spin_ns = fence_spin_ns() if self.can_spin else 0
        devices = list_devices()
        self.info = pick_device(devices, index)
        try:
            self._mgr = self._kp.Manager(self.info.index)
        except Exception as e:
            raise VkEngineError(f"could not create a Vulkan device on {self.info.name}: {e}") from e
        self.features = tuple(self._mgr.enabled_features())
        self._ids = itertools.count(1)
        self._algorithms: dict[tuple, Any] = {}
        self._compiling: dict[tuple, Future] = {}   # each pipeline's first creation (Device.algorithm's twins)
        # whether a pipeline's twins wait for it (Device.algorithm): where the driver's pipeline cache then
        # gives them in milliseconds; lavapipe compiles each anew (0.15-0.18 s for each of the SmolLM2's three
        # mul_mm_q4_1 twins, one after another), so there they compile side by side as before
        self.share_twins = self.info.driver_name != "llvmpipe"
        # pipelines are created on worker threads (the driver compiles them there, in parallel) and
        # resolved when a program is recorded; the device's one VkPipelineCache shares what one compiled
        # with the others and is saved to a file that the next process loads (patches/kp 0002)
        self._shared_cache = hasattr(self._kp, "VKENGINE_PIPELINE_CACHE")
        n_threads = pipeline_threads() if self._shared_cache else 1
        self._pool = _Workers(n_threads, "vk-pipeline") if n_threads > 1 else None
        self.pipeline_cache_file: Path | None = None
        self._fill_threads = max(1, min(8, os.cpu_count() or 1))
        self._filler: ThreadPoolExecutor | None = None
        self.pipeline_times: list[tuple[str, float, float]] = []   # (shader, start, end) of each creation
        # the last settle(): seconds it waited for the pipelines without a stand-in, and the last of them to finish
        self.settle_wait: tuple[float, str] = (0.0, "")
        # shaders whose pipelines may wait behind the others' on the pipeline threads (a kernel with a stand-in:
        # Kernels sets MatmulKernels.has_stand_in), so that a start's must-haves compile first
        self.deferrable: Callable[[str], bool] = lambda name: False
        # shaders whose pipelines were still compiling when settle() stopped waiting: the kernels that have a
        # quicker-to-build alternative use it meanwhile (MatmulKernels._mul_tiled); emptied as they finish
        self._slow: set[str] = set()
        self._save_lock = threading.Lock()
        self._delay = _pipeline_delay(os.environ.get("VKENGINE_PIPELINE_DELAY", ""))
        self._delayed: set[tuple[str, bytes]] = set()
        self.pipeline_cache_loaded = 0    # bytes of saved pipelines the driver took at start
        self._cache_saved_bytes = -1
        if self._shared_cache:
            folder = pipeline_cache_dir() if pipeline_cache == "default" else \
                (Path(pipeline_cache) if pipeline_cache is not None else None)
            if folder is not None:
                self.pipeline_cache_file = folder / self._cache_name()
                self._load_pipeline_cache()
        # weight uploads left for later (WeightPlanner.build while defer_fills is set: EngineConfig.defer_fill),
        # by owner (a weights arena), in order: fill_weights() runs them, and so does any program's submit first
        self.defer_fills = False
        # bench --ablate: dispatches whose label this pattern finds are left out of the programs recorded
        # while it is set (their barriers kept), so a step's time without them measures what they cost in
        # the pipelined step, which the profile's timestamp after every op cannot
        self.omit: re.Pattern | None = None
        self._fills: dict[int, Callable[[], None]] = {}
        self.fill_s = 0.0   # seconds the last fill_weights() took
        self._buffers: list[Buffer] = []
        self._staging = self.buffer(staging_bytes, "host", "staging")
        self._readback: Buffer | None = None
        # Largest single buffer: the device's storage-buffer range, capped so
        # kp's 32-bit sizes cannot overflow.
        self.max_buffer_bytes = min(self.info.max_storage_buffer_range, 1 << 31) & ~0xFFFF

    # -- buffers -----------------------------------------------------------
    def buffer(self, nbytes: int, kind: str = "device", name: str = "") -> Buffer:
        if kind not in ("device", "host"):
            raise ValueError(f"buffer kind {kind!r}")
        nbytes = max(16, (int(nbytes) + 15) & ~15)
        if nbytes > min(self.info.max_storage_buffer_range, 0xFFFFFFFF):
            raise VkEngineError(
                f"buffer {name or '?'} of {nbytes} bytes exceeds the device's storage-buffer range "
                f"({self.info.max_storage_buffer_range} bytes)")
        kp = self._kp
        ttype = kp.TensorTypes.storage if kind == "device" else kp.TensorTypes.host
        try:
            # np.zeros is calloc: a large storage tensor touches no host pages here
            t = self._mgr.tensor_t(np.zeros(nbytes // 4, np.uint32), ttype)
        except Exception as e:
            raise VkEngineError(
                f"out of device memory allocating {nbytes / 2**20:.1f} MiB for {name or 'a buffer'} "
                f"on {self.info.name}: {e}") from e
        b = Buffer(t, nbytes, kind, name, next(self._ids))
        self._buffers.append(b)
        return b

    def free(self, buf: Buffer) -> None:
        keep = {}
        for k, v in self._algorithms.items():
            if buf.id not in k[1]:
                keep[k] = v
            elif isinstance(v, Future):   # a pipeline being created on this buffer: let it finish first
                v.exception()
        self._algorithms = keep
        if buf in self._buffers:
            self._buffers.remove(buf)
        buf.tensor.destroy()

    @property
    def can_spin(self) -> bool:
        """Whether this kp polls fences itself (patches/kp 0003, Device.fence_spin_ns)."""
        return hasattr(self._kp, "VKENGINE_FENCE_SPIN")

    @property
    def memory_bytes(self) -> int:
        """Bytes of memory this device can hold: its device-local heaps. A CPU
        device (lavapipe) allocates from host memory and reports a nominal heap
        (Mesa caps it at 2 GiB, yet larger allocations succeed, lazily, until the
        host runs out): there, the host's available memory."""
        if self.info.type == "cpu":
            avail = host_available_bytes()
            if avail:
                return avail
        return self.info.device_local_bytes

    @property
    def n_buffers(self) -> int:
        return len(self._buffers)

    @property
    def buffers(self) -> list[Buffer]:
        """Every live buffer (a copy of the list)."""
        return list(self._buffers)

    def owns(self, buf: Buffer) -> bool:
        """Whether buf is one of the device's own buffers (staging, readback)."""
        return buf is self._staging or buf is self._readback

    @property
    def allocated_bytes(self) -> dict[str, int]:
        out = {"device": 0, "host": 0}
        for b in self._buffers:
            out[b.kind] += b.nbytes
        return out

    def defer_fill(self, owner: object, fill: Callable[[], None]) -> None:
        """Leave an upload of weights (`fill`) for fill_weights() or the next submit."""
        self._fills[id(owner)] = fill

    def cancel_fill(self, owner: object) -> None:
        """Forget owner's upload left for later (its buffers are being freed)."""
        self._fills.pop(id(owner), None)

    def fill_weights(self) -> float:
        """Run the weight uploads left for later, in order; the seconds they took
        (also kept as fill_s)."""
        t0 = time.perf_counter()
        while self._fills:
            self._fills.pop(next(iter(self._fills)))()
        self.fill_s = time.perf_counter() - t0
        return self.fill_s

    def upload(self, buf: Buffer, data: np.ndarray | bytes, offset: int = 0) -> None:
        """Write bytes at a byte offset (host buffers directly, device buffers
        through the staging buffer in chunks)."""
        raw = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) \
            else np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if offset < 0 or offset + raw.size > buf.nbytes:
            raise ValueError(f"upload of {raw.size} bytes at {offset} overflows {buf.name} ({buf.nbytes} bytes)")
        if buf.kind == "host":
            buf.array(np.uint8)[offset:offset + raw.size] = raw
            return
        st = self._staging.array(np.uint8)
        step = self._staging.nbytes
        for i in range(0, raw.size, step):
            chunk = raw[i:i + step]
            n = chunk.size
            st[:n] = chunk
            pad = (-n) % 4
            if pad:  # vkCmdCopyBuffer sizes are whole bytes, but keep words whole
                st[n:n + pad] = 0
            p = Program(self)
            p._transfer = True
            p.copy(self._staging, buf, 0, offset + i, n)
            p.run()

    def _fill_pool(self) -> ThreadPoolExecutor | None:
        """Threads that fill the staging buffer (upload_blocks), made on first use."""
        if self._fill_threads > 1 and self._filler is None:
            self._filler = ThreadPoolExecutor(self._fill_threads, thread_name_prefix="vk-fill")
        return self._filler

    def upload_blocks(self, buf: Buffer, offset: int, parts: Sequence[np.ndarray], stream) -> int:
        """Write the bytes a quant.Stream takes from the blocks of `parts` (GGUF
        bytes, whole blocks each: a memory-mapped file's tensors) at a byte
        offset, straight into the staging buffer's two halves in turn: the CPU
        fills one half while the GPU copies the other, and no repacked copy of
        the tensor is ever built (a server's weights phase: issue 35's cold
        start). Returns the bytes written (padded to whole words)."""
        from .quant import fill_blocks
        st = stream
        sizes = [np.asarray(p).nbytes for p in parts]
        if any(n % st.block for n in sizes):
            raise ValueError(f"upload_blocks: parts of {sizes} bytes are not whole {st.block}-byte blocks")
        total = sum(sizes) // st.block * st.out
        padded = (total + 3) & ~3
        if offset < 0 or offset + padded > buf.nbytes:
            raise ValueError(f"upload of {padded} bytes at {offset} overflows {buf.name} ({buf.nbytes} bytes)")
        if buf.kind == "host":
            dst = buf.array(np.uint8)[offset:offset + padded]
            pos = 0
            for part in parts:
                blocks = np.asarray(part).reshape(-1).view(np.uint8).reshape(-1, st.block)
                fill_n = blocks.shape[0] * st.out
                fill_blocks(dst[pos:pos + fill_n], blocks, st)
                pos += fill_n
            dst[pos:] = 0
            return padded
        staging = self._staging.array(np.uint8)
        half = self._staging.nbytes // 2
        per = max(4, half // st.out // 4 * 4)          # blocks a chunk: whole words of output
        inflight: list[Program | None] = [None, None]
        turn = 0
        out = offset
        for part in parts:
            blocks = np.asarray(part).reshape(-1).view(np.uint8).reshape(-1, st.block)
            for j in range(0, blocks.shape[0], per):
                chunk = blocks[j:j + per]
                n = chunk.shape[0] * st.out
                prev = inflight[turn]
                if prev is not None:
                    prev.wait()     # the GPU is done reading this half
                base = turn * half
                fill_blocks(staging[base:base + n], chunk, st, self._fill_pool(), self._fill_threads)
                size = n
                if out + n == offset + total and padded != total:   # the last chunk: zeros to a whole word
                    staging[base + n:base + n + padded - total] = 0
                    size += padded - total
                prog = Program(self)
                prog._transfer = True
                prog.copy(self._staging, buf, base, out, size)
                prog.submit()
                inflight[turn] = prog
                out += n
                turn ^= 1
        for q in inflight:
            if q is not None:
                q.wait()
        return padded

    def download(self, buf: Buffer, offset: int = 0, nbytes: int | None = None, dtype=np.uint8) -> np.ndarray:
        """Copy of bytes [offset, offset + nbytes) of a buffer, as `dtype`."""
        nbytes = buf.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or offset + nbytes > buf.nbytes:
            raise ValueError(f"download of {nbytes} bytes at {offset} overflows {buf.name}")
        if buf.kind == "host":
            return buf.array(np.uint8)[offset:offset + nbytes].copy().view(dtype)
        rb = self.readback_buffer(nbytes)
        p = Program(self)
        p.copy(buf, rb, offset, 0, nbytes)
        p.run()
        return rb.array(np.uint8)[:nbytes].copy().view(dtype)

    def readback_buffer(self, nbytes: int) -> Buffer:
        if self._readback is None or self._readback.nbytes < nbytes:
            if self._readback is not None:
                self.free(self._readback)
            self._readback = self.buffer(max(nbytes, 1 << 20), "host", "readback")
        return self._readback

    # -- pipelines ---------------------------------------------------------
    def algorithm(self, name: str, spirv: bytes, buffers: Sequence[Buffer], spec: Sequence[int], push_size: int):
        """A pipeline + descriptor set for shader `name` bound to `buffers`
        (binding i = buffers[i]), cached. Spec constants are 32-bit integers,
        passed as raw bytes (kp 0.9.0 types them by the array's dtype).
        With pipeline threads, what is returned may still be compiling (a
        Future): `resolve` (Program does, when it records) waits for it."""
        key = (name, tuple(b.id for b in buffers), tuple(spec), push_size)
        alg = self._algorithms.get(key)
        if alg is None:
            tensors = [b.tensor for b in buffers]
            if self._shared_cache:
                spec_bytes = struct.pack(f"<{len(spec)}I", *spec)
                twin = (name, tuple(spec), push_size, len(buffers))   # the same pipeline on other buffers
                first = self._compiling.get(twin)
                if self._pool is None:
                    alg = self._create(name, tensors, spirv, spec_bytes, push_size)
                elif first is not None and not first.done() and self.share_twins:
                    # built once the first is: then from the pipeline cache it filled, in milliseconds,
                    # where compiling both at once costs the driver's whole compile twice (a fresh
                    # NVIDIA driver: 7.7 s for each of the 8B's three mul_mc2h_128x256_q4_0, one a
                    # weight arena; notes.md run 41)
                    alg = Future()
                    first.add_done_callback(functools.partial(
                        self._create_twin, alg, (name, tensors, spirv, spec_bytes, push_size)))
                else:
                    # (a kernel with a stand-in waits behind those without one: a start needs only those)
                    alg = self._pool.submit(self._create, name, tensors, spirv, spec_bytes, push_size,
                                            low=self.deferrable(name))
                    self._compiling[twin] = alg
                    alg.add_done_callback(functools.partial(self._built, twin))
            else:   # a kp built before patch 0002 (no shared cache, the GIL held while compiling)
                spec_arr = np.frombuffer(struct.pack(f"<{len(spec)}I", *spec), np.float32) if spec \
                    else np.zeros(0, np.float32)
                try:
                    alg = self._mgr.algorithm(tensors, spirv, [1, 1, 1], spec_arr,
                                              np.zeros(push_size // 4, np.float32))
                except Exception as e:
                    raise VkEngineError(f"pipeline creation failed for {name} on {self.info.name}: {e}") from e
            self._algorithms[key] = alg
        return alg

    def _built(self, twin: tuple, fut: Future) -> None:
        if self._compiling.get(twin) is fut:   # (a later creation of the twin may have taken its place)
            self._compiling.pop(twin, None)

    def _create_twin(self, out: Future, args: tuple, _first: Future) -> None:
        """Create a twin pipeline (Device.algorithm) now that its first is built, its result into `out`."""
        if self._pool is None:   # (closed meanwhile)
            out.set_exception(VkEngineError(f"pipeline creation for {args[0]} cancelled: the device is closed"))
            return
        fut = self._pool.submit(self._create, *args, first=True)
        fut.add_done_callback(functools.partial(_settle_from, out))

    def _create(self, name: str, tensors: list, spirv: bytes, spec: bytes, push_size: int):
        t0 = time.perf_counter()
        if name in self._delay and not (self.share_twins and (name, spec) in self._delayed):
            self._delayed.add((name, spec))   # (twins that wait for it come from the cache, as a driver's would)
            time.sleep(self._delay[name])
        try:
            alg = self._mgr.algorithm_nogil(tensors, spirv, spec, push_size)
        except Exception as e:
            raise VkEngineError(f"pipeline creation failed for {name} on {self.info.name}: {e}") from e
        self.pipeline_times.append((name, t0, time.perf_counter()))
        return alg

    def pipeline_report(self) -> str:
        """How pipeline creation went, for a startup log: how many, their compile
        time summed (against the threads that ran them: a fresh driver is bound by
        the CPU's cores), and what the last settle() waited for."""
        total = sum(b - a for _, a, b in self.pipeline_times)
        threads = len(self._pool.threads) if self._pool is not None else 1
        wait, last = self.settle_wait
        return (f"{len(self.pipeline_times)} pipelines created, {total:.2f} s of compiling on {threads} thread(s); "
                f"waited {wait:.2f} s for those without a stand-in" + (f" (the last: {last})" if last else ""))

    def slowest_pipelines(self, n: int = 3) -> str:
        """The n pipelines that took longest to create (the driver compiling them), for a startup log."""
        top = sorted(self.pipeline_times, key=lambda t: t[1] - t[2])[:n]
        return ", ".join(f"{name} {b - a:.2f} s" for name, a, b in top) or "none"

    @staticmethod
    def resolve(alg):
        """The pipeline itself, once created (waits for one still compiling)."""
        return alg.result() if isinstance(alg, Future) else alg

    def settle(self, grace: float, stand_in: Callable[[str], bool] = lambda name: True) -> set[str]:
        """Wait for the pipelines being created: those of shaders without a
        stand-in to the end, those with one (`stand_in(name)`: the kernels can
        record another while it builds) up to `grace` seconds more; the shaders
        of those still compiling then are `slow` until they finish (a fresh
        NVIDIA driver took 36.5 s for mul_mc2h_256x256_q4_0 and under a second
        for every other pipeline of the 1B: notes.md run 38). When the last
        finishes, the pipeline cache is saved. Returns the slow shaders."""
        pending = [(name, alg) for (name, *_), alg in list(self._algorithms.items())
                   if isinstance(alg, Future) and not alg.done()]
        t0 = time.perf_counter()
        waited = {name for name, alg in pending if not stand_in(name)}
        for name, alg in pending:
            if name in waited:
                alg.exception()
        last = max((t for t in self.pipeline_times if t[0] in waited), key=lambda t: t[2], default=None)
        self.settle_wait = (time.perf_counter() - t0, last[0] if last else "")
        deadline = time.perf_counter() + grace
        for name, alg in pending:
            if stand_in(name):
                try:
                    alg.exception(timeout=max(0.0, deadline - time.perf_counter()))
                except TimeoutError:
                    self._slow.add(name)
        for name, alg in pending:
            if name in self._slow:
                alg.add_done_callback(functools.partial(self._slow_done, name))
        return set(self._slow)

    def _slow_done(self, name: str, _fut: Future | None = None) -> None:
        if not any(k[0] == name and isinstance(a, Future) and not a.done() for k, a in list(self._algorithms.items())):
            self._slow.discard(name)
            if not self._slow:
                log.info("slow pipelines compiled; saving the pipeline cache")
                self.save_pipeline_cache()

    def is_slow(self, name: str) -> bool:
        """Whether shader `name`'s pipeline is still compiling after settle()."""
        return name in self._slow

    @property
    def slow_pending(self) -> bool:
        return bool(self._slow)

    @property
    def slow(self) -> set[str]:
        """The shaders still compiling after settle()."""
        return set(self._slow)

    def _cache_name(self) -> str:
        i = self.info
        raw = f"{i.name}-{i.vendor_id:04x}-{i.driver_name}-{i.driver_info}"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", raw).strip("_")[:160] + ".bin"

    def _load_pipeline_cache(self) -> None:
        f = self.pipeline_cache_file
        assert f is not None
        try:
            data = f.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("pipeline cache %s not read: %s", f, e)
            return
        try:
            self._mgr.load_pipeline_cache(data)
        except Exception as e:   # the driver ignores another driver's data; anything else: start without
            log.warning("pipeline cache %s not loaded: %s", f, e)
            return
        now = self._mgr.pipeline_cache_data()
        if now == data:   # taken whole: saved again only once it holds more
            self.pipeline_cache_loaded = len(data)
            self._cache_saved_bytes = len(now)
            log.debug("pipeline cache: %d bytes loaded from %s", len(data), f)
        else:   # another driver's or device's (the driver ignores it), or reordered: rewritten at the next save
            self.pipeline_cache_loaded = len(now) if len(now) > 32 else 0
            log.debug("pipeline cache %s: %d bytes, %d of them taken by the driver", f, len(data), len(now))

    def save_at_exit(self) -> None:
        """Save the pipeline cache when the process exits (what requests or a
        bench compiled after startup), without keeping the device alive."""
        ref = weakref.ref(self)

        def save() -> None:
            dev = ref()
            if dev is not None:
                dev.save_pipeline_cache()
        atexit.register(save)

    def save_pipeline_cache(self) -> int:
        """Write the device's pipeline cache to its file when it holds more than
        was loaded or last saved (atomically: replicas sharing the folder never
        read half a file). Returns the bytes written (0: nothing new, no file,
        or the write failed, which is logged and otherwise ignored)."""
        f = self.pipeline_cache_file
        if f is None or self._mgr is None:
            return 0
        with self._save_lock:
            return self._save(f)

    def _save(self, f: Path) -> int:
        data = self._mgr.pipeline_cache_data()   # (the pipelines created so far; those compiling join later)
        if len(data) == self._cache_saved_bytes:
            return 0
        tmp = f.with_name(f"{f.name}.{os.getpid()}.tmp")
        try:
            f.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(data)
            os.replace(tmp, f)
        except OSError as e:
            log.warning("pipeline cache not saved to %s: %s", f, e)
            try:
                tmp.unlink()
            except OSError:
                pass
            return 0
        self._cache_saved_bytes = len(data)
        return len(data)

    @property
    def n_pipelines(self) -> int:
        return len(self._algorithms)

    def count_wait(self) -> None:
        """A program finished (the fault hook counts them)."""
        self._waits += 1
        if self._fault_after is not None and self._waits >= self._fault_after:
            raise DeviceFault("the GPU failed: VK_ERROR_DEVICE_LOST (injected by VKENGINE_FAULT_INJECT)")

    def program(self, timestamps: bool = False) -> Program:
        return Program(self, timestamps)

    def close(self) -> None:
        if self._mgr is not None:
            self.save_pipeline_cache()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._filler is not None:
            self._filler.shutdown(wait=True)
            self._filler = None
        self._algorithms.clear()
        self._compiling.clear()
        for b in list(self._buffers):
            b.tensor.destroy()
        self._buffers.clear()
        if self._mgr is not None:
            self._mgr.destroy()
            self._mgr = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
