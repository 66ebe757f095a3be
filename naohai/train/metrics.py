"""Run logs: JSON lines, TensorBoard events, a PNG loss curve."""
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


def plot_loss_curve(output_dir: str, out_file: Optional[str] = None) -> Optional[str]:
    """Draw train and held-out loss against step into a PNG with Pillow."""
    from PIL import Image, ImageDraw

    records = read_metrics(output_dir)
    train = [(r["step"], r["loss"]) for r in records if r.get("split") == "train" and "loss" in r]
    valid = [(r["step"], r["loss"]) for r in records if r.get("split") == "valid" and "loss" in r]
    if not train and not valid:
        return None
    width, height, pad = 800, 480, 50
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    pts = train + valid
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1

    def xy(step, loss):
        return (pad + (step - x0) / (x1 - x0) * (width - 2 * pad),
                height - pad - (loss - y0) / (y1 - y0) * (height - 2 * pad))

    draw.rectangle([pad, pad, width - pad, height - pad], outline="black")
    for series, colour in ((train, (31, 119, 180)), (valid, (214, 39, 40))):
        if len(series) > 1:
            draw.line([xy(*p) for p in series], fill=colour, width=2)
        for p in series:
            if series is valid:
                cx, cy = xy(*p)
                draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=colour)
    draw.text((pad, 15), f"loss (blue: train, red: held-out)  steps {x0}-{x1}", fill="black")
    draw.text((5, pad - 5), f"{y1:.2f}", fill="black")
    draw.text((5, height - pad - 5), f"{y0:.2f}", fill="black")
    out_file = out_file or os.path.join(output_dir, "loss.png")
    img.save(out_file)
    return out_file
