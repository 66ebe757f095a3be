"""`naohai check [RECIPE] STRATEGY [key=value ...] [--compile ...]`: validate, or compile per rank.

  naohai check RECIPE STRATEGY                 validation only (our rules + MindSpore 2.10 rules)
  naohai check STRATEGY                        the recipe is the model preset the file's `model:` key names
  naohai check RECIPE STRATEGY --compile       MindSpore compiles naohai's real train step on N
        [--ranks N] [--scale-down]             simulated GPUs (msrun workers, no accelerator needed)
        [--workdir DIR] [--keep-ir] [--timeout S]
  naohai check RECIPE STRATEGY --compile       only those ranks of the real (unscaled) layout, each in
        --ranks first,last,K...|stages         its own scheduler + worker pair; per-rank memory from
        [--depth N]                            MindSpore's slices beside the planner's

RECIPE is a recipe file, a name in recipes/ or a model preset.  Exit 0 when valid /
every rank compiled, 2 on a user error or a failed compile.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from naohai.commands._args import allow_intermixed
from naohai.errors import UserError
from naohai.validate import cli_seconds

DEFAULT_TIMEOUT = 900.0
DEFAULT_PROFILE = "ascend-910a-32g"


def register(sub) -> None:
    p = sub.add_parser("check", help="validate a strategy; with --compile, compile it per rank with MindSpore")
    p.add_argument("recipe", metavar="RECIPE", nargs="?",
                   help="recipe YAML, a name in recipes/, or a model preset; left out (STRATEGY alone), the preset "
                        "the strategy's model: key names")
    p.add_argument("strategy", metavar="STRATEGY", nargs="?", help="strategy YAML file")
    p.add_argument("overrides", nargs="*", help="dotted recipe overrides, e.g. train.micro_batch_size=2")
    p.add_argument("--compile", action="store_true", help="compile the train step on simulated devices")
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"),
                   help="also check the layout can run on this device (auto = what this machine has); "
                        "a layout it cannot run is an error")
    p.add_argument("--ranks", help="with --scale-down: simulated devices (default 8); otherwise which ranks of the "
                                   "real layout to compile: all (default; every rank a process), or a list of "
                                   "first, last, rank numbers and 'stages' (one rank per pipeline stage), each "
                                   "compiled alone at full width")
    p.add_argument("--depth", type=int, help="with a list of --ranks: layers kept per pipeline stage (default: the "
                                             "real depth where it compiles here in minutes, else 1)")
    p.add_argument("--scale-down", action="store_true", help="shrink a cluster layout to fit --ranks")
    p.add_argument("--profile",
                   help="device profile for the per-rank memory verdict of --compile --ranks first,...: "
                        f"{DEFAULT_PROFILE} (default) | ascend-910b-64g | a YAML file")
    p.add_argument("--workdir", help="where logs, per-rank results and strategy files go")
    p.add_argument("--keep-ir", action="store_true", help="with --compile: keep MindSpore's IR files per rank")
    p.add_argument("--save-slices", action="store_true",
                   help="with --compile: write each rank's compile-time parameter slices to rank_<r>/slices.ckpt")
    p.add_argument("--timeout", type=cli_seconds(), help=f"with --compile: seconds before the job is killed (default "
                                                          f"{DEFAULT_TIMEOUT:g})")
    p.add_argument("--compat-fixes", action="store_true",
                   help="fix known MindSpore 2.10 incompatibilities in a copy of the strategy (printed)")
    allow_intermixed(p)
    p.set_defaults(run=run)


def _recipe(name: str, overrides):
    """The recipe as ``train`` reads the same name (a preset only where no recipe has its name)."""
    from naohai.config import load_recipe_or_preset
    return load_recipe_or_preset(name, overrides)


def _strategy_alone(args) -> bool:
    """``check STRATEGY [key=value ...]``: the strategy file alone stands for the model preset its ``model:`` key
    names, with the strategy's batch (as in `naohai plan STRATEGY`); ``args`` is rewritten to the RECIPE STRATEGY
    form with that preset's name as RECIPE.  Returns whether it was so."""
    from naohai.config import MODEL_PRESETS, is_override
    from naohai.strategy.schema import is_strategy_file, load_strategy
    if args.recipe is None:
        raise UserError("give RECIPE STRATEGY, or a STRATEGY file whose model: key names a preset",
                        where="command line", key="STRATEGY", rule="check [RECIPE] STRATEGY")
    alone = args.strategy is None or (is_override(args.strategy) and not os.path.exists(args.strategy))
    if not alone:
        return False
    if not is_strategy_file(args.recipe):
        raise UserError(f"'{args.recipe}' is not a strategy file (a YAML mapping with a mesh:); give RECIPE STRATEGY, "
                        "or a STRATEGY whose model: key names a preset", where="command line", key="STRATEGY",
                        rule="check [RECIPE] STRATEGY")
    strategy = load_strategy(args.recipe)
    if not strategy.model:
        raise UserError("no recipe given and the strategy has no model: key; give RECIPE STRATEGY, or add model: "
                        "PRESET to the file", where=args.recipe, key="model", rule="recipe or model key")
    if strategy.model not in MODEL_PRESETS:
        raise UserError(f"model: '{strategy.model}' is not a model preset; give RECIPE STRATEGY",
                        where=args.recipe, key="model", rule="model: names a preset")
    given = [args.strategy] if args.strategy is not None else []
    given += list(args.overrides)
    mbs = strategy.micro_batch_size or 1                # the batch `naohai plan STRATEGY` plans
    gb = strategy.global_batch or strategy.data * mbs * strategy.micro_batches
    args.overrides = [f"train.micro_batch_size={mbs}", f"train.global_batch_size={gb}", *given]
    args.recipe, args.strategy = strategy.model, args.recipe
    print(f"recipe: the model preset {strategy.model} (the strategy's model: key); batch {gb} sequences, "
          f"micro-batch size {mbs}, as `naohai plan {args.strategy}` plans it (key=value overrides win)")
    return True


