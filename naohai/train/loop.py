"""The training loop: data -> step -> metrics / eval / checkpoints, with exact resume.

``train(recipe, strategy=None)`` runs a whole job and returns a summary.  Each
optimizer step consumes one global batch; each data-parallel rank reads its
own contiguous slice of it and, with gradient accumulation, splits that slice
into micro-batches.  Everything a resumed run needs (weights, optimizer state,
step, data position, loss scale) is in the checkpoint, and the learning rate is
a pure function of the step, so "N steps, stop, resume, N more" equals 2N steps.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor

from naohai.config import Recipe
from naohai.errors import UserError
from naohai.strategy import apply as strategy_apply
from naohai.train import checkpoint as ckpt
from naohai.train.builder import Built, build
from naohai.train.loss_scale import LossScaler
from naohai.train.metrics import RunLog, cpu_peak_tflops, flops_per_token, plot_loss_curve
from naohai.train.schedule import learning_rate


@dataclass
class TrainResult:
    output_dir: str
    steps_done: int
    losses: Dict[int, float] = field(default_factory=dict)      # train loss per step
    evals: Dict[int, float] = field(default_factory=dict)       # held-out loss per step
    checkpoint: Optional[str] = None
    is_writer: bool = True                                       # rank that reports (rank 0)


def resolve_device(device: Optional[str] = None) -> str:
    """The MindSpore device target: argument, else $NAOHAI_DEVICE, else CPU."""
    device = device or os.environ.get("NAOHAI_DEVICE") or "CPU"
    if device not in ("CPU", "GPU", "Ascend"):
        raise UserError(f"'{device}' is not one of CPU, GPU, Ascend", where="environment",
                        key="NAOHAI_DEVICE")
    return device


def set_mode(recipe: Recipe, device: Optional[str] = None) -> str:
    device = resolve_device(device)
    ms.set_context(mode=ms.GRAPH_MODE if recipe.train.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device(device)
    if device == "CPU" and recipe.model.compute_dtype == "bfloat16":
        raise UserError("bfloat16 compute needs an Ascend 910B: MindSpore 2.10's CPU MatMul has no bfloat16 "
                        "kernel. Use float32 (or float16 with train.loss_scale.dynamic) on CPU.",
                        where=recipe.source, key="model.compute_dtype")
    ms.set_seed(recipe.train.seed)
    np.random.seed(recipe.train.seed)
    return device


def _split_batch(batch: np.ndarray):
    batch = batch.astype(np.int32)
    return Tensor(batch[:, :-1]), Tensor(batch[:, 1:])


class Trainer:
    def __init__(self, recipe: Recipe, resolved=None, *, log: Callable[[str], None] = print,
                 progress: bool = True, device: Optional[str] = None, max_steps: Optional[int] = None):
        self.recipe = recipe
        self.resolved = resolved
        self.device = set_mode(recipe, device)
        self.runtime = strategy_apply.init_runtime(resolved, self.device)
        if self.runtime.mode == "semi_auto":
            raise UserError("this strategy needs semi-auto parallel (model or pipeline parallel). Its train "
                            "step is built and checked by MindSpore's compiler (naohai check RECIPE STRATEGY "
                            "--compile), but the training loop for it (last-stage loss reporting, per-rank "
                            "sharded checkpoints) is not in this version; train with a data-parallel "
                            "strategy meanwhile", where=getattr(resolved, "source", None), key="mesh")
        self.writer = self.runtime.is_writer
        self.log = log if self.writer else (lambda *_: None)
        self.progress = progress
        self.max_steps = max_steps
        self.out = recipe.train.output_dir
        os.makedirs(self.out, exist_ok=True)
        self.prepared_dir, self.tokenizer = self._data()
        self.built: Built = build(recipe, resolved, self.runtime)
        from naohai.data.loader import TokenWindowLoader
        t = recipe.train
        self.loader = TokenWindowLoader(self.prepared_dir, "train", t.global_batch_size, self.runtime.dp_rank,
                                        self.runtime.dp_size, seed=recipe.data.shuffle_seed)
        self.scaler = LossScaler.from_config(t.loss_scale)
        self.step = 0
        self.metrics = RunLog(self.out, enabled=self.writer)
        self.flops_token = flops_per_token(recipe.model)
        self.peak = t.device_peak_tflops or (cpu_peak_tflops() if self.device == "CPU" else 256.0)

    # ------------------------------------------------------------------ data
    def _data(self):
        from naohai.data.pipeline import ensure_prepared
        if self.runtime.world == 1:
            return ensure_prepared(self.recipe, progress=self.progress, log=self.log)
        # several ranks: rank 0 tokenizes and packs, the others wait at a barrier and then
        # load what it wrote (shared file system assumed; or run `naohai data prepare` first)
        result = ensure_prepared(self.recipe, progress=False, log=self.log) if self.runtime.rank == 0 else None
        self._barrier()
        return result or ensure_prepared(self.recipe, progress=False)

    def _barrier(self) -> None:
        from mindspore import ops
        ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()

    # ------------------------------------------------------------------ resume
    def resume(self, path: Optional[str] = None) -> bool:
        path = path or ckpt.latest_checkpoint(self.out)
        if not path:
            return False
        state = ckpt.read_state(path)
        ckpt.load_params(path, self.built.state_params())
        self.step = int(state["step"])
        self.loader.load_state_dict(state["loader"])
        self.scaler.load_state_dict(state["loss_scale"])
        self.log(f"resumed from {path} at step {self.step}")
        return True

    def save(self) -> Optional[str]:
        if not self.writer:
            return None
        state = {"step": self.step, "loader": self.loader.state_dict(), "loss_scale": self.scaler.state_dict(),
                 "recipe": self.recipe.to_dict(), "seed": self.recipe.train.seed}
        return ckpt.save_checkpoint(self.out, self.step, self.built.state_params(), state,
                                    keep=self.recipe.train.keep_checkpoints)

    # ------------------------------------------------------------------ steps
    def train_step(self) -> Dict[str, float]:
        t = self.recipe.train
        # the rate the optimizer will use: its table at its own step counter (skipped
        # overflow steps do not advance it, as in Megatron)
        lr = learning_rate(t, int(self.built.optimizer.global_step.asnumpy()[0]))
        scale = Tensor(self.scaler.scale, ms.float32)
        ids, labels = _split_batch(self.loader.next_batch())
        k = self.built.accum_steps
        if k == 1:
            loss, norm, finite = self.built.train_step(ids, labels, scale)
            loss = float(loss.asnumpy())
        else:
            mb = self.built.micro_batch
            total = 0.0
            for i in range(k):
                total += float(self.built.accumulate_step(ids[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb],
                                                          scale).asnumpy())
            loss = total / k
            norm, finite = self.built.apply_step(Tensor(1.0 / (self.scaler.scale * k), ms.float32))
        finite = bool(finite.asnumpy())
        applied = self.scaler.update(finite)
        loss = self._mean_over_ranks(loss)
        return {"loss": loss, "lr": lr, "grad_norm": float(norm.asnumpy()), "loss_scale": float(scale.asnumpy()),
                "skipped": 0.0 if applied else 1.0}

    def _mean_over_ranks(self, value: float) -> float:
        if self.runtime.mode != "data_parallel":
            return value
        from mindspore import ops
        out = ops.AllReduce()(Tensor(np.array([value], np.float32)))
        return float(out.asnumpy()[0]) / self.runtime.world

    def evaluate(self) -> float:
        from naohai.data.loader import eval_batches
        t = self.recipe.train
        losses = []
        for batch in eval_batches(self.prepared_dir, t.micro_batch_size * self.runtime.dp_size, t.eval_batches,
                                  self.runtime.dp_rank, self.runtime.dp_size):
            ids, labels = _split_batch(batch)
            losses.append(float(self.built.eval_step(ids, labels).asnumpy()))
        return self._mean_over_ranks(float(np.mean(losses)))

    # ------------------------------------------------------------------ loop
    def run(self) -> TrainResult:
        t = self.recipe.train
        result = TrainResult(self.out, self.step, is_writer=self.writer)
        end = t.steps if self.max_steps is None else min(t.steps, self.step + self.max_steps)
        tokens_step = t.global_batch_size * self.recipe.model.seq_length
        if self.step == 0:
            ev = self.evaluate()
            result.evals[0] = ev
            self.metrics.write({"split": "valid", "step": 0, "loss": ev, "ppl": math.exp(min(ev, 50))})
            self.log(f"step      0 | held-out loss {ev:.4f} ppl {math.exp(min(ev, 50)):.1f}")
        window_t, window_steps = time.time(), 0
        while self.step < end:
            rec = self.train_step()
            self.step += 1
            window_steps += 1
            result.losses[self.step] = rec["loss"]
            if not math.isfinite(rec["loss"]) and not self.scaler.enabled:
                raise RuntimeError(f"loss became {rec['loss']} at step {self.step}")
            if self.step % t.log_every == 0 or self.step == end:
                dt = (time.time() - window_t) / window_steps
                tps = tokens_step / dt
                tflops = tps * self.flops_token / 1e12
                rec.update({"step": self.step, "split": "train", "tokens_per_s": tps, "tflops": tflops,
                            "mfu": tflops / (self.peak * self.runtime.world), "step_time": dt})
                self.metrics.write(rec)
                self.log(f"step {self.step:6d} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                         f"grad-norm {rec['grad_norm']:.3f} | scale {rec['loss_scale']:.0f} | "
                         f"{tps:,.0f} tok/s | {tflops:.3f} TFLOPs | MFU {100 * rec['mfu']:.1f}%")
                window_t, window_steps = time.time(), 0
            if self.step % t.eval_every == 0 or self.step == t.steps:
                ev = self.evaluate()
                result.evals[self.step] = ev
                self.metrics.write({"split": "valid", "step": self.step, "loss": ev, "ppl": math.exp(min(ev, 50))})
                self.log(f"step {self.step:6d} | held-out loss {ev:.4f} ppl {math.exp(min(ev, 50)):.1f}")
                window_t = time.time()
            if self.step % t.save_every == 0 or self.step == end:
                result.checkpoint = self.save()
        result.steps_done = self.step
        self.metrics.close()
        if self.writer:
            png = plot_loss_curve(self.out)
            if png:
                self.log(f"loss curve: {png}")
        return result


def train(recipe: Recipe, resolved=None, *, resume: bool = True, **kwargs) -> TrainResult:
    trainer = Trainer(recipe, resolved, **kwargs)
    if resume:
        trainer.resume()
    return trainer.run()
