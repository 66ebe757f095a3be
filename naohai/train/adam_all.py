"""AdamW for every trained parameter by one compiled kernel: the optimizer of a fused CPU step.

MindSpore's :class:`~mindspore.nn.AdamWeightDecay` updates each parameter with a kernel of its own, and on the CPU
backend a kernel launch costs tens of microseconds (on the tiny bench model's 75 parameters that is about as much
as the updates themselves).  :class:`AdamWeightDecayAll` is that optimizer -- the same state (``moments1``,
``moments2``, ``global_step``), the same learning-rate table, decay groups and checkpoints -- whose update is one
call of naohai's ``adam_all`` kernel (:mod:`naohai.model.cpu_kernels`), which writes the parameters and moments
where they lie.  The kernel also takes the clip's factor and the step guard's decision
(:class:`naohai.train.step.TrainStep`): the gradients are scaled as they are read, and a skipped step leaves the
parameters, moments and step counter as they are -- so the step's graph has no branch (a branch around the
optimizer splits MindSpore's CPU graph in three, and passing every parameter between them cost about 2 ms a step
on the tiny bench model).  The update is MindSpore's formula (no bias correction); MindSpore's own kernel rounds a
third of the moments' elements differently in the last bit, so it is used only where a recipe asks for naohai's fused
kernels (``train.cpu_reductions: fused``, :func:`naohai.train.builder.make_optimizer`).
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import nn, Tensor
from mindspore.ops import functional as F


class AdamWeightDecayAll(nn.AdamWeightDecay):
    """:class:`mindspore.nn.AdamWeightDecay` (same arguments, static weight decay, one learning rate for every
    group) whose update is ``kernel`` over all parameters at once (see the module docstring)."""

    def __init__(self, params, kernel, **kwargs):
        super().__init__(params, **kwargs)
        if self.dynamic_weight_decay or self.is_group_lr:
            raise ValueError("AdamWeightDecayAll takes a static weight decay and one learning rate for every group")
        n = len(self._parameters)
        decay = self.weight_decay if self.is_group else (self.weight_decay,) * n
        self.decays = Tensor(np.array([float(d) if flag else 0.0 for d, flag in zip(decay, self.decay_flags)],
                                      np.float32))
        self.kernel = kernel

    def construct(self, gradients, scale, applied):
        """Update with ``gradients * scale`` (``scale`` [1]: the clip's factor) where ``applied`` (a bool scalar);
        where not, nothing changes, the step counter included."""
        lr = self.get_lr()
        go = F.cast(applied, ms.float32)
        self.assignadd(self.global_step, self.global_step_increase_tensor * F.cast(applied, ms.int32))
        return self.kernel(*self._parameters, *self.moments1, *self.moments2, *gradients, lr, self.beta1,
                           self.beta2, self.eps, self.decays, F.cast(scale, ms.float32), go)
