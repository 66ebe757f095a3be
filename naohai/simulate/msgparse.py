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
    re.compile(r"\b([A-Z][A-Za-z0-9]*)(?:Info)?\d*\s*:\s*(?:Invalid|The|Strategy|Check|Infer)"),
    re.compile(r"\bop(?:erator)? ['\"]?([A-Z][A-Za-z0-9_]*)['\"]?"),
    re.compile(r"\b([A-Z][A-Za-z0-9]*)-op\d+"),
    re.compile(r"\b([A-Z][A-Za-z0-9]*)Info\b"),
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


def parse_mindspore_error(exc: BaseException) -> Dict[str, Optional[str]]:
    """``{"type", "message", "op", "parameter"}`` for a compile exception."""
    text = str(exc)
    head = headline(text)
    return {"type": type(exc).__name__, "message": head,
            "op": _first(_OP_PATTERNS, head), "parameter": _first(_PARAM_PATTERNS, head)}
