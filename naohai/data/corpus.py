"""Corpus sources: turn the recipe's ``data.corpus`` list into documents (strings).

A source is one of

``builtin:pydoc``
    The English reference text CPython ships in ``pydoc_data.topics.topics``;
    one document per topic, in sorted topic order.
``builtin:fortunes-zh``
    Debian's ``fortunes-zh`` package (``/usr/share/games/fortunes/{chinese,
    song100,tang300}``); entries are separated by lines holding only ``%``, each
    entry is one document.  ANSI colour escapes in the files are removed.
a path, directory or glob
    ``.jsonl`` files hold one JSON object per line; the string under
    ``data.jsonl_key`` is one document.  ``.txt`` / ``.text`` / ``.md`` files are
    split into documents at runs of two or more blank lines (``\\n\\n\\n``); single
    blank lines (paragraph breaks) stay inside a document.  A directory means all
    such files below it, hidden directories left out.  Matches are read in sorted order.
a ``.json`` mixture file
    written by `naohai data mix` (:mod:`naohai.data.mix`): the documents of its
    sources in the mixture's recorded order.

Documents that are empty or whitespace-only are skipped.  Every problem (missing
path, glob with no matches, unsupported file type, bad JSON line, non-UTF-8 text,
a corpus with no documents at all) raises :class:`UserError` naming the source
and the key ``data.corpus``.
"""
from __future__ import annotations

import glob
import json
import os
import re
import sys
from typing import Dict, Iterator, List, Optional, Sequence

from naohai.errors import UserError, did_you_mean

BUILTINS = ("builtin:pydoc", "builtin:fortunes-zh")
FORTUNES_DIR = "/usr/share/games/fortunes"
FORTUNES_FILES = ("chinese", "song100", "tang300")
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSONL_SUFFIXES = (".jsonl",)
MIXTURE_SUFFIXES = (".json",)

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_DOC_BREAK = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)+")   # two or more blank lines
_KEY = "data.corpus"


def _err(message: str, where: Optional[str] = None, index: Optional[int] = None) -> UserError:
    key = _KEY if index is None else f"{_KEY}[{index}]"
    return UserError(message, where=where, key=key)


# --------------------------------------------------------------------------- builtins
def pydoc_documents() -> Iterator[str]:
    """The pydoc topics, one document per topic, sorted by topic name."""
    from pydoc_data.topics import topics
    for name in sorted(topics):
        yield topics[name]


def strip_ansi(text: str) -> str:
    """Remove terminal colour escapes (also the malformed, nested ones fortunes-zh holds)."""
    while True:
        cleaned = _ANSI.sub("", text)
        if cleaned == text:
            return cleaned.replace("\x1b", "")
        text = cleaned


def fortunes_documents(directory: str = FORTUNES_DIR) -> Iterator[str]:
    """Entries of Debian's fortunes-zh files (UTF-8), colour escapes removed."""
    paths = [os.path.join(directory, f) for f in FORTUNES_FILES]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise _err(f"builtin:fortunes-zh needs the Debian package fortunes-zh, but {missing[0]} is "
                   f"missing; install it with 'apt-get install fortunes-zh'", where="builtin:fortunes-zh")
    for path in paths:
        text = _read_text(path)
        entry: List[str] = []
        for line in text.split("\n"):
            if line.strip() == "%":
                yield strip_ansi("\n".join(entry))
                entry = []
            else:
                entry.append(line)
        if entry:
            yield strip_ansi("\n".join(entry))


