"""Mixed precision on CPU: float16 compute with fp32 master weights and dynamic loss scaling."""
from __future__ import annotations

import pytest

from naohai.errors import UserError
from naohai.train.loop import Trainer
from naohai.train.loss_scale import LossScaler
from naohai.config import LossScaleConfig
from tests.conftest import micro_recipe


def _run(recipe):
    return Trainer(recipe, None, log=lambda *_: None, progress=False).run()


def test_loss_scaler_state_machine():
    s = LossScaler.from_config(LossScaleConfig(dynamic=True, init=1024.0, window=2, factor=2.0, min_scale=1.0))
    assert s.update(False) is False and s.scale == 512.0 and s.skipped == 1
    assert s.update(True) and s.scale == 512.0
    assert s.update(True) and s.scale == 1024.0          # doubled after `window` clean steps
    for _ in range(20):
        s.update(False)
    assert s.scale == 1.0                                  # never below min_scale


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
    trainer = Trainer(r, None, log=lambda *_: None, progress=False)
    trainer.run()
    from naohai.train.metrics import read_metrics
    rows = [m for m in read_metrics(str(tmp_path / "ovf")) if m["split"] == "train"]
    skipped = [m["step"] for m in rows if m["skipped"]]
    assert skipped and skipped[0] == 1
    assert trainer.scaler.scale < 2.0 ** 32
    assert any(not m["skipped"] for m in rows)            # it recovers and trains
    # skipped steps do not advance the optimizer (and so not its learning-rate table)
    assert int(trainer.built.optimizer.global_step.asnumpy()[0]) == 30 - len(skipped)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_bfloat16_on_cpu_is_a_clear_error(tmp_path, micro_data):
    prepared, tok = micro_data
    r = micro_recipe(tmp_path / "bf", prepared, tok)
    r.model.compute_dtype = "bfloat16"
    with pytest.raises(UserError, match="model.compute_dtype"):
        Trainer(r, None, log=lambda *_: None, progress=False)
