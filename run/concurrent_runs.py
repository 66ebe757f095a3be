"""Concurrency drill (not a unit test): two `naohai train` (or, with --launch, two 2-worker
`naohai launch`) on one output folder, many times.

Usage:
  python run/concurrent_runs.py [--tries 20] [--max-offset 2.0] [--seed 0] [--workdir DIR]
                                [--prepared DIR --tokenizer FILE] [--launch]

Each try starts two identical jobs on a fresh folder, the second after a random offset in
[0, --max-offset] seconds (either may reach the lock first).  Exactly one must run (exit 0)
and the other exit 2 within 5 s of its own start, naming the holder ("in use by another job:
pid ..."); the winner's checkpoints must verify (sizes and SHA-256) and its logged losses
equal those of an undisturbed run of the same recipe, each step once.  Prints one JSON line;
exit 0 when every try passed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "run"))

from kill_resume import command, losses, write_recipe  # noqa: E402  (the same micro recipe, commands, metrics)

LAYOUT = "standalone"     # --launch: "launch" (naohai launch, 2 data-parallel workers through msrun)


def _start(recipe: Path, env):
    argv = command(recipe, LAYOUT, recipe.parent / f"{recipe.stem}-logs-{time.time_ns()}")
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True), time.time()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-offset", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir")
    ap.add_argument("--prepared")
    ap.add_argument("--tokenizer")
    ap.add_argument("--launch", action="store_true", help="both jobs are `naohai launch` with 2 workers")
    args = ap.parse_args(argv)
    global LAYOUT
    LAYOUT = "launch" if args.launch else "standalone"
    from naohai.checkpoint import store
    work = Path(args.workdir or tempfile.mkdtemp(prefix="naohai-concurrent-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prepared, tokenizer = args.prepared, args.tokenizer
    if not prepared:
        prepared, tokenizer = str(work / "data"), str(work / "tokenizer.model")
    ref_recipe = work / "reference.yaml"
    write_recipe(ref_recipe, work / "reference", prepared, tokenizer, args.steps)
    proc, _ = _start(ref_recipe, env)
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        print(json.dumps({"error": f"reference run failed ({proc.returncode})", "stderr": err[-2000:]}))
        return 1
    reference = losses(work / "reference")
    rng = random.Random(args.seed)
    failures, loser_s, winners_first = [], [], 0
    for i in range(args.tries):
        recipe = work / f"try{i}.yaml"
        out = work / f"try{i}"
        write_recipe(recipe, out, prepared, tokenizer, args.steps)
        offset = rng.uniform(0, args.max_offset)
        a, ta = _start(recipe, env)
        time.sleep(offset)
        b, tb = _start(recipe, env)
        ends = {}
        while len(ends) < 2:
            for name, p in (("a", a), ("b", b)):
                if name not in ends and p.poll() is not None:
                    ends[name] = time.time()
            time.sleep(0.02)
        errs = {"a": a.stderr.read(), "b": b.stderr.read()}
        codes = {"a": a.returncode, "b": b.returncode}
        starts = {"a": ta, "b": tb}
        if sorted(codes.values()) != [0, 2]:
            failures.append({"try": i, "offset": round(offset, 2), "codes": codes,
                             "stderr": {k: v[-300:] for k, v in errs.items()}})
            continue
        winner = "a" if codes["a"] == 0 else "b"
        loser = "b" if winner == "a" else "a"
        winners_first += winner == "a"
        took = ends[loser] - starts[loser]
        loser_s.append(round(took, 2))
        problems = []
        if took > 5.0:
            problems.append(f"the loser took {took:.1f} s")
        if "in use by another job: pid" not in " ".join(errs[loser].split()):
            problems.append("the loser's message does not name the holder")
        bad = [c for c in store.list_checkpoints(str(out)) if not store.verify(c).ok]
        if bad or not store.list_checkpoints(str(out)):
            problems.append(f"checkpoints that do not verify: {bad or 'none written'}")
        if losses(out) != reference:
            problems.append("the winner's losses differ from the undisturbed run's")
        if problems:
            failures.append({"try": i, "offset": round(offset, 2), "problems": problems})
    result = {"tries": args.tries, "failures": failures[:5], "failed": len(failures),
              "first_started_won": winners_first, "loser_exit_s_max": max(loser_s) if loser_s else None,
              "loser_exit_s_median": sorted(loser_s)[len(loser_s) // 2] if loser_s else None,
              "ok": not failures}
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
