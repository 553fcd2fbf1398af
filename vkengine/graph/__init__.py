"""Named ops over the engine's buffers, recorded into one Program.

A model's forward function (vkengine/models/<arch>.py) is written against
Graph: `g.rms_norm("x", w, "h")`, `g.matmul(w, "h", "qkv")`, ... Activations are
named scratch arrays of shape (rows, width); rows are the batch's tokens (or, for
the `out_*` arrays, the rows whose logits are wanted). The Graph knows where the
params buffer keeps token ids, positions, slots and output rows; models know
nothing of buffers, offsets or kp. Ops by family: dense.py (attention layers,
norms, FFN, head), recurrent.py (Gated DeltaNet), moe.py (experts).
"""
from __future__ import annotations

from .core import ParamsLayout, Scratch
from .dense import DenseOps
from .moe import MoeOps
from .recurrent import RecurrentOps

__all__ = ["Graph", "ParamsLayout", "Scratch"]


class Graph(DenseOps, RecurrentOps, MoeOps):
    """Every named op, over one step's buffers (GraphBase)."""
