"""Marks a freshly built model with a resolved strategy: shard, pipeline stages, recompute, shared graphs.

:func:`apply_strategy` is what the builder calls; it sets ``Primitive.shard`` for
every op the strategy names (:func:`shard_ops`), each cell's ``pipeline_stage``
(:func:`assign_stages`), full or selective recompute per layer
(:func:`apply_recompute`) and, where the device allows, one compiled graph per
distinct layer (MindSpore's ``lazy_inline``, :func:`reuse_layer_graphs`).
:func:`layer_loop_refusal` says why a layout cannot run the layers as one loop;
:func:`fold_micro_batches` compiles a pipeline's per-micro-batch model once (the compile of
chosen ranks).
The model itself (:mod:`naohai.model`) holds no parallel logic.
"""
from __future__ import annotations

from typing import List

import mindspore as ms
from mindspore import nn
from mindspore.ops import operations as P

from naohai.model.lora import LoRAMatMul
from naohai.model.stack import stacked_count
from naohai.strategy.lora import shard_adapter
from naohai.strategy.resolve import ResolvedStrategy
from naohai.strategy.runtime import Runtime


def shard_ops(model, resolved: ResolvedStrategy) -> int:
    """Set ``Primitive.shard`` for every op with a strategy; returns how many were set.  An op wrapped
    by a LoRA adapter shards its base op and the adapter's ops from the same tuple
    (:func:`naohai.strategy.lora.shard_adapter`)."""
    ops_by_name = model.shardable_ops()
    count = 0
    for name, strategy in resolved.op_strategy.items():
        prim = ops_by_name.get(name)
        if prim is None:
            continue
        if isinstance(prim, LoRAMatMul):
            shard_adapter(prim, strategy)
            count += 1
            continue
        prim.shard(tuple(tuple(s) for s in strategy))
        count += 1
    return count


def apply_recompute(model, resolved: ResolvedStrategy) -> None:
    """Full-layer or selective (per-op) recompute as the strategy says, per layer.

    On CPU and GPU a fully recomputed layer keeps its dropouts out of the recomputation:
    there ``Dropout`` is one kernel, and MindSpore 2.10 re-runs it with a new random mask, so
    the backward pass would use another mask than the forward (measured on CPU: the loss and
    the weight gradient of ``sum(dropout(x) * w)`` disagree); its outputs are kept instead.
    On Ascend MindSpore splits it into DropoutGenMask + DropoutDoMask and the mask is kept
    as bits, so the layer is left whole there (the kept outputs would cost a [b, a, s, s]
    tensor per layer); only an Ascend run can confirm that mask reuse.
    """
    keep_dropout = ms.get_context("device_target") != "Ascend"
    cells = model.layer_cells()
    for i, spec in enumerate(resolved.recompute):
        layer = cells[i]
        if spec.mode == "full":
            layer.recompute(mp_comm_recompute=bool(spec.comm),
                            parallel_optimizer_comm_recompute=bool(spec.optimizer_comm),
                            recompute_slice_activation=bool(spec.slice_activation))
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


def assign_stages(model, resolved: ResolvedStrategy) -> None:
    """Pipeline stages: embedding first, layers as planned, head and loss last.

    The tied word embedding is used by the head on the last stage too: it is
    registered on that stage so MindSpore keeps a synchronised copy there.  With
    optimizer parallel it must stay whole (``parallel_optimizer = False``): sharding it
    fails on stage 0 in 2.10 ("For 'AddN', input shape must be same").
    """
    stages = int(resolved.stages)
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


def layer_graph_keys(model, resolved: ResolvedStrategy) -> List[str]:
    """One key per decoder layer; layers with equal keys compile to one shared graph.

    Equal means the same structure (query layer or not), the same shard strategy for
    every op (the rule's strategy with the layer index taken out), the same recompute
    setting and the same pipeline stage.
    """
    keys = []
    for i, layer in enumerate(model.layers):
        prefix = f"layers.{i}."
        parts = [f"query={layer.is_query_layer}",
                 str(sorted((name[len(prefix):], strategy) for name, strategy in resolved.op_strategy.items()
                            if name.startswith(prefix))),
                 repr(resolved.recompute[i]), f"stage={resolved.stage_of_layer[i]}"]
        keys.append("naohai_layer:" + "|".join(parts))
    return keys


def reuse_layer_graphs(model, resolved: ResolvedStrategy) -> int:
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


def layer_loop_refusal(cfg, resolved: ResolvedStrategy, runtime: Runtime):
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
    if any(spec.mode != "none" for spec in resolved.recompute[:stacked_count(cfg)]):
        return "the strategy recomputes layers, and MindSpore 2.10 does not recompute inside a loop"
    return None


def apply_strategy(model, resolved: ResolvedStrategy, reuse_layers: bool = True) -> None:
    """Shard ops, set stages and recompute on a freshly built model; compile equal layers once."""
    shard_ops(model, resolved)
    assign_stages(model, resolved)
    apply_recompute(model, resolved)
    if reuse_layers:
        reuse_layer_graphs(model, resolved)


def fold_micro_batches(networks) -> int:
    """Compile a pipeline's per-micro-batch network once: MindSpore's ``lazy_inline`` key (what
    ``@mindspore.lazy_inline`` on the model's ``__init__`` writes; default policy) on every model that a
    ``mindspore.parallel.nn.Pipeline`` in ``networks`` calls once per micro-batch.  MindSpore's pipeline
    pass then splits one shared graph instead of micro-batches x layers copies of the layers (2.10 warns
    "Pipeline Parallel with no 'lazy_inline' is deprecated" without it); parameter layouts and the
    Send/Receive between stages are the same, a collective inside the model is in the IR once per graph
    instead of once per micro-batch.  Used by the compile of chosen ranks on simulated devices
    (``naohai check --compile --ranks``), where it turns a 200B layout's real depth from past 20 minutes
    into about 2 minutes per rank.  The key must sit on that model: on a decoder layer the simulated-GPU
    path fails ("Using pipeline parallel with interleave, should enable lazy_inline",
    pipeline_interleave.cc).  Returns how many models were marked."""
    from mindspore.parallel.nn.parallel_cell_wrapper import PipelineCell
    marked = set()
    for network in networks:
        for _, cell in network.cells_and_names():
            if isinstance(cell, PipelineCell) and id(cell.network) not in marked:
                cell.network.cell_init_args = "lazy_inline_" + type(cell.network).__name__
                marked.add(id(cell.network))
    return len(marked)
