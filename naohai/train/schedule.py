"""Learning-rate schedule: warmup, then cosine or linear decay to a floor.

A pure function of the optimizer's step counter (the number of updates applied
before this one), so a resumed run gets exactly the same rates.  Two shapes,
chosen by ``train.schedule``:

* ``naohai``: warmup ``lr * (step + 1) / warmup_steps``, then the decay runs over
  the steps *after* warmup, from ``lr`` at ``warmup_steps`` to ``min_lr`` at
  ``decay_steps`` (default ``steps``).
* ``pangu``: the ``LearningRate`` cell of both reference codes (PanGu-alpha
  ``official/nlp/Pangu_alpha/src/utils.py`` and PengCheng-Mind ``src/utils.py``):
  MindSpore's ``WarmUpLR`` (``lr * step / warmup_steps``, so the first update uses
  0) while ``step < warmup_steps``; afterwards ``CosineDecayLR(min_lr, lr,
  decay_steps)`` (or ``PolynomialDecayLR`` of power 1 for ``decay: linear``)
  evaluated at the global step, i.e. over the fixed horizon ``[0, decay_steps]``
  that includes the warmup, and held at ``min_lr`` after it.
"""
from __future__ import annotations

import math

from naohai.config import LRScheduleConfig, TrainConfig


def learning_rate(train: TrainConfig, step: int) -> float:
    """Rate used for the optimizer update whose counter reads ``step`` (0-based)."""
    cfg, total = train.lr_schedule, train.lr_schedule.decay_steps or train.steps
    if cfg.schedule == "pangu":
        return _pangu(cfg, total, step)
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    span = max(1, total - cfg.warmup_steps)
    return _decayed(cfg, (step - cfg.warmup_steps) / span)


def notes(train: TrainConfig) -> list:
    """What a run's length does to its schedule that a user may not mean: a warmup at least as long as the run,
    so the rate never reaches ``lr`` (a short override of ``train.steps`` on a long recipe, the usual way), or a decay
    that ends long before the run (``decay_steps`` below ``steps``), so most steps run at ``min_lr``."""
    cfg, out = train.lr_schedule, []
    peak = max(learning_rate(train, s) for s in range(train.steps)) if cfg.warmup_steps >= train.steps > 0 \
        else cfg.lr
    if peak < cfg.lr * (1 - 1e-9):
        out.append(f"train.warmup_steps={cfg.warmup_steps} is not shorter than train.steps={train.steps}: the "
                   f"learning rate rises through the whole run and peaks at {peak:.3g}, not train.lr={cfg.lr:g}")
    elif cfg.decay_steps is not None and cfg.decay != "constant" and 2 * cfg.decay_steps <= train.steps:
        out.append(f"train.decay_steps={cfg.decay_steps} is at most half of train.steps={train.steps}: steps "
                   f"{cfg.decay_steps}-{train.steps} run at train.min_lr={cfg.min_lr:g}")
    return out


def _pangu(cfg: LRScheduleConfig, total: int, step: int) -> float:
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    return _decayed(cfg, step / total)


def _decayed(cfg: LRScheduleConfig, progress: float) -> float:
    progress = min(1.0, max(0.0, progress))
    if cfg.decay == "cosine":
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        frac = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * frac
