"""`naohai plan`: check a strategy against a recipe and print its plan; search; import.

  naohai plan RECIPE STRATEGY            full report (RECIPE: file, recipes/ name or preset)
  naohai plan STRATEGY                   the recipe is the preset named by the file's `model:` key
  naohai plan RECIPE --devices N --search [--top K] [--write FILE] [--schedulers 1f1b,interleaved]
  naohai plan --import-mindformers FILE --out strategy.yaml [--model PRESET]
Common: --profile NAME|FILE, --json, --micro-batch-size N, --global-batch N.
"""
from __future__ import annotations

import json
import os
from typing import Optional, Tuple

from naohai.errors import UserError
from naohai.validate import MAX_DEVICES, cli_int

DEFAULT_TOP = 5
#: options that belong to one way of running plan: given in another, they would be ignored (a --write that writes
#: nothing), so they are refused
SEARCH_ONLY = ("--top", "--write", "--schedulers")
IMPORT_ONLY = ("--out", "--model")


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="check a strategy file and print memory / time plan; search layouts")
    p.add_argument("targets", nargs="*", metavar="RECIPE_OR_STRATEGY",
                   help="RECIPE STRATEGY, or STRATEGY alone (uses its model: preset), or RECIPE with --search")
    p.add_argument("--devices", type=cli_int(1, MAX_DEVICES),
                   help="device count (checked against the mesh; required for --search)")
    p.add_argument("--search", action="store_true", help="propose the fastest layouts that fit")
    p.add_argument("--top", type=cli_int(1, 1000), help=f"rows in the --search table (default {DEFAULT_TOP})")
    p.add_argument("--write", metavar="FILE", help="with --search: write the best layout naohai can train as a "
                                                  "strategy file")
    p.add_argument("--schedulers", metavar="LIST",
                   help="with --search: pipeline schedulers to plan, comma-separated: 1f1b (compiles and trains), "
                        "interleaved (planning only with MindSpore 2.10); default: those naohai trains")
    p.add_argument("--profile", default="ascend-910a-32g", help="ascend-910a-32g | ascend-910b-64g | a YAML file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--micro-batch-size", type=cli_int(1), help="sequences per data-parallel rank per micro-batch "
                                                         "(default: recipe train.micro_batch_size, or 1 for a preset)")
    p.add_argument("--global-batch", type=cli_int(1), help="sequences per step (default: the recipe's, the "
                                                             "strategy's, or for --search with a preset the "
                                                             "device count x micro-batch size)")
    p.add_argument("--import-mindformers", metavar="FILE", help="turn a MindFormers YAML into a strategy file")
    p.add_argument("--out", metavar="FILE", help="with --import-mindformers: where to write the strategy")
    p.add_argument("--model", help="with --import-mindformers: preset name recorded in the strategy")
    p.set_defaults(run=run)


def _load_target(name: str):
    """(recipe or None, model_cfg, model_name) for a recipe path, recipes/ name or preset."""
    from naohai.config import MODEL_PRESETS, load_recipe, preset_recipe, resolve_recipe_path
    if name in MODEL_PRESETS and not os.path.exists(name):
        return None, preset_recipe(name).model, name
    path = resolve_recipe_path(name)
    if not os.path.exists(path):
        from naohai.errors import did_you_mean
        raise UserError(f"'{name}' is neither a recipe file nor a preset.{did_you_mean(name, MODEL_PRESETS)}",
                        where="command line", key="RECIPE", rule="recipe or preset exists")
    recipe = load_recipe(path)
    return recipe, recipe.model, recipe.name


def _split_targets(args) -> Tuple[Optional[str], Optional[str]]:
    t = list(args.targets)
    if len(t) > 2:
        raise UserError(f"expected RECIPE [STRATEGY], got {len(t)} arguments", where="command line")
    if len(t) == 2:
        return t[0], t[1]
    if len(t) == 1:
        from naohai.strategy.schema import is_strategy_file
        return (None, t[0]) if is_strategy_file(t[0]) else (t[0], None)
    return None, None


