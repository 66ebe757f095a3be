"""The CPU train form of head + loss (:mod:`naohai.model.head_loss`) against float64 numpy and against
MindSpore's own autodiff of the composed form (``Head`` + ``CrossEntropy``), in blocks of uneven size."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

import naohai.model.head_loss as head_loss
from naohai.config import ModelConfig
from naohai.model.finetune import apply_finetune
from naohai.model.transformer import CrossEntropy, NaohaiLM

ROWS, HIDDEN, VOCAB = 10, 8, 24
FORMS = ["mean", "pad", "masked"]


@pytest.fixture
def three_blocks(monkeypatch):
    """10 rows of 24 logits (960 bytes) in blocks of at most 400 bytes: rows 0-3, 4-7, 8-9."""
    monkeypatch.setattr(head_loss, "BLOCK_BYTES", 400)
    assert head_loss.block_rows(ROWS, VOCAB) == 4


def _cfg(form):
    cfg = ModelConfig(vocab_size=VOCAB, vocab_pad_multiple=8, hidden_size=HIDDEN, num_layers=1, num_heads=2,
                      ffn_hidden_size=8, seq_length=ROWS, loss_pad_id=3 if form == "pad" else None)
    cfg.validate()
    return cfg


def _data(form):
    rng = np.random.RandomState(0)
    x = rng.normal(0, 1, (ROWS, HIDDEN)).astype(np.float32)
    w = rng.normal(0, 1, (VOCAB, HIDDEN)).astype(np.float32)
    labels = rng.randint(0, VOCAB, (ROWS,)).astype(np.int32)
    ids = rng.randint(0, VOCAB, (ROWS,)).astype(np.int32)
    ids[[1, 5, 9]] = 3                      # the pad id: those predictions leave the pad form's loss
    if form == "masked":
        labels[[0, 4, 5]] = -100            # not learned
    return x, w, labels, ids


def numpy_loss_and_grads(form, x, w, labels, ids):
    """float64: loss, d loss / d x, d loss / d w, from the composed form's definition."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    logits = x @ w.T
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    target = np.maximum(labels, 0)
    nll = -logp[np.arange(ROWS), target]
    if form == "mean":
        coef = np.full(ROWS, 1.0 / ROWS)
    elif form == "pad":
        mask = (ids != 3).astype(np.float64)
        coef = mask / (mask.sum() + 1e-5)
    else:
        coef = (labels >= 0).astype(np.float64)
    onehot = np.zeros_like(logits)
    onehot[np.arange(ROWS), target] = 1.0
    dlogits = coef[:, None] * (np.exp(logp) - onehot)
    return float((coef * nll).sum()), dlogits @ w, dlogits.T @ x


class Composed(nn.Cell):
    """MatMul(transpose_b) + CrossEntropy: what the model runs outside CPU training."""

    def __init__(self, cfg, masked):
        super().__init__()
        self.loss = CrossEntropy(cfg, masked=masked)
        self.logits = ms.ops.MatMul(transpose_b=True)

    def construct(self, x, w, labels, ids):
        return self.loss(self.logits(x, w), labels, ids)


class Chunked(nn.Cell):
    def __init__(self, cfg, masked, scale):
        super().__init__()
        self.loss = head_loss.ChunkedHeadLoss(cfg, masked=masked)
        self.scale = scale

    def construct(self, x, w, labels, ids):
        loss, _, _ = self.loss(x, w, labels, ids)
        return loss * self.scale


