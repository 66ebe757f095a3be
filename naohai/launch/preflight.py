"""What ``naohai launch`` checks on the launching node before any worker starts.

The recipe and the strategy file are validated exactly as ``naohai train`` will
validate them on every rank, the device is resolved (``--device``, else the recipe's
``train.device``; ``auto`` = Ascend, then GPU, then CPU), and a layout the device
cannot execute (op or pipeline parallel on CPU) is refused with one paragraph that
says what to run instead.  The resolved device is what the workers are told to use.
"""
from __future__ import annotations

from typing import Optional

from naohai.devices import resolve_device
from naohai.strategy.run_plan import Run
from naohai.strategy.runtime import check_runnable


def preflight(run: Run, command: str, device: Optional[str], dry_run: bool = False) -> str:
    """Tell what the run plan adjusted and check its layout for this device; return the device the workers must
    use.  ``run``: the launch's :func:`naohai.strategy.run_plan.plan_run` of the recipe, its overrides and the
    strategy file (made once, before the run folder is taken); ``command``: the recipe path and overrides, for
    the message.

    A dry run (printing the command for another machine) takes an explicit device as given
    instead of asking whether this machine has it."""
    run.tell()
    recipe = run.recipe
    where, key = ("command line", "--device") if device else (recipe.source, "train.device")
    wanted = device or recipe.train.device
    if dry_run and wanted != "auto":
        chosen = wanted
    else:
        chosen = resolve_device(wanted, where=where, key=key)
    check_runnable(run.strategy, chosen, command)
    return chosen
