"""Recording the experts a MoE model chose, step by step (parity mode).

With the fixed-expert mode (`--fixed-experts`: ModelArgs.fixed_experts) the
router computes its logits in one fixed fp32 order and breaks ties by the lower
expert index (shaders/moe_router.comp), so the choice does not depend on the
device or the batch; every step also stores the chosen ids. RecordingEngine
reads them back after each step and appends one JSON line per row:
  {"slot": s, "pos": p, "token": t, "experts": [[e0, e1, ...] per MoE layer]}
which a parity harness can compare with another implementation's routing.
"""
from __future__ import annotations

import json
from typing import TextIO

from ..engine import MAIN, Engine, Pass, Readback


class RecordingEngine(Engine):
    @property
    def can_chain(self) -> bool:
        return False     # one step at a time: each collect() reads that step's choices

    def __init__(self, *args, log: TextIO, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = log
        self.max_in_flight = 1   # (so Engine.prefill collects each chunk before the next)

    def submit(self, tokens, positions, slots, out_rows=(), readback: Readback = Readback.ARGMAX,
               chain=None, sampling=None, prompt: bool = False, pass_: Pass = MAIN, hmap=None, masked: bool = False,
               masks=None, rows: int | None = None, draft_rows=None) -> None:
        if self.in_flight:   # the next step would overwrite the choices before they are read
            raise RuntimeError("the expert log records one step at a time: collect() the step in flight first")
        super().submit(tokens, positions, slots, out_rows, readback, chain=chain, sampling=sampling, prompt=prompt,
                       pass_=pass_, hmap=hmap, masked=masked, masks=masks, rows=rows, draft_rows=draft_rows)
        self._rows = (list(tokens), list(positions), list(slots))

    def collect(self):
        out = super().collect()
        tokens, positions, slots = self._rows
        choices = self.arch.read_expert_choices(self, len(tokens))
        for t, p, s, c in zip(tokens, positions, slots, choices):
            self.log.write(json.dumps({"slot": int(s), "pos": int(p), "token": int(t),
                                       "experts": c.astype(int).tolist()}) + "\n")
        self.log.flush()
        return out
