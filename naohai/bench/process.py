"""The parent's side of a benchmark worker process: start it, send JSON commands, read its answers.

:class:`WorkerProcess` runs a Python module as a child (``python -m MODULE ARGS``) with JSON commands on
its stdin and answers on its stdout as lines starting with :data:`PREFIX` (anything else there, library
chatter, is ignored); its stderr goes to a log file.  :class:`Worker` is one benchmark row's worker,
:mod:`naohai.bench.worker` (the child's side); :mod:`naohai.bench.lm_eval_rate` runs its own module.

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
            lines = [l for l in fh.read().splitlines() if l.strip()]
        warned = [l for l in lines if l.startswith("WARNING") or " WARNING: " in l][-2:]   # e.g. a failed save
        tail = [l for l in warned if l not in lines[-3:]] + lines[-3:]
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
