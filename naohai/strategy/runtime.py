"""Which layout a resolved strategy runs in, and starting it: communication and the parallel context.

Every layout goes through the same code; what differs is chosen from the resolved
strategy (:class:`naohai.strategy.resolve.ResolvedStrategy`, the one-device plan for
a run without a strategy file):

=====================  ==========================================================
layout                 what runs
=====================  ==========================================================
one device             the model; gradients unscaled in the graph
data parallel only     MindSpore DATA_PARALLEL + an explicit gradient all-reduce
(no op sharding)       (the only multi-rank mode with CPU kernels: runs on CPU);
                       these two may run the layers as one loop
                       (:func:`naohai.strategy.annotate.layer_loop_refusal`)
anything else          semi-auto parallel through ``AutoParallel``
                       (:mod:`naohai.strategy.autoparallel`): per-op shard
                       strategies, pipeline stages, optimizer parallel (``hsdp``),
                       each rank fed its data-parallel slice
=====================  ==========================================================

:func:`init_runtime` initialises communication and the parallel context and returns
the :class:`Runtime` the trainer reads (rank, world, data-parallel group, stages,
in-graph micro-batches); :func:`plan_runtime` is the same description without
starting anything (the destination of a reshard).  A layout that cannot run on the
chosen device is refused by :func:`check_runnable`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict

from naohai.errors import UserError
from naohai.strategy.resolve import ResolvedStrategy

@dataclass
class Runtime:
    """What the trainer needs to know about the parallel setup it runs in."""

    mode: str            # standalone | data_parallel | semi_auto
    rank: int
    world: int
    dp_rank: int         # index of this rank's data-parallel group
    dp_size: int
    stages: int = 1
    micro: int = 1       # micro-batches inside one compiled semi-auto step

    @property
    def is_writer(self) -> bool:
        """Rank that writes run-wide artefacts (logs, metrics, manifests)."""
        return self.rank == 0

    @property
    def per_stage(self) -> int:
        return self.world // self.stages

    @property
    def stage(self) -> int:
        return self.rank // self.per_stage


def layout_mode(resolved: ResolvedStrategy) -> str:
    """standalone | data_parallel | semi_auto for a resolved strategy."""
    if resolved.device_num == 1:
        return "standalone"
    if any(v > 1 for k, v in resolved.mesh.items() if k != "data"):
        return "semi_auto"
    for strategy in resolved.op_strategy.values():
        for per_input in strategy:
            # only the first (batch) dimension of activations may be split in pure DP
            if any(s > 1 for s in per_input[1:]):
                return "semi_auto"
    return "data_parallel"


def check_runnable(resolved: ResolvedStrategy, device: str, recipe: str = "RECIPE") -> None:
    """Refuse a layout that MindSpore cannot execute on ``device`` (UserError, before any worker);
    ``recipe`` names the recipe in the suggested check command."""
    if device != "CPU" or layout_mode(resolved) != "semi_auto":
        return
    mesh = " x ".join(f"{k} {v}" for k, v in resolved.mesh.items())
    name = resolved.source or resolved.name
    raise UserError(
        f"this layout ({mesh}) needs semi-auto parallel (model or pipeline parallel), which MindSpore 2.10 cannot "
        f"execute on CPU: its communication (Send/Receive, ReduceScatter, AlltoAll) has no CPU kernel. Train it on "
        f"Ascend (train.device=Ascend or --device Ascend on an Ascend node), check it here with `naohai check {recipe} "
        f"{name} --compile` (MindSpore compiles every rank on simulated devices), or train on CPU with a "
        f"data-parallel strategy (e.g. strategies/tiny-dp2.yaml)", where=name, key="mesh",
        rule="op / pipeline parallel needs Ascend or GPU")


def in_graph_micro(resolved: ResolvedStrategy) -> int:
    """Micro-batches one compiled semi-auto step runs (1 for the other modes)."""
    if layout_mode(resolved) != "semi_auto":
        return 1
    return int(resolved.micro_batches) * int(resolved.gradient_accumulation)


def init_runtime(resolved: ResolvedStrategy, device: str) -> Runtime:
    """Initialise communication and the parallel context for ``resolved``.

    Call before building the model (MindSpore reads the context at build time).
    """
    mode = layout_mode(resolved)
    if mode == "standalone":
        return Runtime("standalone", 0, 1, 0, 1)
    world = int(resolved.device_num)
    check_runnable(resolved, device)
    import mindspore as ms
    from mindspore.communication import get_group_size, get_rank, init

    if not (os.environ.get("MS_ROLE") or os.environ.get("RANK_TABLE_FILE")):
        raise UserError(f"the strategy needs {world} devices, but this is a single process (no msrun or rank "
                        f"table environment). Start it with `naohai launch RECIPE --strategy FILE ...` "
                        f"(msrun), or train without --strategy on one device",
                        where=resolved.source, key="mesh")
    init()
    actual = get_group_size()
    rank = get_rank()
    if actual != world:
        raise UserError(f"the strategy needs {world} devices but {actual} processes were started",
                        where=resolved.source, key="mesh",
                        rule="product of mesh sizes == number of workers")
    if mode == "data_parallel":
        ms.set_auto_parallel_context(parallel_mode=ms.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     device_num=world)
        return Runtime("data_parallel", rank, world, rank, world)
    dp, stages = int(resolved.data), int(resolved.stages)
    per_stage = world // stages
    # device order inside a stage: data-major, model-minor (MindSpore's device matrix)
    dp_rank = (rank % per_stage) // (per_stage // dp)
    return Runtime("semi_auto", rank, world, dp_rank, dp, stages, in_graph_micro(resolved))



def optimizer_sharded(resolved: ResolvedStrategy) -> bool:
    """Optimizer parallel in effect: enabled, more than one data-parallel rank, semi-auto."""
    return bool(resolved.optimizer_parallel.enabled and int(resolved.data) > 1 and layout_mode(resolved) == "semi_auto")


def hsdp_args(resolved: ResolvedStrategy) -> Dict[str, Any]:
    """``AutoParallel.hsdp`` arguments of the strategy's optimizer parallel."""
    opt = resolved.optimizer_parallel
    shard = int(opt.shard_size)
    if shard == int(resolved.data):
        shard = -1  # MindSpore's "the data-parallel group of each parameter"
    return {"shard_size": shard, "threshold": int(opt.threshold_kb), "optimizer_level": opt.level}


def describe(resolved: ResolvedStrategy, runtime: Runtime) -> str:
    """One line for the run log: how this layout runs."""
    if runtime.mode == "standalone":
        return "one device"
    if runtime.mode == "data_parallel":
        return f"data parallel over {runtime.world} ranks (explicit all-reduce)"
    mesh = " x ".join(f"{k} {v}" for k, v in resolved.mesh.items())
    extra = f", optimizer parallel {hsdp_args(resolved)}" if optimizer_sharded(resolved) else ""
    return f"semi-auto {mesh}, {runtime.micro} micro-batch(es) per step{extra}"



def plan_runtime(resolved: ResolvedStrategy) -> Runtime:
    """The :class:`Runtime` of rank 0 of ``resolved``'s layout, without starting communication (what
    a checkpoint written under that layout records; the destination of a reshard)."""
    return Runtime(layout_mode(resolved), 0, int(resolved.device_num), 0, int(resolved.data), int(resolved.stages),
                   in_graph_micro(resolved))
