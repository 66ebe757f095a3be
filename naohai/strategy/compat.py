"""MindSpore 2.10 compatibility rules: strategies our validator accepts but 2.10 cannot compile.

Owns :func:`check_compat(resolved, recipe)`, run after ``check_strategy`` by
``naohai check`` and by the compile entry (``naohai.train.compile_target``).  Each
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

#: (rule id, one-line summary) of every rule below, for reports
RULES: List[Tuple[str, str]] = [
    ("xent-class-axis", "loss.xent (SoftmaxCrossEntropyWithLogits) cannot split its class (vocab) axis"),
]


def _xent_class_axis(resolved) -> None:
    strat = resolved.op_strategy.get("loss.xent")
    if not strat:
        return
    split = max(dims[1] for dims in strat if len(dims) > 1)
    if split > 1:
        rows = strat[0][0]
        raise UserError(
            f"op loss.xent would split the vocabulary (class) axis {split} ways (embedding.vocab_parallel maps "
            "the vocab axis of every op to 'model'); MindSpore 2.10's SoftmaxCrossEntropyWithLogits cannot split "
            "its class axis (compile error 'SoftmaxCrossEntropyWithLogitsInfo: The strategy corresponding to axis "
            f"dimension is not 1'). Keep vocab_parallel for the embedding and head, and add "
            f"ops: {{loss.xent: [[{rows}, 1], [{rows}, 1]]}} to the strategy (naohai check --compat-fixes does "
            "this in a copy)", where=resolved.source, key="ops.loss.xent", rule="mindspore-2.10: xent-class-axis")


def compat_fixes(raw: Dict[str, Any], resolved, recipe=None) -> Tuple[Dict[str, Any], List[str]]:
    """A copy of a strategy mapping with the fixable 2.10 incompatibilities fixed, and what changed."""
    out = copy.deepcopy(raw)
    notes: List[str] = []
    strat = resolved.op_strategy.get("loss.xent")
    if strat and max(dims[1] for dims in strat if len(dims) > 1) > 1:
        rows = strat[0][0]
        out.setdefault("ops", {})
        out["ops"] = dict(out["ops"] or {})
        out["ops"]["loss.xent"] = [[rows, 1], [rows, 1]]
        notes.append(f"ops.loss.xent {[list(d) for d in strat]} -> [[{rows}, 1], [{rows}, 1]] (MindSpore 2.10 cannot "
                     "split SoftmaxCrossEntropyWithLogits' class axis; the head's vocab-parallel logits are "
                     "gathered before the loss)")
    return out, notes


def check_compat(resolved, recipe=None) -> None:
    """Raise a UserError for the first MindSpore 2.10 incompatibility in ``resolved``."""
    _xent_class_axis(resolved)


def validated_run(recipe, path: str, warn=print):
    """(recipe, resolved): load the strategy at ``path``, adopt its batch keys where the recipe leaves
    them to defaults (:func:`naohai.strategy.batch.adopt_batch`: an error where both state different
    values), and validate it against the recipe: our rules plus the MindSpore 2.10 rules above.
    ``warn`` receives one line per adopted key and per warning.  What ``naohai train`` runs with."""
    from naohai.strategy.batch import adopt_batch
    from naohai.strategy.resolve import check_strategy, load_strategy
    strategy = load_strategy(path)
    recipe, adopted = adopt_batch(recipe, strategy)
    resolved = check_strategy(strategy, recipe)
    check_compat(resolved, recipe)
    for note in adopted:
        warn(f"naohai: batch from the strategy file: {note}")
    for warning in resolved.warnings:
        warn(f"naohai: warning: {warning}")
    return recipe, resolved


def validated_strategy(recipe, path: str, warn=print):
    """The resolved strategy of :func:`validated_run` (what ``naohai launch`` / ``submit`` check before
    any worker starts; each worker's ``naohai train`` adopts the same batch)."""
    return validated_run(recipe, path, warn)[1]
