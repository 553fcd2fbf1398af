"""The architecture interface: everything the engine asks of a model family.

Adding an architecture means adding one module (or package) under
vkengine/models/ that defines a subclass of Architecture and an instance of it
named ARCHITECTURE; vkengine/models/__init__.py finds it by the GGUF
`general.architecture` values in `names` (or a Hugging Face config's
`architectures[0]` in `hf_architectures`). llama.py is the shortest example.

An architecture provides:
- args(file): its hyperparameters (a ModelArgs subclass) from GGUF metadata or
  a Hugging Face config.json;
- hf_names: Hugging Face tensor names -> GGUF names (data), applied when a
  safetensors folder is opened, so loaders see GGUF names only;
- scratch_widths(args): the activation arrays its forward uses, by name;
- load_weights(file, args, device, n_ctx): its weights on the device, kept
  quantized (vkengine/models/loader.py does the planning and uploads);
- forward(g, args, weights): one step as named graph ops (vkengine/graph);
- the per-sequence state: a KV cache of every layer (make_state,
  state_bytes) unless it overrides them (qwen35: recurrent state too);
- optionally a multi-token-prediction block (has_mtp, forward_mtp) and
  recorded expert choices (read_expert_choices).
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeVar

from ..errors import VkEngineError
from ..gguf_file import ModelFile
from ..kernels import KVTypes, Region
from ..state import KVCache

if TYPE_CHECKING:
    import numpy as np

    from ..device import Device
    from ..engine import Engine
    from ..graph import Graph


@dataclass(frozen=True)
class Part:
    """The layers [start, stop) of a model's n_layer that one device holds when
    the model is split across devices (--devices; llama.cpp's -sm layer): the
    first part embeds the tokens, the last holds the final norm, the output
    head and any multi-token-prediction block; the residual stream crosses
    from each part to the next (Engine's handoff)."""
    start: int
    stop: int
    n_layer: int

    @property
    def first(self) -> bool:
        return self.start == 0

    @property
    def last(self) -> bool:
        return self.stop == self.n_layer

    def owns(self, layer: int) -> bool:
        """Whether this part holds a layer (an index >= n_layer: the MTP block's, the last part's)."""
        return self.start <= layer < self.stop or (self.last and layer >= self.n_layer)


@dataclass(frozen=True, kw_only=True)
class ModelArgs:
    """Hyperparameters every architecture has; an architecture's Args adds its own."""
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    n_expert: int = 0             # routed experts per MoE layer (0: dense)
    n_nextn: int = 0              # multi-token-prediction blocks in the file
    # run-time choices, set at the edge (CLI) with dataclasses.replace
    fixed_experts: bool = False   # MoE parity mode: fixed-order fp32 router, choices recorded
    mtp_snap_rows: int = 0        # rows of a speculative step that can be rolled back to (MTP: drafts + 1)
    part: Part | None = None      # the layers one device holds of a model split across devices (None: all)

    def owns(self, layer: int) -> bool:
        """Whether this device holds a layer (all of them unless the model is split)."""
        return self.part is None or self.part.owns(layer)

    @property
    def first_part(self) -> bool:
        """Whether this device embeds the tokens (the first part, or the whole model)."""
        return self.part is None or self.part.first

    @property
    def last_part(self) -> bool:
        """Whether this device holds the output head (the last part, or the whole model)."""
        return self.part is None or self.part.last

    @property
    def part_layers(self) -> range:
        """The main layers this device runs, in order."""
        return range(self.part.start, self.part.stop) if self.part is not None else range(self.n_layer)

    @property
    def n_kv_heads(self) -> int:
        return self.n_head_kv

    @property
    def kv_layers(self) -> list[int]:
        """The layers whose KV rows the per-sequence state keeps."""
        return [i for i in range(self.n_layer) if self.owns(i)]

    @property
    def ring_layers(self) -> list[int]:
        """The layers whose KV rows may live in rings of ring_window positions (SlidingWindowArgs)."""
        return []

    @property
    def ring_window(self) -> int:
        return 0

    def check(self, what: str) -> None:
        """Sizes a corrupt file could make zero or negative."""
        for name in ("n_vocab", "n_embd", "n_layer", "n_head", "head_dim"):
            v = getattr(self, name)
            if not v > 0:
                raise VkEngineError(f"{what}: invalid model metadata: {name} is {v}")


@dataclass(frozen=True, kw_only=True)
class SlidingWindowArgs(ModelArgs):
    """Models with sliding-window layers (Gemma, gpt-oss): each such layer
    attends to its last `window` positions, and its KV rows live in a ring
    (Architecture.make_state)."""
    window: int = 0                   # (0: none)
    swa: tuple[bool, ...] = ()        # per layer: a sliding-window layer

    @property
    def ring_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.swa) if s and self.owns(i)] if self.window else []

    @property
    def ring_window(self) -> int:
        return self.window


L = TypeVar("L")


class PartLayers(Generic[L]):
    """An architecture's weights whose `layers` hold None where another part of
    a split model (ModelArgs.part) holds the layer."""
    layers: list[L | None]

    def layer(self, i: int) -> L:
        layer = self.layers[i]
        assert layer is not None, f"layer {i} is held by another part"
        return layer


class ModelWeights(Protocol):
    """What the engine reads of an architecture's weights."""
    rope: Region          # the RoPE table (cos/sin per position and rotated pair)


