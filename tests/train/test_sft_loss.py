"""The masked fine-tuning loss: sum of the NLL of learned tokens / learned tokens of the GLOBAL batch,
against a numpy reference from that definition (per-token NLL from the model's scorer), and the same
loss and gradients whether the batch runs as one micro-batch, as 4 accumulated on the host, or as 4
micro-batches summed inside the step's network (the semi-auto wiring: a pipeline's or an in-graph
accumulation's network returns the SUM of its micro-batch losses -- measured, shared/docs
semi-auto-training.md -- which a CPU stand-in of the same contract replaces here, since a sharded step
cannot execute on CPU), and the same gradient when two data-parallel groups each sum their share's
micro-batches with the global batch's token count (semi-auto data parallel; plain data parallel over
msrun: tests/train/test_sft_data_parallel.py)."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.data.sft import SFTLoader, load_sft, masked_labels, prepare_sft
from naohai.data.tokenizer import Tokenizer
from naohai.model.transformer import TokenNLLNet
from naohai.strategy.runtime import Runtime
from naohai.strategy.run_plan import plan_run
from naohai.strategy.gradients import MeanOverMicro, step_parts
from naohai.train.builder import CompiledSteps, build, token_weight_factors
from naohai.train.step import EvalStep, TrainStep
from tests.conftest import micro_recipe


@pytest.fixture(autouse=True)
def _cpu_graph():
    """The device is named before MindSpore's runtime starts (a later run's set_device must agree)."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)


@pytest.fixture(scope="module")
def sft_dir(micro_data, tmp_path_factory):
    """Packed windows (multi-turn, truncated, padded) of the micro model's tokenizer."""
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
    return str(root / "sft")


@pytest.fixture(scope="module")
def sft_batch(sft_dir):
    """A global batch of 4 windows with unequal learned tokens, padding included."""
    tok_pad = load_sft(sft_dir).meta["tokenizer"]["pad_id"]
    batch = SFTLoader(load_sft(sft_dir), "train", global_batch_size=4, seed=1).next_batch()
    counts = batch[1][:, 1:].sum(axis=1)
    assert len(set(counts.tolist())) > 1 and (batch[0][:, -1] == tok_pad).any()   # unequal rows, padding
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


class MicroSum(ms.nn.Cell):
    """CPU stand-in of MindSpore's ``Pipeline`` / ``GradAccumulation`` network: the rows split into
    ``micro`` micro-batches, the SUM of the model's loss over them."""

    def __init__(self, model, micro):
        super().__init__(auto_prefix=False)
        self.model, self.micro = model, micro

    def construct(self, input_ids, labels):
        rows = input_ids.shape[0] // self.micro
        loss = self.model(input_ids[:rows], labels[:rows])
        for i in range(1, self.micro):
            loss = loss + self.model(input_ids[i * rows:(i + 1) * rows], labels[i * rows:(i + 1) * rows])
        return loss


def _in_graph_micro_batches(tmp_path, stages):
    """Steps wired as :func:`build` wires a semi-auto layout of 4 micro-batches (``stages`` pipeline stages
    or in-graph accumulation): the layout's StepParts and weight factors, the network replaced by MicroSum."""
    world = 8 if stages > 1 else 4
    runtime = Runtime("semi_auto", 0, world, 0, 2, stages, 4)
    one = build(plan_run(_recipe(tmp_path, 4)), masked_loss=True)        # model, optimizer, guard, token weight
    resolved = SimpleNamespace(optimizer_parallel=SimpleNamespace(enabled=False), data=2, scheduler="1f1b",
                               gradient_accumulation=1, micro_batches=4)      # what step_parts reads
    parts = step_parts(one.model, one.optimizer.parameters, resolved, runtime)
    assert parts.micro == 4 and parts.averaged == 1 and parts.eval_micro == (4 if stages > 1 else 1)
    train_f, eval_f = token_weight_factors(parts, 1)
    net = MicroSum(one.model, parts.micro)
    step = TrainStep(net, one.optimizer, one.guard, 0.0, parts.micro, None, MeanOverMicro(parts.micro),
                     one.steps.token_weight)
    step.set_train()
    evaluator = EvalStep(net if stages > 1 else one.model, MeanOverMicro(4) if stages > 1 else None)
    evaluator.set_train(False)
    steps = CompiledSteps(4, 4, one.steps.seq_length, train_step=step, eval_step=evaluator,
                          token_weight=one.steps.token_weight, weight_factor=train_f, eval_weight_factor=eval_f)
    return one, steps


