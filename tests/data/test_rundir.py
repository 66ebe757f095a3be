"""A data run's output folder: new, resumed, restarted, or refused without losing anything."""
import json
import os

import pytest

from naohai.data.rundir import prepare_run_dir
from naohai.errors import UserError
from naohai.runfiles import LOCK_NAME as LOCK

CLEAN = {"format": "naohai-clean-v1", "config": {"a": 1}, "inputs": []}


def _prep(out, plan, restart=False, command="naohai data clean"):
    return prepare_run_dir(str(out), plan, restart, command, "a run with another config")


def test_new_resumed_and_restarted(tmp_path):
    out = tmp_path / "out"
    work = _prep(out, CLEAN)
    assert json.load(open(os.path.join(work, "plan.json"))) == CLEAN
    (out / "part-00000.jsonl").write_text("x\n")
    open(os.path.join(work, "unit-000000.json"), "w").write("{}")
    _prep(out, CLEAN)                                             # same plan: resume, nothing removed
    assert (out / "part-00000.jsonl").exists() and os.path.exists(os.path.join(work, "unit-000000.json"))
    changed = dict(CLEAN, config={"a": 2})
    with pytest.raises(UserError, match="another config; pass --restart"):
        _prep(out, changed)
    assert (out / "part-00000.jsonl").exists()                    # refused: nothing lost
    _prep(out, changed, restart=True)
    assert not (out / "part-00000.jsonl").exists() and not os.path.exists(os.path.join(work, "unit-000000.json"))
    assert json.load(open(os.path.join(work, "plan.json")))["config"] == {"a": 2}


def test_refusals_keep_what_is_there(tmp_path):
    f = tmp_path / "file"
    f.write_text("keep")
    with pytest.raises(UserError, match="is a file"):
        _prep(f, CLEAN)
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="holds no `naohai data clean` run"):
        _prep(other, CLEAN)
    scored = tmp_path / "scored"
    _prep(scored, {"format": "naohai-score-v1"}, command="naohai data score")
    (scored / "part-00000.jsonl").write_text("scored\n")
    with pytest.raises(UserError, match="another kind of run"):
        _prep(scored, CLEAN, restart=True)                        # --restart never deletes another kind's run
    assert f.read_text() == "keep" and (other / "mine.txt").read_text() == "keep"
    assert (scored / "part-00000.jsonl").read_text() == "scored\n"


def test_a_second_data_run_on_the_same_folder_is_refused(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(root)!r})
from naohai.data.rundir import prepare_run_dir
from naohai.runfiles import LOCK_NAME as LOCK
prepare_run_dir({str(out)!r}, {CLEAN!r}, False, "naohai data clean", "x")
print("started", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "started"
        with pytest.raises(UserError, match=f"in use by another job: pid {holder.pid}"):
            _prep(out, CLEAN)
    finally:
        holder.kill()
        holder.wait()
    _prep(out, CLEAN)          # the holder is gone: its lock went with it


def test_an_out_that_overlaps_the_inputs_is_refused_before_anything(tmp_path):
    """An input file or folder, a folder that a folder input's walk or a glob input would read back, or one
    that holds an input file: refused naming --out, before the lock file or anything else is written."""
    from naohai.data.rundir import input_overlap
    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    (raw / "a.jsonl").write_text('{"text": "a"}\n')
    (raw / "sub" / "b.jsonl").write_text('{"text": "b"}\n')
    os.symlink(raw, tmp_path / "link")
    files = [str(raw / "a.jsonl"), str(raw / "sub" / "b.jsonl")]
    cases = [
        ([str(raw)], raw, "is the input folder"),
        ([str(tmp_path / "link")], raw, "is the input folder"),                    # symlinks resolved
        ([str(raw)], tmp_path / "link" / "clean", "lies inside the input folder"),
        ([str(raw)], raw / "sub" / "deeper" / "clean", "lies inside the input folder"),
        (["file://" + str(raw)], raw / "clean", "lies inside the input folder"),   # the Spark engine's URIs
        ([str(raw / "a.jsonl")], raw / "a.jsonl", "is the input file"),
        ([str(raw / "sub")], raw, "contains the input file"),
        ([str(raw / "*" / "*.jsonl")], raw / "clean", "would be matched by the input pattern"),
        ([str(raw / "**" / "*.jsonl")], raw / "x" / "y", "would be matched by the input pattern"),
        ([str(raw)], raw / ".clean", None),                     # below a hidden name: the walk never reads it
        ([str(raw / "sub")], raw / "clean", None),
        ([str(raw / "*.jsonl")], raw / "clean", None),          # the pattern matches nothing written there
        ([str(raw / "**" / "*.txt")], raw / "clean", None),
        ([str(raw / "**" / "*.jsonl")], raw / ".clean", None),
        (["hdfs://nn/raw"], raw / "clean", None),
    ]
    for inputs, out, said in cases:
        got = input_overlap(str(out), inputs, files if said != "contains the input file" else files[1:])
        assert (got is None) if said is None else (got is not None and got.startswith(said)), (inputs, out, got)
    for inputs, out, restart in (([str(raw)], raw, True), ([str(raw)], raw / "clean", False)):
        before = sorted(p for p in tmp_path.rglob("*"))
        with pytest.raises(UserError, match=r"'--out'.*\(rule: --out is no input file or folder"):
            prepare_run_dir(str(out), CLEAN, restart, "naohai data clean", "x", inputs, files)
        assert sorted(p for p in tmp_path.rglob("*")) == before and not (raw / LOCK).exists()
