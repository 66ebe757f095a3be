"""Stopping an msrun job when ``naohai launch`` is signalled, and never leaving a process behind.

msrun 2.10 starts each worker in its own session (``preexec_fn=os.setsid``) and answers
SIGINT by SIGKILLing every worker (no final checkpoint) and SIGTERM by dying alone (the
workers live on, orphaned).  :class:`JobStopper` therefore takes SIGINT and SIGTERM in
``naohai launch`` itself while msrun runs:

1. SIGTERM goes to every worker's process group (msrun's children that lead their own
   session); each worker's ``naohai train`` agrees with the others on a step, writes one
   final checkpoint and exits (:mod:`naohai.interrupt`);
2. after the workers are gone (or ``NAOHAI_STOP_GRACE`` + 15 s), msrun's own process group
   (msrun, the scheduler, its ``tail`` helpers) gets SIGTERM, then SIGKILL for what is left;
3. :class:`naohai.interrupt.Interrupted` reports the workers' own last line and exits
   128 + the signal.

msrun is started in its own process group with ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, and the
workers set the same for themselves under msrun, so a ``naohai launch`` killed outright
(SIGKILL) still takes msrun and then the workers with it.
"""
from __future__ import annotations

import os
import signal
import time
from typing import List, Optional

from naohai import interrupt

#: set in the workers' environment by a joined ``naohai launch``: the job ends with it
END_WITH_LAUNCH = "NAOHAI_END_WITH_LAUNCH"


def _stat(pid: int):
    try:
        with open(f"/proc/{pid}/stat", "r", encoding="utf-8") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields          # [state, ppid, pgrp, session, ...]


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def children(pid: int) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and int(st[1]) == pid:
                found.append(int(entry))
    return found


def group_members(pgid: int) -> List[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and int(st[2]) == pgid and st[0] != "Z":
                found.append(int(entry))
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def start_options() -> dict:
    """``subprocess.Popen`` options for msrun: its own process group, SIGTERM when naohai launch dies."""
    parent = os.getpid()
    return {"start_new_session": True,
            "preexec_fn": lambda: interrupt.die_with_parent(signal.SIGTERM, parent=parent)}


class JobStopper:
    """Takes SIGINT / SIGTERM while msrun (``proc``) runs; see the module docstring."""

    def __init__(self, proc, log_dir: str, log_name: str = "worker"):
        self.proc = proc
        self.log_dir, self.log_name = log_dir, log_name
        self.signum: Optional[int] = None
        self._old = {}

    def __enter__(self) -> "JobStopper":
        for sig in interrupt.STOP_SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum, _frame) -> None:
        if self.signum is not None:
            return                      # already stopping
        self.signum = signum
        print(f"naohai launch: {interrupt.signal_name(signum)} received; asking the workers to save and stop",
              flush=True)
        self.stop(signum)
        raise interrupt.Interrupted(signum, self.report(signum))

    def stop(self, signum: int) -> None:
        workers = [p for p in children(self.proc.pid) if (_stat(p) or [0, 0, 0, -1])[3] == str(p)]
        for w in workers:
            _signal_group(w, signal.SIGTERM)
        deadline = time.time() + interrupt.grace_seconds() + 15.0
        while time.time() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        pgid = self.proc.pid            # msrun leads its own group (start_new_session)
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.time() + 5.0
        while time.time() < deadline and (group_members(pgid) or any(_alive(w) for w in workers)):
            time.sleep(0.1)
        for g in [pgid, *workers]:
            _signal_group(g, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001 - best effort: it was SIGKILLed
            pass

    def report(self, signum: int) -> str:
        last = None
        path = os.path.join(self.log_dir, f"{self.log_name}_0.log")
        try:
            with open(path, "r", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if line.startswith("naohai: stopped by"):
                        last = line.strip()[len("naohai: "):]
        except OSError:
            pass
        return (f"job stopped by {interrupt.signal_name(signum)}; rank 0: {last}" if last else
                f"job stopped by {interrupt.signal_name(signum)}; rank 0 logged no final line (see {path}); "
                f"run the same command to resume from the newest checkpoint")
