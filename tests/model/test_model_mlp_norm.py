"""MLP (SwiGLU, GeLU, FastGeLU) and norms (LayerNorm, RMSNorm, non-parametric) against numpy."""
import dataclasses

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

import model_reference as ref
from naohai.config import ModelConfig
from naohai.model.layers import MLP, Norm

BASE = ModelConfig(vocab_size=64, vocab_pad_multiple=8, hidden_size=16, num_layers=2, num_heads=4,
                   ffn_hidden_size=24, seq_length=8, position="rope", activation="swiglu",
                   norm="layernorm", bias=True, compute_dtype="float32")


def cfg_of(**kw):
    cfg = dataclasses.replace(BASE, **kw)
    cfg.validate()
    return cfg


def prefixed(p, prefix):
    return {f"{prefix}.{k}": v for k, v in p.items()}


# ------------------------------------------------------------------------------ MLP
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "fast_gelu"])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_matches_numpy(activation, bias):
    cfg = cfg_of(activation=activation, bias=bias)
    cell = MLP(cfg, np.random.RandomState(0))
    # weights large enough that the pre-activations span about [-5, 5], where GeLU variants differ
    p = ref.randomize(cell, np.random.RandomState(1), scale=0.5)
    names = set(p)
    assert ("gate_weight" in names) == (activation == "swiglu")
    assert ("up_bias" in names) == bias
    x = np.random.RandomState(2).standard_normal((12, cfg.hidden_size)).astype(np.float32)
    got = cell(Tensor(x)).asnumpy()
    want = ref.mlp(x.astype(np.float64), prefixed(p, "m"), "m", cfg)
    assert got.dtype == np.float32 and got.shape == (12, cfg.hidden_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5)


def test_swiglu_is_silu_gate_times_up():
    # with down = identity-like probe: compare the hidden product directly via a 1-wide down projection
    cfg = cfg_of(activation="swiglu", hidden_size=4, ffn_hidden_size=4, num_heads=2)
    cell = MLP(cfg, np.random.RandomState(0))
    p = ref.randomize(cell, np.random.RandomState(3), scale=0.8)
    cell.down_weight.set_data(Tensor(np.eye(4, dtype=np.float32)))
    cell.down_bias.set_data(Tensor(np.zeros(4, np.float32)))
    x = np.random.RandomState(4).standard_normal((5, 4))
    gate = x @ p["gate_weight"].T + p["gate_bias"]
    up = x @ p["up_weight"].T + p["up_bias"]
    got = cell(Tensor(x.astype(np.float32))).asnumpy()
    np.testing.assert_allclose(got, gate / (1 + np.exp(-gate)) * up, rtol=1e-5, atol=1e-6)
    # gate and up are not interchangeable
    assert np.abs(got - up / (1 + np.exp(-up)) * gate).max() > 1e-3


def test_gelu_activation_is_exact_erf_gelu():
    # "gelu" means the exact GeLU x * Phi(x); the tanh approximation differs by up to ~5e-4 on [-4, 4]
    cfg = cfg_of(activation="gelu")
    cell = MLP(cfg, np.random.RandomState(0))
    x = np.linspace(-4, 4, 161)
    got = cell.activation(Tensor(x.astype(np.float32))).asnumpy()
    np.testing.assert_allclose(got, ref.gelu_exact(x), rtol=0, atol=2e-6)


def test_fast_gelu_formula():
    cfg = cfg_of(activation="fast_gelu")
    cell = MLP(cfg, np.random.RandomState(0))
    x = np.linspace(-8, 8, 321)
    got = cell.act(Tensor(x.astype(np.float32))).asnumpy()
    np.testing.assert_allclose(got, ref.fast_gelu(x), rtol=1e-5, atol=1e-6)
    # the formula is x * sigmoid(1.702 x), visibly different from exact GeLU
    np.testing.assert_allclose(ref.fast_gelu(x), x / (1 + np.exp(-1.702 * x)), rtol=1e-12, atol=1e-12)
    assert np.abs(ref.fast_gelu(x) - ref.gelu_exact(x)).max() > 1e-2


def test_mlp_float16_compute_close_to_numpy():
    cfg = cfg_of(activation="swiglu", compute_dtype="float16")
    cell = MLP(cfg, np.random.RandomState(0))
    p = ref.randomize(cell, np.random.RandomState(1), scale=0.3)
    x = np.random.RandomState(2).standard_normal((8, 16)).astype(np.float32)
    got = cell(Tensor(x)).asnumpy()
    assert got.dtype == np.float32          # back to the float32 residual stream
    want = ref.mlp(x.astype(np.float64), prefixed(p, "m"), "m", cfg)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


