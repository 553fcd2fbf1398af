"""The engine: one model's weights, per-sequence state and scratch on one
device, and `step`, one forward pass over a batch of (token, slot, position)
rows.

A step is recorded once per shape (rows, output rows, what is read back) and
replayed: per-token values (token ids, positions, slots, output rows) live in a
host-visible params buffer and are written just before the submit; each step
starts by copying them to a device-local twin (kernels reading host memory
across PCIe in every workgroup is slow on discrete GPUs). Prefill chunks,
decode steps and mixed batches of several sequences are all steps.
"""
from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import numpy as np

from .device import Device, Program
from .errors import VkEngineError
from .graph import Graph, ParamsLayout, Scratch
from .kernels import Caps, Kernels, KVTypes
from .model import Model
from .options import Options


class Readback(enum.Flag):
    """What a step reads back for its output rows."""
    NONE = 0
    ARGMAX = enum.auto()     # the greedy token (one word a row)
    SAMPLE = enum.auto()     # the token drawn on the device with each row's sampling params
    LOGITS = enum.auto()     # the logits rows (with SAMPLE: the drawn tokens too)
    HIDDEN = enum.auto()     # with any of the above: every row's final-normed hidden state (embeddings)

    @property
    def tokens(self) -> bool:
        """Whether the step chooses its rows' tokens on the device (so a chained step can take them)."""
        return bool(self & (Readback.ARGMAX | Readback.SAMPLE))


_DRAFTS = 1 << 24   # a chain entry >= this: the device's drafts word (entry - _DRAFTS), see Engine._record
_NO_TOKEN = np.uint32(0xFFFFFFFF)   # a masked step's token words until its pick writes them
_READBACKS = (Readback.NONE, Readback.ARGMAX, Readback.SAMPLE, Readback.LOGITS, Readback.SAMPLE | Readback.LOGITS)


@dataclass(frozen=True)
class Pass:
    """Which forward a step records: the model's (MAIN); the model's keeping
    every row's final-normed hidden state (hidden_rows) and, with snapshots,
    its recurrent state after each row (an MTP verify step); or the model's
    multi-token-prediction block (mtp), whose row r reads hidden[hmap[r]]
    (zero_first: zeros for row 0, position 0 having no previous state)."""
    mtp: bool = False
    hidden_rows: bool = False
    snapshots: bool = False
    hidden: str = ""
    zero_first: bool = False
    drafts_at: int = -1    # an MTP step: its chosen tokens also to the device's drafts[drafts_at:] (ParamsLayout)


MAIN = Pass()


@dataclass(frozen=True)
class EngineConfig:
    n_slots: int = 1          # sequences whose state is resident on the device
    n_ctx: int | None = None  # positions per slot (default: min(training context, 4096))
    max_batch: int = 256      # token rows per step (prefill chunk size)
    max_out: int = 16         # rows whose logits one step can produce
    program_cache: int = 0    # recorded steps kept (LRU); 0: 80 per step that may be in flight
    # sampled tokens drawn on the device (Readback.SAMPLE); None: on GPUs (on lavapipe
    # its barrier rounds cost ~0.1 s a row, the host's sampler ~0.1 ms)
    device_sampling: bool | None = None
    max_in_flight: int = 2    # steps submitted and not yet collected (2 or 3; see Engine.max_in_flight)
    options: Options = field(default_factory=Options)   # kernel path switches (Options.from_env at the edge)
    kv_types: KVTypes = KVTypes()   # the KV cache's K and V types (--cache-type-k, --cache-type-v)
    embeddings: bool = False  # steps may read back every row's final-normed hidden state (Readback.HIDDEN)
    # the weights' uploads left to prepare_decode, which runs them while the steps' pipelines compile (a
    # server's start: both take about a second on an 8B, notes.md run 45), or to the device's first submit
    defer_fill: bool = False


class _Submitted(NamedTuple):
    """A step submitted and not yet collected."""
    program: Program
    readback: Readback
    n_out: int
    params: int         # which host params buffer it reads and writes back to
    n: int = 0          # its rows (Readback.HIDDEN reads them all)
    pick: Program | None = None   # a masked step's second program (masks, then its tokens chosen)
    masked: bool = False          # a masked step (pick None: its masks are not given yet)


