"""PNG bar charts of the benchmark, drawn with Pillow (as the trainer's loss curve).

``bar_chart(path, title, groups, series)``: one group of bars per label in ``groups``,
one bar per (name, values, colour) in ``series``; a missing value (None) leaves a gap
labelled with an em dash.  :func:`write_charts` draws tokens/s per model and compile time
per layer count from the results dict.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

Series = Tuple[str, Sequence[Optional[float]], Tuple[int, int, int]]
COLOURS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]


def bar_chart(path: str, title: str, groups: Sequence[str], series: Sequence[Series], unit: str = "",
              per_group: bool = False) -> str:
    """Draw and save; ``per_group`` scales each group to its own largest bar, else one scale for all."""
    from PIL import Image, ImageDraw

    width, height, pad, top = 820, 460, 60, 70
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.text((pad, 12), title, fill="black")
    for i, (name, _, colour) in enumerate(series):
        x = pad + i * 190
        draw.rectangle([x, 36, x + 12, 48], fill=colour)
        draw.text((x + 18, 36), name, fill="black")
    draw.line([pad, height - pad, width - pad // 2, height - pad], fill="black")
    n_groups, n_series = max(1, len(groups)), max(1, len(series))
    slot = (width - pad - pad // 2) / n_groups
    bar = slot * 0.8 / n_series
    every = [v for s in series for v in s[1] if v]
    for g, label in enumerate(groups):
        vals = [s[1][g] if g < len(s[1]) else None for s in series]
        top_val = max([v for v in (vals if per_group else every) if v] or [1.0])
        for k, v in enumerate(vals):
            x0 = pad + g * slot + slot * 0.1 + k * bar
            if v is None:
                draw.text((x0 + bar / 3, height - pad - 14), "\u2014", fill="black")
                continue
            h = (height - pad - top) * v / top_val
            draw.rectangle([x0, height - pad - h, x0 + bar - 4, height - pad], fill=series[k][2])
            draw.text((x0, height - pad - h - 14), (f"{v:,.0f}" if v >= 100 else f"{v:.3g}") + unit, fill="black")
        draw.text((pad + g * slot + slot * 0.1, height - pad + 8), label, fill="black")
    img.save(path)
    return path


def write_charts(results: Dict[str, Any], out_dir: str) -> List[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    models = results.get("models", [])
    if models:
        names = [m["name"] for m in models]
        series = [(label, [m["throughput"][key]["tokens_per_s"] for m in models], COLOURS[i])
                  for i, (key, label) in enumerate((("naohai", "naohai"), ("eager", "PyTorch eager"),
                                                    ("compile", "torch.compile")))]
        paths.append(bar_chart(os.path.join(out_dir, "throughput.png"),
                               "training tokens/s (bars scaled per model)", names, series,
                               per_group=True))
    comp = results.get("compile")
    if comp and comp.get("runs"):
        layers = sorted({r["layers"] for r in comp["runs"]})
        labels = {"loop": "layer loop", "shared": "one cell per layer, shared graph",
                  "separate": "layers compiled separately"}
        forms = [f for f in labels if any(r["form"] == f for r in comp["runs"])]
        series = []
        for i, form in enumerate(forms):
            by = {r["layers"]: r.get("compile_s") for r in comp["runs"] if r["form"] == form}
            series.append((labels[form], [by.get(n) for n in layers], COLOURS[i]))
        paths.append(bar_chart(os.path.join(out_dir, "compile.png"), "train-step compile seconds",
                               [f"{n} layers" for n in layers], series, unit=" s"))
    return paths
