"""Saving, publishing, verifying and loading checkpoints of a run, from one rank or thousands.

Layout of one checkpoint (``<run>/checkpoints/step_<8 digits>/``)::

    manifest.json        step, data position, loss scale, seed, recipe, strategy, layout, versions,
                         and a SHA-256 and size for every file below (written last, by rank 0)
    rank_<r>.ckpt        the parameters rank r holds: on one device or in plain data parallel the
                         full tensors (rank 0 only); under semi-auto every rank's own slices
                         (optimizer-shard slices included), never accumulation buffers or the
                         learning-rate table
    rank_<r>.json        rank r's file entry (sha256, bytes, tensors and their local shapes)
    strategy/rank_<r>.ckpt, strategy/merged.ckpt
                         MindSpore's parameter strategy files of the compiled step (semi-auto)

Atomic across ranks: every rank writes into ``step_<N>.tmp/`` (temporary names, fsync,
rename), the ranks agree that all writes succeeded, then rank 0 writes the manifest and
renames the folder into place.  A crash or a failed write at any moment leaves the
previous checkpoint as it was; a half-written folder keeps its ``.tmp`` suffix and is
never picked.  Retention keeps the last ``keep_last`` and every ``keep_every``-th step.

Resume (:meth:`CheckpointStore.select`) walks the checkpoints newest first and takes the
first one that verifies on every rank (manifest readable, same model, every file of the
layout present with its size and SHA-256); the others are reported with the reason.
A shared file system between nodes is assumed (as MindFormers does for its saves).
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import mindspore as ms
import numpy as np

from naohai import ckpt_format
from naohai.checkpoint.files import fsync_dir, fsync_file, sha256_file, write_json
from naohai.errors import UserError
from naohai.model.config import ModelConfig

FORMAT = "naohai-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def rank_file(rank: int) -> str:
    return f"rank_{rank}.ckpt"


def step_dir(output_dir: str, step: int) -> str:
    return os.path.join(checkpoint_root(output_dir), f"step_{step:08d}")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> List[str]:
    """Published checkpoint folders (those with a manifest), oldest first."""
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, MANIFEST)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def read_manifest(path: str) -> Dict[str, Any]:
    """The manifest of checkpoint folder ``path``, its fields' types and file names checked
    (:func:`check_manifest`): anything else is an integrity error (:class:`UserError`, exit 2)."""
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, "r", encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise UserError("has no manifest.json: not a (complete) naohai checkpoint", where=path) from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the manifest: {exc}", where=file) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"is not a {FORMAT} manifest", where=file)
    check_manifest(data, file)
    return data


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def contained_name(name: Any) -> bool:
    """A manifest file name that stays inside its checkpoint folder: relative, forward slashes,
    no ``..``, ``.`` or empty parts (symbolic links are checked on disk by :func:`verify`)."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


def check_manifest(man: Dict[str, Any], where: str) -> None:
    """Refuse a manifest whose fields have the wrong types or whose file names leave the folder."""
    def bad(key: str, rule: str) -> None:
        raise UserError(f"integrity error: {rule}; the manifest is damaged or was not written by naohai",
                        where=where, key=key)
    if "step" in man and (not _is_int(man["step"]) or man["step"] < 0):
        bad("step", f"must be a whole number >= 0, got {man['step']!r}")
    files = man.get("files", {})
    if not isinstance(files, dict):
        bad("files", f"must be a mapping of file name -> entry, got {type(files).__name__}")
    for name, entry in files.items():
        if not contained_name(name):
            bad("files", f"file name {name!r} leaves the checkpoint folder (absolute, '..' or empty parts)")
        if not isinstance(entry, dict):
            bad(f"files.{name}", f"must be a mapping with sha256 and bytes, got {type(entry).__name__}")
        if not isinstance(entry.get("sha256"), str) or not _HEX64.match(entry["sha256"]):
            bad(f"files.{name}.sha256", f"must be 64 hexadecimal digits, got {entry.get('sha256')!r}")
        if not _is_int(entry.get("bytes")) or entry["bytes"] < 0:
            bad(f"files.{name}.bytes", f"must be a whole number >= 0, got {entry.get('bytes')!r}")
    for key in ("layout", "recipe", "data", "identity"):
        if key in man and man[key] is not None and not isinstance(man[key], dict):
            bad(key, f"must be a mapping, got {type(man[key]).__name__}")
    layout = man.get("layout") or {}
    ranks = layout.get("ranks_with_files", [])
    if not isinstance(ranks, list) or not all(_is_int(r) and r >= 0 for r in ranks):
        bad("layout.ranks_with_files", f"must be a list of rank numbers, got {ranks!r}")
    for key in ("world", "stages"):
        if key in layout and (not _is_int(layout[key]) or layout[key] < 1):
            bad(f"layout.{key}", f"must be a whole number >= 1, got {layout[key]!r}")
    if "signature" in layout and not isinstance(layout["signature"], str):
        bad("layout.signature", f"must be a string, got {layout['signature']!r}")


