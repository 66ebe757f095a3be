"""What keeps a user's files safe: one job per output folder, writable checks, unique temporaries.

* :func:`lock_folder` takes an exclusive ``flock`` on ``<folder>/.naohai.lock`` for the life of
  the process (the kernel drops it when the process ends, however it ends, so a killed run
  never leaves a stale lock).  A second job on the same folder gets a :class:`UserError`
  naming the holder's pid, host, start time and command.  A process started by the holder
  (``naohai launch`` -> msrun -> rank 0) shares its parent's lock.  :func:`holding_folder`
  is the same for a ``with`` block: a command run in-process (a test, a notebook) gives its
  folder back when it returns or fails.
* :func:`check_writable` refuses, up front, an output folder that is a file, sits under a
  file, or cannot be written (read-only file system, permissions); :func:`existing_ancestor`
  is where a new output file's missing folders would start (a file there blocks it).
* :func:`temp_dir_beside` makes a uniquely named temporary folder next to a target (same
  file system, so the final ``os.replace`` is atomic); naohai only ever removes the
  temporaries it created this way, never a name a user may own (``<out>.tmp``).
* :func:`move_into_new_folder` moves a run's old files into a fresh ``superseded-<time>``
  folder (``--no-resume``): nothing is deleted or overwritten.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import tempfile
import time
from typing import Dict, Iterator, Optional

from naohai.errors import UserError

LOCK_NAME = ".naohai.lock"
_HELD: Dict[str, int] = {}   # realpath of a locked folder -> open fd (kept open: the lock lives with it)


_CREATED: set = set()   # folders check_writable created in this process (a failed start may remove them)


def created_here(folder: str) -> bool:
    """Whether :func:`check_writable` created ``folder`` in this process."""
    folder = os.path.abspath(folder)
    return os.path.realpath(os.path.dirname(folder)) + os.sep + os.path.basename(folder) in _CREATED


def existing_ancestor(path: str) -> str:
    """The nearest existing ancestor of ``path``'s folder (``path`` itself not counted): the folder a new file
    at ``path`` would be made in, with any missing folders between; a file there means it cannot be made."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    return parent


def check_writable(folder: str, *, key: Optional[str] = None) -> str:
    """Create ``folder`` (and parents) if needed and prove a file can be written in it; returns its
    absolute path.  Raises :class:`UserError` (exit 2) naming the folder and the reason."""
    folder = os.path.abspath(folder)
    if not os.path.exists(folder):
        _CREATED.add(os.path.realpath(os.path.dirname(folder)) + os.sep + os.path.basename(folder))
    probe_parent = folder
    while not os.path.exists(probe_parent):
        probe_parent = os.path.dirname(probe_parent)
    if not os.path.isdir(probe_parent):
        raise UserError(f"cannot be an output folder: {probe_parent} is a file, not a folder", where=folder, key=key)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".naohai-write-test-", dir=folder)
        os.close(fd)
        os.remove(probe)
    except OSError as exc:
        reason = {errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.ENOSPC: "the disk is full",
                  errno.EDQUOT: "the disk quota is exceeded"}.get(exc.errno, exc.strerror or str(exc))
        raise UserError(f"cannot write the output folder: {reason}", where=folder, key=key) from None
    return folder


def _describe_holder(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8") as fh:
            info = json.load(fh)
        return (f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}"
                f" ({info.get('command')})")
    except (OSError, ValueError, AttributeError):
        return "a process whose details could not be read"


def _ancestors() -> set:
    """Pids of this process's parent, grandparent, ... (Linux /proc; empty elsewhere)."""
    seen, pid = set(), os.getppid()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/stat", "r", encoding="utf-8") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return seen


def lock_folder(folder: str, what: str, *, key: Optional[str] = None) -> str:
    """Hold the exclusive lock of ``folder`` for the rest of this process (see the module docstring);
    returns the lock file.  Locking a folder this process already holds is a no-op."""
    import fcntl
    folder = check_writable(folder, key=key)
    real = os.path.realpath(folder)
    if real in _HELD:
        return os.path.join(folder, LOCK_NAME)
    path = os.path.join(folder, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise UserError(f"cannot lock the output folder: {exc.strerror}", where=folder, key=key) from None
        holder = _describe_holder(path)
        try:
            with open(path, "r", encoding="utf-8") as fh:
                holder_pid = int(json.load(fh).get("pid", -1))
        except (OSError, ValueError, AttributeError, TypeError):
            holder_pid = -1
        if holder_pid in _ancestors():
            return path          # started by the holder (naohai launch -> msrun -> this rank): its lock
        raise UserError(f"is in use by another job: {holder}. One folder belongs to one {what} at a time; "
                        f"wait for it to end, or choose another output folder", where=folder, key=key) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    _HELD[real] = fd
    return path


def forget_locks_in_child() -> None:
    """In a forked child: close its copies of the folder locks' files, so that a lock ends with the process that
    took it. A child that outlives it (a Spark worker forked from the driver's zygote, after the driver was
    killed) held the folder until it ended, and a rerun started at once was refused as "in use". Closing a copy
    does not release the lock while the parent holds it."""
    for fd in _HELD.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


@contextlib.contextmanager
def holding_folder(folder: str, what: str, *, key: Optional[str] = None) -> Iterator[str]:
    """:func:`lock_folder` for a ``with`` block: released at its end, however it ends, unless this
    process held the folder before the block."""
    held_before = os.path.realpath(os.path.abspath(folder)) in _HELD
    path = lock_folder(folder, what, key=key)
    try:
        yield path
    finally:
        if not held_before:
            unlock_folder(folder)


def unlock_folder(folder: str) -> None:
    """Release a lock taken by :func:`lock_folder` in this process (a process's end does it too)."""
    fd = _HELD.pop(os.path.realpath(os.path.abspath(folder)), None)
    if fd is not None:
        os.close(fd)


def temp_dir_beside(target: str) -> str:
    """A new, uniquely named folder next to ``target`` (``.<name>.tmp-XXXXXXXX``) for writing it."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.tmp-", dir=parent)


def temp_file_beside(target: str) -> str:
    """A new, uniquely named empty file next to ``target`` (to be written, then renamed onto it)."""
    target = os.path.abspath(target)
    fd, path = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.tmp-", dir=os.path.dirname(target))
    os.close(fd)
    return path


def write_bytes_atomically(path: str, data: bytes) -> str:
    """Write ``data`` to ``path`` through a uniquely named temporary file beside it and a rename
    (parents created): the file is complete or absent, the temporary removed on failure.  Returns
    the absolute path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = temp_file_beside(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def move_into_new_folder(parent: str, names, label: str) -> Optional[str]:
    """Move those of ``names`` (entries of ``parent``) that exist into a new folder
    ``parent/<label>-<YYYYmmdd-HHMMSS>[-n]``; returns it (None when none existed).  Nothing is
    deleted or overwritten: the new folder is created exclusively (``mkdir`` fails if it exists)."""
    present = [n for n in names if os.path.lexists(os.path.join(parent, n))]
    if not present:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        dest = os.path.join(parent, f"{label}-{stamp}" + (f"-{n}" if n else ""))
        try:
            os.mkdir(dest)
            break
        except FileExistsError:
            continue
    else:
        raise UserError(f"cannot find a free name for a {label} folder", where=parent)
    for name in present:
        os.rename(os.path.join(parent, name), os.path.join(dest, name))
    return dest
