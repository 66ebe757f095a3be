"""Fault-recovery check (not a unit test): SIGKILL (or SIGTERM) a training run at random moments, resume
it each time, and compare every logged step loss with an uninterrupted run of the same recipe.

Usage:
  python run/kill_resume.py [--kills 20] [--layout standalone|dp2] [--signal KILL|TERM] [--seed 0]
                            [--workdir DIR] [--prepared DIR --tokenizer FILE] [--reference RUN_DIR]

With ``--signal TERM`` only the command (``naohai train``, or ``naohai launch`` for dp2) gets SIGTERM,
as a scheduler sends it: it must exit 143 (after its final checkpoint) and leave no process of its
process groups (nor any process carrying the run's marker) behind; the JSON adds the exit codes,
the longest stop and the orphans found.

The recipe is the micro model the tests use (2 layers, hidden 32) with a checkpoint every 2
steps and a loss logged every step.  Each kill moment is random: after a random number (0-4)
of newly logged steps, plus a random 0-0.5 s, so kills land in start-up, compile, steps and
checkpoint saves alike.  Every
row of the interrupted run's ``metrics.jsonl`` must equal the uninterrupted loss of its step
exactly; a resumed run drops the rows past its checkpoint, so each step is logged once
(``reexecuted_rows`` counts rows logged twice: 0 expected).  ``dp2`` runs 2 data-parallel workers through
``naohai launch`` (msrun) and kills every process of the job.  A pass runs from scratch to the
last step (killed and resumed as often as the kill budget allows); passes repeat until all
kills are spent.  Prints one JSON line; exit 0 when all losses match and every pass logged
every step.  ``--reference`` compares against an earlier uninterrupted run of the same recipe (its
recorded recipe is checked) instead of training one again, so several checks can share one.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARK = "NAOHAI_KILL_RESUME_RUN"


def write_recipe(path: Path, out: Path, prepared: str, tokenizer: str, steps: int) -> None:
    import yaml
    recipe = {"name": "kill-resume",
              "model": {"preset": "tiny", "vocab_size": 320, "vocab_pad_multiple": 64, "hidden_size": 32,
                        "num_layers": 2, "num_heads": 4, "ffn_hidden_size": 64, "seq_length": 32},
              "data": {"corpus": ["builtin:pydoc"], "holdout_fraction": 0.05, "prepared_dir": prepared,
                       "tokenizer": tokenizer},
              "train": {"steps": steps, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3, "min_lr": 3e-4,
                        "warmup_steps": 2, "log_every": 1, "eval_every": steps, "eval_batches": 1,
                        "save_every": 2, "keep_checkpoints": 2, "output_dir": str(out)}}
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))


def _recipe_differs(resolved: Path, recipe: Path) -> str:
    """'' when a run's recorded recipe (``recipe.resolved.yaml``) trains what ``recipe`` trains (all but
    train.output_dir equal), else the first differing key."""
    from naohai.config import load_recipe
    if not resolved.exists():
        return f"no {resolved}"
    a, b = load_recipe(str(resolved)).to_dict(), load_recipe(str(recipe)).to_dict()
    for d in (a, b):
        d["train"].pop("output_dir", None)
    for section in sorted(set(a) | set(b)):
        x, y = a.get(section), b.get(section)
        if not (isinstance(x, dict) and isinstance(y, dict)):
            if x != y:
                return section
            continue
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                return f"{section}.{key}"
    return ""


def command(recipe: Path, layout: str, log_dir: Path):
    if layout == "standalone":
        return [sys.executable, "-m", "naohai.cli", "train", str(recipe)]
    strategy = log_dir.parent / "dp2.yaml"
    strategy.write_text("name: dp2\nmesh: {data: 2}\n")
    # MindSpore's default node time-out (30 s): MS_NODE_TIMEOUT also bounds each CPU collective's wait, so with
    # 5 s the host barrier after compiling failed when one rank finished compiling more than 5 s before the
    # other (a full two-worker test run, 2026-11-29: "Broadcast wait receiving ... failed").  The kills here
    # end every process of the job, so the time-out does not delay them.
    return [sys.executable, "-m", "naohai.cli", "launch", str(recipe), "--strategy", str(strategy),
            "--log-dir", str(log_dir), "--master-port", str(_free_port()), "--node-time-out", "30"]


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(marker: str):
    needle = f"{MARK}={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as fh:
                    if needle in fh.read().split(b"\0"):
                        yield int(entry)
            except OSError:
                continue


def _pgrp(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "r") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def _in_groups(groups):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "r") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z" and int(fields[2]) in groups:
                found.append(int(entry))
    return found


def run_once(cmd, env, timeout: float, kill_when=None, sig: str = "KILL", stats=None):
    """Run ``cmd``; once ``kill_when()`` is true, stop it: SIGKILL it and every process it started
    (``sig`` KILL), or SIGTERM to the command alone (``sig`` TERM: it must save, exit 143 and leave no
    process of its process groups behind; ``stats`` collects exit codes, stop times and orphans).
    Returns (finished normally, exit code, seconds, stderr tail)."""
    marker = uuid.uuid4().hex
    env = dict(env, **{MARK: marker})
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        while kill_when is not None and proc.poll() is None and time.time() - t0 < timeout:
            if kill_when():
                raise subprocess.TimeoutExpired(cmd, 0)
            time.sleep(0.02)
        proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        return True, proc.returncode, time.time() - t0, proc.stderr.read().decode(errors="replace")[-2000:]
    except subprocess.TimeoutExpired:
        if sig == "TERM":
            return _terminate(proc, marker, t0, stats)
        for pid in [proc.pid, *_marked(marker)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait()
        for pid in _marked(marker):   # msrun's workers live in their own sessions
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return False, None, time.time() - t0, ""


def _terminate(proc, marker, t0, stats):
    groups = {g for g in (_pgrp(p) for p in [proc.pid, *_marked(marker)]) if g is not None}
    t_sig = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    stop_s = time.time() - t_sig
    time.sleep(0.5)
    orphans = sorted(set(_marked(marker)) | set(_in_groups(groups)))
    for pid in orphans:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    err = proc.stderr.read().decode(errors="replace")
    if stats is not None:
        stats.setdefault("codes", []).append(proc.returncode)
        stats.setdefault("stop_s", []).append(round(stop_s, 2))
        stats.setdefault("orphans", []).extend(orphans)
        last = [ln for ln in err.splitlines() if "stopped by" in ln]
        stats.setdefault("last_lines", []).append(last[-1][-160:] if last else err[-160:])
    # exit 0: the run finished before the signal landed; anything else than 143 (or -15, see main) fails
    return proc.returncode == 0, proc.returncode, time.time() - t0, err[-2000:]


def losses(out: Path):
    """(step, loss) of every complete train row of metrics.jsonl (a row cut by a kill is ignored)."""
    rows = []
    path = out / "metrics.jsonl"
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("split") == "train":
            rows.append((int(rec["step"]), rec["loss"]))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--layout", choices=("standalone", "dp2"), default="standalone")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir")
    ap.add_argument("--prepared", help="prepared data folder (default: prepare the builtin corpus here)")
    ap.add_argument("--tokenizer")
    ap.add_argument("--signal", choices=("KILL", "TERM"), default="KILL",
                    help="KILL: SIGKILL every process of the job; TERM: SIGTERM to the command alone, which must "
                         "save, exit 143 and leave no process behind (default KILL)")
    ap.add_argument("--reference", help="the output folder of an uninterrupted run of the same recipe (this "
                                        "script's own, same --layout, --steps, --prepared): compared against instead "
                                        "of training one again; its recorded recipe must equal this one's")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="naohai-kill-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    prepared, tokenizer = args.prepared, args.tokenizer
    if not prepared:
        prepared, tokenizer = str(work / "data"), str(work / "tokenizer.model")
    ref_recipe, cut_recipe = work / "reference.yaml", work / "interrupted.yaml"
    write_recipe(ref_recipe, work / "reference", prepared, tokenizer, args.steps)
    write_recipe(cut_recipe, work / "interrupted", prepared, tokenizer, args.steps)
    timeout = 900.0
    for old in ("reference", "interrupted"):   # never compare against a previous invocation's files
        shutil.rmtree(work / old, ignore_errors=True)
    if args.reference:
        ref_dir, ref_s = Path(args.reference).resolve(), 0.0
        differs = _recipe_differs(ref_dir / "recipe.resolved.yaml", cut_recipe)
        if differs:
            print(json.dumps({"error": f"--reference {ref_dir} was trained with another recipe: {differs}"}))
            return 1
    else:
        ref_dir = work / "reference"
        ok, code, ref_s, err = run_once(command(ref_recipe, args.layout, work / "logs-ref"), env, timeout)
        if not ok or code != 0:
            print(json.dumps({"error": f"reference run failed ({code})", "stderr": err}))
            return 1
    reference = dict(losses(ref_dir))
    if sorted(reference) != list(range(1, args.steps + 1)):
        print(json.dumps({"error": f"the reference {ref_dir} logged steps {sorted(reference)}, not 1-{args.steps}"}))
        return 1
    rng = random.Random(args.seed)
    stats = {}
    kills, runs, passes, rows_checked, reexecuted, mismatches, gaps = 0, 0, 0, 0, 0, [], []
    while kills < args.kills:
        # one pass: from scratch to the last step, killed at random moments and resumed each time
        passes += 1
        shutil.rmtree(work / "interrupted", ignore_errors=True)
        while True:
            runs += 1
            kill_when = None
            if kills < args.kills:
                start_rows, new_rows, delay = len(losses(work / "interrupted")), rng.randint(0, 4), rng.uniform(0, 0.5)
                reached = []

                def kill_when(start_rows=start_rows, new_rows=new_rows, delay=delay, reached=reached):
                    if not reached and len(losses(work / "interrupted")) - start_rows >= new_rows:
                        reached.append(time.time())
                    return bool(reached) and time.time() - reached[0] >= delay
            ok, code, _, err = run_once(command(cut_recipe, args.layout, work / f"logs-{runs}"), env, timeout,
                                        kill_when, args.signal, stats)
            if not ok:
                kills += 1
                # 143: naohai stopped on the signal; -15: it landed before the interpreter reached naohai's
                # handling (Python start-up): the default action, which a shell also reports as 143
                if args.signal == "TERM" and code not in (143, -signal.SIGTERM):
                    print(json.dumps({"error": f"run {runs} exited {code} after SIGTERM, not 143", "stderr": err}))
                    return 1
                continue
            if code != 0:
                print(json.dumps({"error": f"run {runs} exited {code}", "stderr": err}))
                return 1
            break
        rows = losses(work / "interrupted")
        covered = sorted({s for s, _ in rows})
        rows_checked += len(rows)
        reexecuted += len(rows) - len(covered)
        mismatches += [(passes, s, v, reference.get(s)) for s, v in rows if reference.get(s) != v]
        if covered != list(range(1, args.steps + 1)):
            gaps.append((passes, covered))
    result = {"layout": args.layout, "signal": args.signal, "kills": kills, "runs": runs, "passes": passes,
              "reference_wall_s": round(ref_s, 1), "rows_checked": rows_checked, "reexecuted_rows": reexecuted,
              "steps_covered": not gaps, "mismatches": mismatches[:5],
              "ok": not mismatches and not gaps and not stats.get("orphans")}
    if args.signal == "TERM":
        result.update({"exit_codes": sorted(set(stats.get("codes", []))), "stop_s_max": max(stats.get("stop_s", [0])),
                       "orphans": stats.get("orphans", []), "last_lines": stats.get("last_lines", [])[:3]})
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