def inside(folder: str, name: str) -> Optional[str]:
    """The real path of ``folder/name`` if it resolves inside ``folder`` (symbolic links followed), else None."""
    root = os.path.realpath(folder)
    full = os.path.realpath(os.path.join(folder, name))
    return full if full.startswith(root + os.sep) else None


def versions() -> Dict[str, str]:
    import naohai
    return {"naohai": getattr(naohai, "__version__", "unknown"), "mindspore": ms.__version__,
            "python": platform.python_version()}


def resolve_checkpoint(path: str) -> str:
    """Accept a checkpoint folder or a run folder (its newest checkpoint)."""
    if not str(path).strip():
        raise UserError("the checkpoint path is empty; give a checkpoint folder or a run folder",
                        where="command line", rule="a non-empty path")
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        return path
    if os.path.isdir(path):
        found = list_checkpoints(path)
        if found:
            return found[-1]
    raise UserError("is neither a checkpoint folder (with manifest.json) nor a run folder with checkpoints/",
                    where=path)


# --------------------------------------------------------------------------- verification
@dataclass
class Verdict:
    path: str
    ok: bool
    problems: List[str] = field(default_factory=list)

    def reason(self) -> str:
        return "; ".join(self.problems) or "ok"


def _model_dict(recipe_dict: Dict[str, Any]) -> Dict[str, Any]:
    """The model a manifest's recipe records, with the defaults of keys added to ModelConfig since it was
    written (e.g. ``rope_scaling``: a checkpoint from before it was computed without scaling), so that an
    upgrade does not make every earlier checkpoint 'another model'."""
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.default is not dataclasses.MISSING}
    return dict(defaults, **(recipe_dict.get("model") or {}))


def verify(path: str, model: Optional[Dict[str, Any]] = None, files: Optional[Sequence[str]] = None,
           hash_files: bool = True) -> Verdict:
    """Check a checkpoint folder: manifest, model (if given), and the listed files (all if None): each
    must be in the manifest, resolve inside the folder (no symbolic link out), and have the size and
    (unless ``hash_files`` is False) the SHA-256 the manifest records."""
    v = Verdict(path, True)
    try:
        man = read_manifest(path)
    except UserError as exc:
        return Verdict(path, False, [exc.message if not exc.key else f"key '{exc.key}': {exc.message}"])
    if model is not None:
        saved = _model_dict(man.get("recipe") or {})
        diff = sorted(k for k in set(saved) | set(model) if saved.get(k) != model.get(k))
        if diff:
            v.problems.append("another model: " + ", ".join(f"{k} {saved.get(k)!r} != {model.get(k)!r}"
                                                            for k in diff[:4]))
    entries = man.get("files") or {}
    for name in (files if files is not None else sorted(entries)):
        entry = entries.get(name)
        if entry is None:
            v.problems.append(f"{name} is not in the manifest (a rank missing)")
            continue
        full = os.path.join(path, name)
        if not os.path.lexists(full):
            v.problems.append(f"{name} is missing")
            continue
        if inside(path, name) is None:
            v.problems.append(f"{name} resolves outside the checkpoint folder (a symbolic link out)")
            continue
        if not os.path.isfile(full):
            v.problems.append(f"{name} is not a regular file")
            continue
        size = os.path.getsize(full)
        if size != entry.get("bytes"):
            v.problems.append(f"{name} has {size} bytes, the manifest says {entry.get('bytes')} (truncated?)")
            continue
        if hash_files and sha256_file(full) != entry.get("sha256"):
            v.problems.append(f"{name} does not match its SHA-256 (corrupted)")
    for rank in (man.get("layout") or {}).get("ranks_with_files", []):
        if rank_file(rank) not in entries:
            v.problems.append(f"rank {rank}'s file is not in the manifest (a rank missing)")
    v.ok = not v.problems
    return v


