"""naohai.runfiles: the folder lock, the writable check, unique temporaries, moving files aside."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from naohai.errors import UserError
from naohai.runfiles import (check_writable, holding_folder, lock_folder, move_into_new_folder, temp_dir_beside,
                             unlock_folder)
from tests.conftest import folder_locked

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from naohai.runfiles import lock_folder
lock_folder({folder!r}, "test")
print("locked", flush=True)
time.sleep(60)
"""


def _hold(folder):
    proc = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(ROOT), folder=str(folder))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_holder_is_refused_with_the_first_ones_pid_and_the_lock_dies_with_it(tmp_path):
    proc = _hold(tmp_path / "run")
    try:
        with pytest.raises(UserError) as err:
            lock_folder(str(tmp_path / "run"), "training run")
        assert f"pid {proc.pid}" in str(err.value) and "in use by another job" in str(err.value)
    finally:
        proc.kill()
        proc.wait()
    # killed holder: the kernel released its lock, no stale lock file blocks the next job
    lock_folder(str(tmp_path / "run"), "training run")
    unlock_folder(str(tmp_path / "run"))


def test_a_with_block_holds_the_folder_and_gives_back_only_what_it_took(tmp_path):
    run = tmp_path / "run"
    with holding_folder(str(run), "training run"):
        assert folder_locked(run)
    assert not folder_locked(run)
    with pytest.raises(RuntimeError):
        with holding_folder(str(run), "training run"):
            raise RuntimeError("the job failed")
    assert not folder_locked(run)
    lock_folder(str(run), "training run")             # held before the block: still held after it
    with holding_folder(str(run), "training run"):
        pass
    assert folder_locked(run)
    unlock_folder(str(run))
    assert not folder_locked(run)


def test_writable_check_names_a_file_and_a_read_only_folder(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_writable(str(tmp_path / "afile"))
    with pytest.raises(UserError, match="is a file"):
        check_writable(str(tmp_path / "afile" / "sub"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    # as root permission bits stop nothing; sysfs refuses new entries to everyone
    target = str(ro / "out") if not os.access(str(ro), os.W_OK) else "/sys/naohai-test-output"
    try:
        with pytest.raises(UserError, match="cannot write the output folder"):
            check_writable(target)
    finally:
        ro.chmod(0o700)


def test_temporaries_are_unique_and_never_a_users_name(tmp_path):
    users = tmp_path / "out.tmp"
    users.mkdir()
    (users / "precious").write_text("keep")
    a, b = temp_dir_beside(str(tmp_path / "out")), temp_dir_beside(str(tmp_path / "out"))
    assert a != b and os.path.dirname(a) == str(tmp_path)
    assert (users / "precious").read_text() == "keep"


def test_move_into_new_folder_never_overwrites(tmp_path):
    for name in ("checkpoints", "metrics.jsonl"):
        (tmp_path / name).mkdir() if name == "checkpoints" else (tmp_path / name).write_text("old")
    first = move_into_new_folder(str(tmp_path), ["checkpoints", "metrics.jsonl", "absent"], "superseded")
    (tmp_path / "metrics.jsonl").write_text("newer")
    second = move_into_new_folder(str(tmp_path), ["metrics.jsonl"], "superseded")
    assert first != second
    assert Path(first, "metrics.jsonl").read_text() == "old" and Path(second, "metrics.jsonl").read_text() == "newer"
    assert move_into_new_folder(str(tmp_path), ["metrics.jsonl"], "superseded") is None


def test_a_forked_child_that_forgets_the_lock_does_not_hold_the_folder(tmp_path):
    """A child forked while the folder is locked (the Spark driver's zygote and the workers forked from it)
    closes its copy with forget_locks_in_child: once the parent lets go, the folder is free though the child
    lives on. Without it the child held the folder (a rerun after a killed driver was refused for 0.7 s and more)."""
    from naohai.runfiles import forget_locks_in_child, unlock_folder
    folder = tmp_path / "out"
    folder.mkdir()
    lock_folder(str(folder), "test")
    go_read, go_write = os.pipe()                 # parent -> child: end now
    done_read, done_write = os.pipe()             # child -> parent: forgotten
    pid = os.fork()
    if pid == 0:
        try:
            forget_locks_in_child()
            os.write(done_write, b"x")
            os.read(go_read, 1)
        finally:
            os._exit(0)
    try:
        assert os.read(done_read, 1) == b"x"
        assert folder_locked(folder)              # the parent still holds it: the child's close did not release it
        unlock_folder(str(folder))
        assert not folder_locked(folder)          # free while the child lives
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.write(go_write, b"x")
        os.waitpid(pid, 0)
        for fd in (go_read, go_write, done_read, done_write):
            os.close(fd)
