"""The parallel pieces of a train step: gradient collectors, the global norm's terms, the loss's mean.

:mod:`naohai.train.step` holds the step's math; what differs between layouts comes
from :func:`step_parts`: the network the step differentiates (the model, MindSpore's
``Pipeline`` or ``GradAccumulation`` wrapper), how gradients are collected
(:class:`ReducedGrads` all-reduces them under plain data parallel,
:class:`AccumulatedGrads` reads the ``accu_grads`` buffers that MindSpore's
pipeline / accumulation passes fill, or with optimizer parallel the returned
reduce-scattered gradients while the buffers are cleared, as MindFormers'
``MFPipelineWithLossScaleCell`` does) and how the loss becomes the global mean.
:data:`scale_by` scales every gradient by a scalar and :data:`square_sum` gives each
gradient's square sum marked ``grad_scale`` (a term of the global norm, reduced over
replicas and stages by MindSpore's parallel passes under semi-auto).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import mindspore as ms
from mindspore import nn
from mindspore.ops import composite as C
from mindspore.ops import functional as F
from mindspore.ops import operations as P

from naohai.strategy.resolve import ResolvedStrategy
from naohai.strategy.runtime import Runtime, optimizer_sharded


#: ``hyper_map(F.partial(scale_by, factor), grads)``: every gradient times a scalar, in its own dtype
scale_by = C.MultitypeFuncGraph("naohai_scale_by")


@scale_by.register("Tensor", "Tensor")
def _scale_by_tensor(factor, grad):
    return grad * F.cast(factor, F.dtype(grad))


# The "grad_scale" attribute tells MindSpore's parallel passes that this is a per-gradient
# square sum of a global norm: under semi-auto they divide it by the parameter's replica
# count and all-reduce it inside the stage and across stages (MindFormers' clip_grad does the
# same).  Outside semi-auto no parallel pass runs and it is a plain ExpandDims.
_expand_norm = P.ExpandDims().add_prim_attr("grad_scale", True)
#: ``hyper_map(square_sum, grads)``: each gradient's float32 sum of squares, shape ``(1,)``, marked as a
#: term of the global norm (reduced over replicas and stages under semi-auto)
square_sum = C.MultitypeFuncGraph("naohai_square_sum")


@square_sum.register("Tensor")
def _square_sum_tensor(grad):
    g = F.cast(grad, ms.float32)
    return _expand_norm(F.reduce_sum(g * g), 0)


_read_accumulated = C.MultitypeFuncGraph("naohai_read_accumulated")


@_read_accumulated.register("Tensor", "Tensor", "Tensor")
def _read_accumulated_tensor(inv_scale, grad, accu):
    """The micro-batch sum MindSpore accumulated in ``accu``, unscaled; ``accu`` is cleared."""
    accu = F.depend(accu, grad)
    out = accu * F.cast(inv_scale, F.dtype(accu))
    accu = F.depend(accu, out)
    # zeros built from accu itself (equal(x, x) is 0 for NaN) keep the clear after the read
    zeros = F.mul(F.cast(F.equal(accu, accu), F.dtype(accu)), 0)
    return F.depend(out, F.assign(accu, zeros))


_read_sharded = C.MultitypeFuncGraph("naohai_read_sharded")


@_read_sharded.register("Tensor", "Tensor", "Tensor")
def _read_sharded_tensor(inv_scale, grad, accu):
    """Optimizer parallel: the returned (reduce-scattered) gradient, unscaled; ``accu`` is cleared."""
    out = grad * F.cast(inv_scale, F.dtype(grad))
    accu = F.depend(accu, out)
    zeros = F.mul(F.cast(F.equal(accu, accu), F.dtype(accu)), 0)
    return F.depend(out, F.assign(accu, zeros))


class ReducedGrads(nn.Cell):
    """Data parallel (DATA_PARALLEL mode): all-reduce the mean, then unscale."""

    def __init__(self, weights, world: int):
        super().__init__(auto_prefix=False)
        self.reducer = nn.DistributedGradReducer(weights, mean=True, degree=world)
        self.hyper_map = C.HyperMap()

    def construct(self, grads, inv_scale):
        return self.hyper_map(F.partial(scale_by, inv_scale), self.reducer(grads))


class AccumulatedGrads(nn.Cell):
    """Semi-auto with in-graph micro-batches: gradients from the ``accu_grads`` buffers."""

    def __init__(self, weights, optimizer_sharded: bool):
        super().__init__(auto_prefix=False)
        self.accu_grads = weights.clone(prefix="accu_grads", init="zeros")
        self.sharded = optimizer_sharded
        self.hyper_map = C.HyperMap()

    def construct(self, grads, inv_scale):
        if self.sharded:
            return self.hyper_map(F.partial(_read_sharded, inv_scale), grads, self.accu_grads)
        return self.hyper_map(F.partial(_read_accumulated, inv_scale), grads, self.accu_grads)


class GlobalMeanLoss(nn.Cell):
    """Pipeline: last-stage ranks hold the sum of their micro-batch losses, others 0;
    one all-reduce over the world divided by (ranks per stage x micro) is the global mean."""

    def __init__(self, per_stage: int, micro: int):
        super().__init__(auto_prefix=False)
        self.all_reduce = P.AllReduce()
        self.denominator = float(per_stage * micro)

    def construct(self, loss):
        return self.all_reduce(loss) / self.denominator


class MeanOverMicro(nn.Cell):
    """The micro-batching wrappers (GradAccumulation, an eval Pipeline) return the sum over micro-batches."""

    def __init__(self, micro: int):
        super().__init__(auto_prefix=False)
        self.micro = float(micro)

    def construct(self, loss):
        return loss / self.micro


@dataclass
class StepParts:
    """The parallel pieces :class:`naohai.train.step.TrainStep` is built from."""

    network: Any                 # what the step differentiates (the model, or a micro-batching wrapper)
    micro: int                   # micro-batches inside ``network``
    collect: Any                 # gradient collector cell, or None (unscale only)
    reduce_loss: Any             # loss -> global mean cell, or None
    eval_network: Any            # forward network for held-out loss
    eval_reduce_loss: Any
    opt_sharded: bool
    notes: List[str]
    averaged: int = 1            # ranks whose gradients and losses are averaged outside the model (plain dp)
    eval_micro: int = 1          # micro-batches the eval network sums and ``eval_reduce_loss`` divides by


def step_parts(model, weights, resolved: ResolvedStrategy, runtime: Runtime) -> StepParts:
    """Network wrapper, gradient collector and loss reduction for this layout."""
    if runtime.mode == "standalone":
        return StepParts(model, 1, None, None, model, None, False, [])
    if runtime.mode == "data_parallel":
        return StepParts(model, 1, ReducedGrads(weights, runtime.world), None, model, None, False,
                         ["data parallel: explicit gradient all-reduce (mean) before the norm"], averaged=runtime.world)
    from mindspore.parallel.nn import GradAccumulation, Pipeline

    micro, stages = runtime.micro, runtime.stages
    sharded = optimizer_sharded(resolved)
    notes = []
    if stages > 1:
        network = Pipeline(model, micro)     # stages were set on the cells by assign_stages
        eval_network = Pipeline(model, micro)
        # eval: MindSpore refuses a user all-reduce in a forward-only semi-auto graph; the
        # pipeline broadcasts the last stage's output instead (output_broadcast, compile_parallel)
        reduce_loss, eval_reduce = GlobalMeanLoss(runtime.per_stage, micro), MeanOverMicro(micro)
        notes.append(f"pipeline: {stages} stages x {micro} micro-batches per step, scheduler {resolved.scheduler}")
    elif micro > 1:
        network = GradAccumulation(model, micro)
        eval_network = model
        reduce_loss, eval_reduce = MeanOverMicro(micro), None
        notes.append(f"gradient accumulation in the graph: {micro} micro-batches per step")
    else:
        return StepParts(model, 1, None, None, model, None, sharded, notes)
    if int(resolved.gradient_accumulation) > 1:
        notes.append(f"the global batch holds {resolved.gradient_accumulation} x micro_batches "
                     f"({resolved.micro_batches}) micro-batches per data-parallel rank: all run in one step")
    collect = AccumulatedGrads(weights, sharded)
    return StepParts(network, micro, collect, reduce_loss, eval_network, eval_reduce, sharded, notes,
                     eval_micro=micro if stages > 1 else 1)
