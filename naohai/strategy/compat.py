"""MindSpore 2.10 compatibility rules: strategies our validator accepts but 2.10 cannot compile.

Owns :func:`check_compat(resolved, recipe)`, run after ``check_strategy`` by
:func:`naohai.strategy.run_plan.plan_run` (every run, check and compile).  Each
rule was found by compiling with MindSpore's own parallel compiler on simulated
devices (``naohai check --compile``); the slow tests in ``tests/simulate`` pin the
MindSpore error behind every rule, so a MindSpore upgrade that fixes one shows up
as a failing test and the rule can be dropped.

A rule raises :class:`naohai.errors.UserError` naming the strategy file, the key
and what to use instead.  (2.10 also refuses elementwise ops whose equal-shape inputs
are split differently; the validator's "same logical axis, same slices within an op"
rule and sequence parallel splitting both residual operands already exclude that.)
``recipe`` is accepted for rules that need the model's shapes.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Tuple

from naohai.errors import UserError

#: MindSpore 2.10's pipeline schedulers (``AutoParallel.pipeline``, ``_PipelineScheduler`` in
#: mindspore/parallel/_auto_parallel_context.py); with ``interleave=False`` only "1f1b" is accepted
#: (``set_pipeline_config``: "When pipeline_interleave is False, ... only '1f1b' is allowed")
MS_SCHEDULERS = ("1f1b", "gpipe", "seqpipe", "seqvpp", "seqsmartvpp", "zero_bubble_v")

LOSS_OP = "loss.log_softmax"


def _class_axis_split(resolved) -> int:
    strat = resolved.op_strategy.get(LOSS_OP)
    return max(dims[1] for dims in strat) if strat else 1


def _loss_class_axis(resolved) -> None:
    split = _class_axis_split(resolved)
    if split > 1:
        rows = resolved.op_strategy[LOSS_OP][0][0]
        raise UserError(
            f"op {LOSS_OP} would split the vocabulary (class) axis {split} ways; MindSpore 2.10's LogSoftmax "
            "cannot split the axis it normalises over (compile error 'LogSoftmaxInfo: The strategy corresponding "
            "to axis dimension(2) is not 1'). Keep vocab_parallel for the embedding and head (the logits are "
            f"gathered before the loss) and set ops: {{{LOSS_OP}: [[{rows}, 1]]}} in the strategy (naohai check "
            "--compat-fixes does this in a copy)", where=resolved.source, key=f"ops.{LOSS_OP}",
            rule="mindspore-2.10: loss-class-axis")


def _pipeline_scheduler(resolved) -> None:
    if int(resolved.stages) <= 1:
        return   # no pipeline: MindSpore never reads the scheduler
    sched = str(resolved.scheduler)
    if sched == "gpipe":
        raise UserError(
            "scheduler 'gpipe' compiles in MindSpore 2.10 only together with pipeline_interleave (virtual "
            "chunks), which naohai's gpipe does not use; every rank would fail in set_pipeline_config with "
            "\"When pipeline_interleave is False, 'gpipe' is not supported, only '1f1b' is allowed\". Use "
            "pipeline: {scheduler: 1f1b} (it holds fewer micro-batches' activations than gpipe; naohai plan "
            "shows the difference; naohai check --compat-fixes does this in a copy)",
            where=resolved.source, key="pipeline.scheduler", rule="mindspore-2.10: pipeline-gpipe-needs-interleave")
    if sched == "interleaved":
        raise UserError(
            f"scheduler 'interleaved' ({resolved.virtual_chunks} virtual chunks) is a planning-only scheduler: "
            f"MindSpore 2.10's AutoParallel.pipeline knows {', '.join(MS_SCHEDULERS)} (its interleaved 1F1B "
            "is '1f1b' with interleave=True and every layer given a virtual chunk, Cell.pipeline_segment), and "
            "naohai does not place layers into virtual chunks, so no rank could compile it. Use pipeline: "
            "{scheduler: 1f1b, virtual_chunks: 1} to compile or train (naohai check --compat-fixes does this in "
            "a copy); naohai plan still figures the interleaved layout",
            where=resolved.source, key="pipeline.scheduler", rule="mindspore-2.10: pipeline-interleaved-not-wired")


def compat_fixes(raw: Dict[str, Any], resolved, recipe=None) -> Tuple[Dict[str, Any], List[str]]:
    """A copy of a strategy mapping with the fixable 2.10 incompatibilities fixed, and what changed."""
    out = copy.deepcopy(raw)
    notes: List[str] = []
    if _class_axis_split(resolved) > 1:
        strat = resolved.op_strategy[LOSS_OP]
        rows = strat[0][0]
        out["ops"] = dict(out.get("ops") or {})
        out["ops"][LOSS_OP] = [[rows, 1]]
        notes.append(f"ops.{LOSS_OP} {[list(d) for d in strat]} -> [[{rows}, 1]] (MindSpore 2.10 cannot split "
                     "LogSoftmax's class axis; the head's vocab-parallel logits are gathered before the loss)")
    if int(resolved.stages) > 1 and str(resolved.scheduler) in ("gpipe", "interleaved"):
        pipe = dict(out.get("pipeline") or {})
        old = pipe.get("scheduler")
        pipe["scheduler"] = "1f1b"
        pipe.pop("virtual_chunks", None)
        if old == "interleaved" and isinstance(pipe.get("layers_per_stage"), list):
            pipe["layers_per_stage"] = "auto"   # the list had one entry per stage x chunk
        out["pipeline"] = pipe
        notes.append(f"pipeline.scheduler {old} -> 1f1b (MindSpore 2.10 compiles naohai's pipeline with 1f1b only)")
    return out, notes


def check_compat(resolved, recipe=None) -> None:
    """Raise a UserError for the first MindSpore 2.10 incompatibility in ``resolved``."""
    _loss_class_axis(resolved)
    _pipeline_scheduler(resolved)
