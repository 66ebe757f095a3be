"""Applies a resolved strategy to a model and a train step: the ONLY place with parallel logic.

It owns every call to ``Primitive.shard``, ``pipeline_stage``, ``recompute`` and
the MindSpore parallel context, and the parallel pieces of the train step
(:mod:`naohai.train.step` holds its math).  Every layout goes through the same
functions; what differs is chosen here:

=====================  ==========================================================
layout                 what runs
=====================  ==========================================================
one device             the model; gradients unscaled in the graph
data parallel only     MindSpore DATA_PARALLEL + an explicit gradient all-reduce
(no op sharding)       (the only multi-rank mode with CPU kernels: runs on CPU);
                       these two may run the layers as one loop (``layer_loop_refusal``)
anything else          semi-auto parallel through ``AutoParallel``: per-op shard
                       strategies, pipeline stages, optimizer parallel (``hsdp``),
                       each rank fed its data-parallel slice
                       (``dataset_strategy((dp, 1), (dp, 1))``)
=====================  ==========================================================

Semi-auto steps run ``micro = micro_batches x gradient accumulation`` micro-batches
inside the graph: a ``Pipeline`` wrapper when there are stages, MindSpore's
``GradAccumulation`` wrapper for one stage with ``micro > 1``.  Their gradients are
read from ``accu_grads`` buffers that MindSpore's pipeline / accumulation passes
fill (or, with optimizer parallel, from the returned reduce-scattered gradients while
the buffers are cleared), as MindFormers' ``MFPipelineWithLossScaleCell`` does; the
loss every rank reports is the global mean through one in-graph all-reduce.  A
layout that cannot run on the chosen device is refused by :func:`check_runnable`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import mindspore as ms
from mindspore import nn
from mindspore.ops import composite as C
from mindspore.ops import functional as F
from mindspore.ops import operations as P

from naohai.errors import UserError
from naohai.model.stack import stacked_count


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


def _mesh(resolved) -> Dict[str, int]:
    return dict(getattr(resolved, "mesh", {}) or {}) if resolved is not None else {}


def layout_mode(resolved) -> str:
    """standalone | data_parallel | semi_auto for a resolved strategy (None = one device)."""
    world = int(getattr(resolved, "device_num", 1) or 1) if resolved is not None else 1
    if world == 1:
        return "standalone"
    mesh = _mesh(resolved)
    if any(v > 1 for k, v in mesh.items() if k != "data"):
        return "semi_auto"
    for strategy in getattr(resolved, "op_strategy", {}).values():
        for per_input in strategy:
            # only the first (batch) dimension of activations may be split in pure DP
            if any(s > 1 for s in per_input[1:]):
                return "semi_auto"
    return "data_parallel"


def check_runnable(resolved, device: str, recipe: str = "RECIPE") -> None:
    """Refuse a layout that MindSpore cannot execute on ``device`` (UserError, before any worker);
    ``recipe`` names the recipe in the suggested check command."""
    if device != "CPU" or layout_mode(resolved) != "semi_auto":
        return
    mesh = " x ".join(f"{k} {v}" for k, v in _mesh(resolved).items())
    name = getattr(resolved, "source", None) or getattr(resolved, "name", "the strategy")
    raise UserError(
        f"this layout ({mesh}) needs semi-auto parallel (model or pipeline parallel), which MindSpore 2.10 cannot "
        f"execute on CPU: its communication (Send/Receive, ReduceScatter, AlltoAll) has no CPU kernel. Train it on "
        f"Ascend (train.device=Ascend or --device Ascend on an Ascend node), check it here with `naohai check {recipe} "
        f"{name} --compile` (MindSpore compiles every rank on simulated devices), or train on CPU with a "
        f"data-parallel strategy (e.g. strategies/tiny-dp2.yaml)", where=name, key="mesh",
        rule="op / pipeline parallel needs Ascend or GPU")


def in_graph_micro(resolved) -> int:
    """Micro-batches one compiled semi-auto step runs (1 for the other modes)."""
    if layout_mode(resolved) != "semi_auto":
        return 1
    return int(resolved.micro_batches) * int(getattr(resolved, "gradient_accumulation", 1) or 1)


def init_runtime(resolved, device: str) -> Runtime:
    """Initialise communication and the parallel context for ``resolved``.

    Call before building the model (MindSpore reads the context at build time).
    """
    mode = layout_mode(resolved)
    if mode == "standalone":
        return Runtime("standalone", 0, 1, 0, 1)
    world = int(resolved.device_num)
    check_runnable(resolved, device)
    from mindspore.communication import get_group_size, get_rank, init

    if not (os.environ.get("MS_ROLE") or os.environ.get("RANK_TABLE_FILE")):
        raise UserError(f"the strategy needs {world} devices, but this is a single process (no msrun or rank "
                        f"table environment). Start it with `naohai launch RECIPE --strategy FILE ...` "
                        f"(msrun), or train without --strategy on one device",
                        where=getattr(resolved, "source", None), key="mesh")
    init()
    actual = get_group_size()
    rank = get_rank()
    if actual != world:
        raise UserError(f"the strategy needs {world} devices but {actual} processes were started",
                        where=getattr(resolved, "source", None), key="mesh",
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


# --------------------------------------------------------------------------- the model
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
    """Full-layer or selective (per-op) recompute as the strategy says, per layer.

    On CPU and GPU a fully recomputed layer keeps its dropouts out of the recomputation:
    there ``Dropout`` is one kernel, and MindSpore 2.10 re-runs it with a new random mask, so
    the backward pass would use another mask than the forward (measured on CPU: the loss and
    the weight gradient of ``sum(dropout(x) * w)`` disagree); its outputs are kept instead.
    On Ascend MindSpore splits it into DropoutGenMask + DropoutDoMask and the mask is kept
    as bits, so the layer is left whole there (the kept outputs would cost a [b, a, s, s]
    tensor per layer); only an Ascend run can confirm that mask reuse.
    """
    if resolved is None:
        return
    keep_dropout = ms.get_context("device_target") != "Ascend"
    cells = model.layer_cells()
    for i, spec in enumerate(resolved.recompute):
        layer = cells[i]
        if spec.mode == "full":
            layer.recompute(mp_comm_recompute=bool(spec.comm),
                            parallel_optimizer_comm_recompute=bool(getattr(spec, "optimizer_comm", False)),
                            recompute_slice_activation=bool(getattr(spec, "slice_activation", False)))
            for prim in layer.shardable_ops().values():
                if keep_dropout and isinstance(prim, P.Dropout):
                    prim.recompute(False)
        elif spec.mode == "select":
            ops_by_name = layer.shardable_ops()
            for op in spec.ops:
                owner = getattr(layer, op, None)
                if isinstance(owner, nn.Cell):      # a norm: the cell, whichever form it computes in
                    owner.recompute()
                else:
                    ops_by_name[op].recompute()


def assign_stages(model, resolved) -> None:
    """Pipeline stages: embedding first, layers as planned, head and loss last.

    The tied word embedding is used by the head on the last stage too: it is
    registered on that stage so MindSpore keeps a synchronised copy there.  With
    optimizer parallel it must stay whole (``parallel_optimizer = False``): sharding it
    fails on stage 0 in 2.10 ("For 'AddN', input shape must be same").
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
        table = model.embedding.word_embedding
        table.add_pipeline_stage(0)
        table.add_pipeline_stage(last)
        if resolved.optimizer_parallel.enabled:
            table.parallel_optimizer = False


