"""Launching a simulated-device compile job and collecting its per-rank verdicts.

Owns :func:`run_compile`: build/find the stub libraries, start ``msrun`` with N local
workers running :mod:`naohai.simulate.worker` against a target, enforce a timeout
(killing msrun and every worker it spawned, found by a per-run environment marker,
since msrun puts workers in their own sessions), then gather each rank's
``result.json`` into a :class:`CompileReport` (text table + ``summary.json``).  A rank
that died without a result is reported with how it ended (its exit code or signal from msrun's
output, or the timeout) and the tail of its log.  When every rank
compiled, the deadlock checks of :mod:`naohai.simulate.ircheck` run on each graph's IR
(``ir_checks`` in the report; a violation fails it).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from naohai.errors import UserError
from naohai.simulate.ircheck import check_compile_dir, render as render_ir_checks
from naohai.simulate.msgparse import log_errors, op_from_log, strategy_key
from naohai.simulate.stubs import ensure_stubs

RUN_MARKER_VAR = "NAOHAI_SIM_RUN_ID"
_WORKER = Path(__file__).with_name("worker.py")


@dataclasses.dataclass
class RankResult:
    rank: int
    ok: bool
    result: Optional[Dict[str, Any]]  # the worker's JSON, None if the rank wrote none
    log_tail: str = ""

    @property
    def error(self) -> Optional[Dict[str, Any]]:
        return (self.result or {}).get("error")

    @property
    def parameters(self) -> Dict[str, Any]:
        return (self.result or {}).get("parameters") or {}

    @property
    def comm_ops(self) -> Dict[str, int]:
        return (self.result or {}).get("comm_ops") or {}

    def verdict(self) -> str:
        if self.result is None:
            return "CRASHED (no result written)"
        if self.ok:
            return "ok"
        err = self.error or {}
        where = f" in {err['op']}" if err.get("op") else ""
        return f"{err.get('type', 'Error')}{where}: {(err.get('message') or '').splitlines()[0][:160]}"


@dataclasses.dataclass
class CompileReport:
    target: str
    ranks: int
    workdir: Path
    wall_s: float
    timed_out: bool
    returncode: Optional[int]
    per_rank: List[RankResult]
    ir_checks: Optional[Dict[str, Any]] = None

    @property
    def compiled(self) -> bool:
        return not self.timed_out and all(r.ok for r in self.per_rank)

    @property
    def ok(self) -> bool:
        return self.compiled and (self.ir_checks is None or bool(self.ir_checks.get("passed")))

    @property
    def failed_ranks(self) -> List[int]:
        return [r.rank for r in self.per_rank if not r.ok]

    def rank(self, r: int) -> RankResult:
        """The result of global rank ``r`` (a compile of chosen ranks holds only those)."""
        for res in self.per_rank:
            if res.rank == r:
                return res
        raise KeyError(f"rank {r} was not compiled")

    def to_dict(self) -> Dict[str, Any]:
        return {"target": self.target, "ranks": self.ranks, "workdir": str(self.workdir),
                "wall_s": self.wall_s, "timed_out": self.timed_out,
                "returncode": self.returncode, "ok": self.ok,
                "failed_ranks": self.failed_ranks, "ir_checks": self.ir_checks,
                "per_rank": [{"rank": r.rank, "ok": r.ok, "verdict": r.verdict(),
                              "result": r.result, "log_tail": r.log_tail}
                             for r in self.per_rank]}

    def render(self) -> str:
        kinds = sorted({k for r in self.per_rank for k in r.comm_ops})
        head = ["rank", "verdict", "compile_s", "rss_mb", "params"] + kinds
        rows = []
        for r in self.per_rank:
            res = r.result or {}
            rows.append([str(r.rank), r.verdict()[:70], str(res.get("compile_s", "-")),
                         str(res.get("peak_rss_mb", "-")), str(len(r.parameters))]
                        + [str(r.comm_ops.get(k, 0)) for k in kinds])
        widths = [max(len(x[i]) for x in [head] + rows) for i in range(len(head))]
        lines = [f"compile {self.target} on {self.ranks} simulated devices: "
                 f"{'compiled' if self.compiled else 'FAILED'} in {self.wall_s:.1f} s"
                 + (" (TIMED OUT)" if self.timed_out else "")]
        for row in [head] + rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        groups: Dict[str, List[int]] = {}
        for r in self.per_rank:  # ranks failing with the same message are listed once
            if not r.ok:
                key = (r.error or {}).get("message") or f"crash:{r.rank}"
                groups.setdefault(key, []).append(r.rank)
        for members in groups.values():
            r = self.rank(members[0])
            names = ",".join(str(m) for m in members)
            if r.result is None:
                lines.append(f"--- rank {names}: no result.json {(r.log_tail.splitlines() or [''])[0]}; log tail:")
                lines.extend(r.log_tail.splitlines()[-15:])
                continue
            err = r.error or {}
            lines.append(f"--- rank {names}: {err.get('type')} op={err.get('op')} "
                         f"parameter={err.get('parameter')}"
                         + (f"; strategy key: {err['strategy_key']}" if err.get("strategy_key") else ""))
            lines.append((err.get("message") or "")[:600])
            if err.get("source"):
                lines.append(f"  at {err['source']}")
            lines.extend("  log: " + e[:300] for e in (err.get("log_errors") or [])[:4])
        if self.ir_checks is not None:
            lines.append(render_ir_checks(self.ir_checks))
        return "\n".join(lines)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_with_marker(marker: str) -> List[int]:
    """PIDs of live processes whose environment carries this run's marker."""
    needle = f"{RUN_MARKER_VAR}={marker}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def _kill_run(proc: subprocess.Popen, marker: str) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(3):
        pids = _pids_with_marker(marker)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, n_chars: int = 3000) -> str:
    if not path.exists():
        return f"(no log at {path})"
    data = path.read_bytes()[-n_chars:]
    return data.decode(errors="replace")


