"""The layer loop (naohai.model.stack) in graph mode: the numpy forward, per-layer gradients, names,
initial values; and the MindSpore behaviour it relies on for dropout."""
import dataclasses

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

import model_reference as ref
from naohai.config import ModelConfig
from naohai.model.params import param_shapes
from naohai.model.stack import is_stacked, per_layer_names, stacked_count
from naohai.model.transformer import NaohaiLM
from test_model_lm import VARIANTS, batch

LOOP_VARIANTS = dict(VARIANTS)
# PanGu-alpha's reference order: the final norm right before the query layer
LOOP_VARIANTS["pangu-norm-before-query"] = dict(VARIANTS["pangu"], final_norm="before_query_layer", num_layers=3)
# packed windows: positions and the document mask restart after each EOD (derived once, before the loop)
LOOP_VARIANTS["eod-reset"] = dict(VARIANTS["pengcheng"], num_layers=3, eod_reset=True, eod_reset_positions=True,
                                  eod_id=2)


@pytest.fixture(autouse=True)
def _graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


def per_layer_values(cfg, model):
    """{per-layer name: value} of a model in either form."""
    out = {}
    for p in model.get_parameters():
        names, value = per_layer_names(cfg, p.name), p.asnumpy()
        out.update(zip(names, list(value) if is_stacked(p.name) else [value]))
    return out


def set_per_layer_values(cfg, model, values):
    for p in model.get_parameters():
        names = per_layer_names(cfg, p.name)
        value = np.stack([values[n] for n in names]) if is_stacked(p.name) else values[names[0]]
        p.set_data(Tensor(value.astype(np.float32)))


def test_names_shapes_and_initial_values_are_the_per_layer_models():
    for name in ("pangu", "alibi-gqa", "olmo"):
        cfg = ModelConfig(**VARIANTS[name])
        loop = NaohaiLM(cfg, seed=5, layer_loop=True)
        assert loop.layer_loop and stacked_count(cfg) == cfg.num_layers - (1 if cfg.query_layer else 0)
        listed = {s.name: tuple(s.shape) for s in param_shapes(cfg)}
        got = per_layer_values(cfg, loop)
        assert {n: tuple(v.shape) for n, v in got.items()} == listed
        # one Parameter per weight kind of the looped layers, not one per layer
        params = list(loop.get_parameters())
        stacked = [q for q in params if is_stacked(q.name)]
        assert stacked and len(params) + len(stacked) * (stacked_count(cfg) - 1) == len(listed)
        # the same seed gives the per-layer model's initial values, bit for bit
        want = {p.name: p.asnumpy() for p in NaohaiLM(cfg, seed=5).get_parameters()}
        for n, v in got.items():
            assert np.array_equal(v, want[n]), (name, n)


@pytest.mark.parametrize("name", list(LOOP_VARIANTS))
def test_loop_matches_numpy_forward(name):
    cfg = ModelConfig(**LOOP_VARIANTS[name])
    cfg.validate()
    flat = NaohaiLM(cfg, seed=0)
    p = ref.randomize(flat, np.random.RandomState(1), scale=0.3)
    loop = NaohaiLM(cfg, seed=0, layer_loop=True)
    set_per_layer_values(cfg, loop, p)
    ids, labels = batch(cfg)
    if cfg.eod_reset:
        ids[:, [2, 5]] = cfg.eod_id
    loss = float(loop(Tensor(ids), Tensor(labels)).asnumpy())
    want = ref.lm_loss(p, cfg, ids, labels)
    assert abs(loss - want) <= 1e-5 * max(1.0, abs(want)), (loss, want)
    np.testing.assert_allclose(loop.logits(Tensor(ids)).asnumpy().reshape(-1, cfg.padded_vocab_size),
                               ref.lm_logits(p, cfg, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["pangu", "pengcheng", "eod-reset"])
def test_loop_gradients_equal_the_per_layer_models(name):
    cfg = ModelConfig(**LOOP_VARIANTS[name])
    flat = NaohaiLM(cfg, seed=0)
    p = ref.randomize(flat, np.random.RandomState(1), scale=0.3)
    loop = NaohaiLM(cfg, seed=0, layer_loop=True)
    set_per_layer_values(cfg, loop, p)
    ids, labels = batch(cfg)
    grads = {}
    for model in (flat, loop):
        params = model.trainable_params()
        _, g = ms.value_and_grad(model, None, params)(Tensor(ids), Tensor(labels))
        out = {}
        for prm, gr in zip(params, g):
            names, value = per_layer_names(cfg, prm.name), gr.asnumpy()
            out.update(zip(names, list(value) if is_stacked(prm.name) else [value]))
        grads[model is loop] = out
    assert set(grads[True]) == set(grads[False]) == set(p)
    for n in p:
        np.testing.assert_allclose(grads[True][n], grads[False][n], rtol=1e-5, atol=1e-6, err_msg=n)
    assert any(np.abs(g).max() > 1e-3 for n, g in grads[True].items() if n.startswith("layers.0."))


def test_generation_refuses_the_loop_model():
    cfg = ModelConfig(**VARIANTS["pengcheng"])
    with pytest.raises(ValueError, match="per-layer model"):
        NaohaiLM(cfg, layer_loop=True).step(Tensor(np.zeros((1, 1), np.int32)), Tensor(np.zeros((1, 1), np.int32)),
                                             Tensor(np.zeros((1, 1, 1, 1), np.float32)))


def test_one_layer_query_model_has_nothing_to_loop():
    cfg = dataclasses.replace(ModelConfig(**VARIANTS["pangu"]), num_layers=1)
    assert not NaohaiLM(cfg, layer_loop=True).layer_loop


class _DropLoop(nn.Cell):
    """Two loop iterations of dropout(x * w[i]), the second weighted 10x: from the gradient of w the masks
    of both iterations can be read back."""

    def __init__(self):
        super().__init__()
        self.body = _DropBody()
        self.w = Parameter(Tensor(np.ones((2, 4096), np.float32)), name="w")
        self.count = Tensor(2, ms.int32)

    def construct(self, x):
        i = Tensor(0, ms.int32)
        acc = ops.zeros_like(x)
        while i < self.count:
            acc = acc + self.body(x, self.w, i) * ops.pow(10.0, i.astype(ms.float32))
            i = i + 1
        return acc.sum(), acc


class _DropBody(nn.Cell):
    def __init__(self):
        super().__init__()
        self.drop = ops.Dropout(keep_prob=0.5)

    def construct(self, x, w, i):
        return self.drop(x * ops.gather(w, i, 0))[0]


class _ValueAndGrad(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.grad = ops.GradOperation(get_by_list=True, sens_param=True)
        self.weights = ms.ParameterTuple(net.trainable_params())

    def construct(self, x):
        loss, acc = self.net(x)
        return acc, self.grad(self.net, self.weights)(x, (ops.ones_like(loss), ops.zeros_like(acc)))[0]


def test_dropout_in_a_loop_draws_a_mask_per_iteration_and_its_backward_uses_it():
    acc, grad = _ValueAndGrad(_DropLoop())(Tensor(np.ones(4096, np.float32)))
    acc, grad = acc.asnumpy(), grad.asnumpy()
    first, second = grad[0] / 2.0, grad[1] / 20.0          # d acc / d w[i] = mask_i / keep_prob * 10^i
    assert set(np.unique(first)) == {0.0, 1.0} and set(np.unique(second)) == {0.0, 1.0}
    assert 0.4 < (first != second).mean() < 0.6            # independent masks, not one reused
    np.testing.assert_array_equal(acc, first * 2.0 + second * 20.0)   # the forward used the same masks
