"""Counting communication operators in MindSpore's saved IR text.

Owns one job: given the folder MindSpore wrote with ``MS_DEV_SAVE_GRAPHS`` for one
rank, pick the last front-end IR (``NN_validate_*.ir``, the graph after every
parallel pass: redistribution, pipeline split, optimizer sharding, recompute) and
count the communication primitives it contains, by kind.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Dict, Optional

#: primitive names counted as communication (as printed in the IR)
COMM_PRIMITIVES = frozenset({
    "AllReduce", "AllGather", "ReduceScatter", "AlltoAll", "AllToAll", "AlltoAllV",
    "AllToAllv", "NeighborExchange", "NeighborExchangeV2", "Send", "Receive", "Broadcast",
    "Reduce", "Barrier", "CollectiveScatter", "CollectiveGather", "BatchISendIRecv",
    "MicroStepAllGather", "MiniStepAllGather", "MirrorMicroStep", "MirrorMiniStep",
    "_MirrorOperator", "Mirror", "DistCommAllReduce", "DistCommAllGather",
})
_CALL_RE = re.compile(r"^\s*%\S+\s*=\s*(?:PrimFunc_)?([A-Za-z_][A-Za-z0-9_]*)\(", re.M)
_NUMBERED_RE = re.compile(r"^(\d+)_([A-Za-z0-9_-]+?)_\d+\.ir$")


def final_ir_file(rank_ir_dir: Path) -> Optional[Path]:
    """The ``*_validate_*.ir`` file of a rank, else the highest-numbered front-end IR."""
    rank_ir_dir = Path(rank_ir_dir)
    if not rank_ir_dir.is_dir():
        return None
    numbered = []
    for p in rank_ir_dir.iterdir():
        m = _NUMBERED_RE.match(p.name)
        if m:
            numbered.append((int(m.group(1)), m.group(2), p))
    validate = [n for n in numbered if n[1] == "validate"]
    pick = validate or [n for n in numbered if "backend" not in n[1]]
    return max(pick)[2] if pick else None


def count_comm_ops(ir_text: str) -> Dict[str, int]:
    """Communication primitive name -> number of call nodes in the IR text."""
    counts = Counter(name for name in _CALL_RE.findall(ir_text) if name in COMM_PRIMITIVES)
    return dict(sorted(counts.items()))
