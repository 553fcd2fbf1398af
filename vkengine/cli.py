"""`vkengine` command line: devices, build-shaders, generate, bench, synth, and
the commands that applications register under the entry-point group
`vkengine.commands` (the server's `serve`: pyproject.toml), so that the
library never imports them.

Configuration enters here (flags, VKENGINE_* variables: vkengine.options) and
is passed down; user errors (VkEngineError) print one line without a traceback
and exit with 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import TYPE_CHECKING

from .errors import VkEngineError
from .options import add_model_args, device_index

if TYPE_CHECKING:
    from .model import Model


def _open(args, n_slots: int = 1, max_batch: int | None = None, max_out: int = 16, clock=None):
    """(model, device, engine) for the flags; clock (a StartupClock): each phase marked."""
    from .device import Device
    from .engine import Engine, EngineConfig
    from .kernels import KVTypes
    from .model import load_model
    from .options import Options, split_devices

    def mark(phase: str) -> None:
        if clock is not None:
            clock.mark(phase)
    kv_types = KVTypes(args.cache_type_k, args.cache_type_v)
    split = split_devices(args)
    # (generate, its startup clocked, builds the tokenizer while its decode steps' pipelines compile)
    model = _model_options(args, load_model(args.model, defer_tokenizer=clock is not None))
    mark("model file")
    # generate (its startup clocked) uploads the weights while its decode steps' pipelines compile (prepare_decode)
    cfg = EngineConfig(n_slots=n_slots, n_ctx=args.ctx, max_batch=max_batch or args.batch, max_out=max_out,
                       options=Options.from_env(), kv_types=kv_types,
                       defer_fill=clock is not None and not getattr(args, "mtp", False))
    log = getattr(args, "experts_log", None)
    if split is not None:   # the layers across several devices (vkengine.split)
        from .split import open_split
        if log:
            raise VkEngineError("--experts-log records one device's steps; drop --devices to use it")
        split_eng = open_split(model, split, args.tensor_split, cfg)
        mark("weights and buffers")
        return model, split_eng.device, split_eng
    dev = Device(device_index(args))
    # pipelines this run compiled (a bench's prompt sizes, say) kept for the next process
    dev.save_at_exit()
    mark("device")
    if log:
        from .tools.expert_log import RecordingEngine
        eng: Engine = RecordingEngine(model, dev, cfg, log=open(log, "w"))
    else:
        eng = Engine(model, dev, cfg)
    mark("weights and buffers")
    return model, dev, eng


def _model_options(args: argparse.Namespace, model: Model) -> Model:
    """Run-time choices of the MoE and MTP models (--fixed-experts, --mtp --draft)."""
    import dataclasses
    change: dict = {}
    if getattr(args, "fixed_experts", False) or getattr(args, "experts_log", None):
        if not model.args.n_expert:
            raise VkEngineError("--fixed-experts and --experts-log need a mixture-of-experts model")
        change["fixed_experts"] = True
    if getattr(args, "mtp", False):
        from .serving.speculate import check_mtp
        check_mtp(model, args.draft)
        if getattr(args, "experts_log", None):
            raise VkEngineError("--experts-log records plain engine steps; drop --mtp to use it")
        change["mtp_snap_rows"] = args.draft + 1
    return dataclasses.replace(model, args=dataclasses.replace(model.args, **change)) if change else model


def cmd_devices(args) -> int:
    from .device import list_devices, pick_device
    devs = list_devices()
    chosen = pick_device(devs, device_index(args)).index if devs else None
    if args.brief:
        for d in devs:
            print(f"{d.index}{'*' if d.index == chosen else ' '} {d.name} ({d.type}, {d.driver_name})")
        return 0
    if args.json:
        print(json.dumps([{**d.__dict__, "extensions": len(d.extensions)} for d in devs], indent=1))
        return 0
    for d in devs:
        mark = "  <- selected" if d.index == chosen else ""
        print(f"[{d.index}] {d.name}{mark}")
        print(f"    type {d.type}, Vulkan {d.api_version}, driver {d.driver_name} ({d.driver_info})")
        print(f"    subgroup size {d.subgroup_size}, max storage buffer {d.max_storage_buffer_range / 2**20:.0f} MiB, "
              f"shared memory {d.max_shared_memory // 1024} KiB, workgroup <= {d.max_workgroup_invocations}")
        print(f"    device-local memory {d.device_local_bytes / 2**30:.1f} GiB, "
              f"push constants {d.max_push_constants_size} B, "
              f"timestamps {d.timestamp_period_ns:g} ns/tick")
        if d.cooperative_matrix:
            f16 = "yes" if d.COOPMAT_F16 in d.cooperative_matrix else "no"
            print(f"    cooperative matrices: {len(d.cooperative_matrix)} shapes, 16x16x16 f16 -> f32: {f16}")
    return 0


def cmd_build_shaders(args) -> int:
    from . import spirv
    t = time.perf_counter()
    files = spirv.build_all()
    print(f"{len(files)} shader variants in {spirv.default_cache_dir()} ({time.perf_counter() - t:.1f} s)")
    return 0


def _sampling(args):
    from .serving.sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, seed=args.seed).validate()


def cmd_generate(args) -> int:
    from .serving.generate import GenStats, generate
    from .startup import StartupClock
    clock = StartupClock()
    model, dev, eng = _open(args, clock=clock)
    # the decode steps recorded now, not inside the decode tok/s (with --mtp, a speculative turn's steps:
    # speculate.prepare_turns); meanwhile (the driver compiling) the tokenizer on a thread (load_model's
    # defer_tokenizer); its errors are raised below, where it is read
    warm = threading.Thread(target=model.warm_tokenizer, name="vkengine-tokenizer", daemon=True)
    warm.start()
    if args.mtp:
        from .serving.speculate import prepare_turns
        prepare_turns(eng, args.draft)
    else:
        eng.prepare_decode(1)
    warm.join()
    clock.mark("pipelines and recording")
    tok = model.tokenizer
    text = args.prompt
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = tok.encode(text)
    st = GenStats()
    sampling = _sampling(args)
    if args.mtp and sampling.needs_logits:
        raise VkEngineError("--mtp decodes greedily: use --temp 0 (and no repeat penalty)")
    steps = generate(eng, ids, args.n_predict, sampling, args.stop, ignore_eos=args.ignore_eos, stats=st,
                     mtp_draft=args.draft if args.mtp else 0)
    if not args.chat:
        sys.stdout.write(args.prompt)
    for step in steps:
        sys.stdout.write(step.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if hasattr(eng, "describe"):
        print(f"[{eng.describe()}]", file=sys.stderr)
    print(f"[{dev.info.name}] startup: {clock.summary()}", file=sys.stderr)
    print(f"[{dev.info.name}] prompt {st.prompt_tokens} tokens, {st.prefill_tps:.1f} tok/s prefill; "
          f"generated {st.generated} tokens, {st.decode_tps:.1f} tok/s decode", file=sys.stderr)
    if args.mtp:   # (the first token comes from the prompt's step)
        print(f"[mtp] {st.verify_steps} verify steps, drafts accepted {st.accepted}/{st.drafted} "
              f"({100 * st.acceptance:.0f}%), {(st.generated - 1) / max(st.verify_steps, 1):.2f} tokens per step",
              file=sys.stderr)
    return 0


def cmd_bench(args) -> int:
    from .tools.bench import (
        bench_ctx,
        bench_rows,
        parse_ablate,
        parse_depths,
        parse_parallel,
        run_ablation,
        run_batched,
        run_bench,
        run_mtp_steps,
    )
    parallel = parse_parallel(args.parallel)
    ablate = parse_ablate(args.ablate)
    if ablate and not args.n_gen:
        raise VkEngineError("--ablate times decode steps: give -n > 0")
    depths = parse_depths(args.depth)
    n_seq = max(parallel, default=1)
    args.ctx = bench_ctx(args.ctx, depths, args.n_prompt, args.n_gen)
    rows = max(bench_rows(args.n_prompt, n_seq, depths, args.ubatch), args.draft + 1 if args.mtp else 0)
    model, dev, eng = _open(args, n_slots=n_seq, max_batch=rows, max_out=max(16, n_seq))
    if args.profile:
        for d in depths:
            at = d if d else 128
            steps = [(f"decode step (1 row at position {at})", 1, at, False)]
            steps += [(f"batched decode step ({b} sequences at position {at})", b, at, True) for b in parallel
                      if b > 1]
            if args.n_prompt:   # in steps of at most max_batch rows, as prefill runs it
                n_steps = -(-args.n_prompt // eng.max_batch)
                how = f", {n_steps} steps of up to {eng.max_batch} rows" if n_steps > 1 else ""
                steps.append((f"prefill ({args.n_prompt} rows from position {d}{how})", args.n_prompt, d, False))
            if args.mtp:   # a speculative turn's steps (tools/bench.run_mtp_steps's kinds)
                from .tools.bench import MTP_STEP_TITLES, check_mtp_steps, mtp_step_kinds
                check_mtp_steps(eng, args.draft)
                for name, (n, outs, pass_, hmap, first) in mtp_step_kinds(args.draft, at).items():
                    title = MTP_STEP_TITLES[name].format(k1=args.draft + 1)
                    _print_profile(f"{title} at position {first(0)}",
                                   eng.profile(n, len(outs), start_pos=first(0), pass_=pass_, hmap=hmap))
            for title, n, start, batched in steps:
                if batched:
                    prof = eng.profile(n, n, start_pos=start, batched=True)
                else:
                    prof = _merge_profiles([eng.profile(min(eng.max_batch, n - c), 1, start_pos=start + c)
                                            for c in range(0, n, eng.max_batch)])
                _print_profile(title, prof)
    runs = []
    for d in depths:
        r = run_bench(eng, args.n_prompt, args.n_gen, args.reps, depth=d)
        r["batched"] = [run_batched(eng, b, args.n_gen, args.reps, depth=d) for b in parallel if b > 1]
        if args.mtp:
            r["mtp"] = run_mtp_steps(eng, args.draft, reps=args.reps, depth=d)
        if ablate:
            r["ablate"] = run_ablation(eng, ablate, args.n_gen, parallel, args.reps, depth=d)
        runs.append(r)
    if args.json:
        print(json.dumps(runs[0] if len(runs) == 1 else runs, indent=1))
        return 0
    for r in runs:
        line = f"{model.name} on {eng.describe() if hasattr(eng, 'describe') else dev.info.name}:"
        tag = f" @ d{r['depth']}" if r["depth"] or len(runs) > 1 else ""
        if args.n_prompt:
            line += f" pp{args.n_prompt}{tag} {r['pp_tps']:.1f} tok/s"
        if args.n_gen:
            line += f" tg{args.n_gen}{tag} {r['tg_tps']:.1f} tok/s"
        print(line)
        for b in r["batched"]:
            rel = f"({b['tps'] / r['tg_tps']:.2f}x one sequence), " if args.n_gen else ""
            print(f"  {b['n_seq']} sequences x tg{b['n_gen']}{tag}: {b['tps']:.1f} tok/s aggregate "
                  f"{rel}{b['step_ms']:.2f} ms a step")
        if "mtp" in r:
            m = r["mtp"]
            print(f"  MTP steps{tag}, each submitted and collected alone: decode {m['decode_ms']:.2f} ms, verify of "
                  f"{m['draft'] + 1} rows {m['verify_ms']:.2f} ms, the block over them {m['mtp_block_ms']:.2f} ms, a "
                  f"chained draft {m['mtp_draft_ms']:.2f} ms; a turn's steps {m['turn_ms']:.2f} ms = "
                  f"{m['turn_tps']:.1f} tok/s with every draft accepted ({m['turn_tps'] / m['plain_tps']:.2f}x "
                  f"{m['plain_tps']:.1f})")
            if "chained_turn_ms" in m:
                print(f"  MTP turns{tag} back to back on the device (every draft accepted, no host in between): "
                      f"{m['chained_turn_ms']:.2f} ms a turn = {m['chained_turn_tps']:.1f} tok/s "
                      f"({m['chained_turn_tps'] / m['plain_tps']:.2f}x)")
        if "ablate" in r:
            _print_ablation(r["ablate"], tag)
    return 0


def _print_ablation(res: list[dict], tag: str) -> None:
    """run_ablation's steps: whole, then without each pattern's ops, with what they cost."""
    base = res[0]["step_ms"]
    print(f"  decode steps{tag} whole: " + ", ".join(f"{b} row{'s' if b > 1 else ''} {ms:.3f} ms"
                                                  for b, ms in base.items()))
    for a in res[1:]:
        if not a["omitted"]:
            print(f"    /{a['pattern']}/ finds no op of these steps (labels as --profile prints them)")
            continue
        parts = ", ".join(f"{b}: {ms:.3f} ms ({base[b] - ms:+.3f}, {100 * (base[b] - ms) / base[b]:.0f}%)"
                          for b, ms in a["step_ms"].items())
        print(f"    without /{a['pattern']}/ ({a['omitted']} ops a step): {parts}")


def _print_profile(title: str, prof: list[tuple[str, float, int]]) -> None:
    """A step's Engine.profile rows: its GPU time, then its 14 slowest op kinds with their shares."""
    total = sum(us for _, us, _ in prof)
    print(f"{title}: {total:.0f} us GPU time")
    for label, us, count in prof[:14]:
        print(f"  {us:9.1f} us {100 * us / total:5.1f}%  x{count:<4d} {label}")


