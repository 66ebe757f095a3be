"""What one optimizer step does, the same on one device and on 3456: the train-step cells.

``TrainStep(network, optimizer, guard, grad_clip, micro, collect, reduce_loss)``,
called as ``step(input_ids, labels) -> (loss, grad_norm, applied, loss_scale)``:

1. ``loss = network(input_ids, labels)`` and the gradients of ``loss * loss_scale /
   micro`` (``micro`` = micro-batches summed inside ``network`` by a pipeline or an
   in-graph accumulation wrapper, else 1);
2. ``collect(grads, 1 / loss_scale)`` returns unscaled gradients reduced over data
   parallel as the layout needs (the collectors live in ``naohai/strategy/gradients.py``;
   on one device with a static loss scale, which is 1, there is nothing to do);
3. the global gradient norm in fp32 (see :func:`global_norm`), identical on every
   rank and every pipeline stage (with ``fused_gradients``, the recipe's ``train.cpu_reductions:
   fused`` on CPU, all the gradients' sums of squares are one compiled kernel's; the optimizer is then
   :class:`naohai.train.adam_all.AdamWeightDecayAll`, one kernel for every update that also takes the clip's
   factor and the decision of 4, so that graph has no branch);
4. the update is applied only when the norm is finite and, when the spike guard is
   on, not above ``spike_factor`` x its running mean; gradients are clipped to
   ``grad_clip`` by the global norm;
5. :class:`StepGuard` updates the dynamic loss scale (halve on a non-finite norm, grow
   after ``window`` clean steps) and the running norm mean, in the graph, so every
   rank takes the same decision without a host round trip.
``reduce_loss`` turns the network's output into the global mean loss every rank
reports (the identity where the network already returns it).

For gradient accumulation on one device or plain data parallel the same math is
split in two graphs driven by the host: :class:`AccumulateStep` adds the scaled
gradients of one micro-batch into buffers, :class:`ApplyStep` does 2-5.  Skipped
steps leave the optimizer (and so its step counter and learning-rate table) alone.
The guard's parameters are ordinary Parameters, so checkpoints carry them.

Masked (fine-tuning) loss.  With ``token_weight`` (a Parameter the host sets before each step)
the network returns the SUM of the NLL of its learned tokens and the steps use ``loss *
token_weight`` and its gradients.  The host sets ``token_weight = f / N`` where ``N`` is the
number of learned tokens of the whole global batch (all data-parallel ranks: the loader counts them)
and ``f`` what the step and the loop later divide by: host micro-batches (``ApplyStep``) or the
micro-batches summed in the network (``TrainStep``'s ``micro``), times the data-parallel ranks whose
gradients and losses are averaged outside the graph.  So the step's loss and gradients are ``sum of
all learned NLL / N`` however the batch is split: one batch, accumulation of 4, 4 micro-batches and
data-parallel ranks give the same result.
Pretraining passes no ``token_weight`` and is unchanged.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops import composite as C
from mindspore.ops import functional as F

from naohai.config import GuardConfig
from naohai.strategy.gradients import scale_by, square_sum
from naohai.train.adam_all import AdamWeightDecayAll

_add_into = C.MultitypeFuncGraph("naohai_add_into")


@_add_into.register("Tensor", "Tensor")
def _add_into_tensor(buf, grad):
    return F.assign_add(buf, F.cast(grad, F.dtype(buf)))


_zero = C.MultitypeFuncGraph("naohai_zero")


@_zero.register("Tensor")
def _zero_tensor(buf):
    return F.assign(buf, F.zeros_like(buf))


def global_norm(hyper_map, grads, square_sums=None):
    """sqrt(sum of squares) of all gradients in fp32, shape ``(1,)``; summed by the one kernel ``square_sums``
    when given (:class:`naohai.model.layers.GradientKernels`: ``train.cpu_reductions: fused``, float32
    gradients on CPU)."""
    if square_sums is not None:
        return ops.sqrt(square_sums(*grads))
    return ops.sqrt(ops.addn(hyper_map(square_sum, grads)))


class Unscale(nn.Cell):
    """The one-device gradient collector: multiply by ``1 / loss_scale``."""

    def __init__(self):
        super().__init__(auto_prefix=False)
        self.hyper_map = C.HyperMap()

    def construct(self, grads, inv_scale):
        return self.hyper_map(F.partial(scale_by, inv_scale), grads)


class StepGuard(nn.Cell):
    """Dynamic loss scale and the gradient-norm spike guard, as graph state.

    Parameters (saved in checkpoints): ``guard.loss_scale``, ``guard.good_steps`` (clean
    steps since the scale last changed), ``guard.norm_mean`` and ``guard.norm_count``
    (running mean of the norms of applied steps over at most ``spike_window`` steps).
    """

    def __init__(self, cfg: GuardConfig):
        super().__init__(auto_prefix=False)
        ls = cfg.loss_scale
        self.dynamic = bool(ls.dynamic)
        self.loss_scale = Parameter(Tensor(float(ls.init) if ls.dynamic else 1.0, ms.float32),
                                    name="guard.loss_scale", requires_grad=False)
        self.good_steps = Parameter(Tensor(0, ms.int32), name="guard.good_steps", requires_grad=False)
        self.norm_mean = Parameter(Tensor(0.0, ms.float32), name="guard.norm_mean", requires_grad=False)
        self.norm_count = Parameter(Tensor(0, ms.int32), name="guard.norm_count", requires_grad=False)
        self.window = int(ls.window)
        self.factor = float(ls.factor)
        self.min_scale = Tensor(float(ls.min_scale), ms.float32)
        self.spike_factor = float(cfg.spike_factor)
        self.spike_warmup = int(cfg.spike_warmup)
        self.spike_window = Tensor(float(cfg.spike_window), ms.float32)

    def decide(self, norm):
        """(finite, applied) for a step whose global gradient norm is ``norm`` (shape (1,))."""
        finite = ops.isfinite(norm).all()
        applied = finite
        if self.spike_factor > 0:
            warm = self.norm_count < self.spike_warmup
            calm = (norm <= self.norm_mean * self.spike_factor).all()
            applied = ops.logical_and(finite, ops.logical_or(warm, calm))
        return finite, applied

    def update(self, finite, applied, norm):
        """Record the step's outcome; returns a token to depend on."""
        out = F.zeros((), ms.float32)
        if self.dynamic:
            good = ops.select(finite, self.good_steps + 1, F.zeros((), ms.int32))
            grow = good >= self.window
            scale = self.loss_scale
            grown = ops.select(grow, scale * self.factor, scale)
            shrunk = ops.maximum(scale / self.factor, self.min_scale)
            new_scale = ops.select(finite, grown, shrunk)
            new_good = ops.select(grow, F.zeros((), ms.int32), good)
            out = F.depend(out, F.assign(self.loss_scale, new_scale))
            out = F.depend(out, F.assign(self.good_steps, new_good))
        if self.spike_factor > 0:
            count = self.norm_count + 1
            weight = 1.0 / ops.minimum(F.cast(count, ms.float32), self.spike_window)
            mean = self.norm_mean + (norm.reshape(()) - self.norm_mean) * weight
            out = F.depend(out, F.assign(self.norm_mean, ops.select(applied, mean, self.norm_mean)))
            out = F.depend(out, F.assign(self.norm_count, ops.select(applied, count, self.norm_count)))
        return out


