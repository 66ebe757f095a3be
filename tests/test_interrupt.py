"""naohai.interrupt: children die with their parent (data clean's workers included), the grace setting."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from naohai.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def _children(pid):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pids, seconds):
    deadline = time.time() + seconds
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


PARENT = """
import os, sys, time
sys.path.insert(0, {root!r})
from naohai.interrupt import die_with_parent
parent = os.getpid()
if os.fork() == 0:
    die_with_parent(parent=parent)
    time.sleep(120)
    os._exit(0)
print("forked", flush=True)
time.sleep(120)
"""


def test_a_child_that_asked_dies_when_its_parent_is_killed():
    proc = subprocess.Popen([sys.executable, "-c", PARENT.format(root=str(ROOT))], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "forked"
    kids = _children(proc.pid)
    assert len(kids) == 1
    proc.kill()                         # SIGKILL: nothing in the parent runs
    proc.wait()
    assert _gone_within(kids, 5) == []


def test_data_clean_workers_end_when_the_command_is_terminated(tmp_path):
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    with open(tmp_path / "in.jsonl", "w") as fh:
        for i in range(20000):
            fh.write(json.dumps({"text": " ".join(words[(i * 7 + j) % 10] + str(i + j) for j in range(80))}) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "naohai.cli", "data", "clean", str(tmp_path / "in.jsonl"),
                             "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress"], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and len(_children(proc.pid)) < 2:
        time.sleep(0.05)
    kids = _children(proc.pid)
    assert proc.poll() is None and len(kids) >= 2, "the clean finished before its workers could be seen"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert _gone_within(kids, 10) == []        # on main 10b9408 they stayed, re-parented to pid 1


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_stop_grace_setting_is_checked(monkeypatch, raw):
    from naohai.interrupt import grace_seconds
    monkeypatch.setenv("NAOHAI_STOP_GRACE", raw)
    with pytest.raises(UserError, match="NAOHAI_STOP_GRACE"):
        grace_seconds()
    monkeypatch.setenv("NAOHAI_STOP_GRACE", "40")
    assert grace_seconds() == 40.0


@pytest.mark.parametrize("raw", ["nan", "-1", "1e400"])
def test_a_wrong_stop_grace_stops_a_command_before_any_work(monkeypatch, tmp_path, capsys, raw):
    """It was read only when SIGTERM came: a preempted `naohai train` then exited 2 on it instead of saving, and
    lost its steps since the last checkpoint (found by a probe)."""
    from naohai.cli import main
    monkeypatch.setenv("NAOHAI_STOP_GRACE", raw)
    out = tmp_path / "run"
    assert main(["train", "tiny", "train.steps=2", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err
    assert "NAOHAI_STOP_GRACE" in err and "Traceback" not in err
    assert not out.exists()
