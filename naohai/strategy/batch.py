"""Which batch a run uses when both the recipe and the strategy file speak of it.

A strategy file may record the batch it was planned for (``global_batch``,
``micro_batch_size``; ``naohai plan --search --write`` always does): the plan's
micro-batch count, accumulation and memory are only true for that batch.  The
recipe's ``train.global_batch_size`` / ``train.micro_batch_size`` are training
hyper-parameters (the learning-rate schedule, tokens per step and the data
position of a checkpoint depend on them).  So:

* the recipe file (or a ``train.*=`` override) states the key and the strategy
  agrees, or the strategy is silent: the recipe's value;
* the recipe leaves the key to its default and the strategy states it: the
  strategy's value is adopted, like MindFormers, whose global batch follows from
  the parallel configuration (batch size x data parallel x micro-batches);
  :func:`adopt_batch` returns the changed recipe and one line per adopted key,
  and the run folder's ``recipe.resolved.yaml`` records the adopted values;
* both state it and disagree: a :class:`naohai.errors.UserError` naming both
  files and keys and the two ways out -- a changed hyper-parameter is never
  taken silently.

``naohai train``, ``naohai launch`` (pre-flight and every worker), ``naohai
check`` and ``naohai plan RECIPE STRATEGY`` all go through :func:`adopt_batch`
(via ``naohai.strategy.resolve.check_strategy``), so they agree.
"""
from __future__ import annotations

import dataclasses
from typing import List, Tuple

from naohai.config import Recipe
from naohai.errors import UserError

#: (strategy key, recipe key under train)
BATCH_KEYS = (("global_batch", "global_batch_size"), ("micro_batch_size", "micro_batch_size"))


def adopt_batch(recipe: Recipe, strategy) -> Tuple[Recipe, List[str]]:
    """(recipe with the strategy's batch keys adopted where the recipe is silent, what was adopted)."""
    where = recipe.source or recipe.name
    changes, notes = {}, []
    for skey, rkey in BATCH_KEYS:
        mine = getattr(strategy, skey)
        theirs = getattr(recipe.train, rkey)
        if mine is None or mine == theirs:
            continue
        if f"train.{rkey}" in recipe.stated:
            raise UserError(
                f"the strategy was planned for {skey} {mine}, the recipe {where} sets train.{rkey} {theirs}. "
                f"The batch is a training hyper-parameter and the plan (micro-batches, accumulation, memory) "
                f"holds only for its own batch, so naohai takes neither silently: to train with the "
                f"strategy's batch, give train.{rkey}={mine} (or drop the key from the recipe); to keep the "
                f"recipe's, remove '{skey}' from {strategy.source} or re-plan with naohai plan {where} "
                f"--devices N --search --write FILE", where=strategy.source, key=skey,
                rule="strategy and recipe agree on the batch")
        changes[rkey] = mine
        notes.append(f"train.{rkey}: {theirs} (recipe default) -> {mine} ({skey} in {strategy.source})")
    if not changes:
        return recipe, notes
    train = dataclasses.replace(recipe.train, **changes)
    train.validate(where=f"{where} with the batch of {strategy.source}")
    return dataclasses.replace(recipe, train=train), notes
