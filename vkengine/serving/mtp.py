"""Speculative decoding with a model's own multi-token-prediction (MTP) block
(Qwen3.5's `nextn.*` tensors), greedy: the output is the plain greedy output,
produced in fewer main-model steps when drafts are accepted.

One round, with token t_p sampled at position p but not yet run:
  1. draft: the MTP block at p takes t_p and the main model's final-normed
     hidden state h_{p-1} and predicts d_1 (for p+1); further drafts chain the
     MTP block on its own hidden state (llama.cpp common/speculative.cpp, MTP);
  2. verify: one main-model step over [t_p, d_1 .. d_k] at p .. p+k gives the
     greedy tokens g_0 .. g_k; the drafts are accepted while d_{i+1} == g_i;
  3. roll back: that step kept the linear layers' state after each of its
     rows (snapshots, vkengine/state.py HybridState); the slot is set back to
     the state after the last accepted row (the KV rows beyond it are simply
     overwritten later);
  4. catch up: the MTP block runs over the accepted positions with the verify
     step's hidden states (its own KV cache then matches what the main model
     accepted) and its last row is the next round's first draft.
The MTP block's KV entry at position 0 pairs t_0 with a zero hidden state, as
llama.cpp does. Output equality with plain greedy decoding relies on a batched
step computing each row as a one-row step would (tests/test_mtp_qwen35.py).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine import Engine, Pass, Readback
from ..errors import VkEngineError
from ..state import HybridState
from .generate import GenStats, Step
from .output import OutputStream


@dataclass
class MtpStats(GenStats):
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class MtpRunner:
    """The steps of MTP speculative decoding, as the engine's own steps: main
    steps that keep every row's hidden state (and snapshots), and steps of the
    MTP block."""

    def __init__(self, engine: Engine):
        if not engine.arch.has_mtp(engine.args, engine.weights):
            raise VkEngineError(f"{engine.model.name} has no MTP block (nextn tensors): --mtp needs one")
        self.e = engine
        self.max_draft = engine.kv.snap_rows - 1
        if self.max_draft < 1:
            raise VkEngineError("the engine's state keeps no snapshot rows for speculative steps: create it from "
                                "model args with mtp_snap_rows = drafts + 1 (the CLI's --mtp does)")
        z = engine.scratch.region("mtp_zero")     # the zero hidden state of position 0
        engine.device.upload(z.buf, np.zeros(engine.scratch.widths["mtp_zero"], np.float32), z.off * 4)

    def main(self, tokens, start: int, slot: int, out_rows, snapshots: bool = False) -> np.ndarray:
        """Main-model step over tokens at start.. in slot, keeping every row's
        final-normed hidden state (and, with snapshots, its recurrent state)."""
        n = len(tokens)
        if snapshots and n > self.e.kv.snap_rows:
            raise VkEngineError(f"a verify step of {n} rows exceeds the {self.e.kv.snap_rows} snapshot rows")
        return self.e.step(tokens, range(start, start + n), [slot] * n, out_rows, Readback.ARGMAX,
                           pass_=Pass(hidden_rows=True, snapshots=snapshots))

    def mtp(self, tokens, start: int, slot: int, hidden: str, hmap, out_rows, zero_first: bool = False,
            readback: Readback = Readback.ARGMAX) -> np.ndarray:
        """MTP block over tokens at start.., row r reading hidden[hmap[r]] (from
        `hn` of the last main step or `mtp_hn` of the last MTP step); returns the
        greedy token (or, readback LOGITS, the logits) of each out row."""
        n = len(tokens)
        return self.e.step(tokens, range(start, start + n), [slot] * n, out_rows, readback,
                           pass_=Pass(mtp=True, hidden=hidden, zero_first=zero_first), hmap=list(hmap))


def generate_mtp(runner: MtpRunner, prompt: Sequence[int], max_tokens: int = 128, n_draft: int = 1,
                 stop: Sequence[str] = (), slot: int = 0, ignore_eos: bool = False, stats: MtpStats | None = None,
                 drafter: Callable[[list[int], list[int]], list[int]] | None = None) -> Iterator[Step]:
    """Greedy generation with MTP drafts, yielding the same Steps as
    vkengine.generate.generate with greedy sampling. `drafter(history, drafts)`
    may replace the MTP's drafts (tests: forced acceptances and rejections)."""
    e = runner.e
    prompt = [int(t) for t in prompt]
    if not prompt:
        raise VkEngineError("the prompt is empty")
    if len(prompt) >= e.n_ctx:
        raise VkEngineError(f"the prompt has {len(prompt)} tokens; the context length is {e.n_ctx} "
                            "(use a shorter prompt or a larger --ctx)")
    if not 1 <= n_draft <= runner.max_draft:
        raise VkEngineError(f"--draft must be 1..{runner.max_draft} (snapshot rows of the state)")
    out = OutputStream(e.model.tokenizer, max_tokens, stop, ignore_eos)
    st = stats if stats is not None else MtpStats()
    st.prompt_tokens = len(prompt)
    if max_tokens == 0:
        return
    P = len(prompt)
    t0 = time.perf_counter()
    # prefill in chunks; after each, the MTP block catches up on the chunk's positions
    chunk = e.max_batch - 1
    tok = None
    drafts: list[int] = []
    last_mtp_row = 0
    for c0 in range(0, P, chunk):
        c1 = min(P, c0 + chunk)
        last = c1 == P
        g = runner.main(prompt[c0:c1], c0, slot, [c1 - c0 - 1] if last else [])
        if last:
            tok = int(g[0])
        seq = prompt + [tok] if last else prompt
        first = 0 if c0 == 0 else c0 + 1
        positions = list(range(first, min(c1, e.n_ctx - 1) + 1)) if last else list(range(first, c1 + 1))
        hmap = [max(q - 1 - c0, 0) for q in positions]
        d = runner.mtp([seq[q] for q in positions], first, slot, "hn", hmap, [len(positions) - 1] if last else [],
                       zero_first=c0 == 0)
        if last:
            drafts, last_mtp_row = [int(d[0])], len(positions) - 1
    st.prefill_s = time.perf_counter() - t0
    assert tok is not None and isinstance(e.kv, HybridState)
    history = prompt + [tok]
    p = P                                   # position of the pending token `tok`
    t1 = time.perf_counter()
    emitted = [tok]
    while True:
        for i, t in enumerate(emitted):     # account for this round's tokens, in order
            st.generated += 1
            text, finish = out.push(t)
            if finish is None and p - len(emitted) + 1 + i >= e.n_ctx:
                text += out.truncated()
                finish = "length"
            yield Step(t, text, finish)
            if finish is not None:
                st.decode_s = time.perf_counter() - t1
                return
        k = min(n_draft, e.n_ctx - 1 - p)
        drafts = drafts[:k]
        while len(drafts) < k:              # chain the MTP block on its own hidden state
            d = runner.mtp([drafts[-1]], p + len(drafts), slot, "mtp_hn", [last_mtp_row], [0])
            drafts.append(int(d[0]))
            last_mtp_row = 0
        if drafter is not None:
            drafts = [int(x) for x in drafter(list(history), list(drafts))][:k]
            k = len(drafts)
        g = runner.main([tok] + drafts, p, slot, list(range(k + 1)), snapshots=True)
        st.verify_steps += 1
        n_acc = 0
        while n_acc < k and drafts[n_acc] == g[n_acc]:
            n_acc += 1
        st.drafted += k
        st.accepted += n_acc
        if n_acc < k:
            e.kv.commit_snapshot(slot, n_acc, p + n_acc + 1)
        emitted = [int(x) for x in g[:n_acc + 1]]
        history += emitted
        # the MTP block catches up on the accepted positions; its last row drafts the next round
        positions = [q for q in range(p + 1, p + n_acc + 2) if q < e.n_ctx]
        if positions:
            d = runner.mtp(emitted[:len(positions)], p + 1, slot, "hn", list(range(len(positions))),
                           [len(positions) - 1])
            drafts, last_mtp_row = [int(d[0])], len(positions) - 1
        else:
            drafts = []
        p += n_acc + 1                      # this round's tokens sit at p - n_acc .. p
        tok = emitted[-1]
