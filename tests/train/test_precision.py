"""Mixed precision and the step guard: fp16 compute, dynamic loss scale and skips decided in the graph."""
from __future__ import annotations

import math

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from naohai.config import GuardConfig, LossScaleConfig
from naohai.errors import UserError
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from naohai.train.metrics import read_metrics
from naohai.train.step import StepGuard
from tests.conftest import micro_recipe


def _run(recipe, **kw):
    return start(plan_run(recipe), log=lambda *_: None, progress=False, **kw).run()


class _GuardProbe(nn.Cell):
    """Feeds one gradient norm through StepGuard.decide/update, as TrainStep does."""

    def __init__(self, guard):
        super().__init__()
        self.guard = guard

    def construct(self, norm):
        finite, applied = self.guard.decide(norm)
        return ms.ops.depend(applied, self.guard.update(finite, applied, norm))


def _feed(cfg: GuardConfig, norms):
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    guard = StepGuard(cfg)
    probe = _GuardProbe(guard)
    out = []
    for n in norms:
        applied = bool(probe(Tensor(np.array([n], np.float32))).asnumpy())
        out.append((applied, float(guard.loss_scale.asnumpy()), float(guard.norm_mean.asnumpy())))
    return out


def test_dynamic_loss_scale_state_machine():
    """Halve on a non-finite norm (never below min_scale), double after `window` clean steps."""
    t = GuardConfig(loss_scale=LossScaleConfig(dynamic=True, init=1024.0, window=2, factor=2.0, min_scale=1.0))
    got = _feed(t, [math.inf, 1.0, 1.0, math.nan, 1.0] + [math.inf] * 20)
    # expected from the rule, step by step: inf -> 512 (skip); clean -> 512 (1 good); clean -> 1024 (2 good);
    # nan -> 512 (skip); clean -> 512; then 20 overflows halve down to the floor 1.0
    assert [a for a, _, _ in got[:5]] == [False, True, True, False, True]
    assert [s for _, s, _ in got[:5]] == [512.0, 512.0, 1024.0, 512.0, 512.0]
    assert got[-1][1] == 1.0 and not got[-1][0]


def test_spike_guard_skips_a_spike_and_keeps_the_mean():
    t = GuardConfig(spike_factor=3.0, spike_warmup=3, spike_window=100)
    got = _feed(t, [1.0, 2.0, 3.0, 100.0, 2.0, 2.5])
    assert [a for a, _, _ in got] == [True, True, True, False, True, True]
    # running mean of the applied norms only: (1+2+3)/3 = 2 after three, then (1+2+3+2)/4, (1+2+3+2+2.5)/5
    assert [m for _, _, m in got] == pytest.approx([1.0, 1.5, 2.0, 2.0, 2.0, 2.1])
    assert all(s == 1.0 for _, s, _ in got)            # static scale: a spike is not an overflow


def test_float16_tracks_float32(tmp_path, micro_data):
    prepared, tok = micro_data
    ls = {"dynamic": True, "init": 1024.0, "window": 1000}
    ref = _run(micro_recipe(tmp_path / "fp32", prepared, tok, steps=5, loss_scale=ls))
    half = micro_recipe(tmp_path / "fp16", prepared, tok, steps=5, loss_scale=ls)
    half.model.compute_dtype = "float16"
    got = _run(half)
    for step in range(1, 6):
        assert abs(got.losses[step] - ref.losses[step]) < 2e-2, (step, got.losses, ref.losses)
        assert got.losses[step] != ref.losses[step] or step == 1


def test_overflow_skips_steps_and_lowers_the_scale(tmp_path, micro_data):
    """PanGu's initial scale 2^32 overflows float16 gradients: those steps are skipped, the scale halves."""
    prepared, tok = micro_data
    r = micro_recipe(tmp_path / "ovf", prepared, tok, steps=30, log_every=1, eval_every=30,
                     loss_scale={"dynamic": True, "init": 2.0 ** 32, "window": 1000})
    r.model.compute_dtype = "float16"
    trainer = start(plan_run(r), log=lambda *_: None, progress=False)
    result = trainer.run()
    rows = [m for m in read_metrics(str(tmp_path / "ovf")) if m["split"] == "train"]
    skipped = [m["step"] for m in rows if m["skipped"]]
    assert skipped and skipped[0] == 1 and skipped == result.skipped
    assert trainer.built.loss_scale() < 2.0 ** 32
    assert trainer.built.loss_scale() == 2.0 ** 32 / 2 ** len(skipped)   # halved once per overflow, window not reached
    assert any(not m["skipped"] for m in rows)            # it recovers and trains
    # skipped steps do not advance the optimizer (and so not its learning-rate table)
    assert int(trainer.built.optimizer.global_step.asnumpy()[0]) == 30 - len(skipped)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_bfloat16_on_cpu_is_a_clear_error(tmp_path, micro_data):
    prepared, tok = micro_data
    r = micro_recipe(tmp_path / "bf", prepared, tok)
    r.model.compute_dtype = "bfloat16"
    with pytest.raises(UserError, match="model.compute_dtype"):
        start(plan_run(r), log=lambda *_: None, progress=False)
