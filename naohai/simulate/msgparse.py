"""Turning a MindSpore compile exception into a short, structured verdict.

Owns one job: from an exception raised by ``Cell.compile`` keep MindSpore's own
headline (dropping the C++ call stack and the long "function call stack" trailer)
and pick out the operator and parameter names the message mentions, so a report can
say "rank 3: RuntimeError in MatMul: ...".
"""
from __future__ import annotations

import re
from typing import Dict, List, Optional

_CUT_MARKERS = ("\n- C++ Call Stack", "\n----------------------------------------------------",
                "\n- The Traceback", "\nThe function call stack", "\n- Framework Unexpected")
_OP_PATTERNS = [
    re.compile(r"For '([A-Z][A-Za-z0-9_]*)'"),
    re.compile(r"For primitive\[([A-Z][A-Za-z0-9_]*)\]"),
    re.compile(r"\bFor ([A-Z][A-Za-z0-9_]*)[,:]"),
    re.compile(r"\b([A-Z][A-Za-z0-9]*)(?:Info)?\d*\s*:\s*(?:Invalid|The|Strategy|Check|Infer)"),
    re.compile(r"\bop(?:erator)? ['\"]?([A-Z][A-Za-z0-9_]*)['\"]?"),
    re.compile(r"\b([A-Z][A-Za-z0-9]*)-op\d+"),
]
_PARAM_PATTERNS = [
    re.compile(r"[Pp]arameter[:\s]*\[?['\"]?([A-Za-z_][\w.]*)['\"]?\]?"),
    re.compile(r"param(?:eter)?[ _]name[:\s=]*['\"]?([A-Za-z_][\w.]*)"),
]
_NOT_NAMES = {"is", "of", "the", "in", "and", "must", "should", "with", "for", "not", "which"}


def headline(message: str, limit: int = 1500) -> str:
    cut = len(message)
    for marker in _CUT_MARKERS:
        i = message.find(marker)
        if 0 <= i < cut:
            cut = i
    text = message[:cut].strip()
    return text if len(text) <= limit else text[:limit] + " ..."


def _first(patterns: List[re.Pattern], text: str) -> Optional[str]:
    for pat in patterns:
        for m in pat.finditer(text):
            name = m.group(1)
            if name.lower() not in _NOT_NAMES:
                return name
    return None


_SOURCE_RE = re.compile(r"^# In file (.+?):(\d+)", re.M)
_LOG_ERROR_RE = re.compile(r"^\[ERROR\] [A-Z_]+\([^)]*\):\S+ \[([^\]]+)\] (.*)$", re.M)


def source_location(message: str) -> Optional[str]:
    """Innermost user-code line of MindSpore's "Traceback of Net Construct Code"."""
    i = message.find("The Traceback of Net Construct Code")
    hits = _SOURCE_RE.findall(message[i:] if i >= 0 else "")
    return f"{hits[-1][0]}:{hits[-1][1]}" if hits else None


def log_errors(log_text: str, limit: int = 8) -> List[str]:
    """MindSpore's ``[ERROR]`` log lines as ``"<file:line> <func>] <message>"``, oldest first."""
    out = []
    for m in _LOG_ERROR_RE.finditer(log_text):
        out.append(f"{m.group(1).rsplit('/', 1)[-1]} {m.group(2).strip()}")
        if len(out) >= limit:
            break
    return out


def op_from_log(errors: List[str]) -> Optional[str]:
    """Operator named by the first ``<Op>Info<N>:`` log error (parallel op info classes)."""
    for line in errors:
        m = re.search(r"\b([A-Z][A-Za-z0-9]*)Info\d*\s*:", line)
        if m:
            return m.group(1)
    return None


def parse_mindspore_error(exc: BaseException) -> Dict[str, Optional[str]]:
    """``{"type", "message", "op", "parameter", "source"}`` for a compile exception."""
    text = str(exc)
    head = headline(text)
    return {"type": type(exc).__name__, "message": head,
            "op": _first(_OP_PATTERNS, head), "parameter": _first(_PARAM_PATTERNS, head),
            "source": source_location(text)}


#: words of a MindSpore message -> the strategy-file key that decides them (first match wins)
_KEY_WORDS = [
    (re.compile(r"pipeline_interleave|scheduler", re.I), "pipeline.scheduler"),
    (re.compile(r"micro[_ ]?(size|batch)|MicroBatch", re.I), "micro_batches"),
    (re.compile(r"stage", re.I), "pipeline.layers_per_stage"),
    (re.compile(r"device_num|global_rank|rank_size|group size|device num", re.I), "mesh"),
    (re.compile(r"optimizer|opt_shard|parallel_optimizer|AssignAdd", re.I), "optimizer_parallel"),
    (re.compile(r"Gather|embedding", re.I), "embedding.vocab_parallel"),
]
#: a cell scope in MindSpore's log / message: ``layers-CellList/5-DecoderLayer/attention-Attention``
_SCOPE_RE = re.compile(r"layers-CellList/(\d+)-DecoderLayer/(\w+)-")


def strategy_key(err: Dict) -> Optional[str]:
    """The strategy-file key a compile error most likely comes from, or None: a layer's op scope
    (``layers."5".ops`` with the op kind), else words of the message (micro-batches, stages, mesh,
    optimizer parallel, scheduler), else the op's rule family (``rules``)."""
    text = " ".join([err.get("message") or ""] + list(err.get("log_errors") or []))
    m = _SCOPE_RE.search(text)
    if m:
        op = err.get("op")
        return f'layers."{m.group(1)}" ({m.group(2)}' + (f" {op})" if op else ")")
    for pattern, key in _KEY_WORDS:
        if pattern.search(text):
            return key
    if err.get("op"):
        return f"rules / ops (the strategy of the {err['op']} ops)"
    return None
