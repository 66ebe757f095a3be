"""Exact resume: N steps, stop, resume, N more == 2N steps uninterrupted."""
from __future__ import annotations

import math

import pytest

from naohai.train.loop import Trainer
from tests.conftest import micro_recipe


def _run(recipe, steps=None, resume=True):
    trainer = Trainer(recipe, None, log=lambda *_: None, progress=False, max_steps=steps)
    if resume:
        trainer.resume()
    return trainer.run()


@pytest.mark.parametrize("variant", [
    {},                                                        # one fused step per batch
    {"micro_batch_size": 2},                                   # gradient accumulation (2 micro-batches)
    {"loss_scale": {"dynamic": True, "init": 1024.0, "window": 3}},  # dynamic loss scaling
])
def test_resume_is_exact(tmp_path, micro_data, variant):
    prepared, tok = micro_data
    full = _run(micro_recipe(tmp_path / "full", prepared, tok, **variant), resume=False)
    part = micro_recipe(tmp_path / "part", prepared, tok, **variant)
    first = _run(part, steps=4)
    assert first.steps_done == 4
    second = _run(part, steps=4)
    assert second.steps_done == 8
    resumed = {**first.losses, **second.losses}
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == full.losses[step], (step, resumed[step], full.losses[step])
    assert second.evals[8] == full.evals[8]
    assert all(math.isfinite(v) for v in full.losses.values())


def test_training_reduces_loss(tmp_path, micro_data):
    prepared, tok = micro_data
    res = _run(micro_recipe(tmp_path / "r", prepared, tok, steps=30, eval_every=30, lr=1e-2, warmup_steps=3),
               resume=False)
    assert res.evals[30] < res.evals[0] - 0.5, res.evals


def test_accumulation_matches_full_batch(tmp_path, micro_data):
    """4 sequences as one batch or as 2 x 2 accumulated give the same first-step loss and update."""
    prepared, tok = micro_data
    a = _run(micro_recipe(tmp_path / "a", prepared, tok, steps=3), resume=False)
    b = _run(micro_recipe(tmp_path / "b", prepared, tok, steps=3, micro_batch_size=2), resume=False)
    for step in (1, 2, 3):
        assert abs(a.losses[step] - b.losses[step]) < 1e-5, (step, a.losses, b.losses)
