"""Collectives between compiled steps, on the host: agreement (all ranks ok?), barriers, the mean of a float.

:class:`HostComm` is identity on one process.  The training loop uses it for the
barrier of checkpoint saves, the resume decision and the data-parallel loss (whose
graph does not reduce it).
"""
from __future__ import annotations

from naohai.strategy.runtime import Runtime


class HostComm:
    """Collectives the host loop needs between its compiled steps (identity on one process).

    ``all_ok(flag)`` is True on every rank iff ``flag`` is True on every rank (the barrier
    of checkpoint saves and of the resume decision); ``mean(x)`` averages a float over
    the ranks (the data-parallel loss, whose graph does not reduce it).
    """

    def __init__(self, runtime: Runtime):
        self.world = runtime.world
        self.average = runtime.mode == "data_parallel"

    def _sum(self, values):
        import numpy as np
        from mindspore import Tensor, ops
        return ops.AllReduce()(Tensor(np.asarray(values, np.float32))).asnumpy()

    def all_ok(self, flag: bool) -> bool:
        if self.world == 1:
            return bool(flag)
        return int(round(float(self._sum([1.0 if flag else 0.0])[0]))) == self.world

    def barrier(self) -> None:
        self.all_ok(True)

    def mean(self, value: float) -> float:
        if not self.average:
            return value
        return float(self._sum([value])[0]) / self.world
