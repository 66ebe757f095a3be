"""MindSpore 2.10 compatibility rules: strategies our validator accepts but 2.10 cannot compile.

Owns :func:`check_compat(resolved, recipe)`, run after ``check_strategy`` by
``naohai check`` and by the compile entry (``naohai.train.compile_target``).  Each
rule was found by compiling with MindSpore's own parallel compiler on simulated
devices (``naohai check --compile``); the slow tests in ``tests/simulate`` pin the
MindSpore error behind every rule, so a MindSpore upgrade that fixes one shows up
as a failing test and the rule can be dropped.

A rule raises :class:`naohai.errors.UserError` naming the strategy file, the key
and what to use instead.
"""
from __future__ import annotations

from typing import List, Tuple

from naohai.errors import UserError

#: (rule id, one-line summary) of every rule below, for reports
RULES: List[Tuple[str, str]] = [
    ("xent-class-axis", "loss.xent (SoftmaxCrossEntropyWithLogits) cannot split its class (vocab) axis"),
    ("pipeline-optimizer-parallel", "pipeline stages + optimizer parallel do not compile together in 2.10"),
]


def _xent_class_axis(resolved) -> None:
    strat = resolved.op_strategy.get("loss.xent")
    if not strat:
        return
    split = max(dims[1] for dims in strat if len(dims) > 1)
    if split > 1:
        raise UserError(
            f"op loss.xent would split the vocabulary (class) axis {split} ways; MindSpore 2.10's "
            "SoftmaxCrossEntropyWithLogits only shards the batch axis (its compile fails with "
            "'SoftmaxCrossEntropyWithLogitsInfo ... Invalid strategy'). Keep vocab_parallel for the embedding and "
            "the head MatMul, and give loss.xent ((dp, 1), (dp, 1)) (the default rules do)",
            where=resolved.source, key="ops.loss.xent", rule="mindspore-2.10: xent-class-axis")


def _pipeline_with_optimizer_parallel(resolved) -> None:
    opt = resolved.optimizer_parallel
    if resolved.stages > 1 and opt.enabled and resolved.data > 1:
        raise UserError(
            f"pipeline parallel ({resolved.stages} stages) together with optimizer parallel does not compile in "
            "MindSpore 2.10 with the pipeline train-step wiring naohai uses (the gradient-accumulation "
            "AssignAdd gets an optimizer-sharded gradient for a full-size buffer: 'For AssignAdd, value must "
            "have the same shape as variable'). Set optimizer_parallel: {enabled: false} for pipeline layouts, "
            "or drop the pipeline (mesh.pipeline: 1) to keep optimizer sharding",
            where=resolved.source, key="optimizer_parallel.enabled",
            rule="mindspore-2.10: pipeline-optimizer-parallel")


def check_compat(resolved, recipe=None) -> None:
    """Raise a UserError for the first MindSpore 2.10 incompatibility in ``resolved``."""
    _xent_class_axis(resolved)
    _pipeline_with_optimizer_parallel(resolved)