@pytest.mark.parametrize("stages", [2, 1])
def test_in_graph_micro_batches_equal_one_batch(tmp_path, sft_batch, stages):
    """4 micro-batches inside the step (pipeline: stages 2; in-graph accumulation: stages 1) == one batch
    == host accumulation of 4 (the test above), with rows of unequal learned tokens."""
    ms.set_context(mode=ms.GRAPH_MODE)
    ref_built = build(plan_run(_recipe(tmp_path / "ref", 4)), masked_loss=True)
    ref = _reference_loss(ref_built.model, sft_batch)
    res_ref = ref_built.steps.train(sft_batch)
    built, steps = _in_graph_micro_batches(tmp_path / "mb", stages)
    res = steps.train(sft_batch)
    assert res.applied
    assert abs(res.loss - ref) <= 1e-6 * abs(ref)
    assert abs(res.loss - res_ref.loss) <= 1e-6 * abs(ref)
    assert abs(res.grad_norm - res_ref.grad_norm) <= 1e-5 * res_ref.grad_norm
    m_ref, m = _moments(ref_built), _moments(built)
    for name, value in m_ref.items():
        assert np.abs(m[name] - value).max() <= 1e-5 * np.abs(value).max(), name
    assert abs(steps.evaluate(sft_batch) - _reference_loss(built.model, sft_batch)) <= 1e-5
    # a per-micro-batch mean (each micro-batch's NLL over its own learned tokens, then averaged) is another
    # number on these rows: the equalities above could fail
    ids, labels = masked_labels(sft_batch)
    learned = labels >= 0
    nll = TokenNLLNet(built.model)(Tensor(ids), Tensor(np.where(learned, labels, 0).astype(np.int32))).asnumpy()
    per_micro = np.mean([(nll[i] * learned[i]).sum() / learned[i].sum() for i in range(4)])
    assert abs(per_micro - _reference_loss(built.model, sft_batch)) > 1e-3



def test_data_parallel_groups_of_in_graph_micro_batches_sum_to_one_batch(tmp_path, sft_dir, sft_batch):
    """Semi-auto data parallel: each data-parallel group feeds its rows (its loader's share of the global
    batch) to a network summing 2 micro-batches, weighted by the host with 2 / N, N counted by every
    group's loader over the GLOBAL batch; MindSpore's gradient of the logical graph is the sum over the
    groups' contributions (accumulated here in one set of buffers), which equals one batch's gradient.
    With each group's own learned tokens as N it would not."""
    from naohai.train.builder import _masked_split
    from naohai.train.step import AccumulateStep, make_buffers

    ms.set_context(mode=ms.GRAPH_MODE)
    ref = build(plan_run(_recipe(tmp_path / "ref", 4)), masked_loss=True)
    assert ref.steps.train(sft_batch).applied
    beta1 = ref.optimizer.beta1.asnumpy().item()          # Adam's first moment after one step: (1 - beta1) x grad
    g_ref = {m.name[len("adam_m."):]: m.asnumpy() / (1 - beta1) for m in ref.optimizer.moments1}
    one = build(plan_run(_recipe(tmp_path / "dp", 4)), masked_loss=True)
    weights = one.optimizer.parameters
    buffers = make_buffers(weights)
    step = AccumulateStep(MicroSum(one.model, 2), weights, buffers, one.guard, one.steps.token_weight)
    step.set_train()
    groups = [SFTLoader(load_sft(sft_dir), "train", 4, rank=g, world_size=2, seed=1).next_batch() for g in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([g.tokens for g in groups]), sft_batch.tokens)
    own = [int(g.mask[:, 1:].sum()) for g in groups]
    assert groups[0].learned == groups[1].learned == sum(own) and own[0] != own[1]
    scale = float(one.guard.loss_scale.asnumpy())
    for g in groups:
        step(*_masked_split(g, one.steps.token_weight, 2))      # the factor a 2-micro-batch network gets
    assert set(g_ref) == {w.name for w in weights}
    for w, buf in zip(weights, buffers):
        got = buf.asnumpy() / scale / 2                           # TrainStep divides the seed by micro
        want = g_ref[w.name]
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), w.name
