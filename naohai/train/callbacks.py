"""Small hooks the training loop calls: console log, metrics files, plots.

A callback has any of ``on_start(trainer)``, ``on_step_begin(trainer)``,
``on_step(trainer, record)``, ``on_eval(trainer, step, loss)``, ``on_downstream(trainer, step,
rows)`` (lm-eval task results, :mod:`naohai.train.downstream`), ``on_save(trainer, path)``,
``on_end(trainer)``.  The loop calls them on every rank; each callback decides what a
rank writes (run-wide files: rank 0 only).  Held-out evaluation and checkpoints are
part of the loop itself (they involve every rank).
"""
from __future__ import annotations

import math
import time
from typing import Dict, Optional


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ConsoleLog:
    """One line per logged step (rank 0): time, loss, lr, norm, scale, tok/s, MFU, step time, ETA."""

    def __init__(self, log):
        self.log = log

    def on_step(self, trainer, rec: Dict[str, float]) -> None:
        if not trainer.writer:
            return
        if not rec["applied"]:
            self.log(f"{time.strftime('%H:%M:%S')} step {rec['step']:6d} | SKIPPED ({rec['skip_reason']}) | "
                     f"loss {rec['loss']:.4f} | grad-norm {rec['grad_norm']:.3g} | next scale {rec['next_scale']:.0f}")
        if "tokens_per_s" not in rec:
            return
        mfu = f"MFU {100 * rec['mfu']:.1f}%" if rec.get("mfu") is not None else "MFU ?"
        self.log(f"{time.strftime('%H:%M:%S')} step {rec['step']:6d}/{trainer.total_steps} | loss {rec['loss']:.4f} | "
                 f"lr {rec['lr']:.2e} | grad-norm {rec['grad_norm']:.3f} | scale {rec['loss_scale']:.0f} | "
                 f"{rec['tokens_per_s']:,.0f} tok/s | {mfu} | {1000 * rec['step_time']:.0f} ms/step | "
                 f"ETA {_fmt_duration(rec['eta_s'])}")

    def on_eval(self, trainer, step: int, loss: float) -> None:
        if trainer.writer:
            self.log(f"{time.strftime('%H:%M:%S')} step {step:6d} | held-out loss {loss:.4f} "
                     f"ppl {math.exp(min(loss, 50)):.1f}")

    def on_downstream(self, trainer, step: int, rows) -> None:
        if trainer.writer:
            from naohai.train.downstream import downstream_metrics
            for row in rows:
                values = " ".join(f"{k} {v:.4f}" for k, v in sorted(downstream_metrics(row).items()))
                self.log(f"{time.strftime('%H:%M:%S')} step {step:6d} | {row['task']}: {values} "
                         f"(n {row['n']}, {row['seconds']:.1f} s)")

    def on_save(self, trainer, path: Optional[str]) -> None:
        if trainer.writer and path:
            self.log(f"{time.strftime('%H:%M:%S')} step {trainer.step:6d} | checkpoint published: {path}")


class MetricsFiles:
    """``metrics.jsonl`` and TensorBoard events (rank 0)."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self.run_log = None

    def on_start(self, trainer) -> None:
        if trainer.writer:
            from naohai.train.metrics import RunLog
            self.run_log = RunLog(self.output_dir)
            dropped = self.run_log.keep_until(trainer.step)
            if dropped:
                trainer.log(f"metrics.jsonl: {dropped} rows after step {trainer.step} dropped (those steps run "
                            f"again from the checkpoint)")

    def on_step(self, trainer, rec: Dict[str, float]) -> None:
        if self.run_log is not None and ("tokens_per_s" in rec or not rec["applied"]):
            self.run_log.write({k: v for k, v in rec.items() if k not in ("skip_reason", "eta_s")})

    def on_eval(self, trainer, step: int, loss: float) -> None:
        if self.run_log is not None:
            self.run_log.write({"split": "valid", "step": step, "loss": loss, "ppl": math.exp(min(loss, 50))})

    def on_downstream(self, trainer, step: int, rows) -> None:
        if self.run_log is not None:
            for row in rows:
                self.run_log.write(row)

    def on_end(self, trainer) -> None:
        if self.run_log is not None:
            self.run_log.close()
            self.run_log = None


class LossPlot:
    """``loss.png`` (loss, learning rate, throughput, gradient norm; :mod:`naohai.train.plots`) from
    ``metrics.jsonl`` at the end of the run (rank 0), and ``downstream.png`` when lm-eval tasks were
    scored (``train.eval``)."""

    def __init__(self, output_dir: str, log):
        self.output_dir = output_dir
        self.log = log

    def on_end(self, trainer) -> None:
        if trainer.writer:
            from naohai.train.plots import plot_downstream, plot_run
            try:
                png = plot_run(self.output_dir)
            except OSError as exc:  # a figure must never fail a run whose checkpoints are saved
                self.log(f"WARNING: could not write the plots into {self.output_dir} ({exc}); "
                         f"checkpoints and metrics.jsonl are unaffected (naohai plot {self.output_dir} redraws them)")
                return
            if png:
                self.log(f"plots (loss, learning rate, throughput, gradient norm): {png}")
            try:
                png = plot_downstream(self.output_dir)
            except OSError as exc:
                self.log(f"WARNING: could not write downstream.png into {self.output_dir} ({exc}); metrics.jsonl "
                         f"holds the downstream rows")
                return
            if png:
                self.log(f"downstream tasks: {png}")
