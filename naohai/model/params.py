"""Parameter inventory of a model configuration, computed without allocating weights.

A view of :mod:`naohai.model.spec`: every parameter the cells create, by the
names MindSpore gives them, with shapes, logical axes, owner and weight-decay
flag.  The strategy planner uses it for per-device memory, the trainer for
the decay groups.
"""
from __future__ import annotations

from typing import Dict

from naohai.model.config import ModelConfig
from naohai.model.spec import ParamSpec, embedding_params, head_params, layer_params, param_shapes  # noqa: F401


def count_params(cfg: ModelConfig) -> int:
    return sum(p.size for p in param_shapes(cfg))


def count_by_owner(cfg: ModelConfig) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for p in param_shapes(cfg):
        out[p.owner] = out.get(p.owner, 0) + p.size
    return out