class _Finish(nn.Cell):
    """Steps 3-5 of the module docstring: norm, decision, clip, update, guard."""

    def _init_finish(self, optimizer, guard: StepGuard, grad_clip: float, fused_gradients=None):
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.guard = guard
        self.grad_clip = float(grad_clip)
        self.hyper_map = C.HyperMap()
        self.square_sums = fused_gradients.square_sums if fused_gradients is not None else None
        # AdamWeightDecayAll takes the clip's factor and the decision into its one kernel: no branch in the graph
        self.guarded_update = isinstance(optimizer, AdamWeightDecayAll)
        self.unit = Tensor([1.0], ms.float32)

    def _finish(self, grads):
        norm = global_norm(self.hyper_map, grads, self.square_sums)
        finite, applied = self.guard.decide(norm)
        factor = self.grad_clip / ops.maximum(norm, self.grad_clip) if self.grad_clip > 0 else self.unit
        if self.guarded_update:
            norm = F.depend(norm, self.optimizer(grads, factor, applied))
        else:
            if self.grad_clip > 0:
                grads = self.hyper_map(F.partial(scale_by, factor), grads)
            if applied:
                norm = F.depend(norm, self.optimizer(grads))
        norm = F.depend(norm, self.guard.update(finite, applied, norm))
        return norm.reshape(()), applied


