"""The masked fine-tuning loss: sum of the NLL of learned tokens / learned tokens of the GLOBAL batch,
against a numpy reference from that definition (per-token NLL from the model's scorer), and the same
loss and gradients whether the batch runs as one micro-batch or as 4 accumulated ones."""
import json

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.data.sft import SFTLoader, load_sft, masked_labels, prepare_sft
from naohai.data.tokenizer import Tokenizer
from naohai.errors import UserError
from naohai.model.transformer import TokenNLLNet
from naohai.strategy.runtime import Runtime
from naohai.strategy.run_plan import plan_run
from naohai.train.builder import build
from tests.conftest import micro_recipe


@pytest.fixture(autouse=True)
def _cpu_graph():
    """The device is named before MindSpore's runtime starts (a later run's set_device must agree)."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)


@pytest.fixture(scope="module")
def sft_batch(micro_data, tmp_path_factory):
    """A global batch of 4 packed windows (multi-turn, truncated, padded) of the micro model's tokenizer."""
    _, tok_path = micro_data
    tok = Tokenizer.load(tok_path)
    root = tmp_path_factory.mktemp("sftloss")
    rng = np.random.default_rng(0)
    lines = []
    for i in range(40):
        turns = [{"role": "user", "content": f"q{i} " * int(rng.integers(1, 4))},
                 {"role": "assistant", "content": f"a{i} " * int(rng.integers(1, 5))}]
        if i % 3 == 0:
            turns += [{"role": "user", "content": "more"}, {"role": "assistant", "content": f"b{i} " * 6}]
        lines.append(json.dumps({"messages": turns}))
    (root / "c.jsonl").write_text("\n".join(lines))
    meta = prepare_sft([str(root / "c.jsonl")], tok, str(root / "sft"), 32, holdout_fraction=0.1, seed=0,
                       truncation="truncate")
    assert meta["report"]["truncated"] > 0
    batch = SFTLoader(load_sft(str(root / "sft")), "train", global_batch_size=4, seed=1).next_batch()
    counts = batch[1][:, 1:].sum(axis=1)
    assert len(set(counts.tolist())) > 1 and (batch[0][:, -1] == tok.pad_id).any()   # unequal rows, padding
    return batch


def _recipe(tmp_path, mbs):
    return micro_recipe(tmp_path, micro_batch_size=mbs, grad_clip=0.0)


def _reference_loss(model, batch):
    ids, labels = masked_labels(batch)
    learned = labels >= 0
    nll = TokenNLLNet(model)(Tensor(ids), Tensor(np.where(learned, labels, 0).astype(np.int32))).asnumpy()
    return float(np.sum(nll.astype(np.float64) * learned) / learned.sum())


def _moments(built):
    return {p.name: p.asnumpy() for p in built.optimizer.moments1}


def test_loss_equals_reference_and_accumulation_equals_one_batch(tmp_path, sft_batch):
    ms.set_context(mode=ms.GRAPH_MODE)
    one = build(plan_run(_recipe(tmp_path / "a", 4)), masked_loss=True)
    ref = _reference_loss(one.model, sft_batch)
    res_one = one.steps.train(sft_batch)
    assert res_one.applied
    assert abs(res_one.loss - ref) <= 1e-5 * abs(ref)
    four = build(plan_run(_recipe(tmp_path / "b", 1)), masked_loss=True)
    assert four.steps.train_step is None and four.steps.accumulate_step is not None
    res_four = four.steps.train(sft_batch)
    assert abs(res_four.loss - res_one.loss) <= 1e-6 * abs(ref)
    assert abs(res_four.grad_norm - res_one.grad_norm) <= 1e-5 * res_one.grad_norm
    m_one, m_four = _moments(one), _moments(four)
    for name, value in m_one.items():                   # Adam's first moment is (1 - beta1) x the gradient
        assert np.abs(m_four[name] - value).max() <= 1e-5 * np.abs(value).max(), name
    # the evaluator reports the learned tokens' mean NLL of the (now updated) model
    assert abs(one.steps.evaluate(sft_batch) - _reference_loss(one.model, sft_batch)) <= 1e-5


def test_per_micro_batch_normalisation_would_differ(sft_batch):
    """The rows hold different numbers of learned tokens, so the mean of per-row means (what a
    per-micro-batch normalisation reports) is not the global mean: the test above can fail."""
    _, labels = masked_labels(sft_batch)
    counts = (labels >= 0).sum(axis=1)
    weights = counts / counts.sum()
    assert np.abs(weights - 0.25).max() > 0.05


def test_masked_loss_refuses_semi_auto(tmp_path):
    with pytest.raises(UserError, match="plain data parallel so far"):
        build(plan_run(_recipe(tmp_path, 1)), runtime=Runtime("semi_auto", 0, 8, 0, 2, 2, 4), masked_loss=True)