def _run_import(args) -> int:
    from naohai.strategy.migrate import import_mindformers, write_imported
    swiglu = True
    if args.model:
        from naohai.config import MODEL_PRESETS
        swiglu = MODEL_PRESETS.get(args.model, {}).get("activation", "swiglu") == "swiglu"
    out, notes = import_mindformers(args.import_mindformers, args.model, swiglu)
    if args.out:
        write_imported(out, notes, args.import_mindformers, args.out)
        print(f"wrote {args.out}" + "".join(f"\nnote: {n}" for n in notes))
    else:
        import yaml
        print(yaml.safe_dump(out, sort_keys=False, default_flow_style=None).rstrip())
        for n in notes:
            print(f"# note: {n}")
    return 0


def _search_progress():
    """``progress(done, total)`` for the search: a bar on a terminal's stderr, else a line per quarter."""
    import sys
    state = {"bar": None, "said": -1}

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            if state["bar"] is None:
                from tqdm import tqdm
                state["bar"] = tqdm(total=total, desc="screening meshes", unit="mesh", file=sys.stderr, leave=False)
            state["bar"].n = done
            state["bar"].refresh()
            if done == total:
                state["bar"].close()
        elif total and done * 4 // total > state["said"]:
            state["said"] = done * 4 // total
            print(f"search: {done} of {total} meshes screened", file=sys.stderr, flush=True)
    return progress


def _run_search(args, recipe, cfg, model_name) -> int:
    from naohai.strategy.profiles import load_profile
    from naohai.strategy.search import RUNNABLE_SCHEDULERS, best_runnable, render_table, search, write_strategy
    if args.devices is None:
        raise UserError("--search needs --devices N", where="command line", key="--devices", rule="devices given")
    profile = load_profile(args.profile)
    mbs = args.micro_batch_size if args.micro_batch_size is not None else (
        recipe.train.micro_batch_size if recipe else 1)
    gb = args.global_batch if args.global_batch is not None else (
        recipe.train.global_batch_size if recipe else args.devices * mbs)
    if gb % mbs:
        raise UserError(f"global batch {gb} is not a multiple of the micro-batch size {mbs}", where="command line",
                        key="--global-batch", rule="global_batch % micro_batch_size == 0")
    schedulers = RUNNABLE_SCHEDULERS if args.schedulers is None else _schedulers(args.schedulers)
    cands = search(cfg, args.devices, gb, mbs, profile, args.top or DEFAULT_TOP, model_name,
                   progress=_search_progress(), schedulers=schedulers)
    if args.json:
        print(json.dumps([{"strategy": c.raw, "step_seconds": c.plan.step_seconds, "mfu": c.plan.mfu,
                           "tokens_per_second_per_device": c.plan.tokens_per_second_per_device,
                           "peak_bytes": c.peak_bytes, "runnable": c.runnable} for c in cands], indent=1))
    else:
        print(f"search: {model_name} on {args.devices} devices, global batch {gb}, micro-batch size {mbs}, "
              f"profile {profile.name}")
        print(render_table(cands))
    if args.write:
        if not cands:
            raise UserError("nothing to write: no layout fits", where="command line", key="--write")
        best = best_runnable(cands)
        if best is None:
            raise UserError(f"nothing to write: every row found ({len(cands)}) is planning-only (MindSpore 2.10 "
                            "cannot compile it as naohai applies it); search with --schedulers 1f1b, or a larger "
                            "--top", where="command line", key="--write")
        write_strategy(cands[best], args.write, model_name if recipe is None else None, args.devices)
        if not args.json:
            note = "" if best == 0 else f"; rows 1-{best} are planning-only"
            print(f"wrote {args.write} (row {best + 1}{note})")
    return 0


def _schedulers(text: str):
    """``--schedulers`` as a tuple of :data:`naohai.strategy.search.SCHEDULERS`; anything else is a UserError."""
    from naohai.strategy.search import SCHEDULERS
    names = [n.strip() for n in str(text).split(",")]
    bad = [n for n in names if n not in SCHEDULERS]
    if bad or len(set(names)) != len(names):
        raise UserError(f"'{text}' is not a comma-separated list of distinct schedulers from "
                        f"{', '.join(SCHEDULERS)}", where="command line", key="--schedulers")
    return tuple(names)