def layer_graph_keys(model, resolved) -> List[str]:
    """One key per decoder layer; layers with equal keys compile to one shared graph.

    Equal means the same structure (query layer or not), the same shard strategy for
    every op (the rule's strategy with the layer index taken out), the same recompute
    setting and the same pipeline stage.
    """
    keys = []
    for i, layer in enumerate(model.layers):
        parts = [f"query={layer.is_query_layer}"]
        if resolved is not None:
            prefix = f"layers.{i}."
            parts.append(str(sorted((name[len(prefix):], strategy) for name, strategy in resolved.op_strategy.items()
                                    if name.startswith(prefix))))
            parts.append(repr(resolved.recompute[i]))
            parts.append(f"stage={resolved.stage_of_layer[i]}")
        keys.append("naohai_layer:" + "|".join(parts))
    return keys


def reuse_layer_graphs(model, resolved) -> int:
    """Compile identical decoder layers once (MindSpore's ``lazy_inline``, set per cell).

    MindSpore builds one graph per distinct ``cell_init_args`` key (what the ``@lazy_inline``
    decorator writes) and reuses it for every cell with that key.  On CPU only the
    ``front`` policy compiles (the layer graph is built once, then inlined before the
    backend; MindSpore 2.10 fails with the default policy: "Input[0] must be a Primitive
    ValueNode"); on Ascend the default policy keeps one called sub-graph, as MindFormers'
    decoder layers do.  Not set on GPU, where MindSpore documents no support.  Returns the
    number of distinct layer graphs (0 when not applied).
    """
    device = ms.get_context("device_target")
    if device not in ("CPU", "Ascend") or model.layer_loop or not len(model.layers):
        return 0
    keys = layer_graph_keys(model, resolved)
    for layer, key in zip(model.layers, keys):
        layer.cell_init_args = "lazy_inline_" + key
        if device == "CPU":
            layer.no_inline = False
    return len(set(keys))


