"""Generation of one sequence: `generate()` is the iterator that the CLI, the
parity harness and tests consume, a request run through the same Runner as the
server's (so the same pipeline: prompt chunks, chained decode steps, tokens
drawn on the device where they can be).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from ..engine import Engine
from ..errors import VkEngineError
from .runner import Event, GenRequest, Runner
from .sampling import SamplingParams
from .scheduler import SchedulerConfig


@dataclass
class Step:
    token: int
    text: str                 # text that became final with this token (may be "")
    finish: str | None        # None, "stop" (EOS or stop string), "length" (max tokens or context)
    logits: np.ndarray | None = None   # the row the token was chosen from (generate(logits=True))


@dataclass
class GenStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    drafted: int = 0          # with mtp_draft: drafts the model verified
    accepted: int = 0         # ... and accepted
    verify_steps: int = 0     # ... in this many steps of the model

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first token comes from the prefill; decode steps produce the rest
        return (self.generated - 1) / self.decode_s if self.decode_s and self.generated > 1 else 0.0


def generate(engine: Engine, prompt: Sequence[int], max_tokens: int = 128,
             sampling: SamplingParams = SamplingParams(), stop: Sequence[str] = (), slot: int = 0,
             ignore_eos: bool = False, stats: GenStats | None = None, suppress: Sequence[int] = (),
             logits: bool = False, mtp_draft: int = 0) -> Iterator[Step]:
    """Yield the generated tokens of `prompt` (token ids), run in the engine's
    slot `slot`. suppress: token ids never generated; logits: each Step carries
    the logits row its token was chosen from; mtp_draft: greedy decoding
    drafted by the model's MTP block, up to this many tokens a step (the
    server's speculative decoding, vkengine/serving/speculate.py: the same
    tokens in fewer steps of the model)."""
    runner = Runner(engine, SchedulerConfig(n_slots=1, max_live=1, step_tokens=engine.max_batch, max_queue=0),
                    slots=[slot], mtp_draft=mtp_draft)
    events: deque[Event] = deque()
    job = runner.make_job(GenRequest(prompt, max_tokens, sampling, tuple(stop), ignore_eos,
                                     suppress=frozenset(int(t) for t in suppress), logits=logits), events.append)
    st = stats if stats is not None else GenStats()
    st.prompt_tokens = len(job.seq.tokens)
    if max_tokens == 0:
        return
    runner.add(job)
    try:
        while True:
            while not events:
                if not runner.step():
                    raise RuntimeError("the runner stopped before the request ended")
            ev = events.popleft()
            if ev.error is not None:
                raise job.failure or VkEngineError(ev.error)
            assert ev.token is not None and job.t_first is not None and job.t_last is not None
            st.generated += 1
            st.prefill_s = job.t_first - job.t_submit
            st.decode_s = job.t_last - job.t_first
            st.drafted, st.accepted = job.drafted, job.accepted
            st.verify_steps = runner.spec.steps if runner.spec is not None else 0
            yield Step(ev.token, ev.text, ev.finish, ev.logits)
            if ev.finish is not None:
                return
    finally:   # the steps chained behind the last token are still on the device
        runner.settle()
