"""One run plan: the only way a recipe and a strategy become a run.

:func:`plan_run` is what ``naohai train``, ``launch`` (pre-flight and every worker),
``submit``, ``check``, ``plan RECIPE STRATEGY``, ``ckpt reshard`` and the compile
entry of the simulated-device check (:mod:`naohai.train.compile_target`) call.  In
order, once each:

1. the recipe (a :class:`naohai.config.Recipe`, or a recipe file or name with
   ``overrides``);
2. the strategy: a strategy file, a parsed :class:`naohai.strategy.schema.Strategy`,
   or none -- the built-in one-device strategy
   (:func:`naohai.strategy.resolve.single_device_strategy`), so a run always has a
   resolved strategy;
3. command-line batch flags (``naohai plan --micro-batch-size / --global-batch``)
   replace both the recipe's and the strategy's key;
4. the batch is adopted (:func:`naohai.strategy.batch.adopt_batch`): the strategy's
   ``micro_batch_size`` / ``global_batch`` where the recipe leaves them to defaults,
   an error where both state different values;
5. every strategy rule and the resolution against that recipe
   (:func:`naohai.strategy.resolve.check_strategy`: the batch's divisibility by
   data x micro-batch size x micro-batches is checked there), then the MindSpore 2.10
   compatibility rules (:func:`naohai.strategy.compat.check_compat`);
6. a ``finetune`` section's targets and rank against the model
   (:func:`naohai.strategy.lora.check_adapters`).

The :class:`Run` holds the recipe with the adopted batch (``recipe.train``: the one
home of the batch the trainer reads) and the strategy resolved for it, plus one
note per adopted key and per warning.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

from naohai.config import Recipe, load_recipe
from naohai.strategy.batch import adopt_batch
from naohai.strategy.compat import check_compat
from naohai.strategy.lora import check_adapters
from naohai.strategy.profiles import recipe_profile
from naohai.strategy.resolve import ResolvedStrategy, check_strategy, single_device_strategy
from naohai.strategy.schema import Strategy, load_strategy


@dataclass(frozen=True)
class Run:
    """A recipe and the strategy resolved for it; what a training job, a check or a compile starts from."""

    recipe: Recipe                  # the batch adopted from the strategy where the recipe left it to defaults
    strategy: ResolvedStrategy      # always present: the one-device strategy for a run without a file
    notes: Tuple[str, ...] = ()     # one line per adopted batch key and per strategy warning

    def tell(self, say: Callable[[str], None] = print) -> None:
        """Print the notes, one line each, as ``naohai: ...``."""
        for note in self.notes:
            say(f"naohai: {note}")


def plan_run(recipe: Union[Recipe, str], strategy: Union[None, str, Strategy] = None, overrides: Sequence[str] = (),
             *, devices: Optional[int] = None, micro_batch_size: Optional[int] = None,
             global_batch: Optional[int] = None, compat: bool = True) -> Run:
    """The :class:`Run` of ``recipe`` under ``strategy`` (see the module docstring).  ``overrides`` are
    dotted recipe overrides for a recipe given by file or name; ``devices`` (``naohai plan --devices``)
    must equal the strategy's device count; ``compat=False`` skips the MindSpore 2.10 rules (to show
    what MindSpore itself says)."""
    if isinstance(recipe, Recipe):
        if overrides:
            raise ValueError("overrides apply to a recipe file or name, not to a loaded Recipe")
    else:
        recipe = load_recipe(recipe, list(overrides))
    if strategy is None:
        strategy = single_device_strategy()
    elif not isinstance(strategy, Strategy):
        strategy = load_strategy(strategy)
    flags = {key: value for key, value in (("micro_batch_size", micro_batch_size), ("global_batch", global_batch))
             if value is not None}
    if flags:
        # a command-line flag replaces the strategy's key as well as the recipe's
        strategy = dataclasses.replace(strategy, **{key: None for key in flags})
        train = dataclasses.replace(recipe.train, **{"global_batch_size" if key == "global_batch" else key: value
                                                     for key, value in flags.items()})
        train.validate(where="command line")
        recipe = dataclasses.replace(recipe, train=train)
    recipe_profile(recipe.train.logging.device_profile, recipe.source or "recipe")
    recipe, adopted = adopt_batch(recipe, strategy)
    resolved = check_strategy(strategy, recipe, devices, micro_batch_size, global_batch)
    if compat:
        check_compat(resolved, recipe)
    check_adapters(recipe, resolved)
    notes = tuple(f"batch from the strategy file: {note}" for note in adopted)
    return Run(recipe, resolved, notes + tuple(f"warning: {w}" for w in resolved.warnings))
