"""In-loop downstream evaluation (train.eval): rows on the live weights at the right steps, equal to scoring
the saved checkpoint of the same step afterwards; a task that does not load stops the run before anything."""
from __future__ import annotations

import json
import os
import re

import pytest

from naohai.errors import UserError
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe
from tests.downstream.test_tasks import MC_ROWS, MC_YAML, write_task


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_rows_at_the_right_steps_equal_the_checkpoint_scored_later(tmp_path, micro_data, capfd):
    from naohai.downstream import tasks as dt
    from naohai.downstream.backend import NaohaiEvalLM

    prepared, tok = micro_data
    folder = tmp_path / "tasks"
    write_task(folder, "loop_probe", MC_YAML, MC_ROWS * 3)
    out = tmp_path / "run"
    recipe = micro_recipe(out, prepared, tok, steps=8, save_every=4,
                          eval={"tasks": ["loop_probe"], "every": 4, "include_path": [str(folder)], "batch": 2})
    logs = []
    capfd.readouterr()
    start(plan_run(recipe), log=logs.append, progress=False).run()
    # between the training log's lines: no lm-eval progress bars (request building, tokenising)
    printed = capfd.readouterr()
    assert "it/s]" not in printed.err + printed.out and "Tokenizing inputs" not in printed.err
    rows = [r for r in _rows(str(out)) if r["split"] == "downstream"]
    assert [r["step"] for r in rows] == [0, 4, 8]
    assert all(r["task"] == "loop_probe" and r["n"] == 9 and 0 <= r["acc"] <= 1 and "acc_norm" in r for r in rows)
    assert os.path.isfile(out / "downstream.png")
    assert any(line.startswith("downstream evaluation: scoring graph compiled in ") for line in logs)
    # the end line: evaluations + the graph's compile, against the job's and the loop's wall time
    end = [line for line in logs if line.startswith("downstream evaluation: 3 evaluation(s) in ")]
    assert len(end) == 1
    m = re.search(r"in ([\d.]+) s .* \+ ([\d.]+) s compiling that graph = ([\d.]+) s: ([\d.]+)% of the run's "
                  r"([\d.]+) s since the job started, ([\d.]+)% of the ([\d.]+) s since the training loop", end[0])
    evals, compile_s, spent, job_pct, job_s, loop_pct, loop_s = map(float, m.groups())
    assert spent == pytest.approx(evals + compile_s, abs=0.11) and job_s >= loop_s > 0
    rounding = 0.05 * 100 * (1 / job_s + spent / job_s ** 2)      # the printed seconds carry one decimal
    assert job_pct == pytest.approx(100 * spent / job_s, abs=0.1 + rounding) and loop_pct >= job_pct
    events = os.listdir(out / "tensorboard")
    assert events

    # the live weights at step 4 are the checkpoint of step 4: scoring it afterwards gives the same metrics
    prepared_tasks = dt.prepare(["loop_probe"], include=[str(folder)])
    scorer, tk, step = dt.load_scorer(str(out / "checkpoints" / "step_00000004"), batch=2)
    assert step == 4
    later = dt.rows(dt.run(NaohaiEvalLM(scorer=scorer, tok=tk, step=step), prepared_tasks), step)
    live = rows[1]
    for r in later:
        assert live[r["metric"]] == pytest.approx(r["value"])


def test_a_task_that_does_not_load_stops_the_run_before_anything(tmp_path, micro_data):
    prepared, tok = micro_data
    out = tmp_path / "run"
    recipe = micro_recipe(out, prepared, tok, eval={"tasks": ["no_such_task_xyz"], "every": 4})
    with pytest.raises(UserError, match="train.eval.tasks.*no task named 'no_such_task_xyz'"):
        start(plan_run(recipe), log=lambda *_: None, progress=False)
    assert not os.path.exists(out)


def test_bad_eval_keys():
    with pytest.raises(UserError, match="train.eval.every"):
        micro_recipe("x", eval={"tasks": ["a"], "every": 0})
    with pytest.raises(UserError, match="train.eval.tasks"):
        micro_recipe("x", eval={"tasks": ["a", "a"]})
