"""The training loop, the same for every layout: data -> step -> hooks / eval / checkpoints.

:class:`Trainer` drives one rank.  Each optimizer step it reads this rank's rows of
the global batch (data-parallel rank ``d`` of ``D`` gets rows ``[d*B/D, (d+1)*B/D)``;
model-parallel peers and pipeline stages of a data-parallel group read the same rows),
calls ``built.steps.train`` (a compiled step that returns the global mean loss, the
global gradient norm and whether the update was applied) and hands a record to its
callbacks, whose hooks it calls in order (:class:`naohai.train.callbacks.Callback`: console,
metrics files, throughput and MFU, plots, downstream tasks).  Held-out loss every
``train.eval_every`` steps; a checkpoint every ``train.save_every`` steps and at the end,
written by every rank that holds parameters of its own (:mod:`naohai.checkpoint.store`).

Exact resume: weights, optimizer state, step guard (loss scale, norm statistics),
step and data position are in the checkpoint and the learning rate is a pure function
of the optimizer's own step, so "N steps, stop, resume, N more" equals 2N steps.  A
checkpoint of another layout is loaded through :mod:`naohai.checkpoint.relayout`.
A run stops with :class:`TrainingStopped` (after a checkpoint) when ``max_skipped_steps``
updates in a row were skipped (non-finite or spiking gradient norm).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from naohai import interrupt
from naohai.checkpoint import relayout
from naohai.checkpoint import store as ckpt_store
from naohai.config import Recipe
from naohai.errors import UserError
from naohai.train import schedule
from naohai.train.builder import TrainSetup
from naohai.train.callbacks import Callback, CallbackList


#: what ``--no-resume`` moves aside: the files of a run that a new run at step 0 would replace
SUPERSEDED_FILES = ("checkpoints", "resharded", "metrics.jsonl", "tensorboard", "loss.png")


class TrainingStopped(UserError):
    """The run stopped itself (too many skipped steps); a checkpoint was written first."""

    exit_code = 3


class FinalSaveFailed(UserError):
    """The checkpoint at the last step could not be written: the run must not look successful."""

    exit_code = 1


@dataclass
class TrainResult:
    output_dir: str
    steps_done: int
    losses: Dict[int, float] = field(default_factory=dict)      # train loss per step
    evals: Dict[int, float] = field(default_factory=dict)       # held-out loss per step
    skipped: List[int] = field(default_factory=list)            # steps whose update was skipped
    checkpoint: Optional[str] = None
    is_writer: bool = True                                       # rank that reports (rank 0)


class Trainer:
    """One rank's training loop over a built step (see the module docstring)."""

    def __init__(self, recipe: Recipe, built: TrainSetup, prepared_dir: str, *, store: ckpt_store.CheckpointStore,
                 manifest: Dict[str, Any], log: Callable[[str], None] = print, callbacks: Sequence[Callback] = (),
                 max_steps: Optional[int] = None, strategy_file: Optional[str] = None):
        from naohai.data.loader import TokenWindowLoader

        self.recipe = recipe
        self.built = built
        self.runtime = built.runtime
        self.comm = built.comm
        self.steps = built.steps
        self.prepared_dir = prepared_dir
        self.store = store
        self.manifest = manifest
        self.writer = self.runtime.is_writer
        self.log = log if self.writer else (lambda *_: None)
        self.callbacks = CallbackList(callbacks)
        self.out = recipe.train.output_dir
        self.strategy_file = strategy_file
        t = recipe.train
        from naohai.data.sft import SFTLoader, is_sft_dir
        self.sft = is_sft_dir(prepared_dir)          # conversations with a loss mask: (tokens, mask) batches
        loader = SFTLoader if self.sft else TokenWindowLoader
        self.loader = loader(prepared_dir, "train", t.global_batch_size, self.runtime.dp_rank,
                             self.runtime.dp_size, seed=recipe.data.shuffle_seed)
        self.step = 0
        self.total_steps = t.steps
        self.max_steps = max_steps
        self.end = t.steps        # the last step of this call of run() (max_steps may end it sooner)
        self.skip_streak = 0
        self.pending = None       # a checkpoint save in flight (train.async_save)
        self.last_save_s: Optional[float] = None    # wall time of the last synchronous save
        self.failed_saves: List[int] = []           # steps whose checkpoint could not be written

    # ------------------------------------------------------------------ checkpoints
    def _files_to_read(self, manifest: Dict[str, Any]) -> List[str]:
        return relayout.files_for_rank(manifest, self.manifest["layout"], self.runtime.rank,
                                       sharded=self.runtime.mode == "semi_auto")

    def _load(self, chosen: str, params, folder: str) -> str:
        """Load checkpoint ``chosen`` into ``params`` at this run's layout; returns the folder read."""
        return relayout.load_at_layout(chosen, self.manifest["layout"], self.out, params, rank=self.runtime.rank,
                                       sharded=self.runtime.mode == "semi_auto", all_ok=self.comm.all_ok,
                                       log=self.log, optional=self.built.optional_in_checkpoint, folder=folder)

    def resume(self, path: Optional[str] = None) -> bool:
        """Load the newest checkpoint that verifies (or ``path``); False when there is none.  A checkpoint
        of another layout is resharded for this one first (:mod:`naohai.checkpoint.relayout`)."""
        started = time.time()
        self.log("compiling the train and eval steps ...")
        self.steps.compile()      # semi-auto parameters are sliced by the compile: load after it
        self.log(f"compiled in {time.time() - started:.1f} s")
        self.comm.barrier()       # ... and every rank's strategy file is written
        chosen = self.store.select(self.manifest["identity"], self._files_to_read, explicit=path, log=self.log)
        if chosen is None:
            return False
        man = ckpt_store.read_manifest(chosen)
        self._check_base(chosen, man)
        self._load(chosen, self.built.saved_params(), folder="resharded")
        self.step = int(man["step"])
        self.loader.load_state_dict(man["data"]["loader"])
        self.log(f"resumed from {chosen} at step {self.step} (loss scale {self.built.loss_scale():.0f})")
        return True

    def _check_base(self, chosen: str, man: Dict[str, Any]) -> None:
        """A fine-tuning run resumes its adapters only over the base they were trained on."""
        from naohai.checkpoint.adapters import BASE_KEY
        theirs, mine = man.get(BASE_KEY), self.manifest.get(BASE_KEY)
        if self.recipe.finetune is None or theirs is None or mine is None:
            return
        if theirs.get("fingerprint") != mine.get("fingerprint"):
            raise UserError(f"base mismatch: the adapters of {chosen} were trained on {theirs.get('describe')}, this "
                            f"run's base is {mine.get('describe')} (other weights); set train.init_from to the "
                            f"original base or use a new output folder", where=self.recipe.source or "recipe",
                            key="train.init_from")

    def start_over(self) -> None:
        """``--no-resume``: step 0 in a folder that may hold an earlier run.  Rank 0 moves that run's
        checkpoints, metrics and plots into a new ``superseded-<time>`` folder inside the run folder
        (nothing deleted, nothing overwritten)."""
        from naohai.runfiles import move_into_new_folder
        if self.runtime.rank == 0:
            dest = move_into_new_folder(self.out, SUPERSEDED_FILES, "superseded")
            if dest:
                self.log(f"--no-resume: the previous run's files are kept in {dest}")
        self.comm.barrier()

    def init_from(self, path: str) -> None:
        """Start from the model weights at ``path`` (``train.init_from``): a run folder (its newest
        checkpoint), a checkpoint folder, an imported model folder or any source registered with
        :mod:`naohai.checkpoint.weights`.  Weights only: the optimizer state, the step guard, the step
        (0) and the data position (the start) stay fresh.  A checkpoint of another layout is resharded
        for this one as on resume; any other source is first written as one full checkpoint."""
        from naohai.checkpoint.weights import start_checkpoint
        from naohai.model.params import param_shapes
        self.steps.compile()      # semi-auto parameters are sliced by the compile: load after it
        self.comm.barrier()
        found, chosen = start_checkpoint(path, self.recipe, (self.manifest.get("identity") or {}).get("tokenizer_sha256"),
                                         self.out, rank=self.runtime.rank, all_ok=self.comm.all_ok)
        names = {p.name for p in param_shapes(self.recipe.model)}
        source = self._load(chosen, [p for p in self.built.model_params() if p.name in names], folder="init")
        if self.recipe.finetune is not None:        # the adapters' checkpoints name this base
            from naohai.checkpoint.adapters import BASE_KEY, base_record
            self.manifest[BASE_KEY] = base_record(found, self.recipe.train.seed)
        self.log(f"initialised from {found.describe()}: {len(names)} model tensors"
                 f"{'' if source == chosen else f' (resharded for this layout: {source})'}; "
                 f"optimizer state fresh, step 0, data from the start")

    def save(self, wait: bool = False) -> Optional[str]:
        """Checkpoint the current step.  With ``train.async_save`` the files are written in the
        background and published at the next save or at the end of the run (the same point on
        every rank); ``wait`` publishes at once.  Returns the published folder, if any yet."""
        published = self.finish_save()
        man = dict(self.manifest)
        man["data"] = {"loader": self.loader.state_dict()}
        man["loss_scale"] = self.built.loss_scale()
        background = bool(self.recipe.train.checkpoints.async_save) and not wait
        t0 = time.time()
        self.pending = self.store.save_async(self.step, self.built.saved_params(), man, self.strategy_file,
                                             background=background)
        if not background:
            published = self.finish_save()
            self.last_save_s = time.time() - t0
        return published

    def finish_save(self) -> Optional[str]:
        """Publish the save in flight (if any); a failure is logged and the previous checkpoint kept."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        outcome = pending.finish()
        if outcome.path is None:
            self.failed_saves.append(pending.step)
            previous = ckpt_store.list_checkpoints(self.out)
            self.log(f"WARNING: checkpoint at step {pending.step} FAILED ({outcome.error}); the previous checkpoint "
                     f"{previous[-1] if previous else '(none)'} is intact; training continues")
        self.callbacks.on_save(self, outcome.path)
        return outcome.path

    # ------------------------------------------------------------------ steps
    def evaluate(self) -> float:
        from naohai.data.loader import eval_batches
        t = self.recipe.train
        rows, dp = self.steps.eval_rows, self.runtime.dp_size
        if self.sft:
            from naohai.data.sft import SFTLoader
            held = SFTLoader(self.prepared_dir, "valid", rows * dp, self.runtime.dp_rank, dp, seed=0, shuffle=False)
            batches = (held.next_batch() for _ in range(t.held_out.eval_batches))
        else:
            batches = eval_batches(self.prepared_dir, rows * dp, t.held_out.eval_batches, self.runtime.dp_rank, dp)
        losses = [self.steps.evaluate(batch) for batch in batches]
        return self.comm.mean(float(np.mean(losses)))

    def _record(self, res, lr: float) -> Dict[str, Any]:
        rec = {"split": "train", "step": self.step, "loss": self.comm.mean(res.loss), "lr": lr,
               "grad_norm": res.grad_norm, "loss_scale": res.loss_scale, "applied": res.applied,
               "skipped": 0.0 if res.applied else 1.0}
        if not res.applied:
            rec["skip_reason"] = "non-finite gradient norm" if not math.isfinite(res.grad_norm) else \
                f"gradient norm spike (> {self.recipe.train.guard.spike_factor} x running mean)"
            rec["next_scale"] = self.built.loss_scale()
        return rec

    # ------------------------------------------------------------------ loop
    def run(self) -> TrainResult:
        t = self.recipe.train
        result = TrainResult(self.out, self.step, is_writer=self.writer)
        self.end = t.steps if self.max_steps is None else min(t.steps, self.step + self.max_steps)
        if self.step >= t.steps:
            # a finished run: no step, no file of the run rewritten (recipe, metrics, plots)
            past = "at" if self.step == t.steps else f"past train.steps={t.steps}, at"
            self.log(f"nothing to do: {self.out} is already {past} step {self.step}. To train further raise "
                     f"train.steps (e.g. train.steps={self.step + t.steps}); to start a new run give another "
                     f"train.output_dir (--output-dir) or --no-resume")
            result.checkpoint = (ckpt_store.list_checkpoints(self.out) or [None])[-1]
            return result
        self.callbacks.on_start(self)
        self.log(f"layout: {self.manifest['layout']['describe']}; {self.steps.rows} rows per rank per step")
        for note in self.steps.notes + schedule.notes(t):
            self.log(f"note: {note}")
        if self.step == 0:
            ev = self.evaluate()
            result.evals[0] = ev
            self.callbacks.on_eval(self, 0, ev)
        stop = interrupt.current().watch()
        stop.deferring = True
        try:
            self._steps(result, stop)
        finally:
            stop.deferring = False
            stop.release()
        result.checkpoint = self.finish_save() or result.checkpoint
        result.steps_done = self.step
        try:
            self.callbacks.on_end(self)
        finally:
            self._check_final_save()
        return result

    def _check_final_save(self) -> None:
        """Raise :class:`FinalSaveFailed` when the last step's checkpoint was not written (whatever else failed
        at the end, e.g. the plot on the same full disk)."""
        if self.step in self.failed_saves:
            newest = ckpt_store.list_checkpoints(self.out)
            raise FinalSaveFailed(
                f"the checkpoint of the last step ({self.step}) could not be written (see the WARNING above); the "
                f"newest good checkpoint is " + (f"step {int(ckpt_store.read_manifest(newest[-1])['step'])} "
                                                 f"({newest[-1]})" if newest else "none: no checkpoint was saved") +
                ". Free space (or fix the folder) and run the same command to resume from it",
                where=self.out, key="train.output_dir")

    def _stop_agreed(self, stop) -> bool:
        """Whether any rank received a stop signal (every rank gets the same answer, at the same step)."""
        if self.runtime.world == 1:
            return stop.requested
        return not self.comm.all_ok(not stop.requested)

    def _stop(self, stop, saved_this_step: bool) -> None:
        """One final checkpoint (if it fits the grace time under SIGTERM), the end hooks, then
        :class:`naohai.interrupt.Interrupted` naming the step the run resumes from."""
        import signal as _signal
        signum = stop.signum or _signal.SIGTERM
        note = f"step {self.step} was just checkpointed" if saved_this_step and self.step not in self.failed_saves \
            else ""
        if not saved_this_step:
            left = stop.seconds_left(interrupt.grace_seconds())
            need = None if self.last_save_s is None else 1.5 * self.last_save_s + 1.0
            if self.comm.all_ok(need is None or need <= left):
                path = self.save(wait=True)
                note = f"checkpoint of step {self.step} saved" if path else f"the checkpoint of step {self.step} " \
                                                                           f"FAILED"
            else:
                note = (f"no final checkpoint: a save takes ~{need:.0f} s, {max(0.0, left):.0f} s of the "
                        f"{interrupt.grace_seconds():.0f} s grace (NAOHAI_STOP_GRACE) were left")
        self.finish_save()
        self.callbacks.on_end(self)
        self.comm.barrier()       # every rank has written what it writes before any exits
        newest = ckpt_store.list_checkpoints(self.out)
        resume = (f"run the same command to resume from step {int(ckpt_store.read_manifest(newest[-1])['step'])}"
                  if newest else "no checkpoint yet: the same command starts from step 0")
        raise interrupt.Interrupted(signum, f"stopped by {interrupt.signal_name(signum)} after step {self.step}"
                                    + (f"; {note}" if note else "") + f"; {resume}")

    def _steps(self, result: TrainResult, stop) -> None:
        t = self.recipe.train
        if self._stop_agreed(stop):
            self._stop(stop, saved_this_step=True)
        while self.step < self.end:
            self.callbacks.on_step_begin(self)
            lr = self.built.learning_rate(self.recipe)
            res = self.steps.train(self.loader.next_batch())
            self.step += 1
            rec = self._record(res, lr)
            result.losses[self.step] = rec["loss"]
            if res.applied:
                self.skip_streak = 0
            else:
                self.skip_streak += 1
                result.skipped.append(self.step)
            self.callbacks.on_step(self, rec)
            if self.skip_streak >= t.guard.max_skipped_steps:
                result.checkpoint = self.save(wait=True)
                self.callbacks.on_end(self)
                raise TrainingStopped(
                    f"{self.skip_streak} updates in a row were skipped (last: {rec['skip_reason']}, gradient norm "
                    f"{rec['grad_norm']:.3g}, loss {rec['loss']:.4g}); the weights are those of step "
                    f"{self.step - self.skip_streak}. Checkpoint: {result.checkpoint}. Lower train.lr, check the data "
                    f"near this step, or raise train.max_skipped_steps", where=self.recipe.source,
                    key="train.max_skipped_steps")
            if self.step % t.held_out.eval_every == 0 or self.step == t.steps:
                ev = self.evaluate()
                result.evals[self.step] = ev
                self.callbacks.on_eval(self, self.step, ev)
            saved = self.step % t.checkpoints.save_every == 0 or self.step == self.end
            if saved:
                result.checkpoint = self.save(wait=self.step == self.end) or result.checkpoint
            stop.rearm()
            if self._stop_agreed(stop):
                self._stop(stop, saved_this_step=saved and not t.checkpoints.async_save)
