"""The tensors of a run's state by the names checkpoint files use, whichever form the model has.

Checkpoints, converters, ``ckpt reshard`` and generation all name decoder weights per layer
(``layers.7.attention.q_weight``).  Under the layer loop (:mod:`naohai.model.stack`) the
run holds them stacked (``stack.layer.attention.q_weight`` ``[n, ...]``, and the optimizer's
``adam_m.``/``adam_v.`` moments alike).  :func:`file_view` turns a run's Parameters into
entries with the per-layer names -- ``name``, ``shape``, ``dtype``, ``asnumpy()``,
``set_data(value)``, what :mod:`naohai.checkpoint.store` reads and writes -- so both forms
write the same files and load each other's checkpoints.  A stacked Parameter's entries
share one buffer: reading takes one host copy of the stack, let go once all its layers have been
read, and the stack is written once all its layers are.

Entries write in place (``ops.assign``), never by ``Parameter.set_data``: once the compiled train
step of a layer-loop model has run, MindSpore 2.10 keeps reading and updating its parameters'
old memory after a ``set_data`` -- stacked or not (measured on CPU;
``tests/train/test_layer_loop.py``).  A checkpoint is loaded before the first step, but the
view is safe at any point.
"""
from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from naohai.config import ModelConfig
from naohai.model.stack import is_stacked, per_layer_names


class _Stack:
    """The host copy of one stacked Parameter that its per-layer entries read and write."""

    def __init__(self, param: ms.Parameter):
        self.param = param
        self.buffer = None
        self.written = set()
        self.read = set()

    def array(self) -> np.ndarray:
        if self.buffer is None:
            self.buffer = self.param.asnumpy().copy()
        return self.buffer

    def row(self, index: int) -> np.ndarray:
        """Layer ``index`` of the host copy; the copy is let go once every layer has been read (a checkpoint
        save reads the stacks one after another: one stack's copy at a time, not the whole state's)."""
        array = self.array()
        self.read.add(index)
        if len(self.read) == array.shape[0] and not self.written:
            self.buffer, self.read = None, set()
        return array[index]

    def write(self, index: int, value: Any) -> None:
        array = self.array()
        array[index] = value.asnumpy() if hasattr(value, "asnumpy") else np.asarray(value)
        self.written.add(index)
        if len(self.written) == array.shape[0]:
            ops.assign(self.param, Tensor(array))     # in place (module docstring)
            self.written = set()


class LayerEntry:
    """Layer ``index`` of a stacked Parameter, under its per-layer name."""

    def __init__(self, stack: _Stack, index: int, name: str):
        self.stack, self.index, self.name = stack, index, name
        self.shape = tuple(stack.param.shape[1:])
        self.dtype = stack.param.dtype

    def asnumpy(self) -> np.ndarray:
        return self.stack.row(self.index)

    def set_data(self, value: Any) -> None:
        self.stack.write(self.index, value)


def file_view(cfg: ModelConfig, params: Sequence[ms.Parameter]) -> List[Any]:
    """An entry per tensor of the files for ``params``: a stacked Parameter gives one per layer, a layer
    kept apart takes its per-layer name; every entry writes its Parameter in place."""
    out: List[Any] = []
    for p in params:
        names = per_layer_names(cfg, p.name)
        if is_stacked(p.name):
            stack = _Stack(p)
            out.extend(LayerEntry(stack, j, name) for j, name in enumerate(names))
        else:
            out.append(ParamEntry(p, names[0]))
    return out


class ParamEntry:
    """A whole Parameter under its file name."""

    def __init__(self, param: ms.Parameter, name: str):
        self.param, self.name = param, name
        self.shape, self.dtype = tuple(param.shape), param.dtype

    def asnumpy(self) -> np.ndarray:
        return self.param.asnumpy()

    def set_data(self, value: Any) -> None:
        ops.assign(self.param, value if isinstance(value, Tensor) else Tensor(np.asarray(value)))
