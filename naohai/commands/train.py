"""`naohai train RECIPE [--strategy FILE] [--device D] [key=value ...]`: run a training job."""
from __future__ import annotations

from naohai.commands._args import allow_intermixed


def register(sub) -> None:
    p = sub.add_parser("train", help="train a recipe (one device, or every rank of a strategy under msrun)")
    p.add_argument("recipe", help="recipe YAML file, or a name in recipes/ (e.g. tiny)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 train.lr=1e-3")
    p.add_argument("--strategy", help="strategy YAML file (default: one device)")
    p.add_argument("--device", choices=("auto", "CPU", "GPU", "Ascend"),
                   help="device (default: the recipe's train.device, auto = Ascend, else GPU, else CPU)")
    p.add_argument("--no-resume", action="store_true", help="start from step 0 even if checkpoints exist")
    p.add_argument("--resume-from", metavar="CHECKPOINT",
                   help="resume from this checkpoint folder (it must verify) instead of the newest good one")
    p.add_argument("--max-steps", type=int, help="stop after this many steps in this invocation")
    p.add_argument("--output-dir", help="same as train.output_dir=...")
    allow_intermixed(p)
    p.set_defaults(run=run)


def run(args) -> int:
    """Stop signals are taken by naohai (blocked before MindSpore starts a thread, see
    :mod:`naohai.interrupt`) for the whole command, and given back at its end."""
    import os
    import signal
    import threading
    from naohai import interrupt

    if threading.current_thread() is not threading.main_thread():
        return _run(args)
    before = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    interrupt.block_stop_signals()
    interrupt.current().watch()
    if os.environ.get("MS_ROLE") and os.environ.get("NAOHAI_END_WITH_LAUNCH"):
        interrupt.die_with_parent(signal.SIGTERM)   # a worker or the scheduler under naohai launch: end with msrun
    try:
        return _run(args)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _run(args) -> int:
    import os
    from naohai.config import load_recipe
    from naohai.errors import UserError
    from naohai.devices import runs_on_cpu
    from naohai.runfiles import holding_folder
    from naohai.strategy.host_memory import check_host_memory
    from naohai.strategy.run_plan import plan_run

    if args.no_resume and args.resume_from:
        raise UserError("--no-resume and --resume-from contradict each other", where="command line",
                        key="--resume-from")
    for flag, value in (("--output-dir", args.output_dir), ("--resume-from", args.resume_from),
                        ("--strategy", args.strategy)):
        if value is not None and not value.strip():     # "" took the recipe's folder, the newest checkpoint, ...
            raise UserError("is empty; give a path or leave the flag out", where="command line", key=flag,
                            rule="a non-empty path")
    if args.max_steps is not None and args.max_steps < 1:
        raise UserError(f"must be a positive integer, got {args.max_steps} (0 prepared the data and compiled, then "
                        f"trained nothing)", where="command line", key="--max-steps", rule="--max-steps >= 1")
    overrides = list(args.overrides)
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={args.output_dir}")
    # every recipe and strategy rule first (no MindSpore yet): a mistake is told whether or not the run
    # folder is busy, and leaves no folder behind
    run = plan_run(load_recipe(args.recipe, overrides), args.strategy)
    if os.environ.get("MS_ROLE"):
        return _train(args, run)     # under msrun rank 0 locks the folder once the ranks are known (naohai.train.job)
    # a run too big for this machine's CPU: told before the folder is taken or the data prepared
    check_host_memory(run, processes=1, on_cpu=lambda: runs_on_cpu(args.device or run.recipe.train.device))
    # one process: the run folder is locked before MindSpore is imported, so a second job on it is told at once
    with holding_folder(run.recipe.train.output_dir, "training run", key="train.output_dir"):
        return _train(args, run)


def _train(args, run) -> int:
    from naohai.train.job import train

    run.tell()
    result = train(run, resume=not args.no_resume, resume_from=args.resume_from,
                   max_steps=args.max_steps, device=args.device)
    if result.is_writer:
        # the whole run's held-out losses (earlier invocations included), not only this invocation's
        from naohai.train.metrics import read_metrics
        evals = {int(r["step"]): float(r["loss"]) for r in read_metrics(result.output_dir)
                 if r.get("split") == "valid" and "loss" in r}
        evals.update(result.evals)
        if evals:
            first, last = min(evals), max(evals)
            print(f"done: {result.steps_done} steps; held-out loss {evals[first]:.4f} (step {first}) -> "
                  f"{evals[last]:.4f} (step {last}); output in {result.output_dir}")
    return 0
