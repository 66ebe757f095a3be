"""Figures of a run's ``metrics.jsonl``: loss, learning rate, throughput, gradient norm.

``run_series(records)`` turns the metric rows of one run into per-step series, keeping the
last row written for a step (a resumed run re-runs the steps after its checkpoint, so the
later row is the one whose weights went on).  ``metrics_figure(runs)`` draws one or several
runs into a matplotlib figure with four panels sharing the step axis: train loss (line) and
held-out loss (markers), learning rate, tokens/s, gradient norm; each run has one colour and
the legend names the runs and the two loss kinds.  ``save_metrics_png(...)`` writes it with
matplotlib's Agg canvas (no display, no pyplot state), which is what the trainer calls at the
end of a run (``loss.png``) and ``naohai plot RUN [RUN...]`` calls to overlay runs.
``plot_downstream(run)`` draws the run's downstream rows (``train.eval``) into ``downstream.png``,
one panel per task, its metrics against step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from naohai.data.rundir import atomic_write
from naohai.errors import UserError
from naohai.train.metrics import read_metrics

Series = List[Tuple[int, float]]

#: (metrics key, panel title, y-axis label) of the panels after the loss panel
PANELS = (("lr", "learning rate", "learning rate"),
          ("tokens_per_s", "throughput", "tokens / s"),
          ("grad_norm", "gradient norm", "global gradient norm (before clipping)"))


@dataclass
class RunSeries:
    """Per-step series of one run (each step once, the last row written for it)."""

    label: str
    train_loss: Series = field(default_factory=list)
    valid_loss: Series = field(default_factory=list)
    other: Dict[str, Series] = field(default_factory=dict)


def _last_per_step(rows: Iterable[Tuple[int, float]]) -> Series:
    by_step: Dict[int, float] = {}
    for step, value in rows:
        by_step[int(step)] = float(value)      # a later row for the same step replaces the earlier one
    return sorted(by_step.items())


def run_series(records: Sequence[dict], label: str) -> RunSeries:
    """The series of one run's metric rows (:func:`naohai.train.metrics.read_metrics`)."""
    def rows(split: str, key: str):
        return ((r["step"], r[key]) for r in records
                if r.get("split", "train") == split and isinstance(r.get(key), (int, float)))
    out = RunSeries(label, _last_per_step(rows("train", "loss")), _last_per_step(rows("valid", "loss")))
    for key, *_ in PANELS:
        out.other[key] = _last_per_step(rows("train", key))
    return out


def load_run(path: str, label: Optional[str] = None) -> RunSeries:
    """A run folder's series; a folder without ``metrics.jsonl`` (or with no rows) is a UserError."""
    records = read_metrics(path)
    if not records:
        raise UserError("holds no metrics.jsonl with rows (is it a run folder, and has it logged a step?)",
                        where=path)
    return run_series(records, label or os.path.basename(os.path.normpath(path)) or path)


def metrics_figure(runs: Sequence[RunSeries], title: Optional[str] = None):
    """A matplotlib Figure (Agg canvas attached) with the four panels for ``runs``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2, sharex=True)
    loss_ax = axes[0][0]
    colours = [f"C{i % 10}" for i in range(len(runs))]
    several = len(runs) > 1
    for run, colour in zip(runs, colours):
        name = f"{run.label}: " if several else ""
        if run.train_loss:
            xs, ys = zip(*run.train_loss)
            loss_ax.plot(xs, ys, color=colour, linewidth=1.2, marker="." if len(xs) <= 40 else None,
                         label=f"{name}train loss")
        if run.valid_loss:
            xs, ys = zip(*run.valid_loss)
            loss_ax.plot(xs, ys, color=colour, linestyle="--", marker="o", markersize=4, linewidth=1.0,
                         label=f"{name}held-out loss")
        for ax, (key, *_rest) in zip((axes[0][1], axes[1][0], axes[1][1]), PANELS):
            if run.other.get(key):
                xs, ys = zip(*run.other[key])
                ax.plot(xs, ys, color=colour, linewidth=1.2, marker="." if len(xs) <= 40 else None,
                        label=run.label)
    loss_ax.set_title("loss")
    loss_ax.set_ylabel("loss (nats per token)")
    loss_ax.legend(loc="upper right", fontsize="small")
    for ax, (key, panel_title, ylabel) in zip((axes[0][1], axes[1][0], axes[1][1]), PANELS):
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {panel_title} rows in metrics.jsonl", transform=ax.transAxes,
                    ha="center", va="center", color="grey")
        elif several:
            ax.legend(loc="best", fontsize="small")
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        ax.tick_params(labelbottom=True)
    for ax in axes[1]:
        ax.set_xlabel("optimizer step")
    axes[0][0].set_xlabel("optimizer step")
    axes[0][1].set_xlabel("optimizer step")
    fig.suptitle(title or ", ".join(run.label for run in runs))
    return fig


def save_metrics_png(run_dirs: Sequence[str], out_file: str, labels: Optional[Sequence[str]] = None,
                     title: Optional[str] = None) -> str:
    """Draw the runs in ``run_dirs`` (overlaid) into ``out_file`` (PNG); returns its path."""
    labels = list(labels or [])
    runs = [load_run(d, labels[i] if i < len(labels) else None) for i, d in enumerate(run_dirs)]
    fig = metrics_figure(runs, title)
    folder = os.path.dirname(os.path.abspath(out_file))
    os.makedirs(folder, exist_ok=True)
    atomic_write(out_file, lambda tmp: fig.savefig(tmp, format="png"))
    return out_file


def plot_run(output_dir: str, out_file: Optional[str] = None) -> Optional[str]:
    """``loss.png`` of one run folder (None when it has no metric rows yet)."""
    if not read_metrics(output_dir):
        return None
    return save_metrics_png([output_dir], out_file or os.path.join(output_dir, "loss.png"))


def downstream_series(records: Sequence[dict]) -> Dict[str, Dict[str, Series]]:
    """{task: {metric: series}} of the ``split: "downstream"`` rows (last row per step)."""
    from naohai.train.metrics import downstream_metrics

    out: Dict[str, Dict[str, List[Tuple[int, float]]]] = {}
    for r in records:
        if r.get("split") == "downstream":
            for key, value in downstream_metrics(r).items():
                out.setdefault(str(r.get("task")), {}).setdefault(key, []).append((r["step"], value))
    return {task: {k: _last_per_step(v) for k, v in metrics.items()} for task, metrics in out.items()}


def plot_downstream(output_dir: str, out_file: Optional[str] = None) -> Optional[str]:
    """``downstream.png`` of one run folder: a panel per downstream task (None when there are no such rows)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = downstream_series(read_metrics(output_dir))
    if not series:
        return None
    cols = min(2, len(series))
    rows = -(-len(series) // cols)
    fig = Figure(figsize=(6 * cols, 4 * rows), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (task, metrics) in zip(axes.flat, sorted(series.items())):
        for key, points in sorted(metrics.items()):
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.2, label=key)
        ax.set_title(task)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("score")
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    for ax in list(axes.flat)[len(series):]:
        ax.set_visible(False)
    fig.suptitle(f"downstream tasks: {os.path.basename(os.path.normpath(output_dir))}")
    out_file = out_file or os.path.join(output_dir, "downstream.png")
    atomic_write(out_file, lambda tmp: fig.savefig(tmp, format="png"))
    return out_file
