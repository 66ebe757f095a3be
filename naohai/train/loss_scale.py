"""Dynamic loss scaling decided on the host from a finite-gradient flag.

The NPU float-status operator used by MindSpore's loss-scale cells has no CPU
kernel, so the train step reports whether the global gradient norm was finite
and this small state machine halves the scale on overflow (the step is skipped)
and doubles it after ``window`` clean steps.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from naohai.config import LossScaleConfig


@dataclass
class LossScaler:
    scale: float
    window: int
    factor: float
    min_scale: float
    enabled: bool
    good_steps: int = 0
    skipped: int = 0

    @classmethod
    def from_config(cls, cfg: LossScaleConfig) -> "LossScaler":
        return cls(scale=float(cfg.init) if cfg.dynamic else 1.0, window=cfg.window, factor=cfg.factor,
                   min_scale=cfg.min_scale, enabled=cfg.dynamic)

    def update(self, finite: bool) -> bool:
        """Record one step's outcome; returns True if the update was applied."""
        if not self.enabled:
            return finite
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= self.factor
                self.good_steps = 0
            return True
        self.skipped += 1
        self.good_steps = 0
        self.scale = max(self.min_scale, self.scale / self.factor)
        return False

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)