def _given(args, flags):
    return [f for f in flags if getattr(args, f[2:].replace("-", "_")) is not None]


def _refuse_strays(args) -> None:
    """Exit 2 for an option the chosen way of running plan would ignore."""
    if args.import_mindformers:
        stray = _given(args, SEARCH_ONLY) + (["--search"] if args.search else []) + \
            (["RECIPE_OR_STRATEGY"] if args.targets else [])
        mode = "--import-mindformers"
    else:
        stray = _given(args, IMPORT_ONLY) + ([] if args.search else _given(args, SEARCH_ONLY))
        mode = "--search" if args.search else "a plan of RECIPE STRATEGY"
    if stray:
        owner = {**{f: "--search" for f in SEARCH_ONLY}, **{f: "--import-mindformers" for f in IMPORT_ONLY},
                 "--search": "a search (without --import-mindformers)", "RECIPE_OR_STRATEGY": "a plan or a search"}
        one = len(stray) == 1
        raise UserError("; ".join(f"{f} is for {owner[f]}" for f in stray) +
                        f": with {mode} {'it' if one else 'they'} would do nothing (no file written, nothing searched). Drop {'it' if one else 'them'}, or "
                        f"run what {'it is' if one else 'they are'} for", where="command line", key=stray[0],
                        rule="options of the chosen plan mode")


def run(args) -> int:
    _refuse_strays(args)
    if args.import_mindformers:
        return _run_import(args)
    recipe_name, strategy_path = _split_targets(args)
    if strategy_path is None and not args.search:
        raise UserError("give RECIPE STRATEGY, a STRATEGY with a model: key, or RECIPE --devices N --search",
                        where="command line", rule="plan arguments")
    from naohai.strategy.plan import build_plan, render_text
    from naohai.strategy.profiles import load_profile
    from naohai.strategy.resolve import check_strategy
    from naohai.strategy.run_plan import plan_run
    from naohai.strategy.schema import load_strategy
    strategy = load_strategy(strategy_path) if strategy_path else None
    if recipe_name is None:
        if strategy is None or not strategy.model:
            raise UserError("no recipe given and the strategy has no model: key", where=strategy_path,
                            key="model", rule="recipe or model key")
        recipe_name = strategy.model
    elif not args.json:
        from naohai.config import MODEL_PRESETS, resolve_recipe_path
        if recipe_name in MODEL_PRESETS and os.path.exists(resolve_recipe_path(recipe_name)) \
                and not os.path.exists(recipe_name):   # a name that is both: the preset's model, the strategy's batch
            print(f"'{recipe_name}' read as the model preset {recipe_name}, batch from the strategy (recipes/"
                  f"{recipe_name}.yaml, which train and check read, is planned when given as a path)")
    recipe, cfg, model_name = _load_target(recipe_name)
    if args.search:
        return _run_search(args, recipe, cfg, model_name)
    if recipe is not None:     # a run: the batch adopted as naohai train adopts it
        run = plan_run(recipe, strategy, devices=args.devices, micro_batch_size=args.micro_batch_size,
                       global_batch=args.global_batch, compat=False)
        resolved = run.strategy
    else:                      # a model preset: the strategy's own batch keys
        resolved = check_strategy(strategy, cfg, args.devices, args.micro_batch_size, args.global_batch)
    adapters = None
    if recipe is not None and recipe.finetune is not None:   # fine-tuning: only the adapters train
        from naohai.strategy.lora import planned_adapters
        from naohai.strategy.memory import adapter_placements
        adapters = adapter_placements(resolved, planned_adapters(run.recipe, resolved))
    plan = build_plan(cfg, resolved, load_profile(args.profile), model_name, adapters=adapters)
    print(plan.to_json() if args.json else render_text(plan))
    return 0
