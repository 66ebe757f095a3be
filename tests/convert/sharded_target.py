"""Compile target (run by the simulated-device harness on 2 ranks): a network holding the PanGu-alpha
reference tensors under their own names, each consumed by an op sharded the way the reference's
MindSpore transformer shards it over model parallel 2 (attention dense1-3 weights [out, in] by
rows, projection [in, out] by rows, FFN mapping by columns, output projection by rows, the word
embedding by vocabulary rows; LayerNorm, position tables and some biases replicated).  After the
compile every rank's parameters hold MindSpore's own slices of them."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.parallel.auto_parallel import AutoParallel

from tests.convert.reference_forward import make_weights

DIMS = dict(family="pangu", hidden=16, ffn=64, layers=3, seq=8)   # test_convert_reference FAMILIES["pangu"]


def full_weights(seed: int, vocab: int):
    return make_weights(np.random.RandomState(seed), vocab=vocab, **DIMS)


def split_of(name: str, ndim: int):
    """The reference's model-parallel split of one tensor (2 devices)."""
    rows, cols = ((2, 1) if ndim == 2 else (2,)), ((1, 2) if ndim == 2 else (2,))
    whole = (1,) * ndim
    if "layernorm" in name or "position_embedding" in name or "top_query_embedding" in name:
        return whole
    if "word_embedding" in name:
        return rows
    if ".attention.dense" in name:
        return rows                      # [out, in] weights and their biases split on out
    if ".attention.projection." in name or ".output.projection." in name:
        return rows if name.endswith("weight") else whole
    if ".output.mapping." in name:
        return cols if name.endswith("weight") else rows
    raise AssertionError(name)


class _Holder(nn.Cell):
    def __init__(self, weights):
        super().__init__()
        names = sorted(weights)
        self.params = ParameterTuple([Parameter(Tensor(weights[n]), name=n) for n in names])
        self.squares = tuple(ops.Square().shard((split_of(n, weights[n].ndim),)) for n in names)
        self.sum = ops.ReduceSum()
        self.count = len(names)

    def construct(self, x):
        total = x.sum()
        for i in range(self.count):
            total = total + self.sum(self.squares[i](self.params[i]))
        return total


def reference_slices(seed: int, vocab: int):
    net = AutoParallel(_Holder(full_weights(seed, vocab)), parallel_mode="semi_auto")
    return net, (Tensor(np.zeros((2, 2), np.float32)),)
