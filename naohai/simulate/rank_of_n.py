"""Compiling chosen ranks of an N-device layout, one rank at a time, each in its own process pair.

Owns :func:`compile_ranks`.  Where :func:`naohai.simulate.harness.run_compile` starts N msrun
workers (every rank a process, so N is a few), this starts, for each chosen rank ``k``, one
scheduler process and ONE worker that MindSpore's DryRun communication library tells it is
rank ``k`` of ``N`` (``MS_SIMULATION_LEVEL=1``, ``RANK_SIZE=N``, ``RANK_ID=k``, with the
scheduler's ``MS_WORKER_NUM=1``); the worker is :mod:`naohai.simulate.worker` as under msrun,
so the network, the parallel context and ``result.json`` are the same.  MindSpore then
builds every communication group of the real mesh as a simulation group and compiles rank
``k``'s graph at full width: real slices, real optimizer-shard groups, real micro-batches
(measured facts: /work/shared/docs/rank-of-n-compile.md of this project; 2.10 caps
``global_rank`` at 4095).

Ranks run one after another (each pair holds the host's memory alone); a rank that runs past
``timeout`` is killed with its scheduler.  The result is a :class:`CompileReport` over the
compiled ranks only; the IR checks, when asked, compare what those ranks can be checked for
among themselves (:func:`naohai.simulate.ircheck.check_compile_dir` with ``only=``).

Run as a script (``python rank_of_n.py --scheduler``) it is the scheduler of one pair.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make sibling imports work
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from naohai.errors import UserError  # noqa: E402

#: MindSpore 2.10 refuses a larger global rank (mindspore/parallel/_auto_parallel_context.py)
MAX_RANK = 4095


def _scheduler_main() -> int:
    import mindspore as ms
    from mindspore.communication import init
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("GPU")
    init()   # returns once the worker has registered; the process ends when the worker finalises
    return 0


def _pair_env(world: int, rank: int, port: int, marker: str, workdir: Path, base: Dict[str, str]) -> Dict[str, str]:
    from naohai.simulate.harness import RUN_MARKER_VAR
    from naohai.simulate.stubs import ensure_stubs
    stubs = ensure_stubs()
    env = dict(base)
    env.update(stubs.env(1, precompile_only=True))
    env["PATH"] = os.pathsep.join([str(stubs.cuda_home / "bin"), os.path.dirname(sys.executable), env["PATH"]])
    env.update({RUN_MARKER_VAR: marker, "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": str(port),
                "MS_WORKER_NUM": "1", "PYTHONUNBUFFERED": "1", "GLOG_v": env.get("GLOG_v", "2"),
                "MS_DEV_SAVE_GRAPHS": "1", "MS_DEV_SAVE_GRAPHS_PATH": str(workdir / "ir")})
    env.setdefault("MS_DEV_DUMP_IR_PASSES", "validate")
    for var in ("RANK_ID", "RANK_SIZE", "DEVICE_ID", "MS_NODE_ID", "MS_ROLE", "MS_SIMULATION_LEVEL"):
        env.pop(var, None)
    return env


def compile_one(spec_path: Path, world: int, rank: int, workdir: Path, timeout: float) -> Dict[str, Any]:
    """Compile ``rank`` of ``world`` with the spec at ``spec_path``; {"wall_s", "timed_out", "log"}."""
    from naohai.simulate.harness import _kill_run, free_port
    marker = uuid.uuid4().hex
    port = free_port()
    env = _pair_env(world, rank, port, marker, workdir, dict(os.environ))
    logs = workdir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    sched_env = dict(env, MS_ROLE="MS_SCHED")
    worker_env = dict(env, MS_ROLE="MS_WORKER", MS_NODE_ID="0", MS_SIMULATION_LEVEL="1", RANK_SIZE=str(world),
                      RANK_ID=str(rank), DEVICE_ID="0")
    worker_py = Path(__file__).with_name("worker.py")
    t0 = time.time()
    timed_out = False
    with open(logs / f"scheduler_{rank}.log", "wb") as s_out, open(logs / f"worker_{rank}.log", "wb") as w_out:
        sched = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--scheduler"], env=sched_env,
                                 cwd=str(workdir), stdout=s_out, stderr=subprocess.STDOUT, start_new_session=True)
        worker = subprocess.Popen([sys.executable, str(worker_py), str(spec_path)], env=worker_env,
                                  cwd=str(workdir), stdout=w_out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            worker.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                sched.wait(timeout=0 if timed_out else 30)
            except subprocess.TimeoutExpired:
                pass
            _kill_run(worker, marker)
            _kill_run(sched, marker)
    return {"wall_s": round(time.time() - t0, 2), "timed_out": timed_out,
            "log": str(logs / f"worker_{rank}.log")}


def compile_ranks(target: str, world: int, ranks: Sequence[int], workdir, *, timeout: float = 900.0,
                  kwargs: Optional[Dict[str, Any]] = None, keep_ir: bool = False,
                  ir_check: Optional[Dict[str, Any]] = None, progress=None):
    """Compile ``ranks`` of a ``world``-device layout (``target`` as for ``run_compile``), one pair each.

    ``timeout`` is per rank.  ``progress(line)`` receives one line per rank as it finishes.  Returns
    a :class:`~naohai.simulate.harness.CompileReport` whose ``per_rank`` holds the chosen ranks in
    order, with each rank's wall time in its result (``pair_wall_s``); ``summary.json`` as usual.
    """
    from naohai.simulate.harness import CompileReport, RankResult, _tail
    from naohai.simulate.ircheck import check_compile_dir
    from naohai.simulate.msgparse import log_errors, op_from_log, strategy_key
    bad = [k for k in ranks if not 0 <= k < world]
    if bad:
        raise UserError(f"ranks {bad} are outside 0-{world - 1} (the layout has {world} devices)",
                        where="command line", key="--ranks", rule="0 <= rank < devices")
    if max(ranks) > MAX_RANK:
        raise UserError(f"MindSpore 2.10 caps the global rank at {MAX_RANK}; rank {max(ranks)} cannot be compiled "
                        f"on its own", where="command line", key="--ranks", rule=f"rank <= {MAX_RANK}")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    for old in list(workdir.glob("rank_*/result.json")) + [workdir / "summary.json"]:
        old.unlink(missing_ok=True)  # never report a previous run's verdict
    spec = {"target": target, "kwargs": kwargs or {}, "out_dir": str(workdir), "keep_ir": keep_ir,
            "save_slices": False, "sys_path": []}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    t0 = time.time()
    per_rank, any_timeout = [], False
    for k in ranks:
        run = compile_one(spec_path, world, k, workdir, timeout)
        any_timeout |= run["timed_out"]
        res_path = workdir / f"rank_{k}" / "result.json"
        if res_path.exists():
            res = json.loads(res_path.read_text())
            res["pair_wall_s"] = run["wall_s"]
            err = res.get("error")
            if err is not None:
                log = Path(run["log"])
                details = log_errors(log.read_text(errors="replace")) if log.exists() else []
                err["log_errors"] = details
                err["op"] = op_from_log(details) or err.get("op")
                err["strategy_key"] = strategy_key(err)
            rr = RankResult(k, bool(res.get("ok")), res)
        else:
            why = "TIMED OUT" if run["timed_out"] else "no result"
            rr = RankResult(k, False, None, f"({why} after {run['wall_s']} s)\n" + _tail(Path(run["log"])))
        per_rank.append(rr)
        if progress is not None:
            res = rr.result or {}
            progress(f"  rank {k}: {rr.verdict()[:100]}  (pair {run['wall_s']} s, compile {res.get('compile_s', '-')} s, "
                     f"peak RSS {res.get('peak_rss_mb', '-')} MB)")
    report = CompileReport(target, world, workdir, round(time.time() - t0, 2), any_timeout, 0, per_rank)
    if ir_check is not None and report.compiled:
        graphs = (per_rank[0].result or {}).get("graphs") or []
        report.ir_checks = check_compile_dir(workdir, world, graphs, stages=int(ir_check.get("stages", 1)),
                                             clip=bool(ir_check.get("clip", False)),
                                             trainable=ir_check.get("trainable"),
                                             token_weight=ir_check.get("token_weight"), only=list(ranks))
    (workdir / "summary.json").write_text(json.dumps(report.to_dict(), indent=1, default=str))
    return report


if __name__ == "__main__":
    if sys.argv[1:] == ["--scheduler"]:
        sys.exit(_scheduler_main())
    sys.exit("usage: rank_of_n.py --scheduler (started by naohai.simulate.rank_of_n.compile_ranks)")
