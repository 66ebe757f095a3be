"""Compile targets for the simulated-device harness tests.

Each function is called inside an msrun worker after ``set_device("GPU")`` and
``init()``; it sets up the parallel context and returns ``(network, compile_args)``.
"""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.parallel.auto_parallel import AutoParallel


class _MatMulNet(nn.Cell):
    def __init__(self, strategy):
        super().__init__()
        self.w = Parameter(Tensor(np.full((64, 128), 0.01, np.float32)), name="w")
        self.mm = ops.MatMul().shard(strategy)
        self.sum = ops.ReduceSum()

    def construct(self, x):
        return self.sum(self.mm(x, self.w))


def matmul_mp(strategy=((1, 1), (1, 2)), batch=16):
    """(a) model-parallel MatMul, forward + backward + Momentum update."""
    net = _MatMulNet(tuple(tuple(s) for s in strategy))
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    step = nn.TrainOneStepCell(net, opt)
    parallel = AutoParallel(step, parallel_mode="semi_auto")
    return parallel, (Tensor(np.ones((batch, 64), np.float32)),)


def matmul_too_wide():
    """(c) semantically fine net, but the shard product (4) exceeds 2 devices."""
    return matmul_mp(strategy=((1, 1), (1, 4)))
