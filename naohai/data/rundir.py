"""The output folder of a resumable data run (`data clean`, `data score`): create, resume or restart.

A run keeps ``.work/plan.json`` (its format, settings and input fingerprints) in its output
folder.  :func:`prepare_run_dir` starts a run in a new or empty folder, resumes one whose
plan is unchanged, and with ``restart`` discards the work and outputs of one whose plan is
the same kind.  It refuses, with a :class:`UserError` naming ``--out``: a file, a non-empty
folder that holds no run, a run of another kind, and a changed plan without ``restart``.
Nothing is removed unless the folder holds a run of the same kind and ``restart`` is set.
Before anything else it refuses an output folder that overlaps the inputs
(:func:`input_overlap`): one that is an input file or folder, lies inside an input folder
where walking that folder would reach it (not below a hidden name), would be matched by an
input glob, or contains an input file -- a run there would read its own output back as
input, and ``restart`` would delete input.  The folder is locked for the life of the
process (:func:`naohai.runfiles.lock_folder`): a second run on it exits 2 naming the first one.
"""
from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence
from urllib.parse import unquote, urlparse

from naohai.data.reader import hidden, is_uri
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


# what a run writes in its folder, relative to it: an input glob that matches one of these reads the output back
_WRITES = (("part-00000.jsonl",), (WORK, "unit-000000.jsonl"))


def _local_path(item: str) -> Optional[str]:
    """The local path of an input (a path, or a ``file:`` URI); None for other Hadoop-compatible paths."""
    if not is_uri(item) and not item.startswith("file:"):
        return os.path.expanduser(item)
    url = urlparse(item)
    return unquote(url.path) if url.scheme == "file" else None


def _glob_matches(pattern: List[str], parts: List[str]) -> bool:
    """Whether a glob's components match a path's, as ``glob.glob(recursive=True)`` matches: ``**`` any
    number of folders, and a wildcard no name that starts with '.'."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_glob_matches(rest, parts[k:]) for k in range(len(parts) + 1) if not hidden("/".join(parts[:k])))
    if not parts or (parts[0].startswith(".") and not head.startswith(".") and any(c in head for c in "*?[")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _glob_matches(rest, parts[1:])


def input_overlap(out_dir: str, inputs: Sequence[str], files: Sequence[str]) -> Optional[str]:
    """Why ``out_dir`` cannot be the output folder of a run over ``inputs`` (paths, folders, globs, URIs as
    given) and ``files`` (what they resolved to), or None: it is an input file or folder, lies inside an
    input folder whose walk reaches it (:func:`naohai.data.reader.walk_visible`: not below a hidden name),
    would be matched by an input glob, or contains an input file.  Paths compare after symlinks resolve."""
    out = os.path.realpath(out_dir)
    below = out.rstrip(os.sep) + os.sep
    for item in inputs:
        path = _local_path(item)
        if path is None:
            continue
        if any(ch in path for ch in "*?["):
            parts = os.path.abspath(path).split(os.sep)
            k = next(i for i, p in enumerate(parts) if any(ch in p for ch in "*?["))
            base = os.path.realpath(os.sep.join(parts[:k]) or os.sep).split(os.sep)
            pattern = [p for p in base + parts[k:] if p]
            if any(_glob_matches(pattern, [p for p in out.split(os.sep) + list(w) if p]) for w in _WRITES):
                return f"would be matched by the input pattern {item} (it matches the shards written there)"
            continue
        if not os.path.isdir(path):
            continue
        root = os.path.realpath(path)
        if out == root:
            return f"is the input folder {item}"
        if out.startswith(root.rstrip(os.sep) + os.sep) and not hidden(out[len(root.rstrip(os.sep)) + 1:]):
            return f"lies inside the input folder {item}, whose walk would read what is written there"
    for f in files:
        path = _local_path(f)
        real = path and os.path.realpath(path)
        if real == out:
            return f"is the input file {f}"
        if real and real.startswith(below):
            return f"contains the input file {f}"
    return None


def refuse_input_overlap(out_dir: str, inputs: Sequence[str], files: Sequence[str], command: str) -> None:
    """A :class:`UserError` naming ``--out`` when :func:`input_overlap` finds a reason."""
    overlap = input_overlap(out_dir, inputs, files)
    if overlap is not None:
        raise UserError(f"{overlap}: a `{command}` run there would read its own output back as input, and "
                        "--restart would delete input with the output, so nothing was written or removed. "
                        "Choose an --out outside the inputs (inside an input folder only below a hidden name, one "
                        "starting with '.', which a folder input never reads)", where=out_dir, key="--out",
                        rule="--out is no input file or folder, lies in no input folder that would read it, "
                             "and holds no input file")


def prepare_run_dir(out_dir: str, plan: Dict[str, Any], restart: bool, command: str, changed: str,
                    inputs: Sequence[str] = (), files: Sequence[str] = ()) -> str:
    """The work folder of a run with ``plan`` (whose ``format`` names its kind) in ``out_dir``.

    ``command`` names the run in messages (``naohai data clean``); ``changed`` says what a
    different plan means, e.g. ``"a clean run with another config or other inputs (changed files?)"``.
    ``inputs`` are the run's inputs as given, ``files`` the files they resolved to: an ``out_dir`` that
    overlaps them is refused (:func:`input_overlap`) before anything is read, written or removed.
    """
    work = os.path.join(out_dir, WORK)
    plan_path = os.path.join(work, "plan.json")
    refuse_input_overlap(out_dir, inputs, files, command)
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