def summary(resolved) -> str:
    """A few lines describing the resolved plan."""
    r = resolved
    mesh = " x ".join(f"{k} {v}" for k, v in r.mesh.items())
    lines = [f"strategy {r.name}: {mesh} = {r.device_num} devices; micro-batch size {r.micro_batch_size} per "
             f"data-parallel rank"]
    if r.stages > 1:
        lines.append(f"  pipeline: {r.stages} stages, layers per stage {list(r.layers_per_stage)}, "
                     f"{r.micro_batches} micro-batches, scheduler {r.scheduler}"
                     + (f", {r.virtual_chunks} virtual chunks" if r.virtual_chunks > 1 else ""))
    o = r.optimizer_parallel
    lines.append("  optimizer parallel: " + (f"on (shard size {o.shard_size}, {o.level}, threshold {o.threshold_kb} KB)"
                                              if o.enabled else "off"))
    lines.append(f"  vocab parallel: {r.vocab_parallel}; sequence parallel: {r.sequence_parallel}")
    modes = {}
    for i, spec in enumerate(r.recompute):
        key = spec.mode + (f" {list(spec.ops)}" if spec.mode == "select" else "") + (" +comm" if spec.comm else "")
        modes.setdefault(key, []).append(i)
    lines.append("  recompute: " + "; ".join(f"layers {v[0]}-{v[-1]}: {k}" for k, v in modes.items()))
    sharded = sum(1 for t in r.op_strategy.values() if any(d > 1 for dims in t for d in dims))
    lines.append(f"  ops: {len(r.op_strategy)} named ops, {sharded} with a split axis")
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    return "\n".join(lines)


def runs_on(resolved, device, recipe_words: str) -> str:
    """Where this layout can train; with an explicit ``--device`` a layout it cannot run is a UserError."""
    from naohai.strategy.runtime import check_runnable, layout_mode
    if device:
        from naohai.devices import resolve_device
        chosen = resolve_device(device, where="command line", key="--device")
        check_runnable(resolved, chosen, recipe_words)
        return f"runs on {chosen}: yes"
    if layout_mode(resolved) == "semi_auto":
        return "runs on: Ascend (or GPU) only; MindSpore 2.10 cannot execute op / pipeline parallel on CPU"
    return "runs on: Ascend, GPU or CPU"


def _write_yaml(path: Path, data) -> None:
    import yaml
    path.write_text(yaml.safe_dump(data, sort_keys=False, default_flow_style=None))


