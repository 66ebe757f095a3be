"""Learning-rate schedule: linear warmup, then cosine or linear decay to a floor.

A pure function of the step, so a resumed run gets exactly the same rates.
"""
from __future__ import annotations

import math

from naohai.config import TrainConfig


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Rate used for optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    total = cfg.decay_steps or cfg.steps
    span = max(1, total - cfg.warmup_steps)
    progress = min(1.0, max(0.0, (step - cfg.warmup_steps) / span))
    if cfg.decay == "cosine":
        frac = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        frac = 1.0 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * frac
