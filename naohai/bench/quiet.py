"""Was the machine quiet while the benchmark ran?  Two figures and one rule.

1. The CPU time other processes used during the run: the machine's busy time (user + nice +
   system + irq + softirq + steal of ``/proc/stat``) minus the benchmark's own (this process and
   its waited-for children, ``os.times``), as a share of cores x wall time.  Above
   :data:`MAX_OTHER_SHARE` (5%) the rows competed for the cores, and their ratios and MFU are
   not the machine's.  This is the measure of competition, and where it can be read it decides.
2. The 1-minute load average before the run, printed always and judged only where the share
   cannot be read (no ``/proc/stat``): above :data:`MAX_LOAD_BEFORE` (0.5, a quarter of a 2-core
   machine) other work was running when the benchmark started.  It is an exponentially decaying
   average, so a run started just after other work ended reads high although nothing competes
   with it (2026-11-27: 1.27 before a run during which other processes used 0.7% of the cores).
   The load after the run is printed too but not judged: the benchmark's own workers keep up to
   one runnable thread per core, so it is high after any run.

:func:`verdict` turns them into ``(quiet, warning text)``; the report prints the warning at the top.
"""
from __future__ import annotations

import os
import time
from typing import Dict, Optional, Tuple

MAX_LOAD_BEFORE = 0.5
MAX_OTHER_SHARE = 0.05


def load_average() -> Optional[Tuple[float, float, float]]:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return None


def busy_seconds(stat_text: str) -> Optional[float]:
    """Machine-wide busy CPU seconds of a ``/proc/stat`` text (its ``cpu`` line), None without one."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu":
            v = [int(x) for x in parts[1:]]
            busy = v[0] + v[1] + v[2] + sum(v[5:8])       # user nice system (idle iowait) irq softirq steal
            return busy / float(os.sysconf("SC_CLK_TCK"))
    return None


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class Watch:
    """Start at the beginning of a run, :meth:`stop` at its end: the figures :func:`verdict` judges."""

    def __init__(self):
        self.load_before = load_average()
        self._t0, self._own0, self._busy0 = time.monotonic(), own_seconds(), self._busy()

    @staticmethod
    def _busy() -> Optional[float]:
        try:
            with open("/proc/stat", "r", encoding="ascii") as fh:
                return busy_seconds(fh.read())
        except OSError:
            return None

    def stop(self, cpus: int) -> Dict[str, object]:
        wall = time.monotonic() - self._t0
        busy = self._busy()
        own = own_seconds() - self._own0
        other = None
        if busy is not None and self._busy0 is not None and wall > 0:
            other = other_share(busy - self._busy0, own, wall, cpus)
        quiet, warning = verdict(self.load_before[0] if self.load_before else None, other)
        return {"load_before": self.load_before, "load_after": load_average(), "wall_s": wall,
                "own_cpu_s": own, "other_cpu_share": other, "quiet": quiet, "warning": warning}


def other_share(machine_busy_s: float, own_s: float, wall_s: float, cpus: int) -> float:
    """Share of the machine (cpus x wall) that processes other than the benchmark kept busy (>= 0)."""
    return max(0.0, machine_busy_s - own_s) / (max(1, int(cpus)) * wall_s)


def verdict(load_before_1min: Optional[float], other: Optional[float]) -> Tuple[Optional[bool], str]:
    """(quiet?, warning) by the module's rule; None when neither figure could be read."""
    if other is not None:
        if other <= MAX_OTHER_SHARE:
            return True, ""
        problem = (f"other processes used {100 * other:.0f}% of the cores during the run (quiet: at most "
                   f"{100 * MAX_OTHER_SHARE:.0f}%)")
    elif load_before_1min is not None:
        if load_before_1min <= MAX_LOAD_BEFORE:
            return True, ""
        problem = (f"the 1-minute load average was {load_before_1min:.2f} before the run (quiet: at most "
                   f"{MAX_LOAD_BEFORE}; what other processes used during the run could not be read)")
    else:
        return None, "the load could not be read (no os.getloadavg, no /proc/stat): quietness unknown"
    return False, ("WARNING: the machine was not quiet -- " + problem + ". The rows competed with other work for "
                   "the cores: these tokens/s, ratios and MFU are not this machine's figures. Run again on an "
                   "idle machine.")
