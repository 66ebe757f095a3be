"""Inputs on Hadoop-compatible paths for the Spark engine: ``hdfs://``, ``obs://``, ``s3a://``, ``file://``...

Such an input (a file, a folder or a glob, like a local one) is found and read through the
Hadoop FileSystem of the Spark application, so it reaches whatever the cluster's
connectors and credentials reach (HDFS as configured; OBS through Huawei's OBSA connector,
S3 through ``s3a``, each set up as for any Spark job, e.g. ``--spark-conf
spark.hadoop.fs.obs.endpoint=...``).  The local engine does not read them.

A ``.jsonl`` / ``.jsonl.gz`` file is read by Hadoop's ``TextInputFormat`` in splits of the
engine's ``--split-mb`` (a ``.gz`` whole), its lines numbered as in the file by one counting
job; a ``.txt`` / ``.txt.gz`` file whole by one task (its documents span lines).  The lines
then go through :mod:`naohai.data.reader`'s own parsers, so records, ``path:line`` places
and problems are those of a local file, with two differences that come from Hadoop's
``Text``: a line that is not UTF-8 arrives with U+FFFD replacement characters instead of
being reported, and a truncated ``.gz`` fails the job instead of ending the file with a
problem.
"""
from __future__ import annotations

from typing import Iterable, Iterator, List

from naohai.data.reader import SUFFIXES, Problem, jsonl_records, supported, txt_records
from naohai.errors import UserError

TEXT_INPUT = "org.apache.hadoop.mapreduce.lib.input.TextInputFormat"


def _java_error(exc: Exception) -> str:
    text = str(getattr(exc, "java_exception", exc)).strip().splitlines()
    return text[0] if text else type(exc).__name__


def resolve_uri(sc, item: str) -> List[str]:
    """The files a Hadoop path, folder (every supported file below, sorted) or glob names; a UserError when
    it names nothing usable or its filesystem cannot be reached."""
    try:
        path = sc._jvm.org.apache.hadoop.fs.Path(item)
        fs = path.getFileSystem(sc._jsc.hadoopConfiguration())
        if any(ch in item.split("://", 1)[1] for ch in "*?["):
            statuses = fs.globStatus(path) or []
            found = sorted(str(s.getPath()) for s in statuses if s.isFile() and supported(str(s.getPath())))
            if not found:
                raise UserError(f"the pattern matches no {'/'.join(SUFFIXES)} files", where=item)
            return found
        if not fs.exists(path):
            raise UserError("input not found", where=item)
        if fs.getFileStatus(path).isDirectory():
            found, files = [], fs.listFiles(path, True)
            while files.hasNext():
                name = str(files.next().getPath())
                if supported(name):
                    found.append(name)
            if not found:
                raise UserError(f"the directory holds no {'/'.join(SUFFIXES)} files", where=item)
            return sorted(found)
    except UserError:
        raise
    except Exception as exc:        # no connector for the scheme, no credentials, an unreachable name node
        raise UserError(f"cannot be listed through Hadoop ({_java_error(exc)}); the Spark application needs "
                        "the connector of this scheme and its settings (--spark-conf spark.hadoop....)",
                        where=item) from None
    if not supported(item):
        raise UserError(f"unsupported input type; use {', '.join(SUFFIXES)}", where=item)
    return [item]


def stamp(sc, uri: str) -> list:
    """[path, size, modification time in ms]: enough to notice a changed input on resume."""
    path = sc._jvm.org.apache.hadoop.fs.Path(uri)
    st = path.getFileSystem(sc._jsc.hadoopConfiguration()).getFileStatus(path)
    return [uri, int(st.getLen()), int(st.getModificationTime())]


def _txt_lines(text: str) -> List[tuple]:
    parts = text.split("\n")
    lines = [p + "\n" for p in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
    return [(i, line) for i, line in enumerate(lines, 1)]


def numbered_lines(sc, uri: str, split_bytes: int):
    """An RDD of (line number, line text) of the file, numbered as in the whole file; a ``.jsonl`` file's
    partitions are its input splits, a ``.txt`` file is one partition."""
    if uri.lower().endswith((".txt", ".txt.gz")):
        return sc.wholeTextFiles(uri, 1).values().coalesce(1).flatMap(_txt_lines)
    rdd = sc.newAPIHadoopFile(uri, TEXT_INPUT, "org.apache.hadoop.io.LongWritable", "org.apache.hadoop.io.Text",
                              conf={"mapreduce.input.fileinputformat.split.maxsize": str(split_bytes)})
    return rdd.values().zipWithIndex().map(lambda li: (li[1] + 1, li[0] + "\n"))


def _as_bytes(uri: str, lines: Iterable[tuple], max_line_bytes: int) -> Iterator:
    for lineno, line in lines:
        raw = line.encode("utf-8", "surrogatepass")
        if len(raw) > max_line_bytes:
            yield Problem(f"{uri}:{lineno}", f"line longer than {max_line_bytes} bytes ({len(raw)} bytes)")
            continue
        yield lineno, raw


def records(uri: str, lines: Iterable[tuple], text_key: str, max_line_bytes: int) -> Iterator:
    """The records and problems of a partition of :func:`numbered_lines` (as :func:`naohai.data.reader.read_split`
    gives them for a local file)."""
    numbered = _as_bytes(uri, lines, max_line_bytes)
    if uri.lower().endswith((".txt", ".txt.gz")):
        return txt_records(uri, numbered)
    return jsonl_records(uri, numbered, text_key)
