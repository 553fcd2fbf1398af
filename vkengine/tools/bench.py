"""`vkengine bench`: prefill (pp) and decode (tg) speed, measured like
llama-bench: pp = one prompt of n tokens, tg = n tokens generated one at a
time, both after `depth` tokens already in the context (llama-bench's -d;
default 0, an empty context); median of `reps` runs. Batched decode
(`--parallel B`): B sequences in B slots, each `depth` tokens deep, decode n
tokens together, one step of B rows per token, as the server's batch mode
does; reported as aggregate tok/s (B * n / time). Decode steps are chained as
the server chains greedy decode (`decode`): the next step is on the device
before the host reads the last one's tokens.

The depth is filled once (untimed) by a prefill of random tokens; every run
then starts at that position. KV rows past it are simply rewritten, so an
attention-only model needs nothing between runs; a recurrent state cannot
rewind, so a hybrid model's slots are put back at the depth from a parked
copy (untimed) before each run."""
from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..engine import MAIN, Engine, Pass, Readback
from ..errors import VkEngineError

DEPTH_FILL_ROWS = 256   # rows of the prefill steps that fill a depth


def bench_rows(n_prompt: int, n_seq: int, depths: list[int], ubatch: int = 0) -> int:
    """The engine's max_batch for a bench: the prompt (in steps of at most
    `ubatch` rows where given, as llama-bench's -ub), the batched sequences,
    and chunks of DEPTH_FILL_ROWS to fill a depth."""
    if ubatch < 0:
        raise VkEngineError(f"--ubatch {ubatch}: a number of rows (0: the whole prompt a step)")
    return max(min(n_prompt, ubatch) if ubatch else n_prompt, n_seq, DEPTH_FILL_ROWS if max(depths, default=0) else 1)


def fill_depth(eng: Engine, depth: int, n_seq: int = 1, seed: int = 1) -> Callable[[], None]:
    """Put `depth` random tokens into slots 0..n_seq-1 (one prefill, copied to
    the other slots); returns reset(), which makes every slot continue at
    `depth` again: nothing for KV caches, a restore of the parked state for a
    recurrent one. (run_bench and run_batched check the slots and context.)"""
    if depth <= 0:
        return lambda: None
    toks = np.random.default_rng(seed).integers(0, eng.n_vocab, depth).tolist()
    eng.prefill(toks, 0, readback=Readback.NONE)
    if eng.kv.rewindable:
        for s in range(1, n_seq):
            eng.kv.copy_prefix(0, s, depth)
        return lambda: None
    parked = eng.kv.park(0, depth)

    def reset() -> None:
        for s in range(n_seq):
            eng.kv.restore(parked, s, depth)
    return reset


