"""Streaming input for `naohai data clean`: ``.jsonl`` / ``.txt`` files (optionally ``.gz``) -> records.

Inputs are local files, directories (every supported file below, sorted, hidden entries left
out: see :func:`resolve_inputs`) or globs (Hadoop-compatible paths such as ``hdfs://`` are the
Spark engine's:
:mod:`naohai.data.hadoop_inputs` lists and reads them, then parses their lines with
:func:`jsonl_records` / :func:`txt_records`, as here).  A
``.jsonl`` line is one document (the string under ``text_key``; the other keys are
kept); a ``.txt`` file is split into documents at runs of two or more blank lines, as
:mod:`naohai.data.corpus` does.

Nothing malformed stops the run or disappears: a line that is not UTF-8, not JSON,
not a JSON object, has no (string) text field, or is longer than ``max_line_bytes``
comes out as a :class:`Problem` with the file and line number, and so does a
truncated or corrupt ``.gz`` file.  The caller counts and reports them.

An uncompressed ``.jsonl`` file can also be read in byte ranges (:class:`Split`,
:func:`byte_ranges`, :func:`read_split`: the Spark engine's input splits): each range
gives the lines that start in it, numbered as in the whole file, so the ranges of a file
together give exactly what reading it whole gives.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Union

from naohai.errors import UserError

SUFFIXES = (".jsonl", ".txt", ".jsonl.gz", ".txt.gz")


@dataclass
class Record:
    text: str
    where: str                           # "path:line"
    extra: Optional[Dict[str, object]]   # the other keys of a .jsonl object


@dataclass
class Problem:
    where: str                           # "path:line" or "path"
    reason: str


def supported(name: str) -> bool:
    """Whether a file name has one of the SUFFIXES this reader reads."""
    return name.lower().endswith(SUFFIXES)


def is_uri(path: str) -> bool:
    """Whether an input names a Hadoop-compatible path (``hdfs://``, ``obs://``, ``s3a://``, ``file://``...),
    which only the Spark engine reads (:mod:`naohai.data.hadoop_inputs`)."""
    return re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", path) is not None


def hidden(rel: str) -> bool:
    """Whether a path relative to an input folder passes through a hidden entry (a name starting with '.')."""
    return any(part.startswith(".") for part in rel.split("/"))


def walk_visible(path: str) -> List[str]:
    """The supported files below a folder, sorted, leaving out hidden entries: a file or folder whose name
    starts with '.' is neither read nor entered (the ``.work/`` of a `naohai data clean` or `data score`
    output holds copies of its documents)."""
    found = []
    for d, dirs, fs in os.walk(path):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        found.extend(os.path.join(d, f) for f in fs if supported(f) and not f.startswith("."))
    return sorted(found)


def resolve_inputs(inputs: Sequence[str]) -> List[str]:
    """Files named by paths, directories and globs; a UserError for each that names nothing usable.

    A folder gives every supported file below it, sorted, and never one under a hidden entry (a file or
    folder whose name starts with '.', such as the ``.work/`` of a clean or score output, which holds
    copies of its documents): a clean output folder given as input is read once.  A glob gives the files
    it matches (``glob.glob``: its wildcards match no hidden name either); a file named directly is read
    whatever its name.  The Spark engine applies the same rule to Hadoop-path folders."""
    if not inputs:
        raise UserError("give at least one input file, directory or glob", where="command line")
    files: List[str] = []
    for item in inputs:
        if is_uri(item):
            raise UserError("a Hadoop-compatible path: the local engine reads local files and folders; "
                            "--engine spark reads hdfs://, obs://, s3a:// and file:// paths", where=item)
        path = os.path.expanduser(item)
        if any(ch in path for ch in "*?["):
            found = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p) and supported(p))
            if not found:
                raise UserError(f"the pattern matches no {'/'.join(SUFFIXES)} files", where=item)
        elif os.path.isdir(path):
            found = walk_visible(path)
            if not found:
                raise UserError(f"the directory holds no {'/'.join(SUFFIXES)} files (hidden entries, whose "
                                "names start with '.', are not read)", where=item)
        elif not os.path.exists(path):
            raise UserError("input not found", where=item)
        elif not supported(path):
            raise UserError(f"unsupported input type; use {', '.join(SUFFIXES)}", where=item)
        else:
            found = [path]
        files.extend(found)
    return files


def _open(path: str):
    return gzip.open(path, "rb") if path.lower().endswith(".gz") else open(path, "rb")


def _skip_line(fh) -> None:
    """Read past the end of the line the file position is in (however long it is)."""
    raw = fh.readline(1 << 20)
    while raw and not raw.endswith(b"\n"):
        raw = fh.readline(1 << 20)


def _lines(path: str, max_line_bytes: int, part: Optional["Split"] = None) -> Iterator[Union[tuple, Problem]]:
    """(lineno, bytes) for each line, or a Problem for an over-long line / unreadable file; with ``part``,
    only the lines that start inside its byte range, numbered as in the whole file."""
    lineno = 0
    try:
        with _open(path) as fh:
            if part is not None and part.start:
                lineno = part.newlines_before
                fh.seek(part.start - 1)
                if fh.read(1) != b"\n":           # the range starts inside a line: it belongs to the range before
                    _skip_line(fh)
                    lineno += 1
            while True:
                if part is not None and part.end is not None and fh.tell() >= part.end:
                    return
                raw = fh.readline(max_line_bytes + 1)
                if not raw:
                    return
                lineno += 1
                if len(raw) > max_line_bytes and not raw.endswith(b"\n"):
                    size = len(raw)
                    while raw and not raw.endswith(b"\n"):   # skip the rest of the line
                        raw = fh.readline(1 << 20)
                        size += len(raw)
                    yield Problem(f"{path}:{lineno}", f"line longer than {max_line_bytes} bytes ({size} bytes)")
                    continue
                yield lineno, raw
    except (OSError, EOFError, zlib.error) as exc:
        yield Problem(f"{path}:{lineno + 1}", f"file unreadable from here on: {exc}")


def _jsonl(path: str, text_key: str, max_line_bytes: int, part: Optional["Split"] = None
           ) -> Iterator[Union[Record, Problem]]:
    return jsonl_records(path, _lines(path, max_line_bytes, part), text_key)


def jsonl_records(path: str, lines: Iterable[Union[tuple, Problem]], text_key: str = "text"
                  ) -> Iterator[Union[Record, Problem]]:
    """The records and problems of a ``.jsonl`` file's numbered lines ((lineno, bytes) or a Problem)."""
    for item in lines:
        if isinstance(item, Problem):
            yield item
            continue
        lineno, raw = item
        where = f"{path}:{lineno}"
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Problem(where, f"not UTF-8 (byte {exc.start})")
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield Problem(where, f"not valid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(obj, dict):
            yield Problem(where, f"a JSON {type(obj).__name__}, not an object")
            continue
        text = obj.pop(text_key, None)
        if text is None:
            yield Problem(where, f"no '{text_key}' key (keys: {', '.join(map(str, obj)) or 'none'})")
            continue
        if not isinstance(text, str):
            yield Problem(where, f"'{text_key}' is a {type(text).__name__}, not a string")
            continue
        yield Record(text, where, obj or None)


def _txt(path: str, max_line_bytes: int) -> Iterator[Union[Record, Problem]]:
    return txt_records(path, _lines(path, max_line_bytes))


def txt_records(path: str, lines: Iterable[Union[tuple, Problem]]) -> Iterator[Union[Record, Problem]]:
    """The documents of a ``.txt`` file's numbered lines ((lineno, bytes) or a Problem)."""
    buf: List[str] = []
    start = 0
    blanks = 0
    for item in lines:
        if isinstance(item, Problem):
            yield item
            continue
        lineno, raw = item
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield Problem(f"{path}:{lineno}", f"not UTF-8 (byte {exc.start})")
            continue
        if not line.strip():
            blanks += 1
            if buf:
                buf.append(line)
            continue
        if blanks >= 2 and buf:
            yield Record("".join(buf).strip("\n"), f"{path}:{start}", None)
            buf = []
        if not buf:
            start = lineno
        blanks = 0
        buf.append(line)
    if buf:
        yield Record("".join(buf).strip("\n"), f"{path}:{start}", None)


def read_inputs(files: Sequence[str], text_key: str = "text",
                max_line_bytes: int = 16 << 20) -> Iterator[Union[Record, Problem]]:
    """Every record and problem of the files, in file order then line order."""
    for path in files:
        if path.lower().endswith((".jsonl", ".jsonl.gz")):
            yield from _jsonl(path, text_key, max_line_bytes)
        else:
            yield from _txt(path, max_line_bytes)


@dataclass(frozen=True)
class Split:
    """A byte range of an uncompressed ``.jsonl`` file: the lines that start in ``[start, end)`` (``end`` None:
    to the end of the file); ``newlines_before`` is the number of newline bytes in ``[0, start)``, which
    numbers those lines as in the whole file."""

    start: int = 0
    end: Optional[int] = None
    newlines_before: int = 0


def splittable(path: str) -> bool:
    """Only uncompressed ``.jsonl`` files are read in byte ranges (a ``.txt`` document spans lines; gzip has
    no random access)."""
    return path.lower().endswith(".jsonl")


def byte_ranges(path: str, split_bytes: int) -> List[tuple]:
    """``[start, end)`` ranges of ``split_bytes`` covering the file (one range for a file that is not
    :func:`splittable` or not larger)."""
    size = os.path.getsize(path)
    if not splittable(path) or size <= split_bytes:
        return [(0, None)]
    starts = list(range(0, size, split_bytes))
    return [(a, b if b < size else None) for a, b in zip(starts, starts[1:] + [size])]


def count_newlines(path: str, start: int, end: Optional[int], chunk: int = 8 << 20) -> int:
    """The number of newline bytes in ``[start, end)`` of the file (summed over the ranges before one, its
    :attr:`Split.newlines_before`)."""
    n = 0
    with open(path, "rb") as fh:
        fh.seek(start)
        left = None if end is None else end - start
        while left is None or left > 0:
            buf = fh.read(chunk if left is None else min(chunk, left))
            if not buf:
                break
            n += buf.count(b"\n")
            if left is not None:
                left -= len(buf)
    return n


def read_split(path: str, part: Split, text_key: str = "text",
               max_line_bytes: int = 16 << 20) -> Iterator[Union[Record, Problem]]:
    """The records and problems of the lines that start in one :class:`Split` of a ``.jsonl`` file, with the
    file's own line numbers; the splits of a file together give exactly what :func:`read_inputs` gives."""
    if part.start == 0 and part.end is None:
        yield from read_inputs([path], text_key, max_line_bytes)
        return
    if not splittable(path):
        raise ValueError(f"{path} cannot be read in byte ranges")
    yield from _jsonl(path, text_key, max_line_bytes, part)


def fingerprint(files: Sequence[str]) -> List[list]:
    """[abs path, size, mtime_ns] per file: enough to notice a changed input on resume."""
    out = []
    for p in files:
        st = os.stat(p)
        out.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
    return out