def _workdir(args) -> Path:
    """The folder for what a check writes (scaled or fixed copies, compile logs and results): ``--workdir``, or a
    new temporary folder made the first time one is asked for, so a check that writes nothing leaves nothing
    behind."""
    if getattr(args, "made_workdir", None) is None:
        folder = Path(args.workdir or tempfile.mkdtemp(prefix="naohai-check-")).resolve()
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot be made a folder ({exc.strerror or exc}); give --workdir a folder this user can "
                            f"write, or leave it out for a temporary one", where=str(folder), key="--workdir",
                            rule="a writable folder") from None
        args.made_workdir = folder
    return args.made_workdir


def run(args) -> int:
    from naohai.config import read_yaml
    from naohai.strategy.run_plan import plan_run
    from naohai.strategy.schema import load_strategy

    if _strategy_alone(args):
        from naohai.config import preset_recipe
        recipe = preset_recipe(args.recipe, list(args.overrides))
    else:
        recipe = _recipe(args.recipe, list(args.overrides))
    strategy_path = args.strategy
    chosen = None if args.scale_down else _chosen_ranks_text(args.ranks)
    if not args.compile:
        stray = [f for f, given in (("--keep-ir", args.keep_ir), ("--save-slices", args.save_slices),
                                    ("--timeout", args.timeout is not None), ("--profile", args.profile is not None))
                 if given]
        if stray:
            raise UserError(f"{stray[0]} is for --compile, and without it nothing is compiled; add --compile or "
                            f"drop {stray[0]}", where="command line", key=stray[0],
                            rule="compile options with --compile")
    if args.depth is not None and chosen is None:
        raise UserError("--depth applies to a compile of chosen ranks (--ranks first,last,... or stages)",
                        where="command line", key="--depth", rule="--depth with a list of --ranks")
    if args.scale_down:
        from naohai.simulate.scale_down import scale_down
        ranks = _int_ranks(args.ranks) or 8
        load_strategy(strategy_path)  # the original must parse
        recipe_raw, strategy_raw, changes = scale_down(recipe, read_yaml(strategy_path, "strategy file"), ranks)
        workdir = _workdir(args)
        recipe_file, strategy_file = workdir / "scaled-recipe.yaml", workdir / "scaled-strategy.yaml"
        _write_yaml(recipe_file, recipe_raw)
        _write_yaml(strategy_file, strategy_raw)
        print(f"scale-down to {ranks} ranks (files in {workdir}):")
        for c in changes:
            print(f"  - {c}")
    else:
        recipe_file, strategy_file = None, Path(strategy_path)
    from naohai.config import load_recipe
    recipe_for_check = load_recipe(str(recipe_file)) if recipe_file else recipe
    if args.compat_fixes:
        from naohai.strategy.compat import compat_fixes
        first = plan_run(recipe_for_check, str(strategy_file), compat=False)
        fixed, notes = compat_fixes(read_yaml(str(strategy_file), "strategy file"), first.strategy, first.recipe)
        if notes:
            strategy_file = _workdir(args) / "compat-strategy.yaml"
            _write_yaml(strategy_file, fixed)
            print(f"MindSpore 2.10 compatibility fixes (copy in {strategy_file}):")
            for n in notes:
                print(f"  - {n}")
    run = plan_run(recipe_for_check, str(strategy_file))
    run.tell()
    recipe_for_check, resolved = run.recipe, run.strategy
    print(summary(resolved))
    print(runs_on(resolved, args.device, " ".join([args.recipe, *args.overrides])))
    if chosen is not None and not args.compile:
        raise UserError("--ranks with a list of ranks names what to compile: add --compile", where="command line",
                        key="--ranks", rule="a list of --ranks with --compile")
    if not args.compile:
        print("valid (our rules and the MindSpore 2.10 compatibility rules); add --compile to compile it")
        return 0
    if chosen == [str(resolved.device_num)]:
        chosen = None   # as many ranks as the layout has: all of them
    if args.profile is not None and chosen is None:
        raise UserError("--profile is the device of the per-rank memory verdict of a compile of chosen ranks "
                        "(--compile --ranks first,last,... or stages); without one it would be read by nothing. "
                        "Add them, or drop --profile (naohai plan --profile plans a whole layout's memory)",
                        where="command line", key="--profile", rule="--profile with --compile --ranks LIST")
    if chosen is not None:
        if args.save_slices:
            raise UserError("--save-slices needs parameter values, which a compile of chosen ranks never makes "
                            "(its parameters are deferred); drop --ranks to compile every rank with slices",
                            where="command line", key="--save-slices", rule="--save-slices without a list of --ranks")
        return _compile_chosen(args, chosen, recipe_for_check, strategy_file, resolved, _workdir(args))
    from naohai.train.compile_target import compile_layout, kernel_note
    ranks = _int_ranks(args.ranks) or resolved.device_num
    if ranks != resolved.device_num:
        raise UserError(f"the strategy needs {resolved.device_num} ranks, --ranks is {ranks}; add --scale-down to "
                        f"shrink it", where="command line", key="--ranks", rule="ranks == strategy devices")
    workdir = _workdir(args)
    print(kernel_note())
    print(f"compiling on {ranks} simulated devices in {workdir} ...", flush=True)
    report = compile_layout(recipe_for_check, str(strategy_file), workdir, stages=resolved.stages,
                            timeout=args.timeout or DEFAULT_TIMEOUT, keep_ir=args.keep_ir, save_slices=args.save_slices,
                            ranks=ranks,
                            recipe_file=str(recipe_file) if recipe_file else None,
                            progress=lambda line: print(line, flush=True))
    print(report.render())
    print(param_table(report))
    print(f"per-rank results and strategy files: {workdir}/rank_<r>/ ; summary: {workdir}/summary.json")
    return 0 if report.ok else 2


