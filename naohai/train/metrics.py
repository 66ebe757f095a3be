"""Run logs: JSON lines and TensorBoard events (figures: :mod:`naohai.train.plots`), and which fields of a
downstream row are metrics."""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Dict, List

from naohai.errors import UserError


def _summary_writer_class():
    """tensorboardX's ``SummaryWriter``, imported without torch unless torch is loaded already.

    tensorboardX imports torch when it is installed (only to accept torch tensors as values); naohai
    logs Python floats, and that import costs a training process 2-3 s of CPU and a few hundred MB.
    A ``None`` in ``sys.modules`` makes ``import torch`` raise ImportError, which tensorboardX handles;
    the entry is removed again at once, so a later ``import torch`` elsewhere loads it as usual."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class RunLog:
    """Writes metrics to ``metrics.jsonl`` and TensorBoard events under ``output_dir``."""

    def __init__(self, output_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self._tb = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            try:
                SummaryWriter = _summary_writer_class()
                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:  # optional: metrics.jsonl is always written
                self._tb = None

    def keep_until(self, step: int) -> int:
        """Drop the rows of steps after ``step`` (all rows for step 0): a resumed run re-runs those steps
        and logs them again, so each step stays in the file once.  Rewrites the file atomically;
        returns the number of rows dropped."""
        if not self.enabled or not os.path.exists(self.path):
            return 0
        kept, dropped = [], 0
        with open(self.path, "r", encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                    keep = step > 0 and int(rec.get("step", 0)) <= step
                except (ValueError, TypeError, AttributeError):
                    keep = False          # a row cut short by a kill
                if keep:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += line.strip() != ""
        if dropped:
            tmp = f"{self.path}.tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.writelines(kept)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        return dropped

    def write(self, record: Dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            split = record.get("split", "train")
            if split == "downstream":      # downstream/<task>/<metric>
                split = f"downstream/{record.get('task')}"
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{split}/{key}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(output_dir: str) -> List[Dict[str, float]]:
    """The rows of ``output_dir/metrics.jsonl`` ([] without the file).  A last line cut short (no newline: a
    run killed while writing it) is left out, as a resumed run drops it; any other line that is not a JSON
    object with a whole, non-negative ``step`` is a UserError naming the file and the line."""
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path, "r", encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                if not line.endswith("\n"):
                    break                      # the row a kill cut short
                row = None
            step = row.get("step") if isinstance(row, dict) else None
            if not (isinstance(step, (int, float)) and not isinstance(step, bool) and math.isfinite(step)
                    and step >= 0 and float(step).is_integer()):
                raise UserError(f"line {number} is not a metrics row (a JSON object with a whole step >= 0, "
                                f"as training writes it): {line.strip()[:80]!r}", where=path)
            rows.append(row)
    return rows


def downstream_metrics(row: Dict[str, Any]) -> Dict[str, float]:
    """The metric values of a downstream row (not its bookkeeping fields)."""
    skip = {"split", "step", "task", "n", "num_fewshot", "seconds", "graph_seconds", "truncated", "matched"}
    return {k: v for k, v in row.items() if k not in skip and not k.endswith("_stderr")
            and isinstance(v, (int, float))}