_EXIT_RE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
_PID_RE = re.compile(r"^\[\w+\] \w+\((\d+)[,:]", re.M)


def how_ranks_ended(msrun_out: Path, log_dir: Path, ranks: int) -> Dict[int, str]:
    """For each rank whose worker msrun saw exit non-zero: ``"exit code N"`` or ``"killed by signal N
    (NAME)"``.  msrun names workers by pid; a worker's log lines carry its pid."""
    text = msrun_out.read_text(errors="replace") if msrun_out.exists() else ""
    codes = {int(pid): int(code) for pid, code in _EXIT_RE.findall(text)}
    out: Dict[int, str] = {}
    if not codes:                      # every worker exited 0, or msrun was killed at the timeout
        return out
    for r in range(ranks):
        log = log_dir / f"worker_{r}.log"
        if not log.exists():
            continue
        m = _PID_RE.search(log.read_text(errors="replace"))
        code = codes.get(int(m.group(1))) if m else None
        if code is None:
            continue
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown"
            hint = (": killed from outside, most often by the kernel's out-of-memory killer"
                    if -code == signal.SIGKILL else "")
            out[r] = f"killed by signal {-code} ({name}){hint}"
        else:
            out[r] = f"exit code {code}"
    return out


def _wait_reporting(proc, workdir: Path, ranks: int, t0: float, timeout: float,
                    progress: Optional[Callable[[str], None]]) -> bool:
    """Wait for ``proc`` (True) or ``timeout`` seconds (False); meanwhile pass ``progress`` one line per
    rank whose ``rank_<r>/result.json`` appeared (the worker writes it atomically)."""
    if progress is None:
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    reported = set()

    def report_new():
        for r in range(ranks):
            path = workdir / f"rank_{r}" / "result.json"
            if r in reported or not path.exists():
                continue
            reported.add(r)
            try:
                ok = bool(json.loads(path.read_text()).get("ok"))
            except (OSError, ValueError):
                ok = False
            progress(f"  rank {r}: {'ok' if ok else 'FAILED'} after {time.time() - t0:.0f} s")

    while True:
        try:
            proc.wait(timeout=1.0)
            report_new()
            return True
        except subprocess.TimeoutExpired:
            report_new()
            if time.time() - t0 > timeout:
                return False