# --------------------------------------------------------------------------- files
def _read_text(path: str) -> str:
    try:
        with open(path, "r", encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as exc:
        raise _err(f"is not UTF-8 text (byte {exc.start})", where=path) from None
    except OSError as exc:
        raise _err(f"cannot be read: {exc.strerror}", where=path) from None


def text_file_documents(path: str) -> Iterator[str]:
    """A text file split at runs of two or more blank lines."""
    yield from _DOC_BREAK.split(_read_text(path))


def jsonl_documents(path: str, key: str = "text") -> Iterator[str]:
    """One document per non-blank line: the string under ``key``."""
    try:
        fh = open(path, "r", encoding="utf-8")
    except OSError as exc:
        raise _err(f"cannot be read: {exc.strerror}", where=path) from None
    with fh:
        lineno = 0
        while True:
            lineno += 1
            try:
                line = fh.readline()
            except UnicodeDecodeError:
                raise _err(f"line {lineno} is not UTF-8 text", where=f"{path}:{lineno}") from None
            if not line:
                break
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _err(f"line {lineno} is not valid JSON: {exc.msg} (column {exc.colno})",
                           where=f"{path}:{lineno}") from None
            if not isinstance(obj, dict):
                raise _err(f"line {lineno} must be a JSON object, got {type(obj).__name__}",
                           where=f"{path}:{lineno}")
            if key not in obj:
                raise UserError(f"line {lineno} has no key '{key}'.{did_you_mean(key, obj.keys())} "
                                f"Keys there: {', '.join(map(str, obj)) or 'none'}. Set data.jsonl_key.",
                                where=f"{path}:{lineno}", key="data.jsonl_key")
            value = obj[key]
            if not isinstance(value, str):
                raise UserError(f"line {lineno}: '{key}' must be a string, got {type(value).__name__}",
                                where=f"{path}:{lineno}", key="data.jsonl_key")
            yield value


def _supported(path: str, mixtures: bool = True) -> bool:
    """A corpus file type; mixture files count only when named directly."""
    return path.lower().endswith(TEXT_SUFFIXES + JSONL_SUFFIXES + (MIXTURE_SUFFIXES if mixtures else ()))


def _walk_visible(path: str):
    """os.walk without hidden entries: no folder (e.g. the .work/ of a `naohai data clean` output) or file
    (an editor's lock or swap file, macOS's ``._name`` copies) whose name starts with '.', as
    :func:`naohai.data.reader.walk_visible` reads a folder for `data clean` and `data score`."""
    for d, dirs, files in os.walk(path):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        yield d, dirs, [f for f in files if not f.startswith(".")]


def resolve_source(source: str, index: Optional[int] = None) -> List[str]:
    """The sorted list of files a path/dir/glob source names (builtins return [source])."""
    if source.startswith("builtin:"):
        if source not in BUILTINS:
            raise _err(f"unknown builtin corpus '{source}'.{did_you_mean(source, BUILTINS)} "
                       f"Builtins: {', '.join(BUILTINS)}.", index=index)
        return [source]
    path = os.path.expanduser(source)
    if any(ch in path for ch in "*?["):
        matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        if not matches:
            raise _err(f"the pattern '{source}' matches no files", where=source, index=index)
        files = [p for p in matches if _supported(p, mixtures=False)]
        if not files:
            raise _err(f"the pattern '{source}' matches no .txt/.md/.jsonl files", where=source, index=index)
        return files
    if os.path.isdir(path):
        files = sorted(os.path.join(d, f) for d, _, fs in _walk_visible(path) for f in fs
                       if _supported(f, mixtures=False))
        if not files:
            raise _err("the directory holds no .txt/.md/.jsonl files", where=source, index=index)
        return files
    if not os.path.exists(path):
        raise _err("corpus file not found", where=source, index=index)
    if not _supported(path):
        raise _err(f"unsupported corpus file type; use {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)}, a mixture .json "
                   f"or a builtin ({', '.join(BUILTINS)})", where=source, index=index)
    return [path]


def _documents_of(item: str, jsonl_key: str) -> Iterator[str]:
    if item == "builtin:pydoc":
        return pydoc_documents()
    if item == "builtin:fortunes-zh":
        return fortunes_documents()
    if item.lower().endswith(JSONL_SUFFIXES):
        return jsonl_documents(item, jsonl_key)
    if item.lower().endswith(MIXTURE_SUFFIXES):
        from naohai.data.mix import iter_mixture
        return iter_mixture(item)
    return text_file_documents(item)


def iter_documents(sources: Sequence[str], jsonl_key: str = "text") -> Iterator[str]:
    """All non-empty documents of all sources, in a deterministic order.

    Sources are resolved up front, so a missing file fails before any reading.
    Raises UserError (key ``data.corpus``) if no document is found at all.
    """
    if isinstance(sources, str):
        sources = [sources]
    if not sources:
        raise _err("needs at least one corpus source")
    items = [f for i, s in enumerate(sources) for f in resolve_source(s, i)]
    count = 0
    for item in items:
        for doc in _documents_of(item, jsonl_key):
            if doc.strip():
                count += 1
                yield doc
    if count == 0:
        raise _err(f"the corpus holds no non-empty documents (sources: {', '.join(sources)})")


def fingerprint(sources: Sequence[str], jsonl_key: str = "text") -> Dict[str, object]:
    """A JSON-able description of the sources (files with size and mtime) to detect changes."""
    files = []
    for i, s in enumerate(sources):
        for item in resolve_source(s, i):
            if item == "builtin:pydoc":
                files.append([item, "python %d.%d" % sys.version_info[:2]])
            elif item.startswith("builtin:"):
                files.append([item])
            else:
                st = os.stat(item)
                files.append([os.path.abspath(item), st.st_size, st.st_mtime_ns])
    return {"sources": list(sources), "jsonl_key": jsonl_key, "files": files}
