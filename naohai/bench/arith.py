"""The arithmetic of the benchmark table: throughput of timed steps, MFU, ratios.

MFU = tokens/s x model FLOPs per token / peak FLOP/s, with FLOPs per token from
:func:`naohai.model.flops.flops_per_token` (the trainer's and the planner's definition)
for every row, naohai's and PyTorch's alike, and the peak the measured matmul rate.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence


def tokens_per_second(tokens_per_step: int, step_seconds: Sequence[float]) -> float:
    """Tokens per second over timed steps (total tokens / total time)."""
    total = float(sum(step_seconds))
    if not step_seconds or total <= 0:
        raise ValueError("need at least one timed step with positive duration")
    return tokens_per_step * len(step_seconds) / total


def matmul_tflops(n: int, seconds: float) -> float:
    """TFLOP/s of one n x n by n x n matmul (2 n^3 FLOPs) that took ``seconds``."""
    return 2.0 * n ** 3 / seconds / 1e12


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float) -> Optional[float]:
    """Model FLOPs utilisation as a fraction; None without a positive peak."""
    if not peak_tflops or peak_tflops <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, or None when either is missing or b is not positive."""
    if a is None or b is None or not b > 0 or not math.isfinite(a):
        return None
    return a / b


def best(values: Sequence[float]) -> Optional[float]:
    """The best (highest) of the rounds' figures, None when there is none."""
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None
