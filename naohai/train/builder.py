"""Builds what a training run compiles: model with strategy applied, optimizer, step cells.

``naohai train`` and the simulated compile check (``naohai check --compile``)
both build through here, so the graph checked on a laptop is the graph trained.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from naohai.config import Recipe
from naohai.model.params import param_shapes
from naohai.model.transformer import NaohaiLM
from naohai.strategy import apply as strategy_apply
from naohai.train.schedule import learning_rate
from naohai.train.step import AccumulateStep, ApplyStep, EvalStep, TrainStep, make_buffers


@dataclass
class Built:
    model: NaohaiLM
    optimizer: nn.Optimizer
    runtime: strategy_apply.Runtime
    accum_steps: int
    micro_batch: int
    train_step: Optional[TrainStep] = None
    accumulate_step: Optional[AccumulateStep] = None
    apply_step: Optional[ApplyStep] = None
    eval_step: Optional[EvalStep] = None
    parallel_step: Optional[strategy_apply.ParallelStep] = None   # semi-auto (model/pipeline parallel)

    def state_params(self):
        """Everything a checkpoint must hold for exact resume."""
        seen, out = set(), []
        for p in list(self.model.get_parameters()) + list(self.optimizer.get_parameters()):
            if p.name in seen or p.name == "learning_rate":
                continue
            seen.add(p.name)
            out.append(p)
        return out


def make_optimizer(model: NaohaiLM, recipe: Recipe) -> nn.Optimizer:
    """AdamW; no weight decay on norms, biases and embedding tables."""
    no_decay = {p.name for p in param_shapes(recipe.model) if p.no_decay}
    params = list(model.trainable_params())
    decay = [p for p in params if p.name not in no_decay]
    plain = [p for p in params if p.name in no_decay]
    t = recipe.train
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    # The schedule is a table indexed in-graph by the optimizer's global_step (saved in
    # checkpoints), so resumed runs see exactly the same rates.  Setting a scalar rate
    # from the host with Parameter.set_data is NOT seen by an already compiled graph in
    # MindSpore 2.10 (measured), so it is not used.
    table = np.array([learning_rate(t, i) for i in range(t.steps + 1)], np.float32)
    return nn.AdamWeightDecay(groups, learning_rate=Tensor(table), beta1=t.adam_beta1,
                              beta2=t.adam_beta2, eps=t.adam_eps)


def accumulation(recipe: Recipe, dp_size: int) -> int:
    t = recipe.train
    per_rank = t.global_batch_size // dp_size
    if t.global_batch_size % dp_size or per_rank % t.micro_batch_size:
        from naohai.errors import UserError
        raise UserError(f"global_batch_size {t.global_batch_size} must be a multiple of micro_batch_size "
                        f"{t.micro_batch_size} x data-parallel size {dp_size}", where=recipe.source,
                        key="train.global_batch_size", rule="global_batch % (micro_batch * dp) == 0")
    return per_rank // t.micro_batch_size


def build(recipe: Recipe, resolved=None, runtime: Optional[strategy_apply.Runtime] = None) -> Built:
    """Build model, optimizer and step cells.  ``runtime`` comes from ``init_runtime``."""
    runtime = runtime or strategy_apply.Runtime("standalone", 0, 1, 0, 1)
    model = NaohaiLM(recipe.model, seed=recipe.train.seed)
    strategy_apply.apply_strategy(model, resolved)
    optimizer = make_optimizer(model, recipe)
    if runtime.mode == "semi_auto":
        # micro-batching is the pipeline's (or one micro-batch per step without stages)
        built = Built(model, optimizer, runtime, 1, recipe.train.micro_batch_size, eval_step=EvalStep(model))
        built.parallel_step = strategy_apply.wrap_train_step(model, optimizer, recipe, resolved, runtime)
        return built
    k = accumulation(recipe, runtime.dp_size)
    built = Built(model, optimizer, runtime, k, recipe.train.micro_batch_size, eval_step=EvalStep(model))
    reducer = strategy_apply.grad_reducer(runtime, optimizer.parameters)
    if k == 1:
        built.train_step = TrainStep(model, optimizer, recipe.train.grad_clip, reducer)
    else:
        buffers = make_buffers(optimizer.parameters)
        built.accumulate_step = AccumulateStep(model, optimizer.parameters, buffers)
        built.apply_step = ApplyStep(optimizer, buffers, recipe.train.grad_clip, reducer)
    return built
