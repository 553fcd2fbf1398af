"""Our engine's side of a parity case: a greedy free run and a teacher-forced
pass along llama.cpp's tokens, sharing one prefill of the prompt.

1. the free run: `generate` (the runner every user's request goes through)
   with the logits of each token's row -> N greedy tokens, and the prompt's
   last row (the teacher-forced row for position 0: same prefix);
2. llama.cpp's tokens 0..N-2 as one batch at positions len(prompt)... on top
   of the prompt's KV rows from step 1 (the free run's own rows get
   overwritten) -> logits at every later position. Hybrid models, whose
   recurrent state cannot be rewound, prefill the prompt again first.

Greedy picks exclude llama.cpp's end-of-generation tokens: the reference runs
with ignore_eos, which llama-server implements as a -inf logit bias on them
(server-schema.cpp), so it never emits one; the free run suppresses them the
same way (generate(suppress=...)), which is what makes the tokens comparable.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from vkengine.engine import Engine, EngineConfig, Readback
from vkengine.kernels import KVTypes
from vkengine.options import Options
from vkengine.serving.generate import generate
from vkengine.tokenizer import Tokenizer

# control tokens that llama.cpp treats as end of generation (src/llama-vocab.cpp,
# special_eog_ids), besides the file's EOS/EOT ids
LLAMA_EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)


def eog_ids(tok: Tokenizer) -> frozenset[int]:
    ids = set(tok.eot_ids) | ({tok.eos_id} if tok.eos_id is not None else set())
    for text in LLAMA_EOG_TEXTS:
        i = tok.hf.token_to_id(text)
        if i is not None:
            ids.add(int(i))
    return frozenset(ids)


@dataclass
class EngineCase:
    tokens: list[int]                     # free-run greedy tokens
    tf_top1: list[int]                    # teacher-forced greedy pick per position
    tf_logprobs: list[dict[int, float]]   # teacher-forced log-softmax at the kept ids


def engine_config(max_prompt: int, n_predict: int, n_ctx_train: int, options: Options = Options(),
                  kv_types: KVTypes = KVTypes()) -> EngineConfig:
    """One slot with room for the longest prompt plus N, rounded up to 256 so
    that prompt sets of similar size share KV sizes. 32-row steps: the N-1
    teacher-forced rows of a 32-token case are one step of the same shape for
    every prompt, so it is recorded once. kv_types: the KV cache's (the same
    as llama-server's in the run)."""
    need = max_prompt + n_predict + 1
    n_ctx = min(n_ctx_train, -(-need // 256) * 256)
    return EngineConfig(n_slots=1, n_ctx=n_ctx, max_batch=32, max_out=32, options=options, kv_types=kv_types)


def _log_softmax(row: np.ndarray) -> np.ndarray:
    r = row.astype(np.float64)
    m = r.max()
    return r - m - np.log(np.exp(r - m).sum())


def pick(row: np.ndarray, banned: Sequence[int]) -> int:
    """Greedy token of a logits row with the banned ids masked out."""
    if len(banned):
        row = row.copy()
        row[list(banned)] = -np.inf
    return int(np.argmax(row))


def greedy(eng: Engine, prompt: Sequence[int], n: int, banned: Sequence[int] = (),
           slot: int = 0) -> tuple[list[int], np.ndarray]:
    """n greedy tokens, never a banned one; also returns the prompt's last logits row."""
    steps = list(generate(eng, prompt, n, slot=slot, ignore_eos=True, suppress=banned, logits=True))
    assert steps[0].logits is not None
    return [s.token for s in steps], steps[0].logits


def teacher_forced(eng: Engine, tokens: Sequence[int], start: int, keep: Sequence[Iterable[int]],
                   banned: Sequence[int] = (), slot: int = 0) -> tuple[list[int], list[dict[int, float]]]:
    """Run `tokens` at positions start.. (the KV rows before `start` must hold
    the prefix) and return, per token, the greedy pick for the next position
    and the log-softmax at keep[i] (plus the pick)."""
    top1: list[int] = []
    lps: list[dict[int, float]] = []
    step = min(eng.max_batch, eng.max_out)
    for c in range(0, len(tokens), step):
        chunk = list(tokens[c:c + step])
        rows = eng.step(chunk, range(start + c, start + c + len(chunk)), [slot] * len(chunk),
                        range(len(chunk)), Readback.LOGITS)
        for j, r in enumerate(rows):
            best = pick(r, banned)
            top1.append(best)
            lps.append(_keep(r, set(keep[c + j]) | {best}))
    return top1, lps


def _keep(row: np.ndarray, ids: set[int]) -> dict[int, float]:
    ls = _log_softmax(row)
    return {int(t): float(ls[t]) for t in ids}


def run_case(eng: Engine, prompt: Sequence[int], ref: Sequence[int],
             ref_top: Sequence[Sequence[tuple[int, float]]], banned: Sequence[int] = (),
             slot: int = 0) -> EngineCase:
    """Free run of len(ref) greedy tokens, then teacher forcing along `ref`."""
    n = len(ref)
    free, first = greedy(eng, prompt, n, banned, slot)
    keep = [{t for t, _ in ref_top[i]} | {int(ref[i]), free[i]} for i in range(n)]
    b0 = pick(first, banned)
    top1, lps = [b0], [_keep(first, keep[0] | {b0})]
    if n > 1:
        if not eng.kv.rewindable:
            # a recurrent state now covers the free run: start the slot again
            eng.prefill(prompt, slot, 0, Readback.NONE)
        t, lp = teacher_forced(eng, ref[:n - 1], len(prompt), keep[1:], banned, slot)
        top1 += t
        lps += lp
    return EngineCase(free, top1, lps)