def param_table(report, limit: int = 30) -> str:
    """Sharded shape of each parameter per pipeline-stage group of ranks (first rank shown)."""
    seen = {}
    for r in report.per_rank:
        for name, p in sorted(r.parameters.items()):
            if name.startswith(("accu_grads.", "adam_m.", "adam_v.", "learning_rate", "global_step",
                                "beta1_power", "beta2_power", "moments.")):
                continue
            key = (name, tuple(p.get("full_shape") or ()), tuple(p.get("slice_shape") or p.get("local_shape") or ()),
                   tuple(p.get("opt_local_shape") or ()))
            seen.setdefault(key, []).append(r.rank)
    lines = ["parameter  full -> slice [optimizer shard] : ranks"]
    for (name, full, sl, opt), ranks in list(seen.items())[:limit]:
        lines.append(f"  {name}  {list(full)} -> {list(sl)}" + (f" [{list(opt)}]" if opt else "")
                     + f" : {ranks[0]}..{ranks[-1]}" if ranks else "")
    if len(seen) > limit:
        lines.append(f"  ... {len(seen) - limit} more in summary.json")
    return "\n".join(lines)


def _int_ranks(text):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--ranks {text!r}: with --scale-down it is the number of simulated devices, an integer",
                        where="command line", key="--ranks", rule="--scale-down --ranks N") from None


def _chosen_ranks_text(text):
    """The --ranks words when they choose ranks (not 'all ranks of the layout' as a plain count)."""
    if text is None:
        return None
    words = [w.strip() for w in str(text).split(",") if w.strip()]
    if len(words) == 1 and words[0].isdigit():
        return words   # a count equal to the layout's devices means all of them (decided once resolved)
    for w in words:
        if w not in ("first", "last", "stages") and not w.isdigit():
            raise UserError(f"--ranks {text!r}: '{w}' is neither a rank number nor first, last or stages",
                            where="command line", key="--ranks", rule="--ranks first,last,K,...|stages")
    if not words:
        raise UserError("--ranks is empty", where="command line", key="--ranks", rule="--ranks first,last,K,...|stages")
    return words


def choose_ranks(words, resolved):
    """Global ranks for the --ranks words: first = 0, last = devices - 1, stages = the first rank of
    every pipeline stage (the same data / model position on each, so neighbours' Send / Receive
    can be matched), numbers as given; in order, without repeats."""
    world, per_stage = int(resolved.device_num), int(resolved.devices_per_stage)
    out = []
    for w in words:
        if w == "first":
            picked = [0]
        elif w == "last":
            picked = [world - 1]
        elif w == "stages":
            picked = [k * per_stage for k in range(int(resolved.stages))]
        else:
            picked = [int(w)]
        out += [r for r in picked if r not in out]
    bad = [r for r in out if r >= world]
    if bad:
        raise UserError(f"ranks {bad} are outside 0-{world - 1} (the layout has {world} devices)",
                        where="command line", key="--ranks", rule="0 <= rank < devices")
    return out