def _timed(run: Callable[[], object], reset: Callable[[], None], reps: int) -> float:
    """Median wall time of `reps` runs, each after reset() (untimed). Two
    untimed runs first, so that the timed ones record no program: a step's
    program is kept per params buffer (and chained or not), the buffers
    alternate step by step, and a run of an odd number of steps leaves the
    next one starting on the other buffer. (A warm-up of one prefill or two
    decode steps left the other buffer's prefill and chained decode programs
    to the first timed repetition: with -r 2 the median, their mean, then
    included half a recording.)"""
    for _ in range(2):
        reset()
        run()
    times = []
    for _ in range(reps):
        reset()
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_bench(eng: Engine, n_prompt: int, n_gen: int, reps: int = 3, seed: int = 0, depth: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    V = eng.n_vocab
    out: dict[str, Any] = {"model": eng.model.name, "device": eng.device.info.name, "n_prompt": n_prompt,
                           "n_gen": n_gen, "depth": depth}
    if hasattr(eng, "describe"):   # a split model (vkengine.split): which layers each device holds
        out["split"] = eng.describe()
    if depth + max(n_prompt, n_gen) > eng.n_ctx:
        raise VkEngineError(f"depth {depth} + {max(n_prompt, n_gen)} tokens do not fit the context length "
                            f"{eng.n_ctx} (--ctx)")
    reset = fill_depth(eng, depth)
    if n_prompt:
        toks = rng.integers(0, V, n_prompt).tolist()
        out["pp_s"] = _timed(lambda: eng.prefill(toks, 0, start=depth), reset, reps)
        out["pp_tps"] = n_prompt / out["pp_s"]
    if n_gen:
        tok = int(rng.integers(0, V))
        out["tg_s"] = _timed(lambda: decode(eng, [tok], n_gen, depth), reset, reps)
        out["tg_tps"] = n_gen / out["tg_s"]
    return out


def decode(eng: Engine, toks: list[int], n_gen: int, start: int = 0) -> list[list[int]]:
    """Greedy decode of len(toks) sequences in slots 0.. from position start,
    one step of all rows per token, each step's tokens the previous step's
    greedy outputs: as the server runs greedy decode, each step is submitted
    chained to the one before it (Engine.submit(chain=...)) before that one is
    read back, where the engine allows it. Returns each step's tokens."""
    n = len(toks)
    slots = rows = list(range(n))
    out = []
    if not eng.can_chain:
        for pos in range(start, start + n_gen):
            toks = eng.step(toks, [pos] * n, slots, rows).tolist()
            out.append(toks)
        return out
    eng.submit(toks, [start] * n, slots, rows)
    for pos in range(start + 1, start + n_gen):
        eng.submit(toks, [pos] * n, slots, rows, chain=rows)
        out.append(eng.collect().tolist())
    out.append(eng.collect().tolist())
    return out


def run_batched(eng: Engine, n_seq: int, n_gen: int, reps: int = 3, seed: int = 0, depth: int = 0) -> dict:
    """Aggregate decode speed of n_seq sequences stepping together, each `depth` tokens deep."""
    if n_seq > eng.n_slots:
        raise VkEngineError(f"{n_seq} sequences need {n_seq} slots, the engine has {eng.n_slots}")
    if depth + n_gen > eng.n_ctx:
        raise VkEngineError(f"depth {depth} + {n_gen} tokens do not fit the context length {eng.n_ctx} (--ctx)")
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, eng.n_vocab, n_seq).tolist()
    reset = fill_depth(eng, depth, n_seq)
    s = _timed(lambda: decode(eng, toks, n_gen, depth), reset, reps)
    return {"n_seq": n_seq, "n_gen": n_gen, "depth": depth, "step_ms": 1000 * s / n_gen, "tps": n_seq * n_gen / s}


def parse_ablate(text: str) -> list[re.Pattern]:
    """--ablate's patterns: regular expressions separated by ';'."""
    out = []
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        try:
            out.append(re.compile(part.strip()))
        except re.error as e:
            raise VkEngineError(f"--ablate: {part.strip()!r} is not a regular expression ({e})") from None
    return out


def run_ablation(eng: Engine, patterns: list[re.Pattern], n_gen: int, parallel: list[int], reps: int = 3,
                 depth: int = 0) -> list[dict]:
    """Decode steps (1 row, and each B of `parallel` rows) timed as `decode`
    runs them, first whole, then once per pattern with the dispatches whose
    profile label it finds left out of the recorded steps (their barriers kept;
    the ops' outputs keep the values the whole steps left, so routing and
    sampling stay as they were): the difference is what those ops cost in the
    pipelined step, which Engine.profile's timestamp after every op cannot
    show where a step is hundreds of short dispatches. The results of an
    ablated step are wrong by design; nothing reads them."""
    if not hasattr(eng, "drop_programs"):
        raise VkEngineError("--ablate needs a model on one device")
    rows = [1] + [b for b in parallel if b > 1]
    if max(rows) > eng.n_slots or depth + n_gen > eng.n_ctx:
        raise VkEngineError(f"--ablate: {max(rows)} sequences at depth {depth} + {n_gen} do not fit the engine's "
                            f"{eng.n_slots} slots of {eng.n_ctx} positions")
    reset = fill_depth(eng, depth, max(rows))   # (once: the depth's K and V or state as the whole steps wrote them)
    toks = np.random.default_rng(0).integers(0, eng.n_vocab, max(rows)).tolist()

    def step_ms(b: int) -> float:
        return 1000 * _timed(lambda: decode(eng, toks[:b], n_gen, depth), reset, reps) / n_gen

    def times() -> dict[int, float]:
        eng.drop_programs()
        return {b: step_ms(b) for b in rows}

    base = times()
    res = [{"pattern": None, "depth": depth, "step_ms": base, "omitted": 0}]
    try:
        for pat in patterns:
            eng.device.omit = pat
            t = times()
            omitted = max((p.n_omitted for p in eng._programs.values()), default=0)
            res.append({"pattern": pat.pattern, "depth": depth, "step_ms": t, "omitted": omitted})
    finally:
        eng.device.omit = None
        eng.drop_programs()
    return res


