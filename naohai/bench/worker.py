"""One benchmark row in its own process, driven round by round over a pipe.

MindSpore and PyTorch in one process slowed PyTorch by an order of magnitude here (the
tiny eager row after naohai's rounds in the same process: 444 tokens/s with
OMP_WAIT_POLICY=PASSIVE; in a process of its own 7,600-8,000, same load), so each row
(``naohai``, ``eager``, ``compile``) runs in a worker: ``python -m naohai.bench.worker
ROW MODEL PREPARED_DIR WORKDIR PEAK``.  ``sft-full`` and ``sft-lora`` are :mod:`naohai.bench.finetune`'s rows (MODEL: the bench model as JSON).
It builds the row, answers ``@@bench {"ready": ...}``,
then reads one JSON command per line from stdin -- ``{"cmd": "round", "steps": N}`` (answer:
the timed step seconds, the first step's seconds and the worker's peak resident set so far,
``ru_maxrss`` of ``getrusage(RUSAGE_SELF)`` in bytes), ``{"cmd": "allocated"}`` (naohai:
:meth:`NaohaiRun.allocated`), ``{"cmd": "quit"}``.  Answers are the stdout lines starting with
``@@bench ``; anything else there (library chatter) is ignored.  :class:`Worker` is the
parent's side.

Workers get :func:`worker_env`, Python's ``os.environ``, passed explicitly: once the parent
has loaded MindSpore (for the matmul peak), MindSpore has set ``OMP_NUM_THREADS=1`` in the
process's C environment (not in ``os.environ``), and a child started with the inherited
environment ran PyTorch on one thread (tiny eager 8,600-9,100 tokens/s instead of 12,900).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

PREFIX = "@@bench "


def worker_env() -> Dict[str, str]:
    """The environment a worker starts with: ``os.environ`` as Python sees it (see the module docstring)."""
    return dict(os.environ)


class WorkerProcess:
    """A Python module run as a worker process: JSON commands on its stdin, ``PREFIX`` + JSON answers on its
    stdout, its stderr in ``log_path``; ``ready`` is its first answer."""

    def __init__(self, name: str, module_args, log_path: str):
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen([sys.executable, "-m", *module_args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1, env=worker_env())
        self.ready = self._answer()

    def _answer(self) -> Dict[str, Any]:
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        self.proc.wait()
        self._log.flush()
        with open(self.log_path, "r", encoding="utf-8", errors="replace") as fh:
            tail = [l for l in fh.read().splitlines() if l.strip()][-3:]
        raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {' | '.join(tail)} "
                           f"(log: {self.log_path})")

    def request(self, **cmd) -> Dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request(cmd="quit")
            except (RuntimeError, OSError, ValueError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


class Worker(WorkerProcess):
    """A benchmark row's worker (this module's :func:`main`)."""

    def __init__(self, row: str, model: str, prepared_dir: str, workdir: str, peak: float, label: str = ""):
        """``label``: the model's name in the log file's name (default ``model``)."""
        self.row = row
        super().__init__(f"bench worker {row}", ["naohai.bench.worker", row, model, prepared_dir, workdir,
                                                 repr(float(peak))],
                         os.path.join(workdir, f"worker-{label or model}-{row}.log"))


def peak_rss_bytes() -> int:
    """This process's peak resident set in bytes (``ru_maxrss``: KiB on Linux)."""
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _say(obj: Dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv) -> int:
    row, model, prepared_dir, workdir, peak = argv[0], argv[1], argv[2], argv[3], float(argv[4])
    from naohai.bench.models import bench_models
    if row.startswith("sft-"):          # fine-tuning rows (naohai.bench.finetune): MODEL is a BenchModel's JSON
        from naohai.bench.finetune import VARIANTS, bench_model_from_json
        from naohai.bench.naohai_row import NaohaiRun
        bm = bench_model_from_json(model)
        runner = NaohaiRun(bm, workdir, peak, prepared_dir=prepared_dir, finetune=VARIANTS[row[4:]], tag=row)
    elif row == "naohai":
        bm = bench_models()[model]
        from naohai.bench.naohai_row import NaohaiRun
        runner = NaohaiRun(bm, workdir, peak, prepared_dir=prepared_dir)
    else:
        bm = bench_models()[model]
        from naohai.bench.naohai_row import bench_recipe
        from naohai.bench.torch_row import TorchRun, peer_module
        peer, why = peer_module()
        if peer is None:
            raise SystemExit(why)
        train = bench_recipe(bm, os.path.join(workdir, "unused"), prepared_dir).train
        runner = TorchRun(peer, bm, prepared_dir, train, compiled=row == "compile")
    info: Dict[str, Any] = {"ready": True}
    if row in ("eager", "compile"):
        import torch
        info.update(torch=torch.__version__, threads=torch.get_num_threads())
    _say(info)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "round":
            times = runner.round(int(cmd["steps"]))
            _say({"times": times, "first_step_s": runner.first_step_s, "peak_rss": peak_rss_bytes()})
        elif cmd["cmd"] == "allocated":
            _say(runner.allocated())
        else:
            _say({"bye": True})
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
