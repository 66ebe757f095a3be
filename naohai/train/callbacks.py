"""The training loop's callbacks: the :class:`Callback` hooks, console log, throughput, metrics files, plots.

The loop (:class:`naohai.train.loop.Trainer`) calls the hooks of its callbacks in list order, on
every rank, at these points::

    on_start                        before the first step (after resume / init_from)
    on_step_begin                   before each step reads its batch
    on_step(record)                 after each step; a callback may add fields to the record
                                    for the ones after it (Throughput adds tokens/s and MFU)
    on_eval(step, loss)             after each held-out evaluation
    on_downstream(step, rows)       lm-eval task results (naohai.train.downstream)
    on_save(path)                   a checkpoint was published (path None: it failed)
    on_end                          after the last step, or before a stop

Each callback decides what a rank writes (run-wide files: rank 0 only).  Held-out
evaluation and checkpoints are part of the loop itself (they involve every rank).
"""
from __future__ import annotations

import math
import time
from typing import Any, Dict, List, Optional, Sequence


class Callback:
    """A training-loop callback: override the hooks you need (the others do nothing)."""

    def on_start(self, trainer) -> None:
        pass

    def on_step_begin(self, trainer) -> None:
        pass

    def on_step(self, trainer, record: Dict[str, Any]) -> None:
        pass

    def on_eval(self, trainer, step: int, loss: float) -> None:
        pass

    def on_downstream(self, trainer, step: int, rows: List[Dict[str, Any]]) -> None:
        pass

    def on_save(self, trainer, path: Optional[str]) -> None:
        pass

    def on_end(self, trainer) -> None:
        pass

    @staticmethod
    def due(trainer, every: int) -> bool:
        """Whether a callback that acts every ``every`` steps acts now: at a multiple of ``every``, and at
        the last step of a run that knows it (one without ``max_steps``)."""
        end = trainer.total_steps if trainer.max_steps is None else None
        return trainer.step % every == 0 or trainer.step == end


class CallbackList(Callback):
    """Callbacks called in order: each hook of this list calls that hook of every member."""

    def __init__(self, callbacks: Sequence[Callback]):
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"{type(cb).__name__} is not a naohai.train.callbacks.Callback")
        self.members = list(callbacks)

    def on_start(self, trainer) -> None:
        for cb in self.members:
            cb.on_start(trainer)

    def on_step_begin(self, trainer) -> None:
        for cb in self.members:
            cb.on_step_begin(trainer)

    def on_step(self, trainer, record: Dict[str, Any]) -> None:
        for cb in self.members:
            cb.on_step(trainer, record)

    def on_eval(self, trainer, step: int, loss: float) -> None:
        for cb in self.members:
            cb.on_eval(trainer, step, loss)

    def on_downstream(self, trainer, step: int, rows: List[Dict[str, Any]]) -> None:
        for cb in self.members:
            cb.on_downstream(trainer, step, rows)

    def on_save(self, trainer, path: Optional[str]) -> None:
        for cb in self.members:
            cb.on_save(trainer, path)

    def on_end(self, trainer) -> None:
        for cb in self.members:
            cb.on_end(trainer)


class Throughput(Callback):
    """Adds ``tokens_per_s``, ``tflops``, ``step_time``, ``mfu`` and ``eta_s`` to the record of every
    ``log_every``-th step and of the last one, over the steps since the last such record.  A step's time
    runs from its ``on_step_begin`` to its ``on_step`` (data, compiled step, loss): held-out and downstream
    evaluation, checkpoint saves and the hooks after this one are not counted; the ETA is from wall time.
    MFU = achieved model FLOP/s over ``peak_tflops`` x ``world`` (None when the peak is unknown).  Put it
    before the callbacks that read these fields."""

    def __init__(self, tokens_per_step: int, flops_per_token: float, peak_tflops: float, world: int,
                 log_every: int):
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.peak, self.world, self.log_every = float(peak_tflops), world, log_every
        self.t_start, self.start_step = time.time(), 0
        self.step_began = self.t_start
        self.window_s, self.window_steps = 0.0, 0

    def on_start(self, trainer) -> None:
        self.t_start, self.start_step = time.time(), trainer.step
        self.window_s, self.window_steps = 0.0, 0

    def on_step_begin(self, trainer) -> None:
        self.step_began = time.time()

    def on_step(self, trainer, record: Dict[str, Any]) -> None:
        now = time.time()
        self.window_s += now - self.step_began
        self.window_steps += 1
        step, end = trainer.step, trainer.end
        if step % self.log_every and step != end:
            return
        dt = self.window_s / self.window_steps
        tps = self.tokens_per_step / dt if dt > 0 else float("inf")
        tflops = tps * self.flops_per_token / 1e12
        record.update({"tokens_per_s": tps, "tflops": tflops, "step_time": dt,
                       "mfu": tflops / (self.peak * self.world) if self.peak > 0 else None,
                       "eta_s": (now - self.t_start) / (step - self.start_step) * (end - step)})
        self.window_s, self.window_steps = 0.0, 0


def _fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ConsoleLog(Callback):
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
            from naohai.train.metrics import downstream_metrics
            for row in rows:
                values = " ".join(f"{k} {v:.4f}" for k, v in sorted(downstream_metrics(row).items()))
                self.log(f"{time.strftime('%H:%M:%S')} step {step:6d} | {row['task']}: {values} "
                         f"(n {row['n']}, {row['seconds']:.1f} s)")

    def on_save(self, trainer, path: Optional[str]) -> None:
        if trainer.writer and path:
            self.log(f"{time.strftime('%H:%M:%S')} step {trainer.step:6d} | checkpoint published: {path}")


class MetricsFiles(Callback):
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


class LossPlot(Callback):
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
