"""The downstream scoring graph of a semi-auto layout (operator and pipeline parallel).

In-loop downstream evaluation scores lm-eval requests on the live, sharded weights of the run.
:func:`score_step` builds that graph from the model being trained: the model's own forward
(:class:`naohai.model.transformer.RowScoreNet`, the cells and stages of the loss) with a scoring
head (:class:`~naohai.model.transformer.RowScores`) on the last pipeline stage, micro-batched by
a forward-only ``Pipeline`` and compiled with the pipeline's output broadcast, as the held-out
loss's eval graph is.

The design: each data-parallel group scores its own shard of the requests (the dataset strategy
``(dp, 1)`` of every input, as for training batches), and the graph combines them: every input
row carries a one-hot ``rows`` entry naming its place in the global batch, the scoring head
multiplies its results into that place and sums over the batch axis, which MindSpore turns into
an all-reduce over the data-parallel group; the pipeline then broadcasts the last stage's result.
So every rank of the job returns the same ``[global rows, 2 * seq]`` array, whatever the micro-batch
split, and no host collective is needed.  :func:`score_rows` sizes the batch.
"""
from __future__ import annotations

from typing import Any, Tuple

from naohai.strategy.resolve import ResolvedStrategy
from naohai.strategy.runtime import Runtime

#: every input of the scoring graph (input_ids, labels, rows) is split over data parallel on its batch axis
SCORE_INPUTS = 3


def score_rows(requested: int, runtime: Runtime) -> Tuple[int, int]:
    """(rows each rank feeds per scoring call, global rows per call) for ``train.eval.batch`` =
    ``requested``: the global batch is the smallest multiple of data parallel x micro-batches that
    holds ``requested`` rows (each micro-batch then splits evenly over the data-parallel groups)."""
    unit = max(1, int(runtime.micro))
    per_rank = -(-max(1, int(requested)) // max(1, int(runtime.dp_size)))
    per_rank = -(-per_rank // unit) * unit
    return per_rank, per_rank * max(1, int(runtime.dp_size))


def mark_scores(net, resolved: ResolvedStrategy) -> None:
    """Stage and shard strategies of the scoring head: on the last stage; the log-softmax and the
    label pick as the strategy file gives them for the loss (the same [b*s, V] tensors), the rest
    split over data parallel on the batch axis."""
    stages = int(resolved.stages)
    scores = net.scores
    if stages > 1:
        scores.pipeline_stage = stages - 1
    table = resolved.op_strategy
    dp = int(resolved.data)
    soft = table.get("loss.log_softmax", ((dp, 1),))
    flat = int(soft[0][0])
    ops_by_name = scores.shardable_ops()
    strategies = {
        "log_softmax": soft,
        "pick": table.get("loss.pick", ((flat, 1), (flat, 1))),
        "neg": ((flat,),),
        "argmax": soft,
        "cast": ((flat,),),
        "stack": ((dp, 1), (dp, 1)),
        "place": ((dp, 1, 1), (dp, 1, 1)),
        "sum": ((dp, 1, 1),),
    }
    for name, strategy in strategies.items():
        ops_by_name[name].shard(tuple(tuple(int(d) for d in dims) for dims in strategy))


def score_step(model, resolved: ResolvedStrategy, runtime: Runtime):
    """The compiled-to-be scoring graph of this rank: ``step(input_ids [r, s] int32, labels [r, s] int32,
    rows [r, n] float32) -> [n, 2 * s]`` with ``r`` this rank's rows and ``n`` the global rows."""
    from naohai.model.transformer import RowScoreNet
    from naohai.strategy.autoparallel import compile_parallel

    net = RowScoreNet(model)
    mark_scores(net, resolved)
    if runtime.stages > 1:
        from mindspore.parallel.nn import Pipeline
        net = Pipeline(net, runtime.micro)
    net.set_train(False)
    return compile_parallel(net, resolved, runtime, train=False, inputs=SCORE_INPUTS)


def score_inputs(rows: int, global_rows: int, seq_length: int) -> Tuple[Any, Any, Any]:
    """Zero ``(input_ids, labels, rows)`` of this rank's shape, for compiling without data."""
    import numpy as np
    from mindspore import Tensor
    return (Tensor(np.zeros((rows, seq_length), np.int32)), Tensor(np.zeros((rows, seq_length), np.int32)),
            Tensor(np.zeros((rows, global_rows), np.float32)))