class Architecture(ABC):
    names: ClassVar[tuple[str, ...]] = ()             # GGUF general.architecture values it serves
    hf_architectures: ClassVar[tuple[str, ...]] = ()  # Hugging Face config.json "architectures"
    hf_names: ClassVar[dict[str, str]] = {}           # HF tensor-name pattern -> GGUF name
    # whether its graph and loader take a Part (ModelArgs.part: a model split across devices), and the
    # activation arrays a part hands the next (the residual stream; llama's also the next layer's norm)
    splittable: ClassVar[bool] = False
    handoff: ClassVar[tuple[str, ...]] = ("x",)

    def __init__(self) -> None:
        self._hf_re = [(re.compile(k + "$"), v) for k, v in self.hf_names.items()]

    def hf_to_gguf_name(self, name: str) -> str | None:
        """The GGUF name of a Hugging Face tensor (None: not one this architecture uses)."""
        for pat, repl in self._hf_re:
            if pat.match(name):
                return pat.sub(repl, name)
        return None

    def holds_tensor(self, a: ModelArgs, name: str) -> bool:
        """Whether the device of a's part loads tensor `name` (a GGUF name): a
        block's tensors where the part owns the block, the token embedding on
        the first part (and on the last where the output head reuses it), the
        rest on the last part. (What the engine's memory check counts.)"""
        m = re.match(r"blk\.(\d+)\.", name)
        if m:
            return a.owns(int(m.group(1)))
        if name == "token_embd.weight":
            return a.first_part or a.last_part
        return a.last_part or name.startswith("rope_")

    @abstractmethod
    def args(self, mf: ModelFile) -> ModelArgs:
        """Hyperparameters from a GGUF file or a Hugging Face folder (mf.config)."""

    @abstractmethod
    def scratch_widths(self, a: Any) -> dict[str, int]:
        """Activation arrays of a step, by name: their width (floats a row);
        names starting with `out_` hold output rows only."""

    @abstractmethod
    def load_weights(self, mf: ModelFile, a: Any, device: Device, n_ctx: int) -> ModelWeights:
        """Every weight on the device (matrices kept quantized)."""

    @abstractmethod
    def forward(self, g: Graph, a: Any, w: Any, hidden_rows: bool = False) -> None:
        """Record one step: g.n token rows through every layer; logits of the g.n_out
        requested rows into out_logits. hidden_rows (MTP models): also the
        final-normed hidden state of every row into `hn`."""

    def final_norm(self, g: Graph, a: Any, w: Any, out: str) -> None:
        """After forward: every row's final-normed hidden state (what the output
        matrix reads; embeddings pool it) into `out`, n_embd wide."""
        g.rms_norm("x", w.out_norm, out)

    # -- per-sequence state ------------------------------------------------------------
    def make_state(self, device: Device, a: Any, n_slots: int, n_ctx: int,
                   kv_types: KVTypes = KVTypes(), max_step: int = 0) -> KVCache:
        """The per-sequence state of n_slots sequences of n_ctx positions, the KV
        cache of the types given (EngineConfig.kv_types); max_step: the most rows
        a step takes (bounded caches of sliding-window layers size by it)."""
        rings = a.ring_layers if max_step else []
        return KVCache(device, a.n_layer, n_slots, n_ctx, a.n_kv_heads, a.head_dim, layers=a.kv_layers,
                       types=kv_types, rings=rings or None, window=a.ring_window, max_step=max_step)

    def state_bytes(self, a: Any, n_slots: int, n_ctx: int, kv_types: KVTypes = KVTypes(),
                    max_step: int = 0) -> tuple[int, int]:
        """(bytes per position of one slot, bytes fixed per slot) of make_state's
        state: the ring layers' rows are fixed (where their ring is shorter than
        the context), the others' a position each (plus a q8_0 slot's rounding)."""
        cap = KVCache.capacity(n_ctx, kv_types)
        ring = KVCache.ring_capacity(a.ring_window, max_step, n_ctx, kv_types) if max_step else cap
        n_ring = len(a.ring_layers) if ring < cap else 0
        n_full = len(a.kv_layers) - n_ring
        pos = KVCache.position_bytes(1, a.n_kv_heads, a.head_dim, kv_types)
        return n_full * pos, (n_full * (cap - n_ctx) + n_ring * ring) * pos

    def hands_norm(self, g: Graph, a: Any, w: Any) -> bool:
        """A part of a split model before the last: whether its last layer hands
        the next part h' with the sums of squares (the norm split with the next
        layer's readers, Graph.residual_norm) rather than h itself; g: a step's
        rows, for the choice only (nothing is recorded)."""
        return False

    # -- optional abilities ------------------------------------------------------------------
    def has_mtp(self, a: Any, w: Any) -> bool:
        """Whether the model has a multi-token-prediction block to draft with."""
        return False

    def forward_mtp(self, g: Graph, a: Any, w: Any, hidden: str, map_off: int, zero_first: bool) -> None:
        raise VkEngineError(f"{type(self).__name__} has no multi-token-prediction block")

    def read_expert_choices(self, engine: Engine, n_rows: int, mtp: bool = False) -> np.ndarray:
        raise VkEngineError("expert choices are recorded only in the fixed-expert mode of a MoE model")