class Engine:
    # Steps of more than STEP_EXACT rows run as a bucket of rows (step_rows) on
    # GPUs, so that a server meets a few step shapes instead of one per prompt
    # length and chunk mix: each new shape is a recording that holds every
    # stream for milliseconds (notes.md run 15)
    STEP_EXACT = 8
    # seconds prepare_decode waits, once every other pipeline it asked for is built, for those that have a
    # stand-in (Kernels.has_stand_in) before it records their steps on the stand-in (Device.settle): all but
    # one of the 1B's built in under a second on a fresh NVIDIA driver with 16 threads, that one in 36.5 s
    # (notes.md run 38); from the driver's or vkengine's pipeline cache, milliseconds
    SLOW_PIPELINE_S = 0.3

    @staticmethod
    def context_length(args, n_ctx: int | None) -> int:
        """The positions a sequence may hold: n_ctx (--ctx) if given, else the
        model's training length up to 4096."""
        return int(n_ctx or min(args.n_ctx_train, 4096))

    def __init__(self, model: Model, device: Device, cfg: EngineConfig = EngineConfig(),
                 caps: Caps | None = None):
        """caps: what the kernels may do (default: decided from the device and cfg.options)."""
        self.model, self.device, self.cfg = model, device, cfg
        known = {b.id for b in device.buffers}   # (close() frees what this constructor allocates)
        a = model.args
        self.args = a
        self.n_ctx = self.context_length(a, cfg.n_ctx)
        if self.n_ctx <= 0 or cfg.n_slots <= 0:
            raise VkEngineError("context length and slot count must be positive")
        if cfg.max_in_flight not in (2, 3):
            raise VkEngineError("max_in_flight is 2 or 3")
        cfg.kv_types.check_head_dim(a.head_dim)
        self.kernels = Kernels(device, caps if caps is not None else Caps.detect(device, cfg.options))
        k = self.kernels
        self.arch = model.arch
        widths = dict(self.arch.scratch_widths(a))
        widths["out_argmax"] = Kernels.argmax_tmp_words(a.n_vocab, 1)   # per output row
        on = cfg.device_sampling if cfg.device_sampling is not None else device.info.type != "cpu"
        self.can_sample = bool(on) and k.can_sample(a.n_vocab)
        if self.can_sample:   # the slices' candidates
            widths["out_sample"] = Kernels.sample_tmp_words(a.n_vocab, 1)
        if k.caps.split_attention:   # split decode attention's partial results and zeroed counters
            widths["out_attn_split"] = k.attention_tmp_words(1, a.n_head, a.n_kv_heads, a.head_dim, self.n_ctx)
            widths["out_attn_sync"] = Kernels.attention_sync_words(1, a.n_head)
        widths["out_sync"] = 4          # zeroed counter of fused RMSNorms (Graph.matmul_norm)
        widths["cn_sync"] = 1           # ... of the combined expert matvec's, a word a row (Graph.moe)
        if cfg.embeddings:              # every row's final-normed hidden state (Readback.HIDDEN)
            widths["emb"] = a.n_embd
        self.max_out = max(1, cfg.max_out)
        # fit the scratch buffer within the device's buffer limit
        max_rows = max(1, cfg.max_batch)
        while Scratch.words_needed(widths, max_rows, self.max_out) * 4 > device.max_buffer_bytes and max_rows > 1:
            max_rows //= 2
        if Scratch.words_needed(widths, max_rows, self.max_out) * 4 > device.max_buffer_bytes:
            raise VkEngineError(f"activations of {model.name} do not fit one buffer on {device.info.name}")
        self.max_batch = max_rows
        words = Scratch.words_needed(widths, max_rows, self.max_out)
        self._check_memory(words * 4)
        device.defer_fills = cfg.defer_fill
        try:
            self.weights = self.arch.load_weights(model.file, a, device, self.n_ctx)
        finally:
            device.defer_fills = False
        try:
            self.kv = self.arch.make_state(device, a, cfg.n_slots, self.n_ctx, cfg.kv_types, max_step=self.max_batch)
        except VkEngineError as e:
            raise VkEngineError(f"{e}: reduce the context length (--ctx) or the sequences held on the "
                                "device at once (--parallel, --slots)") from e
        self.scratch = Scratch(device.buffer(words * 4, "device", "scratch"), widths, max_rows, self.max_out)
        for name in ("out_sync", "cn_sync", "out_attn_sync", "norm_q8_sync", "dr_sync", "rt_sync"):   # left zero
            if name in widths:
                rows = self.max_out if name.startswith("out_") else max_rows
                device.upload(self.scratch.buf, np.zeros(self.scratch.strides[name] * rows, np.uint32),
                              self.scratch.offsets[name] * 4)
        # (an MTP model's drafts left on the device: a word per output row of each of its draft steps)
        self.layout = ParamsLayout(max_rows, self.max_out, Kernels.mask_words(a.n_vocab),
                                   draft_words=self.max_out * max(0, a.mtp_snap_rows - 1))
        # A host params buffer per step that may be in flight, used in turn, so
        # that a step can be written and submitted while the ones before it
        # still run. Three (a server: two chained steps queued behind the
        # running one) only where the state rewinds: a sequence that ends has
        # up to two chained rows past its last token, and the second one's
        # input is a token the sequence never gets, which a recurrent state
        # would have taken in (a KV row past the sequence is never read).
        self.max_in_flight = cfg.max_in_flight if self.kv.rewindable else 2
        self.poll_picks = cfg.options.poll_picks   # (a fence wait can sleep past the tokens' arrival)
        self._params = [device.buffer(self.layout.words * 4, "host", f"params-{i}")
                        for i in range(self.max_in_flight)]
        self.params = self._params[0]
        self._next_params = 0
        # MTP steps (Pass.mtp) may get a ring of params buffers of their own (reserve_mtp), past the
        # main ring's max_in_flight: _params[n_main:]
        self.n_main = self.max_in_flight
        self._next_mtp = 0
        self.program_cache = cfg.program_cache or 80 * self.max_in_flight
        self.params_dev = device.buffer(self.layout.words * 4, "device", "params-dev")
        self.logits_host = device.buffer(self.max_out * a.n_vocab * 4, "host", "logits")
        self.hidden_host = (device.buffer(max_rows * self.scratch.stride("emb") * 4, "host", "hidden")
                            if cfg.embeddings else None)
        # a part of a split model (vkengine.split): the arrays the architecture hands on (its residual
        # stream; Architecture.handoff) of a step's rows arrive in handoff_in (host-visible, written by
        # the host from the part before's handoff_out), one after another; one a params buffer, as a
        # step in flight may not have read its own when the host writes the next step's
        self._handoff_row = sum(self.scratch.stride(name) for name in self.arch.handoff)   # words a row
        hand = max_rows * self._handoff_row * 4
        self._handoff_in = ([device.buffer(hand, "host", f"handoff-in-{i}") for i in range(len(self._params))]
                            if not a.first_part else [])
        self.handoff_out = device.buffer(hand, "host", "handoff-out") if not a.last_part else None
        # whether the part before hands over its last layer's norm split (Architecture.hands_norm) for a
        # step of n rows: the part before's hands_norm (SplitEngine sets it)
        self.takes_norm: Callable[[int], bool] | None = None
        self._programs: OrderedDict[tuple, Program] = OrderedDict()
        self._provisional: set[tuple] = set()   # programs recorded on a stand-in for a compiling kernel
        # Pad rows (step_rows) need a sequence's rows to depend on nothing past
        # its positions: true of attention, not of a recurrent state. GPUs only:
        # on lavapipe a step's time grows with its rows, and a recording is
        # small beside it.
        self.pad_steps = self.kv.rewindable and device.info.type != "cpu" and cfg.options.step_buckets
        # Prompt rows on the tiled matmuls whatever their number (tiled_prompts):
        # a prompt row then takes the same kernels in a chunk of 1 or of 64
        # rows, so (with decode rows in steps of their own) a sequence's tokens
        # do not depend on how its prompt was chunked or on who else ran.
        self._tiled_prompts = self.pad_steps and cfg.options.tiled_prompts
        self._inflight: deque[_Submitted] = deque()   # oldest first
        self.deferred: deque[tuple] = deque()   # steps prepare_decode(defer=True) left for record_deferred
        self.programs_evicted = 0   # recorded steps the program cache dropped (LRU) to keep at most program_cache
        self.last_rows = 0   # rows the newest step ran (its pad rows too)
        # whether callers chain decode steps on this device (prepare_decode records them); a split model's
        # parts: no, SplitEngine chains on the host
        self.device_chains = True
        # the buffers this engine allocated (weights, state, activations, params and readbacks):
        # close() frees them. Engines are built one at a time on a device (nothing else allocates
        # meanwhile); the device's own staging and readback buffers are not the engine's
        self._own = [b for b in device.buffers if b.id not in known]

    def _check_memory(self, scratch_bytes: int) -> None:
        """Refuse, before allocating anything, a configuration whose weights, state
        and activations exceed the device's memory: some drivers (lavapipe)
        grant such allocations lazily and the process is killed later, mid-request."""
        cfg, dev = self.cfg, self.device
        mf = self.model.file
        weights = sum(mf.tensor_bytes(n) for n in mf.tensor_names() if self.arch.holds_tensor(self.args, n))
        per_pos, per_slot = self.arch.state_bytes(self.args, cfg.n_slots, self.n_ctx, cfg.kv_types,
                                                  max_step=self.max_batch)
        kv = (per_pos * self.n_ctx + per_slot) * cfg.n_slots
        # the matmuls' own scratch (split K's partial sums, mul_mc2's halves of x)
        shapes = [mf.tensor_shape(n) for n in mf.tensor_names()]
        max_cols = max((s[-1] for s in shapes if len(s) == 2), default=0)
        scratch_bytes += self.kernels.scratch_bytes_bound(self.max_batch, max_cols)
        budget = dev.memory_bytes
        capped = 0 < cfg.options.memory_mib * 2 ** 20 < budget   # (VKENGINE_MEMORY_MIB)
        if capped:
            budget = cfg.options.memory_mib * 2 ** 20
        need = weights + kv + scratch_bytes
        if need <= budget:
            return
        gib = 2 ** 30
        what = (f"{self.model.name} with {cfg.n_slots} slot(s) x {self.n_ctx} positions needs "
                f"{need / gib:.2f} GiB (weights {weights / gib:.2f}, KV cache {kv / gib:.2f}, activations "
                f"{scratch_bytes / gib:.2f}); {dev.info.name} has {budget / gib:.2f} GiB"
                f"{' for it (VKENGINE_MEMORY_MIB)' if capped else ''}"
                f"{' of host memory available' if dev.info.type == 'cpu' and not capped else ''}")
        room = (budget - weights - scratch_bytes) // per_pos
        if weights > budget:
            raise VkEngineError(f"{what}: the weights alone do not fit; use a smaller or more quantized model, or "
                                "split it across devices (--devices)")
        if room < 1:
            raise VkEngineError(f"{what}: the weights and the activations of a {self.max_batch}-row step do not "
                                "fit; use fewer rows per step (--step-tokens, --batch) or a smaller model")
        raise VkEngineError(f"{what}: reduce the context length (--ctx) or the sequences held on the device at "
                            f"once (--parallel, --slots); about {room} positions fit in all "
                            f"(e.g. --ctx {room // cfg.n_slots} with {cfg.n_slots} slot(s))")

    @property
    def n_slots(self) -> int:
        return self.cfg.n_slots

    def hands_norm(self, n: int) -> bool:
        """A split model's part before the last: whether a step of n rows hands
        the next part its first layer's norm split (Architecture.hands_norm)."""
        g = Graph(self.kernels, cast(Program, None), self.scratch, self.params_dev, self.layout, self.kv, n, 0,
                  self.weights.rope, self.args.rms_eps)   # (the choice only: nothing is recorded)
        return self.arch.hands_norm(g, self.args, self.weights)

    @property
    def handoff_in(self):
        """The host buffer the next step submitted reads the part before's arrays from (a split model's later part)."""
        return self._handoff_in[self._next_params] if self._handoff_in else None

    def handoff_words(self, n: int) -> int:
        """Words of handoff_out (and of the next part's handoff_in) a step of n rows fills."""
        return n * self._handoff_row

    @property
    def n_programs(self) -> int:
        """Recorded steps kept (one per shape, at most program_cache): host memory that grows with
        the shapes a server meets, then levels off."""
        return len(self._programs)

    @property
    def n_vocab(self) -> int:
        return self.args.n_vocab

    @property
    def can_chain(self) -> bool:
        """Whether a caller may chain decode steps (submit(chain=...)). A chained
        row of a sequence that has just ended still runs: its KV row and, in a
        hybrid model, the recurrent state then cover one more position, which
        the scheduler records when it frees the slot (Scheduler.finish)."""
        return True

    @property
    def in_flight(self) -> int:
        """Steps submitted and not yet collected (0 .. max_in_flight, and up to
        mtp_depth MTP steps more where reserve_mtp gave them a ring)."""
        return len(self._inflight)

    @property
    def mtp_depth(self) -> int:
        """MTP steps that may be in flight beside max_in_flight main-model steps (reserve_mtp; 0: they share
        the main steps' ring and limit)."""
        return len(self._params) - self.n_main

    def reserve_mtp(self, depth: int) -> None:
        """Let up to `depth` MTP steps (Pass.mtp) be in flight beside max_in_flight
        main-model steps, on params buffers of their own. A speculative turn
        (vkengine.serving.speculate) queues the MTP block, its chained drafts
        and the next verify step behind them at once, so that the device runs
        them back to back while the host is still submitting; with one ring of
        max_in_flight buffers the host waited for the block before the second
        draft and for a draft before the verify step, and the device waited for
        the host in between (notes.md run 47). The MTP block takes in no
        recurrent state (its rows are KV rows of its own layer), so
        max_in_flight's limit, a rewinding matter of the main model's chained
        rows, does not apply to it. Not on a split model's parts (a part's
        handoff buffers follow the main ring)."""
        if self._handoff_in or self.handoff_out is not None:
            return
        while self.mtp_depth < depth:
            b = self.device.buffer(self.layout.words * 4, "host", f"params-mtp-{self.mtp_depth}")
            self._params.append(b)
            self._own.append(b)
            self.program_cache += 8   # (an MTP step's shapes on each buffer)

    def restart_mtp_ring(self) -> None:
        """With no MTP step in flight: the next one takes the MTP ring's first
        buffer (a speculative turn's block always on the same one, its drafts on
        the next: the programs speculate.prepare_turns records ahead)."""
        if not any(s.params >= self.n_main for s in self._inflight):
            self._next_mtp = 0

    def _on_mtp_ring(self, pass_: Pass) -> bool:
        """Whether a step of this pass takes the MTP ring (reserve_mtp) rather than the main one."""
        return pass_.mtp and self.mtp_depth > 0

    def has_room(self, pass_: Pass = MAIN) -> bool:
        """Whether a step of this pass may be submitted now: fewer than
        max_in_flight main-model steps in flight (MTP steps among them where
        they have no ring of their own), or fewer than mtp_depth MTP steps."""
        if self._on_mtp_ring(pass_):
            return sum(s.params >= self.n_main for s in self._inflight) < self.mtp_depth
        return sum(s.params < self.n_main for s in self._inflight) < self.n_main

    def _next_buf(self, pass_: Pass) -> int:
        """The params buffer the next step of this pass takes."""
        return self.n_main + self._next_mtp if self._on_mtp_ring(pass_) else self._next_params

    @property
    def tiled_prompts(self) -> bool:
        """Whether steps of prompt rows run at least the tiled threshold's rows (see __init__)."""
        tf = self.kernels.caps.tiled_from
        return self._tiled_prompts and tf is not None and self.max_batch >= tf

    @property
    def prompt_granule(self) -> int:
        """Rows a prompt step's tiled matmuls pad to (their widest tile of
        tokens; 1 where prompt steps are not padded): a chunk of whole granules
        runs no padded rows."""
        return self.kernels.prompt_granule if self.tiled_prompts else 1

    @property
    def exact_rows(self) -> int:
        """The most rows a step may hold and still compute each row as a
        one-row step does: below every row count where its kernels change
        (Kernels.step_thresholds). Speculative verify steps stay within it."""
        return min([t - 1 for t in self.kernels.step_thresholds(self.max_out)] + [self.max_batch])

    def prompt_cost_rows(self, n: int) -> int:
        """The rows a prompt step of n tokens costs: its step's rows (step_rows)
        up to whole granules (prompt_granule)."""
        g = self.prompt_granule
        return -(-self.step_rows(n, prompt=True) // g) * g

    def step_rows(self, n: int, prompt: bool = False) -> int:
        """The rows a step of n tokens runs. Prompt rows where tiled_prompts:
        at least the tiled threshold. Otherwise n up to STEP_EXACT, else n rounded
        up to 8 up to 64 rows (the matvec variants take 8 columns a workgroup, so
        no workgroup is added), to 16 up to 128, to 64 beyond (whole tiles of the
        tiled matmuls), at most max_batch, and never across a row
        count where the step's kernels change (Kernels.step_thresholds: the
        tiled matmuls, attention on cooperative matrices, split decode
        attention). Which kernel sums a row, and in what order, is then the same
        for n and its bucket (per row, the matvec and matmul variants do not
        depend on the column count; split K's parts depend on the tile columns,
        whose boundaries are multiples of 64), so a row's result does not change."""
        tf = self.kernels.caps.tiled_from
        if prompt and self.tiled_prompts and tf is not None and n < tf:
            return tf
        if n <= self.STEP_EXACT or not self.pad_steps:
            return n
        q = 8 if n <= 64 else 16 if n <= 128 else 64
        b = min(-(-n // q) * q, self.max_batch)
        for t in self.kernels.step_thresholds(self.max_out):
            if n < t <= b:
                b = t - 1
        return max(n, b)

    # -- recorded programs ------------------------------------------------------------
    def _program(self, n: int, n_out: int, readback: Readback, buf: int = 0, chain: tuple[int, ...] = (),
                 pass_: Pass = MAIN, part: str = "") -> Program:
        """part: "" the whole step; "forward" a masked step's first program (its
        logits), "pick" its second (masks, then the tokens chosen)."""
        key = (n, n_out, readback, buf, chain, pass_) + ((part,) if part else ())
        prog = self._programs.get(key)
        if prog is not None and key in self._provisional and not self.device.slow_pending:
            # recorded on a stand-in kernel while its own compiled: record it again, on its own
            self._provisional.discard(key)
            del self._programs[key]
            prog = None
        if prog is not None:
            self._programs.move_to_end(key)
            return prog
        before = self.kernels.substituted
        prog = (self._record_pick(n_out, readback, buf) if part == "pick" else
                self._record(n, n_out, readback, buf=buf, chain=chain, pass_=pass_, pick=part != "forward"))
        if self.kernels.substituted != before:
            self._provisional.add(key)
        self._programs[key] = prog
        if len(self._programs) > self.program_cache:
            self._programs.popitem(last=False)
            self.programs_evicted += 1
        return prog

    def prepare_decode(self, max_rows: int, prompt_rows: int = 0, defer: bool = False) -> int:
        """Record ahead the decode steps a server runs (1..max_rows sequences, one
        row each, greedy, plain and chained, with either params buffer; where
        the device samples, the sampled ones too, within a quarter of the
        program cache), so that no stream waits for a recording when others
        join or leave, and a prompt step of 9 and of max_batch rows, which
        creates the pipelines of the 8-column and the tiled matmuls (drivers
        compile a pipeline on creation: tens of milliseconds each, otherwise
        paid by the first requests).
        With prompt_rows (a server's step size) and pad_steps, first the prompt
        steps of up to that many rows (step_rows' buckets) for up to 4 output
        rows, greedy, sampled or none, with either params buffer:
        the steps that admit a newcomer, as many as the program cache holds
        beside the decode steps (recorded first, so that they are the first it
        lets go).
        defer (a server's start): only the steps of at most one output row now
        (a first request's prompt steps and its decode steps alone); the others
        wait in `deferred` for record_deferred, which the server's engine thread
        calls while it has nothing to run, so that a new replica answers sooner
        (building a step's operations is Python's work: ~7 ms each, 152 steps on
        lavapipe's server config).
        Returns the number of programs recorded."""
        A, S = Readback.ARGMAX, Readback.SAMPLE
        key = tuple[int, int, Readback, int, tuple[int, ...]]
        decode: list[key] = [(n, 1, A, 0, ()) for n in sorted({min(9, self.max_batch), self.max_batch})]
        # two programs per row count and params buffer; keep them within half the program cache
        top = min(max_rows, self.max_out, self.max_batch, self.program_cache // (4 * self.n_main))
        for n in range(1, top + 1):
            for buf in range(self.n_main):
                for chain in ((), tuple(range(n))) if self.can_chain and self.device_chains else ((),):
                    decode.append((n, n, A, buf, chain))   # the key order of _program's arguments
        if self.can_sample:   # sampled replies' steps (their tokens drawn on the device), within a quarter
            top_s = min(top, self.program_cache // (8 * self.n_main))
            for n in range(1, top_s + 1):
                for buf in range(self.n_main):
                    for chain in ((), tuple(range(n))) if self.can_chain and self.device_chains else ((),):
                        decode.append((n, n, S, buf, chain))
        prompt: list[key] = []
        if self.pad_steps:
            top = min(prompt_rows, self.max_batch)
            first = 1 if self.tiled_prompts else self.STEP_EXACT + 1
            for n in sorted({self.step_rows(n, prompt=True) for n in range(first, top + 1)}):
                for buf in range(self.n_main):
                    prompt.append((n, 0, Readback.NONE, buf, ()))
                    for mode in (A, S) if self.can_sample else (A,):
                        prompt += [(n, k, mode, buf, ()) for k in range(1, min(max_rows, self.max_out, 4) + 1)]
        keys = prompt[:max(0, self.program_cache - len(decode) - 8)] + decode
        if not self.args.last_part:   # a split model's earlier part: no output rows, nothing read back or chained
            keys = sorted({(k[0], 0, Readback.NONE, k[3], ()) for k in keys})
        # every program's operations first (their pipelines start compiling on the device's pipeline
        # threads as they are asked for), then the recordings, which wait for them; except that a pipeline
        # still compiling after SLOW_PIPELINE_S (a fresh NVIDIA driver: 36.5 s for the 1B's largest mul_mc2
        # tile) is not waited for: the steps that use it are recorded on a stand-in kernel (mul_mc) and
        # recorded again once it is built (_program)
        todo = [k for k in keys if (*k, MAIN) not in self._programs]
        if defer:
            self.deferred = deque(k for k in todo if k[1] > 1)
            todo = [k for k in todo if k[1] <= 1]
        progs = [self._program(*k) for k in todo]
        self.device.fill_weights()   # (weights left for later: uploaded while those pipelines compile)
        if self.device.settle(self.SLOW_PIPELINE_S, self.kernels.has_stand_in):
            for i, k in enumerate(todo):
                if progs[i].compiling():
                    self._programs.pop((*k, MAIN), None)
                    progs[i] = self._program(*k)
        for prog in progs:
            prog.prepare()
        self.device.save_pipeline_cache()
        return len(progs)

    def record_deferred(self) -> bool:
        """Record one of the steps prepare_decode(defer=True) left for later,
        the first whose pipelines are built (one still compiling goes to the
        back, so that an idle engine thread never waits on the driver: a request
        may arrive meanwhile). Whether one was recorded; the pipeline cache is
        saved after the last."""
        for _ in range(len(self.deferred)):
            k = self.deferred.popleft()
            prog = self._program(*k)   # (its operations: built once, kept by the program cache)
            if prog.compiling():
                self.deferred.append(k)
                continue
            recorded = prog.recorded
            prog.prepare()
            if not self.deferred:
                self.device.save_pipeline_cache()
            if not recorded:
                return True
        return False

    def drop_deferred(self) -> None:
        """Forget the steps left for record_deferred (they are recorded when first run)."""
        self.deferred.clear()

    def _record(self, n: int, n_out: int, readback: Readback, timestamps: bool = False, buf: int = 0,
                chain: tuple[int, ...] = (), pass_: Pass = MAIN, pick: bool = True) -> Program:
        pl = self.layout
        params = self._params[buf]
        prog = self.device.program(timestamps)
        prog.copy(params, self.params_dev, 0, 0, pl.argmax * 4, "params")
        if pass_.mtp:   # the rows of the hidden states the MTP block reads
            prog.copy(params, self.params_dev, pl.hmap * 4, pl.hmap * 4, n * 4, "hmap")
        # chained step: row i's token is output j = chain[i] of the step before it,
        # whose greedy tokens are still in the device's params, or (j >= _DRAFTS)
        # the draft an MTP step left at drafts[j - _DRAFTS], or (j < 0) the host's
        # (runs of consecutive rows copied at once)
        src = [-1 if j < 0 else pl.argmax + j if j < _DRAFTS else pl.drafts + j - _DRAFTS for j in chain]
        i = 0
        while i < len(src):
            k = i + 1
            while k < len(src) and src[i] >= 0 and src[k] == src[k - 1] + 1:
                k += 1
            if src[i] >= 0:
                prog.copy(self.params_dev, self.params_dev, src[i] * 4, (pl.tokens + i) * 4, (k - i) * 4, "chain")
            i = k
        if self._handoff_in and not pass_.mtp:   # what the part before handed on
            self._handoff(prog, n, self._handoff_in[buf], into=True)
        g = Graph(self.kernels, prog, self.scratch, self.params_dev, pl, self.kv, n, n_out, self.weights.rope,
                  self.args.rms_eps, snap_rows=n if pass_.snapshots else 0)
        g.norm_handed = self.takes_norm is not None and not pass_.mtp and self.takes_norm(n)
        if pass_.mtp:
            self.arch.forward_mtp(g, self.args, self.weights, pass_.hidden, pl.hmap, pass_.zero_first)
        else:
            self.arch.forward(g, self.args, self.weights, hidden_rows=pass_.hidden_rows)
        if self.handoff_out is not None:   # to the next part (no output rows here)
            self._handoff(prog, n, self.handoff_out, into=False)
            return prog
        if pick:
            self._pick(g, prog, n_out, readback, params)
            if pass_.drafts_at >= 0 and n_out and readback.tokens:   # (for a verify step behind it)
                prog.copy(self.params_dev, self.params_dev, pl.argmax * 4, (pl.drafts + pass_.drafts_at) * 4,
                          n_out * 4, "drafts")
        if readback & Readback.HIDDEN:   # every row's final-normed hidden state, rows packed as on the device
            assert self.hidden_host is not None
            self.arch.final_norm(g, self.args, self.weights, "emb")
            r = self.scratch.region("emb")
            prog.copy(r.buf, self.hidden_host, r.off * 4, 0, n * self.scratch.stride("emb") * 4, "hidden")
        if n_out and readback & Readback.LOGITS:
            r = self.scratch.region("out_logits")
            stride = self.scratch.stride("out_logits")
            V = self.args.n_vocab
            for i in range(n_out):   # rows are stride apart on the device, packed on the host
                prog.copy(r.buf, self.logits_host, (r.off + i * stride) * 4, i * V * 4, V * 4, "logits")
        return prog

    def _handoff(self, prog: Program, n: int, host, into: bool) -> None:
        """Copy the first n rows of each handed-on array from the host buffer
        (into=True) or to it, the arrays one after another."""
        off = 0
        for name in self.arch.handoff:
            r, words = self.scratch.region(name), n * self.scratch.stride(name)
            if into:
                prog.copy(host, r.buf, off * 4, r.off * 4, words * 4, "handoff")
            else:
                prog.copy(r.buf, host, r.off * 4, off * 4, words * 4, "handoff")
            off += words

    def _pick(self, g: Graph, prog: Program, n_out: int, readback: Readback, params) -> None:
        """The output rows' tokens chosen (greedy or drawn) into the host params."""
        pl = self.layout
        if n_out and readback & Readback.ARGMAX:
            g.argmax("out_logits")
            prog.copy(self.params_dev, params, pl.argmax * 4, pl.argmax * 4, n_out * 4, "argmax")
        elif n_out and readback & Readback.SAMPLE:
            g.sample("out_logits")
            prog.copy(self.params_dev, params, pl.argmax * 4, pl.argmax * 4, n_out * 4, "sample")

    def _record_pick(self, n_out: int, readback: Readback, buf: int) -> Program:
        """A masked step's second program: its rows' token masks to the device,
        the forbidden logits at -inf, then the tokens chosen as _record's."""
        pl, params = self.layout, self._params[buf]
        prog = self.device.program()
        prog.copy(params, self.params_dev, pl.masks * 4, pl.masks * 4, n_out * pl.mask_words * 4, "masks")
        self.kernels.mask_logits(prog, self.scratch.region("out_logits"), self.scratch.stride("out_logits"),
                                 self.args.n_vocab, n_out, self.params_dev, pl.masks)
        g = Graph(self.kernels, prog, self.scratch, self.params_dev, pl, self.kv, n_out, n_out, self.weights.rope,
                  self.args.rms_eps)
        self._pick(g, prog, n_out, readback, params)
        return prog

    def profile(self, n: int, n_out: int = 1, runs: int = 5, start_pos: int = 0,
                batched: bool = False, readback: Readback = Readback.ARGMAX, pass_: Pass = MAIN,
                hmap=None) -> list[tuple[str, float, int]]:
        """GPU time per op kind of one step of n rows: [(label, microseconds per
        step, count)], slowest first. The rows are a prompt chunk in slot 0 at
        positions from start_pos, or (batched=True) n sequences in slots 0..n-1
        all at position start_pos, as in the server's batched decode;
        readback=SAMPLE: the output rows' tokens drawn on the device with the
        server's default sampling (temperature 0.8, top-k 40, top-p 0.95,
        min-p 0.05) instead of the argmax. pass_ and hmap as submit's (an MTP
        model's verify step, MTP block and drafts: bench --mtp --profile)."""
        self._check_hmap(pass_, hmap, n)
        if batched and n > self.n_slots:
            raise VkEngineError(f"a batched step of {n} rows needs {n} slots, the engine has {self.n_slots}")
        if not 0 < n <= self.max_batch:
            # (the activations hold max_batch rows: a longer step would write past them)
            raise VkEngineError(f"a step takes 1..{self.max_batch} rows, got {n}")
        pl, prm = self.layout, self.params.array()
        prm[pl.tokens:pl.tokens + n] = np.arange(n) % self.n_vocab
        prm[pl.positions:pl.positions + n] = start_pos if batched else np.arange(start_pos, start_pos + n)
        prm[pl.slots:pl.slots + n] = np.arange(n) if batched else 0
        prm[pl.out_rows:pl.out_rows + n_out] = np.arange(n - n_out, n)
        if readback == Readback.SAMPLE and not self.can_sample:
            raise VkEngineError("this engine does not sample on the device (EngineConfig.device_sampling)")
        if readback == Readback.SAMPLE:   # the server's default sampling (temperature 0.8, top-k 40, ...)
            words = self._sampling_words(np.tile([0.8, 40, 0.95, 0.05, 0.5], (n_out, 1)))
            prm[pl.sampling:pl.sampling + words.size] = words
        if hmap is not None:
            prm[pl.hmap:pl.hmap + n] = hmap
        prog = self._record(n, n_out, readback if n_out else Readback.NONE, timestamps=True, pass_=pass_)
        totals: dict[str, list[float]] = {}
        counts: dict[str, int] = {}
        for i in range(runs + 1):
            prog.run()
            if i == 0:
                continue   # warm-up
            step: dict[str, float] = {}
            counts = {}
            for label, us in prog.timings():
                step[label] = step.get(label, 0.0) + us
                counts[label] = counts.get(label, 0) + 1
            for k, v in step.items():
                totals.setdefault(k, []).append(v)
        rows = [(k, float(np.median(v)), counts[k]) for k, v in totals.items()]
        return sorted(rows, key=lambda r: -r[1])

    @staticmethod
    def _check_hmap(pass_: Pass, hmap, n: int) -> None:
        """hmap (submit's, profile's): a hidden-state row for each of n rows of an MTP pass, and only there."""
        if pass_.mtp != (hmap is not None) or (hmap is not None and len(hmap) != n):
            raise ValueError("an MTP pass needs hmap, a hidden-state row for each row (and only it does)")

    @staticmethod
    def _sampling_words(samp: np.ndarray) -> np.ndarray:
        """The params words (Kernels.SAMPLE_WORDS a row) of sampling rows
        (temperature, top_k, top_p, min_p, u): floats as bits, top_k an integer."""
        w = np.zeros((len(samp), Kernels.SAMPLE_WORDS), np.float32)
        w[:, [0, 2, 3, 4]] = samp[:, [0, 2, 3, 4]]
        w[:, 4] = np.minimum(w[:, 4], np.float32(1.0 - 2.0 ** -24))   # u < 1 in float32 too
        wu = w.view(np.uint32)
        wu[:, 1] = samp[:, 1].astype(np.uint32)
        return wu.reshape(-1)

    # -- steps --------------------------------------------------------------------------
    def step(self, tokens, positions, slots, out_rows=(), readback: Readback = Readback.ARGMAX, sampling=None,
             prompt: bool = False, pass_: Pass = MAIN, hmap=None) -> Any:
        """Run tokens[i] at positions[i] in slots[i]; return, for each index in
        out_rows, the greedy token (ARGMAX), the token drawn with sampling[j]
        (SAMPLE, see submit) or the logits row (LOGITS); SAMPLE | LOGITS
        returns (tokens, logits); NONE returns None. With HIDDEN added (an engine
        made with embeddings=True): (that, the final-normed hidden state of every
        row, an array of len(tokens) x n_embd)."""
        self.submit(tokens, positions, slots, out_rows, readback, sampling=sampling, prompt=prompt, pass_=pass_,
                    hmap=hmap)
        return self.collect()

    def submit(self, tokens, positions, slots, out_rows=(), readback: Readback = Readback.ARGMAX,
               chain: Sequence[int] | None = None, sampling=None, prompt: bool = False, pass_: Pass = MAIN,
               hmap=None, masked: bool = False, masks=None, rows: int | None = None,
               draft_rows: Sequence[tuple[int, int]] | None = None) -> None:
        """The first half of step(): check, write the params, start the step on
        the device and return at once, so that the caller's host work (a server
        delivering the previous step's text) overlaps the GPU's; collect()
        waits and returns the steps' readbacks in submission order.

        Up to max_in_flight steps may be in flight (none reading logits back),
        so the GPU goes from one to the next without waiting for the host.
        chain[i] = j makes row i's token the token chosen for output row j of
        the newest step in flight (tokens[i] is then ignored): the next decode
        step of running sequences can start before their tokens reach the host.

        SAMPLE (and SAMPLE | LOGITS, which also reads the logits back) draws
        each output row's token on the device: sampling[j] = (temperature,
        top_k, top_p, min_p, u) of output row j, as Sampler with the uniform u
        in [0, 1) (temperature 0: the greedy token; top_k in
        1..Kernels.SAMPLE_K). Its tokens can be chained like greedy ones.

        prompt=True: the rows are prompt tokens; where tiled_prompts, the step
        is padded to the tiled matmuls' rows (step_rows), so that each row's
        result does not depend on how the prompt was chunked. A caller that
        wants a sequence's tokens independent of what else runs keeps prompt
        rows and decode rows in separate steps (the server's runner does).

        pass_ (MTP, vkengine.serving.speculate): which forward the step runs; hmap:
        for an MTP pass, the hidden-state row each row reads. draft_rows: (row,
        i) pairs, row's token being the draft an MTP step left on the device at
        drafts[i] (Pass.drafts_at; tokens[row] is then ignored), so that a
        verify step can follow the MTP steps before their drafts reach the host.

        rows: the rows to run, pad rows included (default pad_rows'; a split
        model's parts all run the last part's choice).

        masked=True (constrained decoding; ARGMAX or SAMPLE, no LOGITS): each
        output row's tokens are chosen among those its mask allows (masks[j]:
        Kernels.mask_words(n_vocab) uint32 words, bit t of word t // 32 set:
        token t allowed; all ones: any). The step runs as two programs: its
        forward starts now; the masks and the choice follow when masks are given,
        here or by submit_masks() later, so that the host can compute a row's
        mask from the token the step before it chose (collected meanwhile)
        while the GPU runs this step's forward. Nothing else is submitted
        until they are."""
        tok, pos, slt, outs, mode, samp, chain_key = self.check_submit(
            tokens, positions, slots, out_rows, readback, chain, sampling, pass_, hmap, masked, draft_rows)
        n, n_out = len(tok), len(outs)
        n_req = n
        if not pass_.mtp:   # (the MTP block keeps KV rows only, in its own layer)
            self.kv.begin_step(pos, slt)   # a recurrent state checks and accounts for the rows
        n_run = self.pad_rows(n, n_out, mode, chain_key, pass_, prompt, pos, slt) if rows is None else rows
        if n_run > n:
            # pad rows: token 0 in the last row's slot at the positions after that
            # slot's last one in this step. Their KV rows lie past the sequence
            # (no row of this step reads them, a later step writes each before
            # reading it, and parking and prefix reuse take only rows the
            # sequence has), and their outputs are never read
            s = slt[-1]
            top = int(pos[slt == s].max())
            tok = np.concatenate([tok, np.zeros(n_run - n, np.int64)])
            pos = np.concatenate([pos, np.arange(top + 1, top + 1 + n_run - n, dtype=np.int64)])
            slt = np.concatenate([slt, np.full(n_run - n, s, np.int64)])
            n = n_run
        self.last_rows = n   # (the rows it runs: a split model's part hands on that many)
        buf = self._next_buf(pass_)
        if buf >= self.n_main:
            self._next_mtp = (self._next_mtp + 1) % self.mtp_depth
        else:
            self._next_params = (buf + 1) % self.n_main
        pl, prm = self.layout, self._params[buf].array()
        prm[pl.tokens:pl.tokens + n] = tok
        prm[pl.positions:pl.positions + n] = pos
        prm[pl.slots:pl.slots + n] = slt
        prm[pl.out_rows:pl.out_rows + n_out] = outs
        if hmap is not None:
            prm[pl.hmap:pl.hmap + n] = hmap
        if samp is not None:
            words = self._sampling_words(samp)
            prm[pl.sampling:pl.sampling + words.size] = words
        prog = self._program(n, n_out, mode, buf, chain_key, pass_, part="forward" if masked else "")
        prog.submit()
        self._inflight.append(_Submitted(prog, mode, n_out, buf, n_req, masked=masked))
        if masked and masks is not None:
            self.submit_masks(masks)

    def pad_rows(self, n: int, n_out: int, mode: Readback, chain_key: tuple[int, ...], pass_: Pass, prompt: bool,
                 pos: np.ndarray, slt: np.ndarray) -> int:
        """The rows a step of n rows runs (n, or more with pad rows: step_rows):
        a prompt step's where tiled_prompts, another's where no program of
        exactly n rows is recorded, and only where the pad rows' positions fit
        the context."""
        n_run = self.step_rows(n, prompt) if not chain_key else n
        tiled_prompt = prompt and self.tiled_prompts
        if n_run > n and (tiled_prompt or (n, n_out, mode, self._next_buf(pass_), chain_key, pass_)
                          not in self._programs):
            top = int(pos[slt == slt[-1]].max())
            if top + (n_run - n) < self.n_ctx:
                return n_run
        return n

    def check_submit(self, tokens, positions, slots, out_rows, readback: Readback, chain, sampling, pass_: Pass,
                     hmap, masked: bool, draft_rows: Sequence[tuple[int, int]] | None = None) -> tuple:
        """Every check submit makes before it changes anything (a split model's
        last part is asked before its other parts run): the rows as arrays
        (tokens, positions, slots, out_rows), the readback mode, the sampling
        rows and the chain."""
        if not self.has_room(pass_):
            ring = self._on_mtp_ring(pass_)
            raise RuntimeError(f"{self.mtp_depth if ring else self.max_in_flight} {'MTP ' if ring else ''}steps are "
                               "already in flight: collect() one first")
        if self._inflight and self._inflight[-1].masked and self._inflight[-1].pick is None:
            raise RuntimeError("the masked step in flight needs its masks first (submit_masks)")
        if readback & ~Readback.HIDDEN not in _READBACKS:
            raise ValueError(f"unknown readback {readback!r}")
        if readback & Readback.HIDDEN and self.hidden_host is None:
            raise VkEngineError("hidden states are read back only by an engine made with embeddings=True")
        alone = Readback.LOGITS | Readback.HIDDEN
        if self._inflight and (self._inflight[-1].readback & alone or readback & alone):
            raise RuntimeError("a step that reads logits or hidden states back runs alone: collect() the step "
                               "in flight first")
        n, n_out = len(tokens), len(out_rows)
        if not 0 < n <= self.max_batch:
            raise VkEngineError(f"a step takes 1..{self.max_batch} tokens, got {n}")
        if n_out > self.max_out:
            raise VkEngineError(f"a step produces at most {self.max_out} logit rows, asked for {n_out}")
        if n_out and not self.args.last_part:
            raise ValueError("only the last part of a split model produces output rows")
        if len(positions) != n or len(slots) != n:
            raise ValueError("tokens, positions and slots differ in length")
        self._check_hmap(pass_, hmap, n)
        tok = np.asarray(tokens, np.int64)
        pos = np.asarray(positions, np.int64)
        slt = np.asarray(slots, np.int64)
        chain_key: tuple[int, ...] = ()
        if chain is not None:
            prev = self._inflight[-1] if self._inflight else None
            if prev is None or prev.readback not in (Readback.ARGMAX, Readback.SAMPLE):
                raise RuntimeError("a chained step needs a step in flight that reads its tokens back")
            chain_key = tuple(int(j) for j in chain)
            if len(chain_key) != n or min(chain_key) < 0 or max(chain_key) >= prev.n_out:
                raise ValueError(f"chain must give, for each of the {n} rows, an output row of the step in flight")
            tok = np.zeros(n, np.int64)
        if draft_rows:
            if chain is not None:
                raise ValueError("a step takes its tokens from a step in flight (chain) or from drafts, not both")
            dw = self.layout.draft_words
            key = [-1] * n
            for row, i in draft_rows:
                if not (0 <= row < n and 0 <= i < dw) or key[row] >= 0:
                    raise ValueError(f"draft_rows: distinct rows in 0..{n - 1}, draft words in 0..{dw - 1}")
                key[row] = _DRAFTS + int(i)
                tok[row] = 0
            chain_key = tuple(key)
        if pass_.drafts_at >= 0 and (not pass_.mtp or pass_.drafts_at + len(out_rows) > self.layout.draft_words):
            raise ValueError("drafts_at: an MTP step's tokens within the device's draft words")
        if tok.min() < 0 or tok.max() >= self.n_vocab:
            raise VkEngineError(f"token id out of range 0..{self.n_vocab - 1}")
        if pos.min() < 0 or pos.max() >= self.n_ctx:
            raise VkEngineError(f"position {int(pos.max())} is beyond the context length {self.n_ctx}")
        if slt.min() < 0 or slt.max() >= self.n_slots:
            raise VkEngineError(f"slot out of range 0..{self.n_slots - 1}")
        outs = np.asarray(out_rows, np.int64)
        if n_out and (outs.min() < 0 or outs.max() >= n):
            raise ValueError("output row out of range")
        mode = (readback if n_out else Readback.NONE) | (readback & Readback.HIDDEN)
        if masked and (not mode.tokens or mode & Readback.LOGITS):
            raise ValueError("a masked step chooses its rows' tokens on the device: ARGMAX or SAMPLE, without LOGITS")
        samp = None
        if mode & Readback.SAMPLE:
            if not self.can_sample:
                raise VkEngineError(f"this device cannot sample rows of {self.n_vocab} logits")
            samp = np.asarray(sampling, np.float64) if sampling is not None else None
            if samp is None or samp.shape != (n_out, 5):
                raise ValueError("sampling needs (temperature, top_k, top_p, min_p, u) for each output row")
            k = samp[:, 1]
            if not (np.isfinite(samp).all() and (k == np.round(k)).all() and (k >= 1).all()
                    and (k <= Kernels.SAMPLE_K).all() and (samp[:, 4] >= 0).all() and (samp[:, 4] < 1).all()):
                raise ValueError(f"sampling: finite values, top_k in 1..{Kernels.SAMPLE_K}, u in [0, 1)")
        return tok, pos, slt, outs, mode, samp, chain_key

    def submit_masks(self, masks) -> None:
        """The token masks of the masked step in flight (the newest): its tokens
        are chosen once its forward is done (see submit)."""
        sub = self._inflight[-1] if self._inflight else None
        if sub is None or not sub.masked or sub.pick is not None:
            raise RuntimeError("no masked step in flight waits for its masks")
        pl = self.layout
        arr = np.asarray(masks)
        if arr.shape != (sub.n_out, pl.mask_words) or arr.dtype.kind not in "iu" or arr.dtype.itemsize != 4:
            raise ValueError(f"masks: {sub.n_out} rows of {pl.mask_words} 32-bit words")
        prm = self._params[sub.params].array()
        prm[pl.masks:pl.masks + arr.size] = arr.view(np.uint32).reshape(-1)
        prm[pl.argmax:pl.argmax + sub.n_out] = _NO_TOKEN    # (poll_picks: replaced by the tokens chosen)
        pick = self._program(0, sub.n_out, sub.readback, sub.params, part="pick")
        pick.submit()
        self._inflight[-1] = sub._replace(pick=pick)

    def collect(self) -> Any:
        """Wait for the oldest step in flight; its readback as step() returns it."""
        if not self._inflight:
            raise RuntimeError("no step in flight")
        if self._inflight[0].masked and self._inflight[0].pick is None:
            raise RuntimeError("the masked step's masks were never given (submit_masks)")
        prog, mode, n_out, buf, n, pick, _ = self._inflight.popleft()
        prog.wait()
        pl, prm = self.layout, self._params[buf].array()
        if pick is not None:
            if self.poll_picks:
                self._poll_tokens(prm[pl.argmax:pl.argmax + n_out])
            pick.wait()
        tokens = prm[pl.argmax:pl.argmax + n_out].astype(np.int64) if mode.tokens else None
        out: Any = tokens
        if mode & Readback.LOGITS:
            V = self.n_vocab
            lg = self.logits_host.array(np.float32)[: n_out * V].reshape(n_out, V).copy()
            out = (tokens, lg) if tokens is not None else lg
        if mode & Readback.HIDDEN:   # (what the step returns without it, its rows' hidden states)
            assert self.hidden_host is not None
            st = self.scratch.stride("emb")
            hid = self.hidden_host.array(np.float32)[: n * st].reshape(n, st)[:, : self.args.n_embd].copy()
            return out, hid
        return out

    @staticmethod
    def _poll_tokens(words, limit_s: float = 0.05) -> None:
        """Spin until every word has left _NO_TOKEN (the pick has written its
        tokens to host memory) or limit_s has passed; the fence wait follows
        either way. The GIL is let go every few hundred reads."""
        t_end = time.perf_counter() + limit_s
        while True:
            for _ in range(256):
                if (words != _NO_TOKEN).all():
                    return
            if time.perf_counter() > t_end:
                return
            time.sleep(0)

    def prefill(self, tokens, slot: int, start: int = 0, readback: Readback = Readback.ARGMAX, sampling=None):
        """Run a prompt through a slot in chunks of max_batch; returns the last
        token's readback (sampling: its row, for readback SAMPLE)."""
        tokens = list(tokens)
        if not tokens:
            raise VkEngineError("empty prompt")
        if start + len(tokens) > self.n_ctx:
            raise VkEngineError(f"prompt of {len(tokens)} tokens (from position {start}) does not fit the "
                                f"context length {self.n_ctx}")
        if self.in_flight:
            raise RuntimeError("prefill runs alone: collect() the steps in flight first")
        # chunks submitted up to max_in_flight ahead (none read back until the last), so the device goes from
        # one to the next without waiting for the host; a split model's first parts run the next chunk
        # while its last part runs this one
        for c in range(0, len(tokens), self.max_batch):
            chunk = tokens[c:c + self.max_batch]
            last = c + len(chunk) == len(tokens)
            mode = readback if last else Readback.NONE
            while self.in_flight and (self.in_flight >= self.max_in_flight
                                      or mode & (Readback.LOGITS | Readback.HIDDEN)):   # (those run alone)
                self.collect()
            self.submit(chunk, range(start + c, start + c + len(chunk)), [slot] * len(chunk),
                        [len(chunk) - 1] if last else (), mode, sampling=sampling if last else None, prompt=True)
        while self.in_flight > 1:
            self.collect()
        out = self.collect()
        return out[0] if out is not None else None

    def drop_programs(self) -> None:
        """Forget every recorded step (after the steps in flight), so the next
        steps record again: bench --ablate records them without some ops."""
        while self.in_flight:
            self.collect()
        self._programs.clear()
        self._provisional.clear()

    def close(self) -> None:
        """Wait for the steps in flight, then free the recorded steps and every
        buffer this engine and its kernels allocated (their pipelines with
        them); the engine is unusable after. Parking buffers a server's runner
        holds are its own (it frees them)."""
        while self._inflight:
            sub = self._inflight.popleft()
            sub.program.wait()
            if sub.pick is not None:
                sub.pick.wait()
        self._programs.clear()
        self._provisional.clear()
        dev = self.device
        dev.cancel_fill(getattr(self.weights, "arena", None))   # (weights never uploaded: nothing ran)
        for b in [*self._own, *self.kernels.scratch_buffers()]:
            if b in dev.buffers and not dev.owns(b):
                dev.free(b)
        self._own = []