@pytest.mark.parametrize("mode", [ms.PYNATIVE_MODE, ms.GRAPH_MODE])
@pytest.mark.parametrize("form", FORMS)
def test_loss_and_gradients(three_blocks, form, mode):
    ms.set_context(mode=mode)
    cfg = _cfg(form)
    x, w, labels, ids = _data(form)
    args = (Tensor(x), Tensor(w), Tensor(labels), Tensor(ids))
    scale = 2.5                                 # an incoming gradient other than 1 reaches dx and dw
    loss, (dx, dw) = ms.value_and_grad(Chunked(cfg, form == "masked", scale), grad_position=(0, 1))(*args)
    want, want_dx, want_dw = numpy_loss_and_grads(form, x, w, labels, ids)
    np.testing.assert_allclose(float(loss.asnumpy()), scale * want, rtol=1e-6)
    np.testing.assert_allclose(dx.asnumpy(), scale * want_dx, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(dw.asnumpy(), scale * want_dw, rtol=1e-5, atol=2e-6)

    c_loss, (c_dx, c_dw) = ms.value_and_grad(Composed(cfg, form == "masked"), grad_position=(0, 1))(*args)
    assert float(loss.asnumpy()) == pytest.approx(scale * float(c_loss.asnumpy()), rel=1e-7)
    np.testing.assert_allclose(dx.asnumpy(), scale * c_dx.asnumpy(), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw.asnumpy(), scale * c_dw.asnumpy(), rtol=1e-6, atol=1e-8)


def test_block_rows():
    assert head_loss.block_rows(2048, 2048) == 2048            # 16 MiB of logits: one block
    assert head_loss.block_rows(2048, 32000) == 512            # 250 MiB: four
    assert head_loss.block_rows(7, 10 ** 9) == 1               # never less than a row


@pytest.mark.parametrize("form,tied", [("mean", True), ("pad", True), ("masked", True), ("mean", False)])
def test_model_in_training_mode_matches_composed(three_blocks, form, tied):
    """The model trains through the chunked form on CPU (training mode) with the composed form's loss and
    gradients (the head's own weight when untied); in inference mode it runs the composed form."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = ModelConfig(vocab_size=VOCAB, vocab_pad_multiple=8, hidden_size=8, num_layers=2, num_heads=2,
                      ffn_hidden_size=12, seq_length=5, loss_pad_id=3 if form == "pad" else None,
                      tie_embeddings=tied)
    cfg.validate()
    model = NaohaiLM(cfg, seed=0, masked_loss=form == "masked")
    assert model.fuse_head_loss
    rng = np.random.RandomState(1)
    ids = rng.randint(0, VOCAB, (2, 5)).astype(np.int32)
    labels = rng.randint(0, VOCAB, (2, 5)).astype(np.int32)
    if form == "masked":
        labels[0, :2] = -100
    params = model.trainable_params()
    assert ("head.weight" in [p.name for p in params]) is not tied
    results = {}
    for training in (True, False):
        model.set_train(training)
        loss, grads = ms.value_and_grad(model, None, params)(Tensor(ids), Tensor(labels))
        results[training] = (float(loss.asnumpy()), [g.asnumpy() for g in grads])
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-7)
    for p, a, b in zip(params, results[True][1], results[False][1]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=p.name)


def test_frozen_head_skips_the_weight_gradient(three_blocks):
    """Fine-tuning freezes the head: the chunked form then computes dx alone (dw zeros), the same dx."""
    from naohai.config import FinetuneConfig
    ms.set_context(mode=ms.GRAPH_MODE)
    cfg = _cfg("mean")
    model = NaohaiLM(cfg, seed=0)
    apply_finetune(model, FinetuneConfig(method="lora", rank=2, alpha=4, targets=r"attention\.q$"), seed=0)
    assert model.fuse_head_loss and not model.chunked_loss.weight_grad
    x, w, labels, ids = _data("mean")
    args = (Tensor(x), Tensor(w), Tensor(labels), Tensor(ids))
    frozen = Chunked(cfg, False, 1.0)
    frozen.loss.weight_grad = False
    _, (dx, dw) = ms.value_and_grad(frozen, grad_position=(0, 1))(*args)
    _, want_dx, _ = numpy_loss_and_grads("mean", x, w, labels, ids)
    np.testing.assert_allclose(dx.asnumpy(), want_dx, rtol=1e-5, atol=1e-7)
    assert not dw.asnumpy().any()
