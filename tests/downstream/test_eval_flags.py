"""`naohai eval` flags checked before anything is scored: --out never overwrites a file that is not this
command's own results for the same model (a folder, a path under a file, a user's file, a checkpoint's
manifest), empty paths and out-of-range --batch name their flag, and --tasks flags given with --ids / --text
are errors rather than silently ignored.  Every case: one paragraph, exit 2, no traceback, nothing written."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from naohai.checkpoint.store import list_checkpoints
from naohai.cli import main
from naohai.downstream import tasks as dt
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, micro_data):
    prepared, tok = micro_data
    out = tmp_path_factory.mktemp("evalflags") / "run"
    start(plan_run(micro_recipe(out, prepared, tok, steps=2, save_every=2)), log=lambda *_: None,
          progress=False).run()
    return str(out)


@pytest.fixture
def no_scoring(monkeypatch):
    """The checks come first: loading the model for scoring is a test failure."""
    def refuse(*a, **k):
        raise AssertionError("the model was loaded for scoring before --out was checked")
    monkeypatch.setattr(dt, "load_scorer", refuse)


def _fail(argv, capsys):
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("naohai: error:")
    return " ".join(err.split())


def _snapshot(folder):
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as fh:
                out[p] = fh.read()
    return out


def test_out_that_is_not_our_results_is_refused_before_scoring(tmp_path, micro_run, capsys, no_scoring):
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n", encoding="utf-8")
    manifest = os.path.join(list_checkpoints(micro_run)[-1], "manifest.json")
    other = tmp_path / "other.json"          # results of `naohai eval --tasks` for another model
    other.write_text(json.dumps({"model": str(tmp_path / "another_run"), "checkpoint": None, "step": 1,
                                 "tasks": ["naohai_pydoc_cont"], "rows": [], "written": "2024-01-01T00:00:00Z"}))
    before = _snapshot(micro_run)
    for out in (mine, manifest, other):
        kept = open(out, "rb").read()
        msg = _fail(["eval", micro_run, "--tasks", "naohai_pydoc_cont", "--out", str(out)], capsys)
        assert "'--out'" in msg and "already exists" in msg and "nothing is overwritten" in msg, msg
        assert open(out, "rb").read() == kept
    assert _snapshot(micro_run) == before


def test_out_folder_link_or_under_a_file(tmp_path, micro_run, capsys, no_scoring):
    blocker = tmp_path / "file"
    blocker.write_text("x", encoding="utf-8")
    target = tmp_path / "target.json"
    target.write_text("{}", encoding="utf-8")
    link = tmp_path / "link.json"
    os.symlink(target, link)
    for out, words in ((str(tmp_path), "is a folder"), (str(blocker / "res.json"), "which is a file"),
                       (str(tmp_path / "new") + "/", "names a folder"), (str(link), "symbolic link")):
        msg = _fail(["eval", micro_run, "--tasks", "naohai_pydoc_cont", "--out", out], capsys)
        assert "'--out'" in msg and words in msg, msg
    assert blocker.read_text(encoding="utf-8") == "x" and target.read_text(encoding="utf-8") == "{}"
    assert os.path.islink(link) and not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv, flag", [
    (["--ids", ""], "--ids"),
    (["--text", ""], "--text"),
    (["--tasks", ""], "--tasks"),
    (["--tasks", "naohai_pydoc_cont", "--out", ""], "--out"),
])
def test_empty_values_name_their_flag(tmp_path, micro_run, capsys, no_scoring, argv, flag):
    msg = _fail(["eval", micro_run] + argv, capsys)
    assert f"'{flag}'" in msg or f"{flag}:" in msg, msg


@pytest.mark.parametrize("batch", ["99999999999999999999", "4097", "0", "-1", "two"])
def test_batch_has_bounds(tmp_path, micro_run, capsys, no_scoring, batch):
    msg = _fail(["eval", micro_run, "--tasks", "naohai_pydoc_cont", "--batch", batch], capsys)
    assert "--batch" in msg and "[1, 4096]" in msg, msg


@pytest.mark.parametrize("extra, flag", [
    (["--num-fewshot", "2"], "--num-fewshot"),
    (["--limit", "3"], "--limit"),
    (["--log-samples"], "--log-samples"),
    (["--include-path", "."], "--include-path"),
    (["--out", "res.json"], "--out"),
])
@pytest.mark.parametrize("mode", ["--ids", "--text"])
def test_tasks_flags_without_tasks_are_errors(tmp_path, micro_run, capsys, monkeypatch, extra, flag, mode):
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "ids.npy", np.arange(100))
    (tmp_path / "held.txt").write_text("The quick brown fox. " * 20, encoding="utf-8")
    src = "ids.npy" if mode == "--ids" else "held.txt"
    msg = _fail(["eval", micro_run, mode, src, "--device", "CPU"] + extra, capsys)
    assert f"'{flag}'" in msg and "belongs to --tasks" in msg, msg
    assert not (tmp_path / "res.json").exists()


def test_rerun_replaces_its_own_results_only_for_the_same_model(tmp_path, micro_run, capsys):
    out = tmp_path / "res.json"
    argv = ["eval", micro_run, "--tasks", "naohai_pydoc_cont", "--limit", "1", "--batch", "2", "--device", "CPU",
            "--out", str(out)]
    assert main(argv) == 0
    first = json.load(open(out))
    assert main(argv) == 0                   # our own earlier results for this model: replaced
    second = json.load(open(out))
    assert second["model"] == first["model"] == os.path.abspath(micro_run) and second["rows"]
    # the same file given for another model (one checkpoint folder of the run) is not ours to replace
    kept = out.read_bytes()
    msg = _fail(["eval", list_checkpoints(micro_run)[0], "--tasks", "naohai_pydoc_cont", "--limit", "1",
                 "--out", str(out)], capsys)
    assert "'--out'" in msg and "already exists" in msg
    assert out.read_bytes() == kept


def test_default_results_file_is_replaced_whichever_spelling_of_the_model(micro_run, capsys):
    """<run>/downstream/step_N.json written for the run folder is replaced when its checkpoint folder is
    evaluated; a file there that is not results is refused."""
    ckpt = list_checkpoints(micro_run)[-1]
    default = os.path.join(micro_run, "downstream", "step_2.json")
    base = ["--tasks", "naohai_pydoc_cont", "--limit", "1", "--batch", "2", "--device", "CPU"]
    assert main(["eval", micro_run] + base) == 0 and os.path.isfile(default)
    assert main(["eval", ckpt] + base) == 0
    assert json.load(open(default))["model"] == os.path.abspath(ckpt)
    with open(default, "w", encoding="utf-8") as fh:
        fh.write("my notes\n")
    msg = _fail(["eval", micro_run] + base, capsys)
    assert "'--out'" in msg and "already exists" in msg
    assert open(default, encoding="utf-8").read() == "my notes\n"
