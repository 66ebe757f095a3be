"""Applies a resolved strategy to a model: the ONLY place with parallel logic.

It owns every call to ``Primitive.shard``, ``pipeline_stage``, ``recompute``
and the MindSpore parallel context.  One device runs the same path: the
strategy is then all ones and the context stays stand-alone.

How the parallel mode is chosen:
- world size 1                      -> stand-alone
- only the data axis > 1, no op sharding, one stage
                                    -> MindSpore DATA_PARALLEL with an explicit
                                       gradient all-reduce (runs on CPU too)
- anything else                     -> semi-auto parallel with per-op strategies,
                                       pipeline stages and optimizer parallel
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import mindspore as ms
from mindspore import nn


@dataclass
class Runtime:
    """What the trainer needs to know about the parallel setup it runs in."""

    mode: str            # standalone | data_parallel | semi_auto
    rank: int
    world: int
    dp_rank: int         # index of this rank's data-parallel group member
    dp_size: int
    stages: int = 1

    @property
    def is_writer(self) -> bool:
        """Rank that writes replicated artefacts (checkpoints, logs) when data parallel."""
        return self.rank == 0


def _mesh(resolved) -> Dict[str, int]:
    return dict(getattr(resolved, "mesh", {}) or {}) if resolved is not None else {}


def _pure_data_parallel(resolved) -> bool:
    mesh = _mesh(resolved)
    others = [v for k, v in mesh.items() if k != "data"]
    if any(v > 1 for v in others):
        return False
    for strategy in getattr(resolved, "op_strategy", {}).values():
        for per_input in strategy:
            # only the first (batch) dimension of activations may be split in pure DP
            if any(s > 1 for s in per_input[1:]):
                return False
    return True


def init_runtime(resolved, device: str) -> Runtime:
    """Initialise communication and the parallel context for ``resolved``.

    Call before building the model (MindSpore reads the context at build time).
    """
    world = int(getattr(resolved, "device_num", 1) or 1) if resolved is not None else 1
    if world == 1:
        return Runtime("standalone", 0, 1, 0, 1)
    from mindspore.communication import get_group_size, get_rank, init

    init()
    actual = get_group_size()
    rank = get_rank()
    if actual != world:
        from naohai.errors import UserError
        raise UserError(f"the strategy needs {world} devices but {actual} processes were started",
                        where=getattr(resolved, "source", None), key="mesh",
                        rule="product of mesh sizes == number of workers")
    mesh = _mesh(resolved)
    if _pure_data_parallel(resolved):
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
        return Runtime("data_parallel", rank, world, rank, world)
    dp = int(mesh.get("data", 1))
    stages = int(mesh.get("pipeline", 1))
    per_stage = world // stages
    # device order inside a stage: data-major, model-minor (as in MindSpore's device matrix)
    dp_rank = (rank % per_stage) // (per_stage // dp)
    return Runtime("semi_auto", rank, world, dp_rank, dp, stages)


def shard_ops(model, resolved) -> int:
    """Set ``Primitive.shard`` for every op with a strategy; returns how many were set."""
    if resolved is None:
        return 0
    ops_by_name = model.shardable_ops()
    count = 0
    for name, strategy in resolved.op_strategy.items():
        prim = ops_by_name.get(name)
        if prim is None:
            continue
        prim.shard(tuple(tuple(s) for s in strategy))
        count += 1
    return count


def apply_recompute(model, resolved) -> None:
    """Full-layer or selective (per-op) recompute as the strategy says, per layer."""
    if resolved is None:
        return
    for i, spec in enumerate(resolved.recompute):
        layer = model.layers[i]
        if spec.mode == "full":
            if spec.comm:
                layer.recompute(mp_comm_recompute=True, parallel_optimizer_comm_recompute=True)
            else:
                layer.recompute()
        elif spec.mode == "select":
            ops_by_name = layer.shardable_ops()
            for op in spec.ops:
                ops_by_name[op].recompute()


def assign_stages(model, resolved) -> None:
    """Pipeline stages: embedding first, layers as planned, head and loss last.

    The tied word embedding is used by the head on the last stage too: it is
    registered on that stage so MindSpore keeps a synchronised copy there.
    """
    stages = int(_mesh(resolved).get("pipeline", 1)) if resolved is not None else 1
    if stages <= 1:
        return
    last = stages - 1
    model.embedding.pipeline_stage = 0
    for i, layer in enumerate(model.layers):
        layer.pipeline_stage = int(resolved.stage_of_layer[i])
    model.head.pipeline_stage = last
    model.loss.pipeline_stage = last
    if model.cfg.tie_embeddings:
        model.embedding.word_embedding.add_pipeline_stage(last)


def grad_reducer(runtime: Runtime, weights):
    """Gradient all-reduce (mean) for the explicit data-parallel mode, else None."""
    if runtime.mode != "data_parallel":
        return None
    return nn.DistributedGradReducer(weights, mean=True, degree=runtime.world)


def apply_strategy(model, resolved) -> None:
    """Shard ops, set stages and recompute on a freshly built model."""
    shard_ops(model, resolved)
    assign_stages(model, resolved)
    apply_recompute(model, resolved)