def _compile_chosen(args, words, recipe, strategy_file, resolved, workdir) -> int:
    """``--compile --ranks first,last,...|stages``: chosen ranks of the real layout, one pair each."""
    from naohai.config import read_yaml, recipe_from_dict
    from naohai.simulate.scale_down import default_depth, reduce_depth
    from naohai.strategy.profiles import load_profile
    from naohai.strategy.rank_memory import GB, rank_rows, render
    from naohai.strategy.run_plan import plan_run
    from naohai.strategy.schema import parse_strategy
    from naohai.train.compile_target import compile_chosen_ranks, kernel_note

    world = int(resolved.device_num)
    ranks = choose_ranks(words, resolved)
    deepest = max(resolved.layers_per_stage)
    depth, why = (args.depth, f"--depth {args.depth}") if args.depth is not None else default_depth(resolved)
    compile_recipe, compile_strategy, compiled = recipe, Path(strategy_file), resolved
    reduced = depth is not None and depth < deepest
    if reduced:
        rec_raw, strat_raw, changes = reduce_depth(recipe, read_yaml(str(strategy_file), "strategy file"), resolved,
                                                   depth)
        compile_strategy = workdir / "depth-strategy.yaml"
        _write_yaml(compile_strategy, strat_raw)
        _write_yaml(workdir / "depth-recipe.yaml", rec_raw)
        compile_recipe = recipe_from_dict(rec_raw, where=str(workdir / "depth-recipe.yaml"))
        compiled = plan_run(compile_recipe, parse_strategy(strat_raw, str(compile_strategy)), compat=False).strategy
        print(f"depth: {why}; compiled layout (files in {workdir}):")
        for c in changes:
            print(f"  - {c}")
    else:
        print(f"depth: the real one, {sum(resolved.layers_per_stage)} layers"
              + (f" ({why})" if args.depth is None else ""))
    print(kernel_note())
    print(f"compiling ranks {','.join(map(str, ranks))} of {world} at full width, each in its own scheduler + "
          f"worker pair, in {workdir} ...", flush=True)
    report = compile_chosen_ranks(compile_recipe, str(compile_strategy), workdir, world=world, ranks=ranks,
                                  stages=compiled.stages, timeout=args.timeout or DEFAULT_TIMEOUT, keep_ir=args.keep_ir,
                                  progress=print)
    print(report.render())
    profile = load_profile(args.profile or DEFAULT_PROFILE)
    limit = (profile.memory_gb - profile.reserve_gb) * GB
    from naohai.strategy.lora import planned_adapters
    from naohai.strategy.memory import adapter_placements
    lora = planned_adapters(compile_recipe, compiled)
    rows = rank_rows(report.per_rank, compiled, compile_recipe.model, limit,
                     real=(resolved, recipe.model) if reduced else None,
                     adapters=adapter_placements(compiled, lora) if lora else None)
    print(render(rows, limit, profile.name))
    summary_path = workdir / "summary.json"
    summary = json.loads(summary_path.read_text())
    summary["chosen_ranks"] = ranks
    summary["depth"] = {"layers_per_stage": depth if reduced else None, "why": why,
                        "compiled_layers": sum(compiled.layers_per_stage), "real_layers": sum(resolved.layers_per_stage)}
    summary["profile"] = profile.name
    by_rank = {row["rank"]: row for row in rows}
    for entry in summary["per_rank"]:
        entry["memory"] = by_rank.get(entry["rank"])
    summary_path.write_text(json.dumps(summary, indent=1, default=str))
    misfits = [row["rank"] for row in rows if row.get("fits") is False]
    if misfits:
        print(f"ranks {misfits} do not fit {profile.name} ({limit / GB:.1f} GiB usable)")
    print(f"per-rank results: {workdir}/rank_<r>/ ; summary (one entry per compiled rank, its verdict and bytes): "
          f"{summary_path}")
    return 0 if report.ok and not misfits else 2