class TrainStep(_Finish):
    """One optimizer step in one graph (see the module docstring)."""

    def __init__(self, network, optimizer, guard: StepGuard, grad_clip: float, micro: int = 1,
                 collect=None, reduce_loss=None, token_weight=None, fused_gradients=None):
        super().__init__(auto_prefix=False)
        self.network = network
        self._init_finish(optimizer, guard, grad_clip, fused_gradients)
        self.micro = float(micro)
        # a static loss scale is 1: on one device there is nothing to unscale (x * 1 is x)
        self.static_one = not guard.dynamic and collect is None and \
            ms.get_auto_parallel_context("parallel_mode") == ms.ParallelMode.STAND_ALONE
        self.one = Tensor(1.0, ms.float32)
        self.collect = None if self.static_one else collect if collect is not None else Unscale()
        self.reduce_loss = reduce_loss
        self.grad = C.GradOperation(get_by_list=True, sens_param=True)
        self.weighted = token_weight is not None
        self.token_weight = token_weight

    def construct(self, input_ids, labels):
        scale = self.one if self.static_one else self.guard.loss_scale.value()
        loss = self.network(input_ids, labels)
        sens = F.ones_like(loss) * F.cast(scale / self.micro, F.dtype(loss))
        if self.weighted:
            weight = F.cast(self.token_weight.value(), F.dtype(loss))
            loss = loss * weight
            sens = sens * weight
        grads = self.grad(self.network, self.weights)(input_ids, labels, sens)
        if not self.static_one:
            grads = self.collect(grads, 1.0 / scale)
        norm, applied = self._finish(grads)
        if self.reduce_loss is not None:
            loss = self.reduce_loss(loss)
        return loss, norm, applied, scale


class AccumulateStep(nn.Cell):
    """Adds the gradients of ``loss * loss_scale`` of one micro-batch into ``buffers``."""

    def __init__(self, network, weights, buffers, guard: StepGuard, token_weight=None):
        super().__init__(auto_prefix=False)
        self.network = network
        self.weights = weights
        self.buffers = buffers
        self.guard = guard
        self.grad = C.GradOperation(get_by_list=True, sens_param=True)
        self.hyper_map = C.HyperMap()
        self.weighted = token_weight is not None
        self.token_weight = token_weight

    def construct(self, input_ids, labels):
        loss = self.network(input_ids, labels)
        sens = F.ones_like(loss) * F.cast(self.guard.loss_scale.value(), F.dtype(loss))
        if self.weighted:
            weight = F.cast(self.token_weight.value(), F.dtype(loss))
            loss = loss * weight
            sens = sens * weight
        grads = self.grad(self.network, self.weights)(input_ids, labels, sens)
        return F.depend(loss, self.hyper_map(_add_into, self.buffers, grads))


class ApplyStep(_Finish):
    """Collects the buffers of ``micro`` accumulated micro-batches, updates, clears them."""

    def __init__(self, optimizer, buffers, guard: StepGuard, grad_clip: float, micro: int, collect=None,
                 fused_gradients=None):
        super().__init__(auto_prefix=False)
        self._init_finish(optimizer, guard, grad_clip, fused_gradients)
        self.buffers = buffers
        self.micro = float(micro)
        self.collect = collect if collect is not None else Unscale()

    def construct(self):
        scale = self.guard.loss_scale.value()
        grads = self.hyper_map(F.partial(scale_by, F.ones((), ms.float32)), self.buffers)
        grads = self.collect(grads, 1.0 / (scale * self.micro))
        norm, applied = self._finish(grads)
        norm = F.depend(norm, self.hyper_map(_zero, self.buffers))
        return norm, applied, scale


def make_buffers(weights) -> ms.ParameterTuple:
    """Float32 gradient-accumulation buffers, zeros (``initializer``-made, so they stay unmaterialised
    inside :func:`naohai.model.layers.deferred_parameters`)."""
    from mindspore.common.initializer import initializer
    return ms.ParameterTuple(
        Parameter(initializer("zeros", w.shape, ms.float32), name=f"accum.{w.name}", requires_grad=False)
        for w in weights)


class EvalStep(nn.Cell):
    """Forward loss only; ``reduce_loss`` as in :class:`TrainStep`.  A masked loss comes out as the sum of
    the learned tokens' NLL (over micro-batches: ``reduce_loss``'s mean of it); the host weights it
    (:meth:`naohai.train.builder.CompiledSteps.evaluate`: a Parameter read in a forward-only pipeline graph
    crashes MindSpore 2.10's compile of the last stage)."""

    def __init__(self, network, reduce_loss=None):
        super().__init__(auto_prefix=False)
        self.network = network
        self.reduce_loss = reduce_loss

    def construct(self, input_ids, labels):
        loss = self.network(input_ids, labels)
        if self.reduce_loss is not None:
            loss = self.reduce_loss(loss)
        return loss
