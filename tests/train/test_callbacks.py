"""The loop's callback protocol: hooks called in list order, and the throughput / MFU callback's
arithmetic against the definition (tokens over the steps' own time; model FLOP/s over peak x devices)."""
from __future__ import annotations

import pytest

from naohai.train import callbacks as cb_mod
from naohai.train.callbacks import Callback, CallbackList, Throughput


class _Recorder(Callback):
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def on_step(self, trainer, record):
        self.calls.append((self.name, dict(record)))
        record[self.name] = True


def test_hooks_run_in_list_order_and_later_callbacks_see_earlier_fields():
    calls = []
    hooks = CallbackList([_Recorder("a", calls), _Recorder("b", calls)])
    hooks.on_start(None)                 # the hooks a callback does not define do nothing
    hooks.on_step(None, {"step": 1})
    assert [name for name, _ in calls] == ["a", "b"]
    assert "a" in calls[1][1] and "b" not in calls[0][1]


def test_an_object_that_is_not_a_callback_is_refused():
    class Duck:
        def on_step(self, trainer, record):
            pass
    with pytest.raises(TypeError, match="Duck"):
        CallbackList([Duck()])


class _Trainer:
    def __init__(self, end):
        self.step, self.end = 0, end


def test_throughput_counts_only_the_steps_own_time(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(cb_mod.time, "time", lambda: clock[0])
    tokens, flops_token, peak, world = 4096, 3.0e9, 2.0, 4
    tp = Throughput(tokens, flops_token, peak, world, log_every=2)
    trainer = _Trainer(end=5)
    tp.on_start(trainer)
    step_seconds = [0.5, 1.5, 2.0, 1.0, 3.0]
    records = []
    for seconds in step_seconds:
        tp.on_step_begin(trainer)
        clock[0] += seconds                  # the step
        trainer.step += 1
        rec = {"step": trainer.step}
        tp.on_step(trainer, rec)
        records.append(rec)
        clock[0] += 10.0                     # an evaluation or a save: not the step's time
    assert "tokens_per_s" not in records[0] and "tokens_per_s" not in records[2]
    for i, window in ((1, step_seconds[0:2]), (3, step_seconds[2:4]), (4, step_seconds[4:5])):
        dt = sum(window) / len(window)
        assert records[i]["step_time"] == pytest.approx(dt)
        assert records[i]["tokens_per_s"] == pytest.approx(tokens / dt)
        assert records[i]["tflops"] == pytest.approx(tokens / dt * flops_token / 1e12)
        assert records[i]["mfu"] == pytest.approx(tokens / dt * flops_token / (peak * 1e12 * world))
    # ETA from wall time: 2 steps took 2.0 s of steps + 10 s after the first -> 12 s for 2 steps, 3 left
    assert records[1]["eta_s"] == pytest.approx((0.5 + 10.0 + 1.5) / 2 * 3)
    assert records[4]["eta_s"] == pytest.approx(0.0)


def test_throughput_without_a_peak_has_no_mfu(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(cb_mod.time, "time", lambda: clock[0])
    tp = Throughput(100, 1.0, 0.0, 1, log_every=1)
    trainer = _Trainer(end=1)
    tp.on_start(trainer)
    tp.on_step_begin(trainer)
    clock[0] += 2.0
    trainer.step = 1
    rec = {}
    tp.on_step(trainer, rec)
    assert rec["mfu"] is None and rec["tokens_per_s"] == pytest.approx(50.0)
