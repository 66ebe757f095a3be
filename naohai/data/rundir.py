"""The output folder of a resumable data run (`data clean`, `data score`): create, resume or restart.

A run keeps ``.work/plan.json`` (its format, settings and input fingerprints) in its output
folder.  :func:`prepare_run_dir` starts a run in a new or empty folder, resumes one whose
plan is unchanged, and with ``restart`` discards the work and outputs of one whose plan is
the same kind.  It refuses, with a :class:`UserError` naming ``--out``: a file, a non-empty
folder that holds no run, a run of another kind, and a changed plan without ``restart``.
Nothing is removed unless the folder holds a run of the same kind and ``restart`` is set.
The folder is locked for the life of the process (:func:`naohai.runfiles.lock_folder`): a
second run on it exits 2 naming the first one.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any, Callable, Dict, Optional

from naohai.errors import UserError
from naohai.runfiles import LOCK_NAME, lock_folder

WORK = ".work"
REPORT = "report.json"


def atomic_write(path: str, write: Callable[[str], Any]) -> None:
    """``write(tmp)`` a temporary name, then rename it to ``path``: the file is complete or absent."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def atomic_write_text(path: str, text: str) -> None:
    """:func:`atomic_write` of a UTF-8 text, the file closed before it is renamed into place."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
    atomic_write(path, write)


def remove_outputs(out_dir: str) -> None:
    """Delete a run's shards (``part-*.jsonl``, gzipped too) and its report."""
    for p in glob.glob(os.path.join(glob.escape(out_dir), "part-*.jsonl*")) + [os.path.join(out_dir, REPORT)]:
        if os.path.exists(p):
            os.remove(p)


def prepare_run_dir(out_dir: str, plan: Dict[str, Any], restart: bool, command: str, changed: str) -> str:
    """The work folder of a run with ``plan`` (whose ``format`` names its kind) in ``out_dir``.

    ``command`` names the run in messages (``naohai data clean``); ``changed`` says what a
    different plan means, e.g. ``"a clean run with another config or other inputs (changed files?)"``.
    """
    work = os.path.join(out_dir, WORK)
    plan_path = os.path.join(work, "plan.json")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError("is a file, not a directory", where=out_dir, key="--out")
    if os.path.isdir(out_dir) and set(os.listdir(out_dir)) - {LOCK_NAME} and not os.path.exists(plan_path):
        raise UserError(f"is not empty and holds no `{command}` run; choose a new --out directory "
                        "(nothing there is replaced)", where=out_dir, key="--out")
    # one job per folder from here on (held until the process ends; the writable check comes first)
    lock_folder(out_dir, f"`{command}` run", key="--out")
    if os.path.exists(plan_path):
        with open(plan_path, "r", encoding="utf-8") as fh:
            old = json.load(fh)
        if not isinstance(old, dict) or old.get("format") != plan.get("format"):
            raise UserError(f"holds another kind of run, not a `{command}` one; choose a new --out directory "
                            "(nothing there is replaced)", where=out_dir, key="--out")
        if old != json.loads(json.dumps(plan)) and not restart:
            raise UserError(f"holds {changed}; pass --restart to discard it and start again, or choose a new "
                            "--out", where=out_dir, key="--out")
        if restart:
            shutil.rmtree(work)
            remove_outputs(out_dir)
    os.makedirs(work, exist_ok=True)
    if not os.path.exists(plan_path):
        atomic_write_text(plan_path, json.dumps(plan, indent=1))
    return work


def finished_report(out_dir: str) -> Optional[Dict[str, Any]]:
    """The ``report.json`` of a run that finished in ``out_dir`` (None while it has not)."""
    path = os.path.join(out_dir, REPORT)
    if not os.path.exists(path):
        return None
    with open(path, "r", encoding="utf-8") as fh:
        return json.load(fh)


def write_report(out_dir: str, report: Dict[str, Any]) -> None:
    """Write ``report.json`` atomically: the mark of a finished run."""
    atomic_write_text(os.path.join(out_dir, REPORT), json.dumps(report, ensure_ascii=False, indent=1))