def _merge_profiles(profs: list[list[tuple[str, float, int]]]) -> list[tuple[str, float, int]]:
    """Engine.profile's rows of several steps summed by label, slowest first."""
    us: dict[str, float] = {}
    count: dict[str, int] = {}
    for prof in profs:
        for label, t, c in prof:
            us[label] = us.get(label, 0.0) + t
            count[label] = count.get(label, 0) + c
    return sorted(((k, v, count[k]) for k, v in us.items()), key=lambda r: -r[1])


def cmd_synth(args) -> int:
    from .tools.synth import synth_main
    return synth_main(args)


def _plugins(sub) -> None:
    """Subcommands registered by installed applications: entry points of the
    group `vkengine.commands`, each a function register(subparsers)."""
    from importlib.metadata import entry_points
    for ep in entry_points(group="vkengine.commands"):
        ep.load()(sub)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="vkengine", description="LLM inference on Vulkan through Kompute")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("devices", help="list Vulkan devices")
    add_model_args(p, model=False)
    p.add_argument("--brief", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_devices)

    p = sub.add_parser("build-shaders", help="compile every shader variant to SPIR-V (cached)")
    p.set_defaults(fn=cmd_build_shaders)

    p = sub.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_model_args(p)
    p.add_argument("prompt")
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (0: greedy)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--mtp", action="store_true",
                   help="speculative decoding with the model's MTP block (Qwen3.5 nextn tensors); greedy only")
    p.add_argument("--draft", type=int, default=2, help="tokens drafted per step with --mtp")
    p.add_argument("--fixed-experts", action="store_true",
                   help="MoE parity mode: fixed-order fp32 router logits, ties to the lowest expert index")
    p.add_argument("--experts-log", default=None, metavar="PATH",
                   help="with a MoE model: write the experts chosen for every token as JSON lines "
                        "(implies --fixed-experts)")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("bench", help="prefill (pp) and decode (tg) speed")
    add_model_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument("-r", "--reps", type=int, default=3)
    p.add_argument("-ub", "--ubatch", type=int, default=0, metavar="N",
                   help="prompt steps of at most N rows, as llama-bench's -ub (default: the whole prompt a step, "
                        "as many rows as the activations hold)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", action="store_true", help="GPU time per op of a decode and a prefill step "
                   "(at each --depth)")
    p.add_argument("-d", "--depth", default="0", metavar="D[,D...]",
                   help="tokens already in the context before pp and tg are measured, as llama-bench's -d, "
                        "e.g. 0,4096,16384 (the context grows to fit unless --ctx is given)")
    p.add_argument("--parallel", default="", metavar="B[,B...]",
                   help="also measure batched decode of B sequences stepping together (the server's batch mode), "
                        "e.g. 4,16")
    p.add_argument("--mtp", action="store_true",
                   help="also time the steps of a speculative turn with the model's MTP block (Qwen3.5 nextn "
                        "tensors): the verify step, the block over its rows, a chained draft")
    p.add_argument("--draft", type=int, default=2, help="drafts a turn with --mtp")
    p.add_argument("--ablate", default="", metavar="RE[;RE...]",
                   help="also time the decode steps (1 row and each --parallel B) without the ops whose profile "
                        "label each regular expression finds (their results wrong, their barriers kept): what "
                        "those ops cost in the pipelined step, e.g. 'mul_mat_id;delta_rule;attention'")
    p.set_defaults(fn=cmd_bench)

    p = sub.add_parser("synth", help="write a deterministic random-weight model (GGUF and safetensors)")
    from .tools.synth import add_synth_args
    add_synth_args(p)
    p.set_defaults(fn=cmd_synth)

    _plugins(sub)
    return ap


def run(parser: argparse.ArgumentParser, argv=None) -> int:
    """Parse argv and run its command: user errors print one line and give 2."""
    args = parser.parse_args(argv)
    try:
        return args.fn(args) or 0
    except VkEngineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def main(argv=None) -> int:
    return run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