def bench_ctx(ctx: int | None, depths: list[int], n_prompt: int, n_gen: int) -> int | None:
    """bench's --ctx: as given, else room for the deepest run where there is
    depth or the run needs more than the engine's default context (4096 at
    most: `bench -p 16384` fits without --ctx), else None (the default)."""
    need = max(depths, default=0) + max(n_prompt, n_gen, 1)
    if ctx is None and (max(depths, default=0) or need > 4096):
        return need
    return ctx


def parse_depths(text: str) -> list[int]:
    """`--depth 0,4096` -> [0, 4096]: tokens already in the context (llama-bench's -d)."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VkEngineError(f"--depth takes comma-separated token counts such as 0,4096, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise VkEngineError(f"--depth counts must be >= 0, got {text!r}")
    return vals


def parse_parallel(text: str) -> list[int]:
    """`--parallel 4,16` -> [4, 16]: the sequence counts of batched decode."""
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise VkEngineError(f"--parallel takes comma-separated sequence counts such as 1,4,16, got {text!r}") from None
    if any(v < 1 or v > 256 for v in vals):
        raise VkEngineError(f"--parallel counts must be 1..256, got {text!r}")
    return vals


def check_mtp_steps(eng: Engine, draft: int) -> None:
    """The error of timing or profiling a turn's steps on an engine that cannot run them."""
    if not eng.model.args.n_nextn or eng.model.args.mtp_snap_rows < draft + 1:
        raise VkEngineError("the MTP steps need a model with an MTP block opened with --mtp --draft")


MTP_STEP_TITLES = {"decode_ms": "decode step (1 row)", "verify_ms": "verify step ({k1} rows: the token and its drafts)",
                   "mtp_block_ms": "MTP block ({k1} rows)", "mtp_draft_ms": "MTP chained draft (1 row)"}


def mtp_step_kinds(draft: int, depth: int) -> dict:
    """The steps of a speculative turn, by name: (rows, output rows, pass, hmap,
    the i-th step's first position) of a one-row decode step, the verify step of
    the pending token and `draft` drafts (hidden rows and recurrent snapshots
    kept), the MTP block over those draft + 1 positions drafting from the last,
    and one chained draft of the block on its own hidden state."""
    k1 = draft + 1
    rows = list(range(k1))
    return {"decode_ms": (1, [0], MAIN, None, lambda i: depth + i),
            "verify_ms": (k1, rows, Pass(hidden_rows=True, snapshots=True), None, lambda i: depth + i * k1),
            "mtp_block_ms": (k1, [k1 - 1], Pass(mtp=True, hidden="hn"), rows, lambda i: depth + 1 + i * k1),
            "mtp_draft_ms": (1, [0], Pass(mtp=True, hidden="mtp_hn"), [0], lambda i: depth + 1 + i)}


