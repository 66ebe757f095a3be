"""Exact resume: N steps, stop, resume, N more == 2N steps uninterrupted."""
from __future__ import annotations

import math

import pytest

from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from naohai.train.metrics import read_metrics
from tests.conftest import micro_recipe


def _run(recipe, steps=None, resume=True):
    trainer = start(plan_run(recipe), log=lambda *_: None, progress=False, max_steps=steps)
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
    # TensorBoard events and a PNG loss curve are written next to metrics.jsonl
    events = list((tmp_path / "r" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    with open(tmp_path / "r" / "loss.png", "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    tb = _read_tfevents(events[0])
    assert [v for _, v in tb["train/loss"]] == pytest.approx(
        [m["loss"] for m in read_metrics(str(tmp_path / "r")) if m["split"] == "train"], rel=1e-6)
    assert [s for s, _ in tb["valid/loss"]] == [0, 30]


def _read_tfevents(path):
    """Scalars from a TensorBoard event file (TFRecord framing: length, crc, payload, crc)."""
    import struct
    from tensorboardX.proto.event_pb2 import Event

    out = {}
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        payload = data[pos + 12:pos + 12 + length]
        pos += 12 + length + 4
        event = Event.FromString(payload)
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_accumulation_matches_full_batch(tmp_path, micro_data):
    """4 sequences as one batch or as 2 x 2 accumulated give the same first-step loss and update."""
    prepared, tok = micro_data
    a = _run(micro_recipe(tmp_path / "a", prepared, tok, steps=3), resume=False)
    b = _run(micro_recipe(tmp_path / "b", prepared, tok, steps=3, micro_batch_size=2), resume=False)
    for step in (1, 2, 3):
        assert abs(a.losses[step] - b.losses[step]) < 1e-5, (step, a.losses, b.losses)


def test_finished_run_has_nothing_to_do_and_keeps_its_recipe(tmp_path, micro_data):
    """Resuming a run at (or past) train.steps takes no step, says so, and rewrites none of the run's
    files: the recorded recipe stays the one its checkpoints were trained with."""
    prepared, tok = micro_data
    out = tmp_path / "done"
    first = _run(micro_recipe(out, prepared, tok, steps=4, save_every=4), resume=False)
    assert first.steps_done == 4
    files = {name: (out / name).read_bytes() for name in ("recipe.resolved.yaml", "metrics.jsonl", "loss.png")}
    lines = []
    for steps in (4, 2):          # the same recipe again; a shorter one with another learning rate
        trainer = start(plan_run(micro_recipe(out, prepared, tok, steps=steps, lr=1e-3)), log=lines.append,
                        progress=False)
        trainer.resume()
        again = trainer.run()
        assert again.steps_done == 4 and again.losses == {} and again.evals == {}
        assert again.checkpoint == first.checkpoint
    said = [line for line in lines if line.startswith("nothing to do")]
    assert len(said) == 2 and "already at step 4" in said[0] and "past train.steps=2, at step 4" in said[1]
    assert "(e.g. train.steps=8)" in said[0] and "(e.g. train.steps=6)" in said[1]
    assert {name: (out / name).read_bytes() for name in files} == files
