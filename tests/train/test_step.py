"""The one-device train step with a static loss scale against the same step unscaling by 1/1 (naohai/train/step.py).

A static loss scale is 1, so on one device the step skips the unscaling multiply (``x * 1`` is ``x``).  Three
steps of a small decoder with AdamW and an active clip must give the losses, gradient norms and weights of the
step built with the multiply, bit for bit; a dynamic scale keeps it."""
from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from naohai.config import GuardConfig, LossScaleConfig, ModelConfig
from naohai.model.transformer import NaohaiLM
from naohai.train.step import StepGuard, TrainStep, Unscale


def _step(guard: GuardConfig, collect=None):
    cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=8, hidden_size=32, num_layers=2, num_heads=4,
                      ffn_hidden_size=48, seq_length=16, position="rope", activation="swiglu", norm="layernorm",
                      bias=True, compute_dtype="float32")
    cfg.validate()
    model = NaohaiLM(cfg, seed=3)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2, weight_decay=0.1)
    return model, TrainStep(model, optimizer, StepGuard(guard), grad_clip=0.05, collect=collect)


def _three_steps(skip: bool):
    """``skip``: the default one-device step; else the same step given the unscaling collector explicitly
    (a collector given is always applied: the step that multiplies by 1/1)."""
    model, step = _step(GuardConfig(), collect=None if skip else Unscale())
    assert step.static_one == skip and (step.collect is None) == skip
    rng = np.random.RandomState(5)
    out = []
    for _ in range(3):
        tokens = rng.randint(0, 64, (2, 17)).astype(np.int32)
        loss, norm, applied, scale = step(Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]))
        assert bool(applied.asnumpy()) and float(scale.asnumpy()) == 1.0
        out += [loss.asnumpy(), norm.asnumpy()]
    return out + [p.asnumpy() for p in model.trainable_params()], [float(n) for n in out[1::2]]


def test_a_static_scale_skips_the_unscaling_with_the_same_numbers():
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    try:
        skipped, norms = _three_steps(True)
        multiplied, _ = _three_steps(False)
        assert not _step(GuardConfig(loss_scale=LossScaleConfig(dynamic=True)))[1].static_one
    finally:
        ms.set_context(mode=mode)
    assert min(norms) > 0.05                          # the clip acts on every step
    assert len(skipped) == len(multiplied) > 20
    for a, b in zip(skipped, multiplied):
        assert a.tobytes() == b.tobytes()