# ------------------------------------------------------------------------------ norms
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "nonparam_layernorm"])
@pytest.mark.parametrize("eps", [1e-5, 0.5])
def test_norm_matches_numpy(kind, eps):
    cfg = cfg_of(norm=kind, norm_eps=eps)
    cell = Norm(cfg)
    p = ref.randomize(cell, np.random.RandomState(0))
    expected = {"layernorm": {"gamma", "beta"}, "rmsnorm": {"gamma"}, "nonparam_layernorm": set()}[kind]
    assert set(p) == expected
    rng = np.random.RandomState(1)
    # rows with different scales and offsets, some of small variance so that eps matters
    x = (rng.standard_normal((6, 16)) * np.array([[0.1], [0.5], [1], [2], [5], [0.3]])
         + np.array([[0], [1], [-2], [0.5], [3], [0]])).astype(np.float32)
    got = cell(Tensor(x)).asnumpy()
    want = ref.norm(kind, x.astype(np.float64), prefixed(p, "n"), "n", eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_rmsnorm_does_not_centre():
    cfg = cfg_of(norm="rmsnorm")
    x = (np.random.RandomState(0).standard_normal((3, 16)) + 4).astype(np.float32)
    got = Norm(cfg)(Tensor(x)).asnumpy()
    assert np.all(got.mean(-1) > 0.9)                 # a layernorm would give mean 0
    np.testing.assert_allclose((got ** 2).mean(-1), np.ones(3), rtol=1e-3)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "nonparam_layernorm"])
def test_norm_runs_in_float32_for_float16_input(kind):
    cfg = cfg_of(norm=kind, compute_dtype="float16", norm_fp32=True)
    cell = Norm(cfg)
    p = ref.randomize(cell, np.random.RandomState(0))
    rng = np.random.RandomState(1)
    # |x| ~ 300: x^2 (~1e5) overflows float16 (max 65504); a float16 norm would produce inf/0/nan
    x16 = (300 + 200 * rng.standard_normal((4, 16))).astype(np.float16)
    got = cell(Tensor(x16)).asnumpy()
    assert got.dtype == np.float16                    # cast back to the input dtype
    assert np.all(np.isfinite(got))
    want = ref.norm(kind, x16.astype(np.float64), prefixed(p, "n"), "n", cfg.norm_eps)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=4e-3)
    # the float16 arithmetic the fp32 path avoids really does overflow
    with np.errstate(over="ignore"):
        assert not np.isfinite((x16 * x16).mean(-1, dtype=np.float16)).all()


