"""Equal decoder layers as one graph-mode loop over stacked weights (the layer loop).

:class:`LayerStack` holds layers ``0 .. n-1`` of a model as ONE decoder-layer cell whose
every Parameter is stacked over the layers (``[n, ...]``), and runs them with a
``while`` loop over an int32 counter; each cell picks its layer's slice with
:func:`naohai.model.layers.layer_slice`.  The graph therefore holds one copy of the
layer whatever the depth: MindSpore 2.10 compiles 64 layers in about the time of 4 on
CPU, and its CPU backend keeps one set of per-kernel buffers instead of one per layer
(``run/bench_layer_loop.py`` and the README's compile section measure both).  The math
is the per-layer model's, in the same order; a layer kept apart (PanGu's query layer, or
the last layer when the final norm runs before it) follows the loop as an ordinary cell.

Parameter names differ from the per-layer model (``stack.layer.attention.q_weight``
``[n, ...]`` holds ``layers.<j>.attention.q_weight``, ``last_layer.*`` is ``layers.<L-1>.*``).
:func:`per_layer_names` maps them; checkpoints and every other file use the per-layer
names (``naohai/checkpoint/entries.py`` splits and joins the stacks at that boundary).

Write new values into the looped model's Parameters with ``ops.assign``, not ``set_data``: once
its compiled train step has run, MindSpore 2.10 keeps reading and updating their old memory after
a ``set_data`` (measured on CPU; ``tests/train/test_layer_loop.py``).

The stack derives the packed window's positions and document mask once, before the loop.
Dropout inside the loop draws a fresh mask in every iteration and its backward uses that
mask (MindSpore 2.10 on CPU; ``tests/model/test_model_stack.py``).  MindSpore does not
recompute inside the loop, so the trainer keeps one cell per layer when a strategy asks for
recompute (:func:`naohai.strategy.annotate.layer_loop_refusal`).
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn
from mindspore.common.initializer import initializer

from naohai.model.config import ModelConfig

STACK = "stack.layer."          # name prefix of the stacked Parameters inside NaohaiLM
LAST = "last_layer."            # the layer kept apart, when there is one


def last_layer_apart(cfg: ModelConfig) -> bool:
    """Whether the last layer runs outside the loop: PanGu's query layer (other parameters), or a final
    norm that runs right before it."""
    return bool(cfg.query_layer) or cfg.final_norm == "before_query_layer"


def stacked_count(cfg: ModelConfig) -> int:
    """How many layers the loop runs."""
    return cfg.num_layers - (1 if last_layer_apart(cfg) else 0)


def is_stacked(name: str) -> bool:
    """Whether a (state) tensor of the looped model is stacked over layers (its first axis)."""
    return STACK in name


def per_layer_names(cfg: ModelConfig, name: str) -> List[str]:
    """The per-layer names a (state) tensor of the looped model stands for, in layer order: one name
    for most, ``n`` for a stacked one (also ``adam_m.stack.layer.*`` etc.)."""
    if is_stacked(name):
        return [name.replace(STACK, f"layers.{j}.", 1) for j in range(stacked_count(cfg))]
    if name.startswith(LAST) or f".{LAST}" in name:
        i = name.index(LAST)
        return [name[:i] + f"layers.{cfg.num_layers - 1}." + name[i + len(LAST):]]
    return [name]


class LayerStack(nn.Cell):
    """``construct(x [b*s, h], input_ids [b, s]) -> x`` through the stacked layers, in order."""

    def __init__(self, layers: Sequence[nn.Cell]):
        super().__init__()
        template = layers[0]
        # parameters_and_names of a cell not yet attached: names relative to it ("attention.q_weight")
        per_layer = [dict(layer.parameters_and_names()) for layer in layers]
        for name, _ in template.parameters_and_names():
            owner = template
            *path, leaf = name.split(".")
            for part in path:
                owner = getattr(owner, part)
            first = per_layer[0][name]
            if first.has_init:   # built inside deferred_parameters: stack the initializer, not data
                value = initializer(first.init_mode.init, (len(layers), *first.shape), first.dtype)
            else:
                value = Tensor(np.stack([p[name].asnumpy() for p in per_layer]))
            setattr(owner, leaf, Parameter(value, name=leaf))
        self.layer = template
        self.count = Tensor(len(layers), ms.int32)

    def construct(self, x, input_ids):
        positions, bias = None, None
        if self.layer.layout is not None:
            positions, bias = self.layer.layout(input_ids)
        i = Tensor(0, ms.int32)
        while i < self.count:
            x = self.layer(x, None, i, positions, bias)
            i = i + 1
        return x


def split_layers(cfg: ModelConfig, layers: Sequence[nn.Cell]) -> Tuple[LayerStack, object]:
    """(stack of the looped layers, the layer kept apart or None) from the per-layer cells."""
    n = stacked_count(cfg)
    return LayerStack(layers[:n]), (layers[n] if n < len(layers) else None)