def run_mtp_steps(eng: Engine, draft: int, n_steps: int = 32, reps: int = 3, depth: int = 0) -> dict:
    """The steps of one speculative turn with the MTP block (vkengine.serving.speculate),
    each kind timed alone, submitted and collected as the server's turn has them:
    a one-row decode step (what a token costs without drafts), the verify step of
    the pending token and `draft` drafts (their hidden rows and recurrent
    snapshots kept), the MTP block over those draft + 1 positions drafting from
    the last, and one chained draft of the block on its own hidden state. ms a
    step: median of `reps` runs of n_steps steps (fewer where the context is
    short), each step at the positions after the one before (a recurrent state
    cannot rewind), from `depth` tokens of context. `turn_ms` sums a turn's
    steps (verify, block, draft - 1 drafts) without the host's work between
    them, and `turn_tps` is draft + 1 tokens over it: what the server's turn
    would give with every draft accepted and no gap between steps."""
    check_mtp_steps(eng, draft)
    eng.reserve_mtp(draft)
    k1 = draft + 1
    n_steps = min(n_steps, (eng.n_ctx - depth - 1) // (k1 + 1))
    if n_steps < 1:
        raise VkEngineError(f"depth {depth} leaves no room for a turn's {k1 + 1} positions in the context "
                            f"length {eng.n_ctx} (--ctx)")
    reset = fill_depth(eng, depth)
    # each kind: (tokens, output rows, pass, hmap) and its steps' positions (the i-th: after the one before);
    # everything but the submit and collect built before the timing
    kinds = mtp_step_kinds(draft, depth)
    out: dict[str, Any] = {"model": eng.model.name, "device": eng.device.info.name, "draft": draft, "depth": depth,
                           "steps": n_steps}
    for name, (n, outs, pass_, hmap, first) in kinds.items():
        toks, slots = [7] * n, [0] * n
        positions = [list(range(first(i), first(i) + n)) for i in range(n_steps)]

        def run(outs=outs, pass_=pass_, hmap=hmap, toks=toks, slots=slots, positions=positions) -> None:
            for pos in positions:
                eng.submit(toks, pos, slots, outs, Readback.ARGMAX, pass_=pass_, hmap=hmap)
                eng.collect()
        out[name] = 1000 * _timed(run, reset, reps) / n_steps
    out["turn_ms"] = out["verify_ms"] + out["mtp_block_ms"] + (draft - 1) * out["mtp_draft_ms"]
    out["turn_tps"] = 1000 * k1 / out["turn_ms"]
    out["plain_tps"] = 1000 / out["decode_ms"]
    # the same turns back to back on the device, nothing waited for but the steps in flight
    n_turns = min(n_steps, (eng.n_ctx - depth - 2 * k1) // k1)
    if n_turns >= 1:
        out["chained_turn_ms"] = 1000 * _timed(lambda: _chained_turns(eng, draft, depth, n_turns), reset,
                                               reps) / n_turns
        out["chained_turn_tps"] = 1000 * k1 / out["chained_turn_ms"]
    return out


def _chained_turns(eng: Engine, draft: int, p: int, n_turns: int) -> None:
    """n_turns speculative turns, every draft accepted, as one chain on the
    device: each verify step reads its drafts from the MTP steps before it
    (draft_rows), the MTP block takes the verify step's greedy tokens (chain)
    and hidden rows, its drafts chain on it; the host waits only where the
    steps in flight leave no room (Engine.has_room; the MTP steps on a ring
    of their own, Engine.reserve_mtp). What a turn costs the device with no
    host in between: beside the server's turn (which collects each verify step
    before it submits the block) it says how much of that turn is the host's."""
    k1 = draft + 1
    verify = Pass(hidden_rows=True, snapshots=True)

    def submit(tokens, positions, outs, pass_: Pass, **kw) -> None:
        while not eng.has_room(pass_):
            eng.collect()
        eng.submit(tokens, positions, [0] * len(tokens), outs, Readback.ARGMAX, pass_=pass_, **kw)

    for t in range(n_turns):
        # (the pending token from the host, as the server's turn has it; the drafts from the device after the first)
        submit([7] * k1, range(p, p + k1), range(k1), verify,
               draft_rows=[(1 + i, i) for i in range(draft)] if t else None)
        submit([0] * k1, range(p + 1, p + 1 + k1), [k1 - 1], Pass(mtp=True, hidden="hn", drafts_at=0),
               hmap=list(range(k1)), chain=list(range(k1)))
        for d in range(1, draft):
            submit([0], [p + k1 + d], [0], Pass(mtp=True, hidden="mtp_hn", drafts_at=d), hmap=[0], chain=[0])
        p += k1
    while eng.in_flight:
        eng.collect()
