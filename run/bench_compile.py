"""Benchmark (not a test): 8-rank simulated compile of what `naohai train` compiles for the tiny
model -- the train step, then the eval net -- plus the IR deadlock checks.

Usage: python run/bench_compile.py [--strategy strategies/tiny-dp2-mp2-pp2.yaml] [--mbs 2]
Prints one line: wall time of the msrun job (start-up + init + build + both compiles on every
rank), the slowest rank's compile time (train + eval), peak RSS per worker and the IR-check
verdict.  Target: <= 150 s wall on a 2-core machine.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from naohai.simulate.harness import run_compile  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategy", default=str(ROOT / "strategies/tiny-dp2-mp2-pp2.yaml"))
    ap.add_argument("--recipe", default=str(ROOT / "recipes/tiny.yaml"))
    ap.add_argument("--mbs", type=int, default=2, help="train.micro_batch_size override")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workdir")
    args = ap.parse_args()
    workdir = args.workdir or tempfile.mkdtemp(prefix="naohai-bench-")
    overrides = [f"train.micro_batch_size={args.mbs}"]
    strategy = str(Path(args.strategy).resolve())
    # same MindSpore 2.10 compatibility fixes as `naohai check --compat-fixes` (copy in workdir)
    import yaml
    from naohai.config import load_recipe, read_yaml
    from naohai.strategy.compat import compat_fixes
    from naohai.strategy.run_plan import plan_run
    recipe = load_recipe(str(Path(args.recipe).resolve()), overrides)
    first = plan_run(recipe, strategy, compat=False)
    fixed, notes = compat_fixes(read_yaml(strategy), first.strategy, first.recipe)
    if notes:
        strategy = str(Path(workdir) / "compat-strategy.yaml")
        Path(strategy).write_text(yaml.safe_dump(fixed, sort_keys=False))
    kwargs = {"recipe_path": str(Path(args.recipe).resolve()), "strategy_path": strategy, "overrides": overrides}
    resolved = plan_run(recipe, strategy).strategy
    rep = run_compile("naohai.train.compile_target:build_for_compile", args.ranks, workdir, kwargs=kwargs,
                      ir_check={"stages": resolved.stages, "clip": recipe.train.optimizer.grad_clip > 0})
    compile_s = [r.result.get("compile_s") for r in rep.per_rank if r.result and r.result.get("compile_s")]
    rss = [r.result.get("peak_rss_mb", 0) for r in rep.per_rank if r.result]
    graphs = (rep.per_rank[0].result or {}).get("graphs") if rep.per_rank else None
    ir = "passed" if rep.ir_checks and rep.ir_checks["passed"] else "FAILED" if rep.ir_checks else "not run"
    print(f"bench_compile: {Path(args.strategy).stem} on {args.ranks} ranks: {'OK' if rep.ok else 'FAILED'}; "
          f"graphs {graphs}; wall {rep.wall_s:.1f} s (target <= 150); slowest rank compile "
          f"{max(compile_s, default=0):.1f} s; peak RSS per worker max {max(rss, default=0):.0f} MB, mean "
          f"{sum(rss) / max(len(rss), 1):.0f} MB; IR checks {ir}; workdir {workdir}")
    return 0 if rep.ok else 1


if __name__ == "__main__":
    sys.exit(main())
