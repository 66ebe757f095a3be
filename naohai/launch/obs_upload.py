"""Uploading the code tree and optional data to OBS before a ModelArts job.

Owns OBS path parsing (``/bucket/path/`` as the ModelArts API writes it, or
``obs://bucket/path/``), choosing which files to send (:data:`DEFAULT_EXCLUDES`),
and the upload itself through ``esdk-obs-python``: small files with one PUT,
files from :data:`MULTIPART_THRESHOLD` bytes up through the SDK's multipart
``uploadFile``.  The SDK does not raise on HTTP errors, so every response status
is checked and turned into a UserError with OBS's error code and request id.
"""
from __future__ import annotations

import fnmatch
import os
import subprocess
from dataclasses import dataclass
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

from naohai.errors import UserError
from naohai.launch.credentials import Credentials, require

DEFAULT_EXCLUDES = (".git", ".hg", "runs", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
                    "*.egg-info", "*.ckpt", "*.safetensors", "*.npy", "*.mindir", ".ipynb_checkpoints",
                    # what MindSpore's kernel compilers leave in the working directory
                    "akg_kernel_meta", "kernel_meta", "dsa_transfrom.log", "kernel_build_tmp.key")
MULTIPART_THRESHOLD = 32 * 1024 * 1024
PART_SIZE = 16 * 1024 * 1024


@dataclass(frozen=True)
class ObsPath:
    bucket: str
    key: str          # no leading slash; '' for the bucket root

    @property
    def api_form(self) -> str:
        """``/bucket/key`` as the ModelArts API expects."""
        return f"/{self.bucket}/{self.key}"

    def child(self, rel: str) -> "ObsPath":
        base = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return ObsPath(self.bucket, base + rel.replace(os.sep, "/"))


_BUCKET_OK = set("abcdefghijklmnopqrstuvwxyz0123456789-.")


def parse_obs_path(text: Optional[str], flag: str, directory: bool = True) -> ObsPath:
    """Parse ``/bucket/path/`` or ``obs://bucket/path/``; directories end with '/'."""
    raw = (text or "").strip()
    if not raw:
        raise UserError("an OBS path is required, written /bucket/path/", where="command line", key=flag)
    body = raw[len("obs://"):] if raw.startswith("obs://") else raw
    if not raw.startswith(("obs://", "/")):
        raise UserError(f"'{raw}' is not an OBS path; write /bucket/path/ or obs://bucket/path/",
                        where="command line", key=flag)
    bucket, _, key = body.lstrip("/").partition("/")
    if not (3 <= len(bucket) <= 63) or not set(bucket) <= _BUCKET_OK:
        raise UserError(f"'{bucket}' is not a valid bucket name (3-63 lowercase letters, digits, '-', '.')",
                        where="command line", key=flag)
    if directory and key and not key.endswith("/"):
        key += "/"
    return ObsPath(bucket, key)


def _excluded(rel: str, excludes: Sequence[str]) -> bool:
    parts = rel.split("/")
    return any(fnmatch.fnmatch(part, pat) for part in parts for pat in excludes) or \
        any(fnmatch.fnmatch(rel, pat) for pat in excludes)


