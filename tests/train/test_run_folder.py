"""A run folder belongs to one job and one model: the lock, the identity check on resume,
--no-resume moving the old run aside, and metrics.jsonl holding each step once after a resume."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from naohai.checkpoint import store
from naohai.cli import main
from naohai.config import write_recipe
from naohai.strategy.run_plan import plan_run
from naohai.train.callbacks import Callback
from naohai.train.job import start
from naohai.train.metrics import read_metrics
from tests.conftest import folder_locked, micro_recipe

ROOT = Path(__file__).resolve().parents[2]


def _recipe_file(tmp_path, out, micro_data, **train):
    prepared, tok = micro_data
    recipe = micro_recipe(out, prepared, tok, **{"steps": 4, "save_every": 2, "eval_every": 4, "eval_batches": 1,
                                                 "log_every": 1, **train})
    return write_recipe(recipe, str(tmp_path / "recipe.yaml"))


def _digests(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}


def test_another_model_in_the_folder_is_refused_and_no_resume_moves_it_aside(tmp_path, micro_data, capsys):
    out = tmp_path / "run"
    recipe = _recipe_file(tmp_path, out, micro_data)
    assert main(["train", recipe]) == 0
    before = _digests(out / "checkpoints")
    metrics_before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", recipe, "model.num_layers=3"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.num_layers: 2 in the checkpoint, 3 now" in err and "--no-resume" in err and "Traceback" not in err
    assert _digests(out / "checkpoints") == before and (out / "metrics.jsonl").read_text() == metrics_before
    # --no-resume: the 2-layer run is kept, byte for byte, in a superseded-* folder; the new run starts at 0
    assert main(["train", recipe, "model.num_layers=3", "--no-resume"]) == 0
    aside = list(out.glob("superseded-*"))
    assert len(aside) == 1 and _digests(aside[0] / "checkpoints") == before
    assert (aside[0] / "metrics.jsonl").read_text() == metrics_before
    newest = store.read_manifest(store.list_checkpoints(str(out))[-1])
    assert newest["recipe"]["model"]["num_layers"] == 3 and newest["step"] == 4
    assert [r["step"] for r in read_metrics(str(out)) if r["split"] == "train"] == [1, 2, 3, 4]


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from naohai.runfiles import lock_folder
lock_folder({folder!r}, "training run")
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_job_on_a_locked_folder_exits_2_naming_the_holder(tmp_path, micro_data, capsys):
    out = tmp_path / "run"
    recipe = _recipe_file(tmp_path, out, micro_data)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), folder=str(out))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["train", recipe]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"pid {holder.pid}" in err and "in use by another job" in err and "Traceback" not in err
        assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()
        # a recipe or strategy mistake is told as itself, busy folder or not (the rules come before the lock)
        strategy = tmp_path / "s.yaml"
        strategy.write_text("name: s\nmesh: {data: 1, model: 1, pipeline: 1}\nglobal_batch: 8\n")
        assert main(["train", recipe, "--strategy", str(strategy)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "global_batch 8" in err and "in use by another job" not in err and "Traceback" not in err
    finally:
        holder.kill()
        holder.wait()


def test_train_called_in_process_gives_its_folder_back_however_it_ends(tmp_path, micro_data, monkeypatch, capsys):
    """The CLI's ``main`` in a test or a notebook: the run folder is not kept locked after the command
    (a pytest worker held ``runs/default`` for its life, and the other worker's tests on it failed)."""
    from naohai.errors import UserError

    out = tmp_path / "run"
    recipe = _recipe_file(tmp_path, out, micro_data)

    def fails(*args, **kwargs):
        assert folder_locked(out)                       # held while the job runs
        raise UserError("cannot read the corpus", where="corpus.txt")

    monkeypatch.setattr("naohai.train.job.train", fails)
    assert main(["train", recipe]) == 2
    assert "cannot read the corpus" in capsys.readouterr().err
    assert not folder_locked(out)


class _Crash(Callback):
    """Stops the process (as a kill would) after ``at`` steps, metrics rows for those steps written."""

    def __init__(self, at):
        self.at = at

    def on_step(self, trainer, rec):
        if trainer.step == self.at:
            raise RuntimeError("simulated crash")


def test_resume_drops_metrics_rows_past_the_checkpoint(tmp_path, micro_data):
    prepared, tok = micro_data
    recipe = micro_recipe(tmp_path / "run", prepared, tok, steps=8, save_every=4, eval_every=4, eval_batches=1,
                          log_every=1)
    with pytest.raises(RuntimeError):
        start(plan_run(recipe), log=lambda *_: None, progress=False, callbacks=[_Crash(6)]).run()
    assert [r["step"] for r in read_metrics(str(tmp_path / "run")) if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    lines = []
    trainer = start(plan_run(recipe), log=lines.append, progress=False)
    assert trainer.resume() and trainer.step == 4
    trainer.run()
    rows = read_metrics(str(tmp_path / "run"))
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, 9))
    assert [r["step"] for r in rows if r["split"] == "valid"] == [0, 4, 8]
    assert any("2 rows after step 4 dropped" in ln for ln in lines), lines


@pytest.mark.parametrize("where", ["a file", "under a file", "read-only"])
def test_an_output_folder_that_cannot_be_written_is_one_paragraph(tmp_path, micro_data, capsys, where):
    (tmp_path / "afile").write_text("keep")
    out = {"a file": tmp_path / "afile", "under a file": tmp_path / "afile" / "run",
           "read-only": Path("/sys/naohai-test-run")}[where]       # sysfs refuses new entries, even to root
    recipe = _recipe_file(tmp_path, out, micro_data)
    assert main(["train", recipe]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "train.output_dir" in err and "Traceback" not in err
    assert ("is a file" in err) if where != "read-only" else ("cannot write the output folder" in err)
    assert (tmp_path / "afile").read_text() == "keep"
