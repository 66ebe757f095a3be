"""Run logs: JSON lines and TensorBoard events (figures: :mod:`naohai.train.plots`)."""
from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

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
                from tensorboardX import SummaryWriter
                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:  # optional: metrics.jsonl is always written
                self._tb = None

    def write(self, record: Dict[str, float]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=True) + "\n")
        if self._tb is not None:
            step = int(record.get("step", 0))
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"{record.get('split', 'train')}/{key}", value, step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None


def read_metrics(output_dir: str) -> List[Dict[str, float]]:
    path = os.path.join(output_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, "r", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
