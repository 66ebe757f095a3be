"""SIGKILL at random moments, resume, and every logged loss equals the uninterrupted run's
(run/kill_resume.py does the killing; 20 kills are its default, CI runs a few)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("layout,kills", [("standalone", 3), ("dp2", 2)])
def test_killed_runs_resume_to_the_same_losses(layout, kills, micro_data, tmp_path):
    prepared, tok = micro_data
    res = subprocess.run([sys.executable, str(ROOT / "run" / "kill_resume.py"), "--kills", str(kills),
                          "--layout", layout, "--seed", "1", "--workdir", str(tmp_path), "--prepared", str(prepared),
                          "--tokenizer", str(tok)], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0 and result["ok"], result
    assert result["kills"] == kills and result["steps_covered"] and result["mismatches"] == []
