"""SIGKILL (or SIGTERM) at random moments, resume, and every logged loss equals the uninterrupted run's
(run/kill_resume.py does the killing; 20 kills are its default, CI runs a few); two jobs on one folder,
exactly one runs (run/concurrent_runs.py; 20 tries by default, CI runs 2)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kill_resume(micro_data, workdir, *args):
    prepared, tok = micro_data
    res = subprocess.run([sys.executable, str(ROOT / "run" / "kill_resume.py"), *args, "--workdir", str(workdir),
                          "--prepared", str(prepared), "--tokenizer", str(tok)],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT)
    return res, json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def standalone_reference(micro_data, tmp_path_factory):
    """One uninterrupted standalone run of kill_resume.py's recipe, shared by the standalone checks
    (kill_resume.py checks its recorded recipe equals theirs)."""
    work = tmp_path_factory.mktemp("kill_resume_reference")
    res, result = _kill_resume(micro_data, work, "--kills", "0", "--layout", "standalone")
    assert res.returncode == 0 and result["ok"] and result["kills"] == 0, result
    return str(work / "reference")


@pytest.mark.slow
@pytest.mark.parametrize("layout,kills,sig", [("standalone", 3, "KILL"), ("dp2", 2, "KILL"), ("standalone", 2, "TERM")])
def test_killed_runs_resume_to_the_same_losses(layout, kills, sig, micro_data, tmp_path, request):
    shared = ["--reference", request.getfixturevalue("standalone_reference")] if layout == "standalone" else []
    res, result = _kill_resume(micro_data, tmp_path, "--kills", str(kills), "--layout", layout, "--signal", sig,
                               "--seed", "1", *shared)
    assert res.returncode == 0 and result["ok"], result
    assert result["kills"] == kills and result["steps_covered"] and result["mismatches"] == []
    assert result["reexecuted_rows"] == 0            # a resumed run drops the rows past its checkpoint
    if sig == "TERM":                                # every stop exited 143 and left no process behind
        assert set(result["exit_codes"]) <= {143, -15} and result["orphans"] == []


@pytest.mark.slow
def test_two_jobs_on_one_folder_exactly_one_runs(micro_data, tmp_path):
    prepared, tok = micro_data
    res = subprocess.run([sys.executable, str(ROOT / "run" / "concurrent_runs.py"), "--tries", "2", "--steps", "4",
                          "--workdir", str(tmp_path), "--prepared", str(prepared), "--tokenizer", str(tok)],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and result["ok"] and result["failed"] == 0, result


@pytest.mark.slow
def test_a_shared_reference_of_another_recipe_is_refused(standalone_reference, micro_data, tmp_path):
    res, result = _kill_resume(micro_data, tmp_path, "--kills", "1", "--steps", "8", "--reference", standalone_reference)
    assert res.returncode == 1 and "was trained with another recipe: train." in result["error"], result
