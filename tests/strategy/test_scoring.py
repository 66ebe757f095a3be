"""The semi-auto downstream scoring graph's math, on one device: the row-placed per-token scores equal the
model's own log-softmax and argmax (numpy from its logits), and data-parallel shards of a batch, each fed
with its one-hot row places, add up to the whole batch's result in order (what the graph's all-reduce
over data parallel does; the sharded compile itself is tests/simulate/test_check.py's)."""
from __future__ import annotations

import numpy as np
import pytest
from mindspore import Tensor

from naohai.model.config import ModelConfig
from naohai.model.transformer import NaohaiLM, RowScoreNet
from naohai.strategy.runtime import Runtime
from naohai.strategy.scoring import score_rows
from naohai.train.builder import CompiledSteps
from tests.conftest import MICRO_MODEL


@pytest.fixture(autouse=True)
def _cpu():
    import mindspore as ms
    ms.set_device("CPU")          # before the first kernel (later tests set it again)
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _model():
    cfg = ModelConfig(**{k: v for k, v in MICRO_MODEL.items() if k != "preset"})
    model = NaohaiLM(cfg, seed=3)
    model.set_train(False)
    return cfg, model


def _reference(model, ids, labels):
    logits = model.logits(Tensor(ids)).asnumpy().astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    return nll, logits.argmax(-1)


def test_rows_are_placed_where_their_one_hot_says():
    cfg, model = _model()
    rng = np.random.RandomState(0)
    ids = rng.randint(0, cfg.vocab_size, (3, cfg.seq_length)).astype(np.int32)
    labels = rng.randint(0, cfg.vocab_size, (3, cfg.seq_length)).astype(np.int32)
    places = np.zeros((3, 5), np.float32)
    places[0, 4], places[1, 0], places[2, 2] = 1, 1, 1            # rows 1 and 3 of the result stay empty
    out = RowScoreNet(model)(Tensor(ids), Tensor(labels), Tensor(places)).asnumpy()
    assert out.shape == (5, 2 * cfg.seq_length)
    out = out.reshape(5, cfg.seq_length, 2)
    nll, top = _reference(model, ids, labels)
    for row, place in enumerate([4, 0, 2]):
        np.testing.assert_allclose(out[place, :, 0], nll[row], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out[place, :, 1], top[row])
    assert not out[[1, 3]].any()


def test_data_parallel_shards_add_up_to_the_whole_batch():
    """CompiledSteps.score_forward of dp rank 0 and 1, their graph outputs summed (the in-graph all-reduce):
    the nll and argmax of every global row, in the order the Scorer passed them."""
    cfg, model = _model()
    net = RowScoreNet(model)
    rows, n = score_rows(3, Runtime("semi_auto", 0, 8, 0, 2, 2, 2))
    assert (rows, n) == (2, 4)
    fed = {}

    def shard_step(d):
        def step(ids, labels, places):
            fed[d] = (ids.asnumpy(), places.asnumpy())
            return net(ids, labels, places)
        return step

    partial = [CompiledSteps(0, 0, cfg.seq_length, score_step=shard_step(d), score_rows=rows,
                             score_global_rows=n, dp_rank=d).score_forward() for d in (0, 1)]
    rng = np.random.RandomState(1)
    ids = rng.randint(0, cfg.vocab_size, (n, cfg.seq_length)).astype(np.int32)
    labels = np.roll(ids, -1, 1)
    outs = [f(ids, labels) for f in partial]
    nll = outs[0][0] + outs[1][0]
    top = outs[0][1] + outs[1][1]
    ref_nll, ref_top = _reference(model, ids, labels)
    np.testing.assert_allclose(nll, ref_nll, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(top, ref_top)
    for d in (0, 1):          # each group fed only its own rows, one-hot at their global places
        np.testing.assert_array_equal(fed[d][0], ids[2 * d:2 * d + 2])
        np.testing.assert_array_equal(fed[d][1].argmax(1), [2 * d, 2 * d + 1])
        assert fed[d][1].sum() == 2
    assert partial[0].rows == n and partial[0].sharded
    with pytest.raises(ValueError, match="takes \\[4, 32\\] rows"):
        partial[0](ids[:2], labels[:2])


@pytest.mark.parametrize("requested,dp,micro,expected", [(16, 2, 4, (8, 16)), (8, 2, 4, (4, 8)),
                                                         (5, 2, 4, (4, 8)), (1, 4, 1, (1, 4)),
                                                         (16, 1, 1, (16, 16))])
def test_score_rows_round_up_to_data_parallel_times_micro_batches(requested, dp, micro, expected):
    assert score_rows(requested, Runtime("semi_auto", 0, dp * 2, 0, dp, 2, micro)) == expected
