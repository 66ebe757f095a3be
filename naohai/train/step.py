"""The jit-compiled training step cells.

``TrainStep``     one graph: gradients of ``loss * scale``, optional data-parallel
                  reduction, unscale, global norm, clip, AdamW update unless the
                  norm is not finite.  Returns (loss, grad_norm, finite).
``AccumulateStep`` + ``ApplyStep``  the same split in two graphs for gradient
                  accumulation: micro-steps add scaled gradients into buffers,
                  the apply step averages, reduces, clips and updates.
``EvalStep``      forward loss only.

The learning rate lives in the optimizer's ``learning_rate`` parameter and is set
from the host every step (see ``naohai.train.schedule``); the loss scale is an
input, decided on the host (``naohai.train.loss_scale``).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.ops import composite as C
from mindspore.ops import functional as F

_mul = C.MultitypeFuncGraph("mul")


@_mul.register("Tensor", "Tensor")
def _mul_tensor(factor, grad):
    return grad * F.cast(factor, F.dtype(grad))


_square_sum = C.MultitypeFuncGraph("square_sum")


@_square_sum.register("Tensor")
def _square_sum_tensor(grad):
    g = F.cast(grad, ms.float32)
    return F.reduce_sum(g * g)


_add_into = C.MultitypeFuncGraph("add_into")


@_add_into.register("Tensor", "Tensor")
def _add_into_tensor(buf, grad):
    return F.assign_add(buf, F.cast(grad, F.dtype(buf)))


_zero = C.MultitypeFuncGraph("zero")


@_zero.register("Tensor")
def _zero_tensor(buf):
    return F.assign(buf, F.zeros_like(buf))


class _UpdateMixin(nn.Cell):
    """Unscale, reduce, measure, clip and apply gradients."""

    def _init_update(self, optimizer, grad_clip: float, reducer=None):
        self.optimizer = optimizer
        self.weights = optimizer.parameters
        self.grad_clip = float(grad_clip)
        self.reducer = reducer
        self.hyper_map = C.HyperMap()

    def _update(self, grads, inv_scale):
        if self.reducer is not None:
            grads = self.reducer(grads)
        grads = self.hyper_map(F.partial(_mul, inv_scale), grads)
        norm = ops.sqrt(ops.addn(self.hyper_map(_square_sum, grads)))
        finite = ops.isfinite(norm)
        if self.grad_clip > 0:
            factor = self.grad_clip / ops.maximum(norm, self.grad_clip)
            grads = self.hyper_map(F.partial(_mul, factor), grads)
        if finite:
            norm = F.depend(norm, self.optimizer(grads))
        return norm, finite


class TrainStep(_UpdateMixin):
    def __init__(self, network, optimizer, grad_clip: float, reducer=None):
        super().__init__(auto_prefix=False)
        self.network = network
        self._init_update(optimizer, grad_clip, reducer)
        self.grad = C.GradOperation(get_by_list=True, sens_param=True)

    def construct(self, input_ids, labels, scale):
        loss = self.network(input_ids, labels)
        grads = self.grad(self.network, self.weights)(input_ids, labels, F.cast(scale, F.dtype(loss)))
        norm, finite = self._update(grads, 1.0 / scale)
        return loss, norm, finite


class AccumulateStep(nn.Cell):
    """Adds the gradients of ``loss * scale`` of one micro-batch into ``buffers``."""

    def __init__(self, network, weights, buffers):
        super().__init__(auto_prefix=False)
        self.network = network
        self.weights = weights
        self.buffers = buffers
        self.grad = C.GradOperation(get_by_list=True, sens_param=True)
        self.hyper_map = C.HyperMap()

    def construct(self, input_ids, labels, scale):
        loss = self.network(input_ids, labels)
        grads = self.grad(self.network, self.weights)(input_ids, labels, F.cast(scale, F.dtype(loss)))
        return F.depend(loss, self.hyper_map(_add_into, self.buffers, grads))


class ApplyStep(_UpdateMixin):
    """Averages the buffers over ``k`` micro-batches, updates, and clears the buffers."""

    def __init__(self, optimizer, buffers, grad_clip: float, reducer=None):
        super().__init__(auto_prefix=False)
        self._init_update(optimizer, grad_clip, reducer)
        self.buffers = buffers

    def construct(self, inv_scale_and_k):
        grads = self.hyper_map(F.partial(_mul, F.ones((), ms.float32)), self.buffers)
        norm, finite = self._update(grads, inv_scale_and_k)
        norm = F.depend(norm, self.hyper_map(_zero, self.buffers))
        return norm, finite


def make_buffers(weights) -> ms.ParameterTuple:
    return ms.ParameterTuple(
        Parameter(ops.zeros(w.shape, ms.float32), name=f"accum.{w.name}", requires_grad=False) for w in weights)


class EvalStep(nn.Cell):
    def __init__(self, network):
        super().__init__(auto_prefix=False)
        self.network = network

    def construct(self, input_ids, labels):
        return self.network(input_ids, labels)