def layer_loop_refusal(cfg, resolved, runtime: Runtime):
    """Why the layout cannot run the layers as one loop (:mod:`naohai.model.stack`), or None.

    Semi-auto layouts (operator parallel, pipeline stages, optimizer parallel) keep one graph
    per layer: MindSpore 2.10 fails to shard a loop over stacked weights ("Shape should have
    only one -2", ``run/bench_layer_loop.py --semi-auto``), and a stack lives on one stage.
    Recompute is not applied inside a loop: MindSpore 2.10 compiles a loop body marked for
    recompute to the same graph as an unmarked one (its backward reads the forward's saved
    outputs; compared in the compiled IR on CPU), so layers that a strategy recomputes keep
    one cell each, where it is applied."""
    if runtime.mode == "semi_auto":
        return f"the {runtime.mode} layout compiles one graph per layer (MindSpore cannot shard the loop)"
    if resolved is not None and any(spec.mode != "none" for spec in resolved.recompute[:stacked_count(cfg)]):
        return "the strategy recomputes layers, and MindSpore 2.10 does not recompute inside a loop"
    return None


def apply_strategy(model, resolved, reuse_layers: bool = True) -> None:
    """Shard ops, set stages and recompute on a freshly built model; compile equal layers once."""
    shard_ops(model, resolved)
    assign_stages(model, resolved)
    apply_recompute(model, resolved)
    if reuse_layers:
        reuse_layer_graphs(model, resolved)


# --------------------------------------------------------------------------- the step's parallel pieces
#: ``hyper_map(F.partial(scale_by, factor), grads)``: every gradient times a scalar, in its own dtype
scale_by = C.MultitypeFuncGraph("naohai_scale_by")


@scale_by.register("Tensor", "Tensor")
def _scale_by_tensor(factor, grad):
    return grad * F.cast(factor, F.dtype(grad))


# The "grad_scale" attribute tells MindSpore's parallel passes that this is a per-gradient
# square sum of a global norm: under semi-auto they divide it by the parameter's replica
# count and all-reduce it inside the stage and across stages (MindFormers' clip_grad does the
# same).  Outside semi-auto no parallel pass runs and it is a plain ExpandDims.
_expand_norm = P.ExpandDims().add_prim_attr("grad_scale", True)
#: ``hyper_map(square_sum, grads)``: each gradient's float32 sum of squares, shape ``(1,)``, marked as a
#: term of the global norm (reduced over replicas and stages under semi-auto)
square_sum = C.MultitypeFuncGraph("naohai_square_sum")


@square_sum.register("Tensor")
def _square_sum_tensor(grad):
    g = F.cast(grad, ms.float32)
    return _expand_norm(F.reduce_sum(g * g), 0)


_read_accumulated = C.MultitypeFuncGraph("naohai_read_accumulated")


@_read_accumulated.register("Tensor", "Tensor", "Tensor")
def _read_accumulated_tensor(inv_scale, grad, accu):
    """The micro-batch sum MindSpore accumulated in ``accu``, unscaled; ``accu`` is cleared."""
    accu = F.depend(accu, grad)
    out = accu * F.cast(inv_scale, F.dtype(accu))
    accu = F.depend(accu, out)
    # zeros built from accu itself (equal(x, x) is 0 for NaN) keep the clear after the read
    zeros = F.mul(F.cast(F.equal(accu, accu), F.dtype(accu)), 0)
    return F.depend(out, F.assign(accu, zeros))


