"""The learning-rate schedules against independent references.

``pangu`` is checked against the references' ``LearningRate`` cell rebuilt from
MindSpore's own ``WarmUpLR`` / ``CosineDecayLR`` / ``PolynomialDecayLR`` (as
PanGu-alpha ``official/nlp/Pangu_alpha/src/utils.py`` LearningRate and PengCheng-Mind
``src/utils.py`` LearningRate combine them: ``(1 - is_warmup) * decay + is_warmup *
warmup`` with ``is_warmup = warmup_steps > global_step``), and against the same
formula written out in numpy; ``naohai`` against its formula by hand.  The optimizer
reads the table at its own step counter, so update k uses the rate at global step k,
as the references' optimizers do (``Optimizer.get_lr`` before ``global_step += 1``).
"""
import math

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from naohai.config import TrainConfig, preset_recipe
from naohai.errors import UserError
from naohai.model.transformer import NaohaiLM
from naohai.train.builder import make_optimizer
from naohai.train.schedule import learning_rate

@pytest.fixture(autouse=True)
def _pynative_cpu():
    """Eager CPU, with the device named before any kernel runs (later tests set it again)."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)



def mindspore_reference(lr, end_lr, warmup, decay_steps, cosine, steps):
    """The references' LearningRate.construct over global steps 0..steps-1, with MindSpore's cells."""
    decay = (nn.CosineDecayLR(end_lr, lr, decay_steps) if cosine
             else nn.PolynomialDecayLR(lr, end_lr, decay_steps, power=1.0))
    warm = nn.WarmUpLR(lr, warmup) if warmup > 0 else None
    out = []
    for g in range(steps):
        step = Tensor(np.array(g, np.int32))
        d = float(decay(step).asnumpy())
        if warm is None:
            out.append(d)
            continue
        is_warmup = float(np.float32(warmup) > np.float32(g))
        out.append((1.0 - is_warmup) * d + is_warmup * float(warm(step).asnumpy()))
    return np.array(out)


def numpy_reference(lr, end_lr, warmup, decay_steps, cosine, steps):
    """The same, written from MindSpore's documented formulas."""
    g = np.arange(steps, dtype=np.float64)
    p = np.minimum(g, decay_steps) / decay_steps
    decay = end_lr + 0.5 * (lr - end_lr) * (1 + np.cos(np.pi * p)) if cosine else (lr - end_lr) * (1 - p) + end_lr
    if warmup == 0:
        return decay
    warm = lr * np.minimum(g, warmup) / warmup
    is_warmup = (warmup > g).astype(np.float64)
    return (1 - is_warmup) * decay + is_warmup * warm


@pytest.mark.parametrize("decay,warmup,decay_steps,steps", [
    ("cosine", 5, 40, 60),      # training past the horizon holds end_lr
    ("linear", 7, 30, 30),
    ("cosine", 0, 25, 25),
    ("cosine", 12, 10, 20),     # warmup longer than the horizon: end_lr right after warmup
])
def test_pangu_schedule_equals_reference_learning_rate(decay, warmup, decay_steps, steps):
    cfg = TrainConfig.from_keys(steps=steps, lr=6e-5, min_lr=1e-6, warmup_steps=warmup, decay=decay,
                      decay_steps=decay_steps, schedule="pangu")
    cfg.validate()
    ours = np.array([learning_rate(cfg, k) for k in range(steps)])
    want_np = numpy_reference(6e-5, 1e-6, warmup, decay_steps, decay == "cosine", steps)
    want_ms = mindspore_reference(6e-5, 1e-6, warmup, decay_steps, decay == "cosine", steps)
    np.testing.assert_allclose(ours, want_np, rtol=1e-12, atol=0)
    np.testing.assert_allclose(ours, want_ms, rtol=2e-6, atol=1e-12)   # MindSpore computes in float32
    if warmup:
        assert ours[0] == 0.0                      # WarmUpLR: the first update uses lr * 0 / warmup


def test_naohai_schedule_by_hand():
    cfg = TrainConfig.from_keys(steps=14, lr=1.0, min_lr=0.0, warmup_steps=4, decay="linear", schedule="naohai")
    got = [learning_rate(cfg, k) for k in range(14)]
    # warmup (k+1)/4, then linear from 1 at k=4 to 0 at k=14 over 10 steps
    want = [0.25, 0.5, 0.75, 1.0] + [1.0 - j / 10 for j in range(10)]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    cfg.lr_schedule.decay = "cosine"
    assert learning_rate(cfg, 9) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_optimizer_update_k_uses_rate_of_global_step_k():
    recipe = preset_recipe("tiny-pangu")
    recipe.train.steps, sched = 12, recipe.train.lr_schedule
    sched.warmup_steps, sched.decay_steps, sched.lr, sched.min_lr, sched.schedule = 3, 10, 1e-3, 1e-5, "pangu"
    recipe.validate()
    opt = make_optimizer(NaohaiLM(recipe.model), recipe)
    want = numpy_reference(1e-3, 1e-5, 3, 10, True, 13)
    for k in range(13):
        opt.global_step.set_data(Tensor(np.array([k], np.int32)))
        assert float(opt.get_lr().asnumpy()) == pytest.approx(want[k], rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("changes,key", [
    (dict(schedule="pangolin"), "train.schedule"),
    (dict(schedule="pangu", decay="constant"), "train.decay"),
    (dict(decay_steps=0), "train.decay_steps"),
])
def test_schedule_errors_name_the_key(changes, key):
    cfg = TrainConfig.from_keys(**changes)
    with pytest.raises(UserError) as e:
        cfg.validate()
    assert key in str(e.value)


@pytest.mark.parametrize("steps, warmup, decay_steps, decay, says", [
    (20, 30, None, "cosine", "peaks at 0.002, not train.lr=0.003"),     # naohai warmup: 3e-3 x 20 / 30
    (29, 30, None, "cosine", "peaks at 0.0029, not train.lr=0.003"),
    (30, 30, None, "cosine", None),                                      # the last step reaches lr
    (600, 30, 300, "cosine", "steps 300-600 run at train.min_lr=0.0003"),
    (31, 30, None, "cosine", None),
    (30, 30, None, "cosine-pangu", "peaks at 0.0029, not train.lr=0.003"),   # lr x step / warmup: 3e-3 x 29 / 30
    (600, 30, 301, "linear", None),
    (600, 30, 100, "constant", None),                                    # no decay to end early
])
def test_a_schedule_the_run_cannot_follow_is_noted(steps, warmup, decay_steps, decay, says):
    """`naohai train` logs a note when the run's length bends its schedule: a warmup at least as long as the
    run (the rate's peak computed as 3e-3 x steps / warmup by hand) or a decay over half the run or less."""
    from naohai.train.schedule import notes
    cfg = TrainConfig(steps=steps)
    cfg.lr_schedule.lr, cfg.lr_schedule.min_lr = 3e-3, 3e-4
    if decay.endswith("-pangu"):
        decay, cfg.lr_schedule.schedule = decay[:-len("-pangu")], "pangu"
    cfg.lr_schedule.warmup_steps, cfg.lr_schedule.decay_steps, cfg.lr_schedule.decay = warmup, decay_steps, decay
    got = notes(cfg)
    if says is None:
        assert got == []
    else:
        assert len(got) == 1 and says in got[0], got