def verified(path: str, files: Optional[Sequence[str]] = None, hash_files: bool = True) -> Dict[str, Any]:
    """The manifest of ``path`` after :func:`verify` passed (``hash_files`` False: sizes only, the
    readers' --no-verify); an integrity error (:class:`UserError`, exit 2) otherwise."""
    v = verify(path, None, files, hash_files=hash_files)
    if not v.ok:
        raise UserError(f"does not verify: {v.reason()} (naohai ckpt verify {path} checks every file)", where=path)
    return read_manifest(path)


def identity_difference(saved: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """What differs between the identity (model, tokenizer, data) a checkpoint's manifest records and
    this run's (``current``); a checkpoint from before identities were recorded is compared on its model only."""
    diff = []
    old_model = _model_dict(saved.get("recipe") or {})
    new_model = dict(current.get("model") or {})
    for k in sorted(set(old_model) | set(new_model)):
        if old_model.get(k) != new_model.get(k):
            diff.append(f"model.{k}: {old_model.get(k)!r} in the checkpoint, {new_model.get(k)!r} now")
    old_id = saved.get("identity") or {}
    for k in ("tokenizer_sha256", "data"):
        if k in old_id and k in current and old_id[k] != current[k]:
            label = "tokenizer (SHA-256 of its model file)" if k.startswith("tokenizer") else \
                "prepared data (corpus, holdout, seed)"
            diff.append(f"{label}: {str(old_id[k])[:16]}... in the checkpoint, {str(current[k])[:16]}... now")
    return diff


# --------------------------------------------------------------------------- the store
Collective = Callable[[bool], bool]


def _solo(flag: bool) -> bool:
    return flag


class _HostCopy:
    """A tensor's values copied to host memory now, written later (a background save)."""

    def __init__(self, tensor: Any):
        self.values = np.array(tensor.asnumpy(), copy=True)
        self.shape, self.dtype = tuple(tensor.shape), tensor.dtype

    def asnumpy(self) -> "np.ndarray":
        return self.values


@dataclass
class SaveOutcome:
    path: Optional[str]          # the published folder, None when the save failed
    error: Optional[str] = None  # why it failed (this rank's or another's)


@dataclass
class PendingSave:
    """A save whose files may still be being written; ``finish()`` publishes it (every rank)."""

    store: Any
    step: int
    tmp: str
    final: str
    manifest: Dict[str, Any]
    failed: Optional[str] = None      # the save failed before writing (the ranks agreed on it)
    error: Optional[str] = None       # this rank's write error
    thread: Any = None

    def finish(self) -> SaveOutcome:
        if self.failed is not None:
            return SaveOutcome(None, self.failed)
        if self.thread is not None:
            self.thread.join()
        return self.store._commit(self)  # noqa: SLF001 - the store's own second phase


class CheckpointStore:
    """Checkpoints of one run as seen by one rank.

    ``all_ok(flag)`` must return True on every rank iff ``flag`` is True on every rank
    (an all-reduce; the identity for one process): it is the barrier of the save and of
    the resume decision.  ``writes`` says whether this rank writes a parameter file.
    """

    def __init__(self, output_dir: str, rank: int = 0, world: int = 1, writes: bool = True,
                 all_ok: Collective = _solo, keep_last: int = 3, keep_every: int = 0):
        self.output_dir = output_dir
        self.rank, self.world = rank, world
        self.writes = writes
        self.all_ok = all_ok
        self.keep_last, self.keep_every = keep_last, keep_every

    # ---- saving
    def save(self, step: int, params: Sequence[ms.Parameter], manifest: Dict[str, Any],
             strategy_file: Optional[str] = None) -> SaveOutcome:
        """Write this rank's part of the checkpoint for ``step`` and publish it (rank 0)."""
        return self.save_async(step, params, manifest, strategy_file, background=False).finish()

    def save_async(self, step: int, params: Sequence[ms.Parameter], manifest: Dict[str, Any],
                   strategy_file: Optional[str] = None, background: bool = True) -> "PendingSave":
        """Start a save of ``params`` (Parameters, or entries with ``name`` and ``asnumpy()``): the
        tensors are copied to host memory now, written (and fsynced, hashed, read back) by a
        background thread; :meth:`PendingSave.finish` -- called at the same point
        of the loop on every rank -- waits for the writes, then agrees and publishes as
        :meth:`save` does.  Training steps run while the files are written."""
        final = step_dir(self.output_dir, step)
        tmp = final + ".tmp"
        error = None
        try:
            if self.rank == 0:
                if os.path.exists(tmp):
                    shutil.rmtree(tmp)
                os.makedirs(tmp)
        except OSError as exc:
            error = f"rank 0 cannot create {tmp}: {exc}"
        if not self.all_ok(error is None):
            return PendingSave(self, step, tmp, final, manifest, failed=error or "another rank failed")
        # in the background: a host copy of this step's values (the next steps change the parameters in place);
        # else each tensor is copied out when the writer reaches it (one at a time: ckpt_format.write)
        if not self.writes:
            snapshot = []
        elif background:
            snapshot = [(p.name, _HostCopy(p)) for p in params]
        else:
            snapshot = [(p.name, p) for p in params]
        pending = PendingSave(self, step, tmp, final, manifest)

        def write():
            try:
                if self.writes:
                    self._write_rank(tmp, snapshot)
                if strategy_file and os.path.exists(strategy_file):
                    self._copy_strategy(tmp, strategy_file)
            except (OSError, RuntimeError, ValueError) as exc:
                pending.error = f"rank {self.rank}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
        if background:
            import threading
            pending.thread = threading.Thread(target=write, name=f"naohai-save-{step}", daemon=True)
            pending.thread.start()
        else:
            write()
        return pending

    def _commit(self, pending: "PendingSave") -> SaveOutcome:
        tmp, final, error = pending.tmp, pending.final, pending.error
        if not self.all_ok(error is None):
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            return SaveOutcome(None, error or "another rank failed to write its part")
        if self.rank == 0:
            try:
                self._publish(tmp, final, pending.step, pending.manifest)
            except (OSError, ValueError) as exc:
                error = f"rank 0 cannot publish: {exc}"
                shutil.rmtree(tmp, ignore_errors=True)
        if not self.all_ok(error is None):
            return SaveOutcome(None, error or "rank 0 could not publish")
        if self.rank == 0:
            self._retain()
        return SaveOutcome(final)

    def _write_rank(self, tmp: str, tensors: Sequence[Any]) -> None:
        """Write ``(name, tensor)`` pairs as this rank's file (temporary name, fsync, read back, rename); a tensor
        as :func:`naohai.ckpt_format.write` takes it."""
        name = rank_file(self.rank)
        part = os.path.join(tmp, f"rank_{self.rank}.part.ckpt")   # MindSpore appends .ckpt to other names
        expected = [(e.name, e.dims, e.nbytes) for e in ckpt_format.write(part, tensors)]
        fsync_file(part)
        digest, size = sha256_file(part), os.path.getsize(part)
        # read back: a write cut short by a full disk or a file-size limit must not pass.  The file's table of
        # contents only (names, shapes, bytes): loading it would hold a second copy of every tensor
        try:
            written = [(e.name, e.dims, e.nbytes) for e in ckpt_format.entries(part)]
        except ckpt_format.MalformedCheckpoint as exc:
            raise OSError(f"{name} as read back is not a whole checkpoint: {exc}") from None
        if written != expected:
            first = next((i for i, (a, b) in enumerate(zip(written, expected)) if a != b), min(len(written),
                                                                                                len(expected)))
            raise OSError(f"{name}: wrote {len(expected)} tensors, read back {len(written)}; the first that differs "
                          f"is number {first}: written {expected[first] if first < len(expected) else None}, read "
                          f"back {written[first] if first < len(written) else None} (name, shape, bytes)")
        os.replace(part, os.path.join(tmp, name))
        entry = {"rank": self.rank, "sha256": digest, "bytes": size,
                 "tensors": {n: list(dims) for n, dims, _ in written}}
        write_json(os.path.join(tmp, f"rank_{self.rank}.json"), entry)

    def _copy_strategy(self, tmp: str, strategy_file: str) -> None:
        folder = os.path.join(tmp, "strategy")
        os.makedirs(folder, exist_ok=True)
        dst = os.path.join(folder, rank_file(self.rank))
        shutil.copyfile(strategy_file, dst + ".part")
        fsync_file(dst + ".part")
        os.replace(dst + ".part", dst)

    def _publish(self, tmp: str, final: str, step: int, manifest: Dict[str, Any]) -> None:
        files: Dict[str, Any] = {}
        for r in range(self.world):
            meta = os.path.join(tmp, f"rank_{r}.json")
            if os.path.exists(meta):
                with open(meta, "r", encoding="utf-8") as fh:
                    entry = json.load(fh)
                files[rank_file(r)] = {k: entry[k] for k in ("rank", "sha256", "bytes")}
                files[f"rank_{r}.json"] = {"sha256": sha256_file(meta), "bytes": os.path.getsize(meta)}
        strategy_dir = os.path.join(tmp, "strategy")
        if os.path.isdir(strategy_dir):
            for name in sorted(os.listdir(strategy_dir)):
                full = os.path.join(strategy_dir, name)
                files[f"strategy/{name}"] = {"sha256": sha256_file(full), "bytes": os.path.getsize(full)}
        man = dict(manifest)
        man.update({"format": FORMAT, "step": step, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "versions": versions(), "files": files})
        write_json(os.path.join(tmp, MANIFEST), man)
        if os.path.exists(final):      # a re-save of the same step (a resumed run reaching it again)
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_dir(checkpoint_root(self.output_dir))

    def _retain(self) -> None:
        found = list_checkpoints(self.output_dir)
        if self.keep_last <= 0:
            return
        keep = set(found[-self.keep_last:])
        for path in found:
            step = int(_STEP_DIR.match(os.path.basename(path)).group(1))
            if self.keep_every and step % self.keep_every == 0:
                keep.add(path)
        for path in found:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    # ---- resuming
    def select(self, identity: Dict[str, Any], needed: Callable[[Dict[str, Any]], List[str]],
               explicit: Optional[str] = None, log: Callable[[str], None] = print) -> Optional[str]:
        """The newest checkpoint that verifies on every rank (or ``explicit``, which must verify).

        ``identity`` is this run's (``model``, ``tokenizer_sha256``, ``data``); a checkpoint of another
        identity is refused (:class:`UserError`, exit 2, naming the difference), never skipped:
        starting over would overwrite it.  ``needed(manifest)`` names the files this rank must read.
        """
        candidates = [explicit] if explicit else list(reversed(list_checkpoints(self.output_dir)))
        for path in candidates:
            verdict, other = self._verify_for_me(path, identity, needed)
            if other:
                raise UserError(
                    "holds checkpoints of another run: " + "; ".join(other[:6]) + ". A run folder belongs to "
                    "one model and data; resume with the settings it was trained with, choose another "
                    "train.output_dir (train.init_from starts a new run from these weights), or pass "
                    "--no-resume to start over (the old checkpoints are moved aside, not deleted)",
                    where=path, key="--resume-from" if explicit else None)
            if self.all_ok(verdict.ok):
                return path
            if explicit:
                raise UserError(f"cannot resume from it: {verdict.reason() if not verdict.ok else 'another rank '}"
                                f"{'' if not verdict.ok else 'found a problem'}", where=path, key="--resume-from")
            log(f"skipping checkpoint {path}: " + (verdict.reason() if not verdict.ok else
                                                   "another rank found a problem with its files"))
        return None

    def _verify_for_me(self, path: str, identity: Dict[str, Any], needed):
        """(verdict, differences of identity) of ``path`` for this rank."""
        try:
            man = read_manifest(path)
        except UserError as exc:
            return Verdict(path, False, [exc.message]), []
        other = identity_difference(man, identity)
        if other:
            return Verdict(path, False, other), other
        try:
            files = needed(man)
        except UserError as exc:
            return Verdict(path, False, [exc.message]), []
        return verify(path, None, files), []


def load_into(path: str, files: Sequence[str], params: Sequence[ms.Parameter],
              optional: Callable[[str], bool] = lambda name: False) -> List[str]:
    """Copy the tensors of ``files`` into ``params`` (Parameters, or entries with ``name``, ``shape``, ``dtype``
    and ``set_data``) by name; returns names not found (all optional)."""
    saved: Dict[str, Any] = {}
    for name in files:
        try:
            saved.update(ms.load_checkpoint(os.path.join(path, name)))
        except (RuntimeError, ValueError, OSError) as exc:
            raise UserError(f"cannot load {name}: {str(exc).splitlines()[0]}", where=path) from None
    missing = []
    for p in params:
        value = saved.get(p.name)
        if value is None:
            missing.append(p.name)
            continue
        if tuple(value.shape) != tuple(p.shape):
            raise UserError(f"parameter '{p.name}' has shape {tuple(value.shape)} in the checkpoint but "
                            f"{tuple(p.shape)} here (a different model or layout?)", where=path)
        p.set_data(value.astype(p.dtype) if value.dtype != p.dtype else value)
    required = [m for m in missing if not optional(m)]
    if required:
        raise UserError(f"the checkpoint lacks {len(required)} parameters, e.g. {required[:3]}", where=path)
    return missing