_read_sharded = C.MultitypeFuncGraph("naohai_read_sharded")


@_read_sharded.register("Tensor", "Tensor", "Tensor")
def _read_sharded_tensor(inv_scale, grad, accu):
    """Optimizer parallel: the returned (reduce-scattered) gradient, unscaled; ``accu`` is cleared."""
    out = grad * F.cast(inv_scale, F.dtype(grad))
    accu = F.depend(accu, out)
    zeros = F.mul(F.cast(F.equal(accu, accu), F.dtype(accu)), 0)
    return F.depend(out, F.assign(accu, zeros))


class ReducedGrads(nn.Cell):
    """Data parallel (DATA_PARALLEL mode): all-reduce the mean, then unscale."""

    def __init__(self, weights, world: int):
        super().__init__(auto_prefix=False)
        self.reducer = nn.DistributedGradReducer(weights, mean=True, degree=world)
        self.hyper_map = C.HyperMap()

    def construct(self, grads, inv_scale):
        return self.hyper_map(F.partial(scale_by, inv_scale), self.reducer(grads))


class AccumulatedGrads(nn.Cell):
    """Semi-auto with in-graph micro-batches: gradients from the ``accu_grads`` buffers."""

    def __init__(self, weights, optimizer_sharded: bool):
        super().__init__(auto_prefix=False)
        self.accu_grads = weights.clone(prefix="accu_grads", init="zeros")
        self.sharded = optimizer_sharded
        self.hyper_map = C.HyperMap()

    def construct(self, grads, inv_scale):
        if self.sharded:
            return self.hyper_map(F.partial(_read_sharded, inv_scale), grads, self.accu_grads)
        return self.hyper_map(F.partial(_read_accumulated, inv_scale), grads, self.accu_grads)


class GlobalMeanLoss(nn.Cell):
    """Pipeline: last-stage ranks hold the sum of their micro-batch losses, others 0;
    one all-reduce over the world divided by (ranks per stage x micro) is the global mean."""

    def __init__(self, per_stage: int, micro: int):
        super().__init__(auto_prefix=False)
        self.all_reduce = P.AllReduce()
        self.denominator = float(per_stage * micro)

    def construct(self, loss):
        return self.all_reduce(loss) / self.denominator


class MeanOverMicro(nn.Cell):
    """The micro-batching wrappers (GradAccumulation, an eval Pipeline) return the sum over micro-batches."""

    def __init__(self, micro: int):
        super().__init__(auto_prefix=False)
        self.micro = float(micro)

    def construct(self, loss):
        return loss / self.micro


@dataclass
class StepParts:
    """The parallel pieces :class:`naohai.train.step.TrainStep` is built from."""

    network: Any                 # what the step differentiates (the model, or a micro-batching wrapper)
    micro: int                   # micro-batches inside ``network``
    collect: Any                 # gradient collector cell, or None (unscale only)
    reduce_loss: Any             # loss -> global mean cell, or None
    eval_network: Any            # forward network for held-out loss
    eval_reduce_loss: Any
    opt_sharded: bool
    notes: List[str]


def optimizer_sharded(resolved) -> bool:
    return bool(resolved is not None and resolved.optimizer_parallel.enabled and int(resolved.data) > 1
                and layout_mode(resolved) == "semi_auto")


