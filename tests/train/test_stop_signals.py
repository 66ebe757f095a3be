"""SIGINT (Ctrl-C) and SIGTERM on `naohai train`: one final checkpoint, a message naming the step the
run resumes from, exit 130 / 143, and after the resume metrics.jsonl holds each step once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from naohai.checkpoint import store
from naohai.config import write_recipe
from tests.conftest import micro_recipe

ROOT = Path(__file__).resolve().parents[2]


def _recipe(tmp_path, micro_data, **train):
    prepared, tok = micro_data
    recipe = micro_recipe(tmp_path / "run", prepared, tok, **{"steps": 400, "save_every": 5, "eval_every": 400,
                                                              "eval_batches": 1, "log_every": 1, **train})
    return write_recipe(recipe, str(tmp_path / "recipe.yaml"))


def _train(recipe, *extra, signum=None, after_step=None, env=None):
    """Run `naohai train`; send ``signum`` once the console shows ``after_step`` (None: at once
    after start-up began).  Returns (exit code, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "naohai.cli", "train", recipe, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    if signum is not None:
        if after_step is None:
            time.sleep(1.0)
        else:
            for line in proc.stdout:
                out.append(line)
                if f" step {after_step:6d}/" in line:
                    break
        proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=600)
    return proc.returncode, "".join(out) + stdout, stderr


def _train_steps(run):
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["split"] == "train"]


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_says_where_it_resumes_and_the_resume_logs_each_step_once(tmp_path, micro_data, signum,
                                                                                   code):
    recipe = _recipe(tmp_path, micro_data)
    rc, out, err = _train(recipe, signum=signum, after_step=7)
    assert rc == code, err[-2000:]
    last = err.strip().splitlines()[-1]
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else "SIGTERM"
    assert last.startswith(f"naohai: stopped by {name} after step "), last
    stopped = int(last.split("after step ")[1].split(";")[0])
    assert stopped >= 7 and f"resume from step {stopped}" in last and "Traceback" not in err
    assert store.verify(store.step_dir(str(tmp_path / "run"), stopped)).ok
    assert _train_steps(tmp_path / "run") == list(range(1, stopped + 1))
    rc, out, err = _train(recipe, "--max-steps", "3")
    assert rc == 0, err[-2000:]
    assert f"resumed from {store.step_dir(str(tmp_path / 'run'), stopped)} at step {stopped}" in out
    assert _train_steps(tmp_path / "run") == list(range(1, stopped + 4))
    assert "held-out loss" in out and "(step 0)" in out        # the summary covers the whole run


def test_sigterm_during_start_up_exits_143_without_a_traceback(tmp_path, micro_data):
    rc, _, err = _train(_recipe(tmp_path, micro_data), signum=signal.SIGTERM)
    assert rc == 143 and "stopped by SIGTERM" in err and "Traceback" not in err, err[-2000:]
    assert store.list_checkpoints(str(tmp_path / "run")) == []


def test_sigterm_without_time_for_a_save_skips_it_and_names_the_last_good_step(tmp_path, micro_data):
    rc, _, err = _train(_recipe(tmp_path, micro_data), signum=signal.SIGTERM, after_step=7,
                        env={"NAOHAI_STOP_GRACE": "0"})
    last = err.strip().splitlines()[-1]
    assert rc == 143 and "no final checkpoint" in last and "NAOHAI_STOP_GRACE" in last, err[-2000:]
    newest = int(store.read_manifest(store.list_checkpoints(str(tmp_path / "run"))[-1])["step"])
    assert newest % 5 == 0 and f"resume from step {newest}" in last