def _git_files(root: str) -> Optional[List[str]]:
    """Tracked and untracked-but-not-ignored files of the git work tree whose top is ``root``
    (relative posix paths), or None when ``root`` is not the top of a work tree or git is absent."""
    try:
        top = subprocess.run(["git", "-C", root, "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=False)
        if top.returncode != 0 or os.path.realpath(top.stdout.strip()) != os.path.realpath(root):
            return None
        listed = subprocess.run(["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                capture_output=True, check=False)
    except OSError:
        return None
    if listed.returncode != 0:
        return None
    return sorted({rel for rel in listed.stdout.decode("utf-8", "surrogateescape").split("\0") if rel})


def collect_files(root: str, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> List[Tuple[str, str]]:
    """``[(absolute path, relative posix path)]`` under ``root``, sorted, excludes applied.  In a git
    checkout only the files git would keep (tracked, or untracked and not ignored by ``.gitignore``)."""
    if not os.path.isdir(root):
        raise UserError("is not a directory", where=root)
    in_git = _git_files(root)
    if in_git is not None:
        return [(os.path.join(root, *rel.split("/")), rel) for rel in in_git
                if not _excluded(rel, excludes) and os.path.isfile(os.path.join(root, *rel.split("/")))]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
        rel_dir = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not _excluded(rel_dir + d, excludes))
        for name in sorted(filenames):
            rel = rel_dir + name
            path = os.path.join(dirpath, name)
            if not _excluded(rel, excludes) and os.path.isfile(path):
                out.append((path, rel))
    return out


def obs_client(creds: Credentials, server: str):
    obs = require("obs")
    return obs.ObsClient(access_key_id=creds.access_key, secret_access_key=creds.secret_key, server=server)


class Uploader:
    """Puts local files into OBS, single PUT or multipart by size."""

    def __init__(self, client, creds: Credentials, threshold: int = MULTIPART_THRESHOLD,
                 part_size: int = PART_SIZE, progress: Optional[Callable[[str], None]] = None):
        self.client = client
        self.creds = creds
        self.threshold = threshold
        self.part_size = part_size
        self.progress = progress or (lambda msg: None)

    def upload_file(self, path: str, dest: ObsPath) -> int:
        size = os.path.getsize(path)
        try:
            if size >= self.threshold:
                resp = self.client.uploadFile(dest.bucket, dest.key, path, partSize=self.part_size, taskNum=2)
            else:
                resp = self.client.putFile(dest.bucket, dest.key, path)
        except OSError as exc:    # refused / unreachable: the SDK lets socket errors through
            raise UserError(f"cannot connect to OBS to upload {path} ({self.creds.redact(str(exc))}); "
                            "check --obs-endpoint/--region and the network", where="OBS") from None
        except Exception as exc:  # the SDK raises plain Exceptions for other transport failures
            raise UserError(f"upload of {path} to obs:/{dest.api_form} failed: "
                            f"{self.creds.redact(str(exc))}", where="OBS") from None
        self._check(resp, path, dest)
        self.progress(f"uploaded {path} -> obs:/{dest.api_form} ({size} bytes"
                      f"{', multipart' if size >= self.threshold else ''})")
        return size

    def upload_tree(self, root: str, dest: ObsPath, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> Tuple[int, int]:
        """Upload every kept file under ``root``; returns (files, bytes)."""
        files = collect_files(root, excludes)
        total = 0
        for path, rel in files:
            total += self.upload_file(path, dest.child(rel))
        return len(files), total

    def upload_path(self, local: str, dest: ObsPath, excludes: Sequence[str] = DEFAULT_EXCLUDES) -> Tuple[int, int]:
        """A directory (tree) or a single file (into ``dest`` as a folder)."""
        if os.path.isdir(local):
            return self.upload_tree(local, dest, excludes)
        if os.path.isfile(local):
            return 1, self.upload_file(local, dest.child(os.path.basename(local)))
        raise UserError("does not exist", where=local, key="--data")

    def _check(self, resp, path: str, dest: ObsPath) -> None:
        status = getattr(resp, "status", None)
        if status is not None and status < 300:
            return
        code = getattr(resp, "errorCode", None)
        msg = getattr(resp, "errorMessage", None) or getattr(resp, "reason", None)
        request_id = getattr(resp, "requestId", None)
        detail = ", ".join(f"{k}={v}" for k, v in (("status", status), ("error_code", code),
                                                  ("error_msg", msg), ("request_id", request_id)) if v)
        raise UserError(f"upload of {path} to obs:/{dest.api_form} was refused ({self.creds.redact(detail)})",
                        where="OBS")


def plan_summary(files: Iterable[Tuple[str, str]]) -> Tuple[int, int]:
    files = list(files)
    return len(files), sum(os.path.getsize(p) for p, _ in files)
