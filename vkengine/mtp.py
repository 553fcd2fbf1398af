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
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from .engine import Engine
from .errors import VkEngineError
from .generate import GenStats, OutputStream, Step
from .graph import ParamsLayout


@dataclass(frozen=True)
class MtpLayout(ParamsLayout):
    """The engine's params layout plus, per row, the row of the hidden-state
    array that the MTP block reads."""

    @property
    def hmap(self) -> int:
        return self.argmax + self.max_out

    @property
    def words(self) -> int:
        return self.hmap + self.max_rows


@dataclass
class MtpStats(GenStats):
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class MtpRunner:
    """Records and runs the steps of MTP speculative decoding on an engine's
    buffers: main steps that keep hidden states (and snapshots), MTP steps."""

    def __init__(self, engine: Engine):
        a = engine.args
        if not getattr(a, "n_nextn", 0) or getattr(engine.weights, "mtp", None) is None:
            raise VkEngineError(f"{engine.model.name} has no MTP block (nextn tensors): --mtp needs one")
        self.e = engine
        self.dev = engine.device
        self.max_draft = engine.kv.snap_rows - 1
        if self.max_draft < 1:
            raise VkEngineError("the engine's state keeps no snapshot rows for speculative steps: create it from "
                                "model args with mtp_snap_rows = drafts + 1 (the CLI's --mtp does)")
        self.layout = MtpLayout(engine.max_batch, engine.max_out)
        self.params = self.dev.buffer(self.layout.words * 4, "host", "mtp-params")
        self.params_dev = self.dev.buffer(self.layout.words * 4, "device", "mtp-params-dev")
        z = engine.scratch.region("mtp_zero")     # the zero hidden state of position 0
        self.dev.upload(z.buf, np.zeros(engine.scratch.widths["mtp_zero"], np.float32), z.off * 4)
        self._programs: dict[tuple, object] = {}

    def _record(self, key):
        kind, n, n_out, hidden, zero_first, snap, readback = key
        e, pl = self.e, self.layout
        prog = self.dev.program()
        prog.copy(self.params, self.params_dev, 0, 0, pl.words * 4, "params")
        g = e.arch.GRAPH(e.kernels, prog, e.scratch, self.params_dev, pl, e.kv, n, n_out, e.weights.rope,
                         e.args.rms_eps, snap_rows=n if snap else 0)
        if kind == "main":
            e.arch.forward(g, e.args, e.weights, hidden_rows=True)
        else:
            e.arch.forward_mtp(g, e.args, e.weights, hidden, pl.hmap, zero_first)
        if n_out and readback == "logits":
            r, stride, V = e.scratch.region("out_logits"), e.scratch.stride("out_logits"), e.args.n_vocab
            for i in range(n_out):
                prog.copy(r.buf, e.logits_host, (r.off + i * stride) * 4, i * V * 4, V * 4, "logits")
        elif n_out:
            g.argmax("out_logits")
            prog.copy(self.params_dev, self.params, pl.argmax * 4, pl.argmax * 4, n_out * 4, "argmax")
        return prog

    def _run(self, key, tokens, positions, slot: int, out_rows, hmap=None) -> np.ndarray:
        n, n_out = len(tokens), len(out_rows)
        if not 0 < n <= self.e.max_batch or n_out > self.e.max_out:
            raise VkEngineError(f"a speculative step of {n} rows does not fit this engine")
        pl, prm = self.layout, self.params.array()
        prm[pl.tokens:pl.tokens + n] = tokens
        prm[pl.positions:pl.positions + n] = positions
        prm[pl.slots:pl.slots + n] = slot
        prm[pl.out_rows:pl.out_rows + n_out] = out_rows
        if hmap is not None:
            prm[pl.hmap:pl.hmap + n] = hmap
        prog = self._programs.get(key)
        if prog is None:
            prog = self._programs[key] = self._record(key)
        prog.run()
        if key[-1] == "logits":
            V = self.e.args.n_vocab
            return self.e.logits_host.array(np.float32)[: n_out * V].reshape(n_out, V).copy()
        return prm[pl.argmax:pl.argmax + n_out].astype(np.int64)

    def main(self, tokens, start: int, slot: int, out_rows, snapshots: bool = False) -> np.ndarray:
        """Main-model step over tokens at start.. in slot, keeping every row's
        final-normed hidden state (and, with snapshots, its recurrent state)."""
        n = len(tokens)
        positions = np.arange(start, start + n)
        if snapshots and n > self.e.kv.snap_rows:
            raise VkEngineError(f"a verify step of {n} rows exceeds the {self.e.kv.snap_rows} snapshot rows")
        self.e.kv.begin_step(positions, np.full(n, slot))
        return self._run(("main", n, len(out_rows), "", False, snapshots, "argmax"), tokens, positions, slot,
                         out_rows)

    def mtp(self, tokens, start: int, slot: int, hidden: str, hmap, out_rows, zero_first: bool = False,
            readback: str = "argmax") -> np.ndarray:
        """MTP block over tokens at start.., row r reading hidden[hmap[r]] (from
        `hn` of the last main step or `mtp_hn` of the last MTP step); returns the
        greedy token (or, readback="logits", the logits) of each out row."""
        n = len(tokens)
        key = ("mtp", n, len(out_rows), hidden, zero_first, False, readback)
        return self._run(key, tokens, np.arange(start, start + n), slot, out_rows, hmap)


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