def run_compile(target: str, ranks: int, workdir, timeout: float = 900.0,
                kwargs: Optional[Dict[str, Any]] = None, precompile_only: bool = True,
                keep_ir: bool = False, sys_path: Sequence[str] = (),
                cluster_time_out: int = 300, ir_check: Optional[Dict[str, Any]] = None,
                save_slices: bool = False, progress: Optional[Callable[[str], None]] = None) -> CompileReport:
    """Compile ``target`` (``"module:function"``) on ``ranks`` simulated GPUs.

    ``kwargs`` go to the target function; ``sys_path`` entries are prepended to the
    workers' ``sys.path`` (for targets outside installed packages).  Everything is
    written under ``workdir``: ``spec.json``, ``logs/worker_<r>.log``,
    ``rank_<r>/{result.json,strategy.ckpt,final.ir,<graph>.ir}``, ``summary.json``.
    ``ir_check`` (``{"stages": S, "clip": bool}``, plus ``"trainable": [names]`` for a fine-tuning
    run) turns on the IR checks;
    ``save_slices`` writes each rank's compile-time parameter slices (``rank_<r>/slices.ckpt``).
    ``progress(line)`` receives one short line per rank as its verdict appears (rank, seconds since
    the start, ok / FAILED), so a compile of several minutes is not silent.
    """
    if ranks < 1:
        raise UserError(f"ranks must be >= 1, got {ranks}", key="ranks")
    if ":" not in target:
        raise UserError(f"target must look like 'package.module:function', got {target!r}",
                        key="target")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    for old in list(workdir.glob("rank_*/result.json")) + [workdir / "summary.json"]:
        old.unlink(missing_ok=True)  # never report a previous run's verdict
    stubs = ensure_stubs()
    marker = uuid.uuid4().hex
    spec = {"target": target, "kwargs": kwargs or {}, "out_dir": str(workdir),
            "keep_ir": keep_ir, "save_slices": save_slices, "sys_path": [str(Path(p).resolve()) for p in sys_path]}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    env = dict(os.environ)
    env.update(stubs.env(ranks, precompile_only=precompile_only))
    # msrun starts workers with plain 'python': make that this interpreter
    env["PATH"] = os.pathsep.join([str(stubs.cuda_home / "bin"), os.path.dirname(sys.executable),
                                   env["PATH"]])
    env[RUN_MARKER_VAR] = marker
    env["MS_DEV_SAVE_GRAPHS"] = "1"
    env["MS_DEV_SAVE_GRAPHS_PATH"] = str(workdir / "ir")
    # only the final front-end graph is read (communication-op counts): dumping every pass's
    # IR costs compile time
    env.setdefault("MS_DEV_DUMP_IR_PASSES", "validate")
    env.setdefault("GLOG_v", "2")
    env["PYTHONUNBUFFERED"] = "1"
    log_dir = workdir / "logs"
    cmd = [sys.executable, "-c", "import sys; from mindspore.parallel.cluster.run import main; "
           "sys.argv[0] = 'msrun'; sys.exit(main())",
           f"--worker_num={ranks}", f"--local_worker_num={ranks}",
           f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True",
           f"--cluster_time_out={int(cluster_time_out)}", str(_WORKER), str(spec_path)]
    t0 = time.time()
    timed_out = False
    with open(workdir / "msrun.out", "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=str(workdir), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            timed_out = not _wait_reporting(proc, workdir, ranks, t0, timeout, progress)
        finally:
            _kill_run(proc, marker)  # also reaps any worker left behind
    wall = time.time() - t0
    per_rank = []
    ended = how_ranks_ended(workdir / "msrun.out", log_dir, ranks)
    for r in range(ranks):
        res_path = workdir / f"rank_{r}" / "result.json"
        if res_path.exists():
            res = json.loads(res_path.read_text())
            err = res.get("error")
            if err is not None:  # the log often says why better than the exception does
                log_path = log_dir / f"worker_{r}.log"
                details = log_errors(log_path.read_text(errors="replace")) if log_path.exists() else []
                err["log_errors"] = details
                err["op"] = op_from_log(details) or err.get("op")
                err["strategy_key"] = strategy_key(err)
            per_rank.append(RankResult(r, bool(res.get("ok")), res))
        else:
            why = ended.get(r) or ("still running at the timeout" if timed_out
                                   else "stopped by msrun after another rank's worker failed" if ended
                                   else "ended without a result; msrun reported no exit code")
            per_rank.append(RankResult(r, False, None, f"({why})\n" + _tail(log_dir / f"worker_{r}.log")))
    report = CompileReport(target, ranks, workdir, round(wall, 2), timed_out,
                           proc.returncode, per_rank)
    if ir_check is not None and report.compiled:
        graphs = (per_rank[0].result or {}).get("graphs") or []
        report.ir_checks = check_compile_dir(workdir, ranks, graphs, stages=int(ir_check.get("stages", 1)),
                                             clip=bool(ir_check.get("clip", False)),
                                             trainable=ir_check.get("trainable"),
                                             token_weight=ir_check.get("token_weight"))
    (workdir / "summary.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    return report
