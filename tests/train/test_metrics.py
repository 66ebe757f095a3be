"""Run logs (naohai/train/metrics.py): TensorBoard events are written without loading torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.train.test_resume import _read_tfevents

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys
{pre}
from naohai.train.metrics import RunLog
log = RunLog(sys.argv[1])
for step, loss in [(1, 2.5), (2, 2.25)]:
    log.write({{"step": step, "split": "train", "loss": loss}})
log.close()
loaded = "torch" in sys.modules
import torch                                  # still importable afterwards
print(json.dumps({{"torch_before": loaded, "tensor": float(torch.ones(2).sum())}}))
"""


@pytest.mark.parametrize("pre", ["", "import torch"])
def test_events_are_written_and_torch_is_only_loaded_by_whoever_asks(tmp_path, pre):
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-c", SCRIPT.format(pre=pre), str(out)], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen == {"torch_before": bool(pre), "tensor": 2.0}
    [events] = (out / "tensorboard").glob("events.out.tfevents.*")
    assert _read_tfevents(events)["train/loss"] == [(1, 2.5), (2, 2.25)]
