"""The planner's model-state memory for one device against what a built run allocates.

Planner: :func:`naohai.strategy.memory.stage_states` of the one-device layout
(:func:`naohai.strategy.resolve.default_strategy`): float32 weights, gradients and the two
Adam moments.  Run: the bytes of the built ``TrainStep``'s trainable parameters and of the
optimizer's moment tensors (:meth:`naohai.bench.naohai_row.NaohaiRun.allocated`), and the
process's resident-set growth over the build and over the first round of steps (which
holds the compiled graph, the gradients and activations; CPU MindSpore reports no device
allocator figures).
"""
from __future__ import annotations

from typing import Dict

from naohai.config import ModelConfig


def planned_states(cfg: ModelConfig, micro_batch: int) -> Dict[str, float]:
    from naohai.strategy.memory import stage_activations, stage_states
    from naohai.strategy.resolve import default_strategy
    r = default_strategy(cfg, micro_batch)
    st = stage_states(cfg, r)[0]
    act = stage_activations(cfg, r)[0]
    return {"parameters": float(st.weights), "gradients": float(st.grads), "optimizer_state": float(st.optimizer),
            "activations": float(act.total), "parameters_count": int(st.params)}


def compare(planned: Dict[str, float], allocated: Dict[str, int]) -> Dict[str, object]:
    """One record: planned and allocated bytes side by side, with allocated / planned ratios."""
    out: Dict[str, object] = {"planned": planned, "allocated": allocated}
    for key in ("parameters", "optimizer_state"):
        p = planned.get(key)
        out[f"{key}_ratio"] = allocated[key] / p if p else None
    return out