@pytest.mark.parametrize("kind", ["layernorm", "nonparam_layernorm"])
def test_cpu_layernorm_equals_mindspores_fused_op_forward_and_backward(kind):
    """On the CPU backend the LayerNorms are composite (row means as MatMuls); MindSpore's own fused
    LayerNorm and LayerNormGrad are the reference for the output and the x, gamma and beta gradients."""
    from mindspore import nn, ops
    cfg = cfg_of(norm=kind, norm_eps=1e-5)
    cell = Norm(cfg)
    assert cell.composite and isinstance(cell.primitive(), ops.LayerNorm)   # the strategy's op still exists
    ref.randomize(cell, np.random.RandomState(0))
    rng = np.random.RandomState(1)
    x = (rng.standard_normal((2, 5, 16)) * 3 + 1).astype(np.float32)       # [b, s, h]: any leading shape
    w = rng.standard_normal((2, 5, 16)).astype(np.float32)

    class Fused(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)

        def construct(self, x, gamma, beta):
            return self.op(x, gamma, beta)[0]

    gamma = cell.gamma.asnumpy() if kind == "layernorm" else np.ones(16, np.float32)
    beta = cell.beta.asnumpy() if kind == "layernorm" else np.zeros(16, np.float32)
    fused = Fused()
    np.testing.assert_allclose(cell(Tensor(x)).asnumpy(), fused(Tensor(x), Tensor(gamma), Tensor(beta)).asnumpy(),
                               rtol=1e-5, atol=1e-5)
    weights = cell.trainable_params()
    assert len(weights) == (2 if kind == "layernorm" else 0)
    dx, dparams = ops.grad(lambda x: (cell(x) * Tensor(w)).sum(), grad_position=0, weights=weights)(Tensor(x)) \
        if weights else (ops.grad(lambda x: (cell(x) * Tensor(w)).sum())(Tensor(x)), ())
    want = ops.grad(lambda x, g, b: (fused(x, g, b) * Tensor(w)).sum(), grad_position=(0, 1, 2))(
        Tensor(x), Tensor(gamma), Tensor(beta))
    for g, r in zip((dx,) + tuple(dparams), want):
        np.testing.assert_allclose(g.asnumpy(), r.asnumpy(), rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ explicit broadcasts (CPU)
@pytest.mark.parametrize("make", ["mlp", "rmsnorm", "attention"])
def test_cpu_explicit_broadcasts_equal_mindspores_broadcasting_ops(make):
    """On the CPU backend the cells broadcast a bias / norm statistic / RoPE table / attention bias to
    the full shape before the elementwise op (``layers.full``: MindSpore's CPU broadcasting kernel keeps
    16 bytes of index per output element).  MindSpore's own broadcasting ops (``full = False``) are the
    reference: outputs and the gradients of every input and parameter agree."""
    from mindspore import ops
    from naohai.model.layers import Attention, cpu_backend
    assert cpu_backend()
    rng = np.random.RandomState(0)
    if make == "mlp":
        cell = MLP(cfg_of(activation="swiglu"), np.random.RandomState(1))
        x = rng.standard_normal((12, 16)).astype(np.float32)
    elif make == "rmsnorm":
        cell = Norm(cfg_of(norm="rmsnorm"))
        x = rng.standard_normal((12, 16)).astype(np.float32)
    else:
        cell = Attention(cfg_of(), np.random.RandomState(1))
        x = rng.standard_normal((2 * 8, 16)).astype(np.float32)
    assert cell.full
    w = Tensor(rng.standard_normal(cell(Tensor(x)).shape).astype(np.float32))
    params = cell.trainable_params()

    def run():
        fn = ops.value_and_grad(lambda t: (cell(t) * w).sum(), grad_position=0, weights=params)
        value, (gx, gw) = fn(Tensor(x))
        return [value.asnumpy(), gx.asnumpy()] + [g.asnumpy() for g in gw]
    got = run()
    cell.full = False
    want = run()
    assert len(got) == len(want) == 2 + len(params) and len(params) > 0
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------ full: Tile forward, BroadcastTo's backward
@pytest.mark.parametrize("operand, like", [((64, 1), (64, 48)),            # a norm's row statistic
                                           ((48,), (64, 48)),              # gamma, a bias
                                           ((1, 1, 8, 8), (2, 4, 8, 8)),   # the attention bias
                                           ((8, 6), (2, 3, 8, 6))])        # RoPE's tables
def test_full_is_broadcast_to_bit_for_bit_in_graph_mode_forward_and_backward(operand, like):
    """``layers.full`` (on) tiles its operand and differentiates as MindSpore's own ``BroadcastTo`` does; the
    reference is ``ops.broadcast_to``, compiled the same way: output and both gradients equal exactly, so that
    the train step's losses stay those of the BroadcastTo form (measured: the first 20 losses of the tiny, 27m
    and 42m bench models bit-identical).  ``Tile``'s own derived backward reduces in another order; ``repeat``
    (the copy for code that is not differentiated) equals it too."""
    from mindspore import ops
    from naohai.model.layers import full, repeat
    rng = np.random.RandomState(3)
    b = Tensor(rng.standard_normal(operand).astype(np.float32) * rng.uniform(0.1, 10, operand[-1]).astype(np.float32))
    x = Tensor(rng.standard_normal(like).astype(np.float32))
    w = Tensor(rng.standard_normal(like).astype(np.float32))

    def tiled(b, x):
        return (x * full(b, x, True) * w).sum()

    def broadcast(b, x):
        return (x * ops.broadcast_to(b, x.shape) * w).sum()

    got = ms.jit(ops.value_and_grad(tiled, grad_position=(0, 1)))(b, x)
    want = ms.jit(ops.value_and_grad(broadcast, grad_position=(0, 1)))(b, x)
    for a, r in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert a.shape == r.shape
        np.testing.assert_array_equal(a.asnumpy(), r.asnumpy())
    np.testing.assert_array_equal(ms.jit(repeat)(b, x).asnumpy(), np.broadcast_to(b.asnumpy(), like))
