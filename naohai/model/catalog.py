"""The catalog of named, shardable operations of the model, with logical axes.

This is the contract between the model and the strategy layer: for a model
configuration, every operation a strategy may shard, its stable full name
(``layers.7.attention.q``), primitive kind, and the logical axes and sizes of
its inputs.  It is a view of the one model description, :mod:`naohai.model.spec`,
which the cells also build from, so the two cannot drift apart.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

from naohai.model.config import ModelConfig
from naohai.model.spec import LOGICAL_AXES, Axes, OpSpec, layer_ops, op_catalog, top_ops  # noqa: F401


#: op names of earlier naohai versions -> the ops that replaced them (strategy files may still say them)
RENAMED_OPS: Dict[str, Tuple[str, ...]] = {
    # OneHot + SoftmaxCrossEntropyWithLogits became LogSoftmax + GatherD (no one-hot target)
    "loss.xent": ("loss.log_softmax", "loss.pick"),
}


def layer_op_names(cfg: ModelConfig, query_layer: bool = False) -> List[str]:
    """Names of the ops inside one layer (relative), e.g. for per-layer rules and recompute lists."""
    return [spec.name for spec in layer_ops(cfg, 1, query_layer)]