def step_parts(model, weights, resolved, runtime: Runtime) -> StepParts:
    """Network wrapper, gradient collector and loss reduction for this layout."""
    if runtime.mode == "standalone":
        return StepParts(model, 1, None, None, model, None, False, [])
    if runtime.mode == "data_parallel":
        return StepParts(model, 1, ReducedGrads(weights, runtime.world), None, model, None, False,
                         ["data parallel: explicit gradient all-reduce (mean) before the norm"])
    from mindspore.parallel.nn import GradAccumulation, Pipeline

    micro, stages = runtime.micro, runtime.stages
    sharded = optimizer_sharded(resolved)
    notes = []
    if stages > 1:
        network = Pipeline(model, micro)     # stages were set on the cells by assign_stages
        eval_network = Pipeline(model, micro)
        # eval: MindSpore refuses a user all-reduce in a forward-only semi-auto graph; the
        # pipeline broadcasts the last stage's output instead (output_broadcast, compile_parallel)
        reduce_loss, eval_reduce = GlobalMeanLoss(runtime.per_stage, micro), MeanOverMicro(micro)
        notes.append(f"pipeline: {stages} stages x {micro} micro-batches per step, scheduler {resolved.scheduler}")
    elif micro > 1:
        network = GradAccumulation(model, micro)
        eval_network = model
        reduce_loss, eval_reduce = MeanOverMicro(micro), None
        notes.append(f"gradient accumulation in the graph: {micro} micro-batches per step")
    else:
        return StepParts(model, 1, None, None, model, None, sharded, notes)
    if int(getattr(resolved, "gradient_accumulation", 1) or 1) > 1:
        notes.append(f"the global batch holds {resolved.gradient_accumulation} x micro_batches "
                     f"({resolved.micro_batches}) micro-batches per data-parallel rank: all run in one step")
    collect = AccumulatedGrads(weights, sharded)
    return StepParts(network, micro, collect, reduce_loss, eval_network, eval_reduce, sharded, notes)


def _hsdp_args(resolved) -> Dict[str, Any]:
    opt = resolved.optimizer_parallel
    shard = int(opt.shard_size)
    if shard == int(resolved.data):
        shard = -1  # MindSpore's "the data-parallel group of each parameter"
    return {"shard_size": shard, "threshold": int(opt.threshold_kb), "optimizer_level": opt.level}


def compile_parallel(cell, resolved, runtime: Runtime, *, train: bool):
    """``cell`` as it must be called in this layout: wrapped in ``AutoParallel`` for semi-auto."""
    if runtime.mode != "semi_auto":
        return cell
    from mindspore.parallel.auto_parallel import AutoParallel

    parallel = AutoParallel(cell, parallel_mode="semi_auto")
    if runtime.stages > 1:
        # eval graphs: the last stage's loss is broadcast to every stage (MindSpore skips the
        # broadcast for training graphs, whose loss GlobalMeanLoss reduces in the graph)
        parallel.pipeline(stages=runtime.stages, interleave=int(resolved.virtual_chunks) > 1,
                          scheduler=str(resolved.scheduler), output_broadcast=not train)
    dp = int(resolved.data)
    # every model-parallel rank and every stage of a data-parallel group reads the same rows
    parallel.dataset_strategy(((dp, 1), (dp, 1)))
    if optimizer_sharded(resolved):
        parallel.hsdp(**_hsdp_args(resolved))
    return parallel


def save_strategy_file(network, path: str) -> None:
    """Have MindSpore write the parameter strategy file of ``network``'s compile to ``path`` (an
    ``AutoParallel`` wrapper's own setting; otherwise the parallel context's)."""
    from mindspore.parallel.auto_parallel import AutoParallel
    if isinstance(network, AutoParallel):
        network.save_param_strategy_file(path)
    else:
        ms.set_auto_parallel_context(strategy_ckpt_config={"save_file": path})


def skip_parameter_init_in_compile(network) -> None:
    """A semi-auto graph built for a compile-only check: MindSpore initialises no parameter slice while
    compiling it (``AutoParallel.no_init_parameters_in_compile``), so host memory holds none."""
    from mindspore.parallel.auto_parallel import AutoParallel
    if isinstance(network, AutoParallel):
        network.no_init_parameters_in_compile()


def describe(resolved, runtime: Runtime) -> str:
    """One line for the run log: how this layout runs."""
    if runtime.mode == "standalone":
        return "one device"
    if runtime.mode == "data_parallel":
        return f"data parallel over {runtime.world} ranks (explicit all-reduce)"
    mesh = " x ".join(f"{k} {v}" for k, v in _mesh(resolved).items())
    extra = f", optimizer parallel {_hsdp_args(resolved)}" if optimizer_sharded(resolved) else ""
    return f"semi-auto {mesh}, {runtime.micro} micro-batch(es) per step{extra}"


def compile_inputs(rows: int, seq_length: int) -> Tuple[Any, Any]:
    """Zero ``(input_ids, labels)`` of this rank's shape, for compiling without data."""
    import numpy as np
    from mindspore import Tensor
    ids = Tensor(np.zeros((rows, seq_length), np.int32))
    return ids, Tensor(np.zeros((rows, seq_length), np.int32))


# --------------------------------------------------------------------------- host-side collectives
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
