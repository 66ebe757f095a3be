"""Sampling rules against numpy, and generation from a trained checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

from naohai.errors import UserError
from naohai.generate import Generator, SamplingConfig, sample_next
from naohai.train.job import start
from tests.conftest import micro_recipe


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal(50)
    assert sample_next(logits, SamplingConfig(temperature=0), np.random.default_rng(1), 50) == int(np.argmax(logits))


def test_padding_rows_are_never_sampled():
    logits = np.zeros(64)
    logits[60:] = 100.0                       # rows past the real vocabulary (padding) must be ignored
    picks = {sample_next(logits, SamplingConfig(temperature=1.0), np.random.default_rng(i), 60) for i in range(50)}
    assert max(picks) < 60


def test_top_k_and_top_p_restrict_the_support():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.05, 0.05]))
    k2 = {sample_next(logits, SamplingConfig(temperature=1.0, top_k=2), rng, 5) for _ in range(300)}
    assert k2 == {0, 1}
    p = {sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.85), rng, 5) for _ in range(300)}
    assert p == {0, 1, 2}                     # 0.5 + 0.3 < 0.85 <= 0.9: the third is needed


def test_temperature_sharpens_like_numpy_softmax():
    logits = np.array([1.0, 0.0, -1.0])
    rng = np.random.default_rng(3)
    n = 4000
    counts = np.bincount([sample_next(logits, SamplingConfig(temperature=0.5), rng, 3) for _ in range(n)],
                         minlength=3) / n
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(counts, expected, atol=0.03)


def test_bad_sampling_flags():
    with pytest.raises(UserError, match="--top-p"):
        SamplingConfig(top_p=0).validate()
    with pytest.raises(UserError, match="--temperature"):
        SamplingConfig(temperature=-1).validate()


def test_generate_from_checkpoint(tmp_path, micro_data):
    prepared, tok = micro_data
    recipe = micro_recipe(tmp_path / "run", prepared, tok, steps=4, save_every=4)
    start(recipe, None, log=lambda *_: None, progress=False).run()
    gen = Generator(str(tmp_path / "run"))
    assert gen.step == 4
    greedy = gen.generate("The ", SamplingConfig(max_new_tokens=8, temperature=0))
    again = gen.generate("The ", SamplingConfig(max_new_tokens=8, temperature=0))
    assert isinstance(greedy, str) and greedy == again
    sampled = gen.generate("The ", SamplingConfig(max_new_tokens=8, temperature=1.0, seed=5))
    assert isinstance(sampled, str)
