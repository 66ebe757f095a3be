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


@pytest.mark.slow
@pytest.mark.parametrize("layout,kills,sig", [("standalone", 3, "KILL"), ("dp2", 2, "KILL"), ("standalone", 2, "TERM")])
def test_killed_runs_resume_to_the_same_losses(layout, kills, sig, micro_data, tmp_path):
    prepared, tok = micro_data
    res = subprocess.run([sys.executable, str(ROOT / "run" / "kill_resume.py"), "--kills", str(kills),
                          "--layout", layout, "--signal", sig, "--seed", "1", "--workdir", str(tmp_path),
                          "--prepared", str(prepared), "--tokenizer", str(tok)],
                         capture_output=True, text=True, timeout=1500, cwd=ROOT)
    result = json.loads(res.stdout.strip().splitlines()[-1])
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
