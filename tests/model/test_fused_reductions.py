"""The fused reductions a recipe opts into (``train.cpu_reductions: fused``, naohai/model/cpu_kernels.cc).

References: the float64 NumPy math of LayerNorm and RMSNorm and of their gradients, written from their
definitions (not from the kernels' formulas), and MindSpore's own composed graph, which the fused kernels
must track to float32 accuracy; the attention's softmax and SwiGLU's activation against float64 NumPy from their
definitions; the global norm against NumPy's float64 sum of squares."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

from naohai.config import ModelConfig, load_recipe
from naohai.errors import UserError
from naohai.model import cpu_kernels, layers
from naohai.model.head_loss import ChunkedHeadLoss
from naohai.train.adam_all import AdamWeightDecayAll


def _cfg(norm: str, h: int) -> ModelConfig:
    cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=8, hidden_size=h, num_layers=1, num_heads=2,
                      ffn_hidden_size=48, seq_length=16, norm=norm, compute_dtype="float32")
    cfg.validate()
    return cfg


class _Grad(nn.Cell):
    """(y, dx, gradients of the norm's parameters) of ``norm`` at x for the output gradient dy."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.params = norm.trainable_params()
        self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

    def construct(self, x, dy):
        return self.norm(x), self.grad(self.norm, self.params)(x, dy)


def _norm_and_grads(norm, x, dy):
    y, ((dx,), dparams) = _Grad(norm)(Tensor(x), Tensor(dy))
    return [y.asnumpy(), dx.asnumpy()] + [d.asnumpy() for d in dparams]


def _reference(kind, x, dy, gamma, beta, eps):
    """Float64: y of the norm, and by the chain rule written out over the row (mean and variance as functions
    of every element of the row) dx, dgamma, dbeta."""
    h = x.shape[-1]
    x, dy = x.reshape(-1, h).astype(np.float64), dy.reshape(-1, h).astype(np.float64)
    g64 = gamma.astype(np.float64)
    centered = kind != "rmsnorm"
    mu = x.mean(axis=1, keepdims=True) if centered else np.zeros((x.shape[0], 1))
    var = ((x - mu) ** 2).mean(axis=1, keepdims=True)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mu) * rstd
    y = xhat * g64 + (beta.astype(np.float64) if centered else 0.0)
    dxhat = dy * g64
    # d xhat_j / d x_i = rstd * (delta_ij - [centered] / h - xhat_i xhat_j / h)
    dx = rstd * (dxhat - (dxhat.mean(axis=1, keepdims=True) if centered else 0.0)
                 - xhat * (dxhat * xhat).mean(axis=1, keepdims=True))
    out = [y, dx, (dy * xhat).sum(axis=0)]
    return out + ([dy.sum(axis=0)] if centered else [])


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "nonparam_layernorm"])
@pytest.mark.parametrize("shape", [(2, 7, 40), (3, 128), (1, 1, 16), (4, 33, 512)])
def test_fused_norms_equal_float64_math_and_track_the_composed_graph(kind, shape):
    """Output, input gradient and parameter gradients: within float32 accuracy of the float64 math (widths
    below, at and not a multiple of the kernels' 16 lanes; one row), as close to it as the composed graph,
    and a second call repeats the first bit for bit."""
    ms.set_context(mode=ms.GRAPH_MODE)
    h = shape[-1]
    cfg = _cfg(kind, h)
    rng = np.random.RandomState(h)
    x = (rng.standard_normal(shape) * 3 + rng.uniform(-2, 2, h)).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    with layers.fused_reductions():
        fused = layers.Norm(cfg, rng=np.random.RandomState(1))
    plain = layers.Norm(cfg, rng=np.random.RandomState(1))
    assert fused.fused is not None and plain.fused is None
    gamma, beta = rng.uniform(0.5, 1.5, h).astype(np.float32), rng.uniform(-1, 1, h).astype(np.float32)
    if kind == "nonparam_layernorm":                  # fixed unit gain, zero shift
        gamma, beta = np.ones(h, np.float32), np.zeros(h, np.float32)
    else:
        for norm in (fused, plain):
            norm.gamma.set_data(Tensor(gamma))
            if norm.beta is not None:
                norm.beta.set_data(Tensor(beta))
    got = _norm_and_grads(fused, x, dy)
    composed = _norm_and_grads(plain, x, dy)
    want = _reference(kind, x, dy, gamma, beta, cfg.norm_eps)
    n_params = 0 if kind == "nonparam_layernorm" else (1 if kind == "rmsnorm" else 2)
    assert len(got) == len(composed) == 2 + n_params
    for name, a, c, r in zip(["y", "dx", "dgamma", "dbeta"], got, composed, want):
        r = r.reshape(a.shape)
        scale = np.abs(r).max() + 1e-30
        tol = 2e-6 if name in ("y", "dx") else 1e-5                # parameter gradients: sums over rows
        err, err_composed = np.abs(a - r).max() / scale, np.abs(c - r).max() / scale
        assert err < tol, (name, err)
        assert err_composed < tol, (name, err_composed)       # the reference agrees with MindSpore's own graph
    again = _norm_and_grads(fused, x, dy)
    for a, b in zip(got, again):
        assert a.tobytes() == b.tobytes()


def test_square_sums_equal_float64_and_repeat():
    """All the gradients' sums of squares by one kernel: each in float64 lanes, so within a float32 rounding of
    NumPy's float64 sum whatever the lengths (the lanes' remainder, one element, ReduceSum's threaded sizes), and
    added in input order as AddN adds."""
    ms.set_context(mode=ms.GRAPH_MODE)
    prims = cpu_kernels.primitives()
    assert prims is not None, cpu_kernels.why_not()

    class _Apply(nn.Cell):
        def __init__(self):
            super().__init__()
            self.sums = prims["square_sums"]

        def construct(self, *grads):
            return self.sums(*grads)

    apply = _Apply()
    rng = np.random.RandomState(0)
    shapes = [(1,), (15,), (17,), (3, 5, 7), (512, 513), (262147,)]
    grads = [(rng.standard_normal(shape) * rng.uniform(1e-4, 10)).astype(np.float32) for shape in shapes]
    got = apply(*[Tensor(g) for g in grads]).asnumpy()
    assert got.shape == (1,) and got.dtype == np.float32
    per = [float(np.sum(g.astype(np.float64) ** 2)) for g in grads]
    assert abs(float(got[0]) - sum(per)) <= 1e-6 * sum(per)
    in_order = np.float32(per[0])
    for p in per[1:]:
        in_order = np.float32(in_order + np.float32(p))
    assert abs(float(got[0]) - float(in_order)) <= 2.4e-7 * sum(per)
    again = apply(*[Tensor(g) for g in grads])
    assert again.asnumpy().tobytes() == got.tobytes()


def test_attention_softmax_and_silu_product_equal_float64_forward_and_backward():
    """The attention's softmax(x * scale + bias) and SwiGLU's (g * sigmoid(g)) * u by the fused kernels, against
    NumPy's float64 math from the definitions: blocked scores (bias -1e9) are exactly 0, sigmoid saturates
    (g = +-100, -88), a per-sequence bias broadcast over heads; forward and backward to float32 accuracy."""
    ms.set_context(mode=ms.GRAPH_MODE)
    assert layers.prepare_broadcast()
    with layers.fused_reductions():
        softmax = layers._fused_cell(layers._FusedSoftmax, "scaled_softmax")
        glu = layers._fused_cell(layers._FusedSiluProduct, "silu_product")
    assert softmax is not None and glu is not None
    rng = np.random.RandomState(1)
    grad = ops.GradOperation(get_all=True, sens_param=True)
    for bias_shape in [(1, 5, 37), (2, 1, 5, 37)]:
        x = (rng.standard_normal((2, 3, 5, 37)) * 6).astype(np.float32)
        bias = np.where(rng.uniform(size=bias_shape) < 0.4, -1e9, rng.standard_normal(bias_shape)).astype(np.float32)
        bias[..., 0] = 0.0                                   # every row sees one position
        scale = Tensor(0.125, ms.float32)
        y = softmax(Tensor(x), Tensor(bias), scale).asnumpy()
        z = x.astype(np.float64) * 0.125 + bias
        e = np.exp(z - z.max(-1, keepdims=True))
        ref = e / e.sum(-1, keepdims=True)
        assert np.abs(y - ref).max() < 3e-7
        assert (y[np.broadcast_to(bias, y.shape) == -1e9] == 0).all()
        dy = rng.standard_normal(x.shape).astype(np.float32)
        dx = grad(softmax)(Tensor(x), Tensor(bias), scale, Tensor(dy))[0].asnumpy()
        want = (ref * dy - ref * (ref * dy).sum(-1, keepdims=True)) * 0.125
        assert np.abs(dx - want).max() < 2e-6 * np.abs(want).max()
    g = (rng.standard_normal((64, 50)) * 5).astype(np.float32)
    g[0, :4] = [-100, 100, -88, 0]
    u, dy = (rng.standard_normal((64, 50)).astype(np.float32) for _ in range(2))
    out = glu(Tensor(g), Tensor(u)).asnumpy()
    g64 = g.astype(np.float64)
    s = 1 / (1 + np.exp(-g64))
    dg, du = grad(glu)(Tensor(g), Tensor(u), Tensor(dy))
    for got, want in [(out, g64 * s * u), (du.asnumpy(), dy * g64 * s), (dg.asnumpy(), dy * u * (s + g64 * s * (1 - s)))]:
        assert np.abs(got - want).max() < 4e-7 * np.abs(want).max()   # (dg's terms cancel near g = -1.28)


def test_cross_entropy_kernel_equals_float64_nll_and_gradient():
    """The head's cross entropy by one kernel (``softmax_cross_entropy``): each row's NLL and the gradient
    w_i * (softmax - onehot) of sum_i w_i * nll_i against NumPy's float64 math, for one weight for every row (the
    mean) and one per row (a mask); rows whose logits span 200 (their small probabilities underflow to 0), a label
    at either end of the vocabulary; a label outside it is refused, not read."""
    ms.set_context(mode=ms.GRAPH_MODE)
    prims = cpu_kernels.primitives()
    assert prims is not None, cpu_kernels.why_not()

    class _Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = prims["softmax_cross_entropy"]

        def construct(self, x, labels, w):
            return self.op(x, labels, w)

    loss = _Loss()
    rng = np.random.RandomState(2)
    rows, vocab = 37, 1000
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    x[3] = np.linspace(-100, 100, vocab, dtype=np.float32)
    labels = rng.randint(0, vocab, rows).astype(np.int32)
    labels[:2] = [0, vocab - 1]
    for w in (np.array([1.0 / rows], np.float32), (rng.uniform(size=rows) * (rng.uniform(size=rows) < 0.7)).astype(np.float32)):
        nll, g = (t.asnumpy() for t in loss(Tensor(x), Tensor(labels), Tensor(w)))
        z = x.astype(np.float64)
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        want_nll = lse - z[np.arange(rows), labels]
        p = np.exp(z - lse[:, None])
        onehot = np.zeros_like(p)
        onehot[np.arange(rows), labels] = 1
        want_g = np.broadcast_to(w.astype(np.float64), (rows,))[:, None] * (p - onehot)
        assert nll.shape == (rows,) and g.shape == (rows, vocab)
        assert np.abs(nll - want_nll).max() < 2e-6 * max(1.0, np.abs(want_nll).max())
        assert np.abs(g - want_g).max() < 1e-6 * np.abs(want_g).max()      # p_y near 1: w * p - w cancels
        assert (g[3, :400] == 0).all()                       # exp below -87.3 is 0, as it underflows
    labels[5] = vocab
    with pytest.raises(RuntimeError):
        loss(Tensor(x), Tensor(labels), Tensor(np.array([1.0], np.float32)))


def test_adam_all_updates_every_parameter_in_place_as_adam_weight_decay_does():
    """AdamWeightDecayAll (one kernel for every parameter, written in place) against MindSpore's AdamWeightDecay
    with the same decay groups and learning-rate table over five steps: the parameters and both moments agree to
    the last bits (MindSpore's kernel rounds some moments' elements differently), both against NumPy's float64
    form of the update.  The fused optimizer gets the clip's factor (MindSpore's gets the gradients times it, as
    the composed step's clip gives them) and the guard's decision: a skipped step changes nothing, not even the
    step counter, so the step after it reads the same learning rate as MindSpore's next step."""
    ms.set_context(mode=ms.GRAPH_MODE)
    assert layers.prepare_broadcast()
    kernels = layers.fused_gradient_kernels()
    rng = np.random.RandomState(3)
    shapes = [(400, 300), (32,), (17,), (5, 7, 3)]           # the first large enough to be split over threads
    start = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    table = Tensor(np.array([3e-3, 2e-3, 1e-3, 5e-4, 1e-4, 5e-5], np.float32))

    def make(cls, *extra):
        params = [ms.Parameter(Tensor(v.copy()), name=f"{cls.__name__}{i}") for i, v in enumerate(start)]
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
        return params, cls(groups, *extra, learning_rate=table, beta1=0.9, beta2=0.95, eps=1e-8)

    class _Update(nn.Cell):
        def __init__(self, opt):
            super().__init__()
            self.opt = opt

        def construct(self, *args):
            return self.opt(*args)

    (ref_params, ref), (params, fused) = make(nn.AdamWeightDecay), make(AdamWeightDecayAll, kernels.adam_all)
    m = [np.zeros(s) for s in shapes]
    v = [np.zeros(s) for s in shapes]
    p = [a.astype(np.float64) for a in start]
    lr_step = 0
    for step, (scale, applied) in enumerate([(1.0, True), (0.37, True), (0.5, False), (0.21, True), (1.0, True)]):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        before = [t.asnumpy().copy() for t in params + list(fused.moments1) + list(fused.moments2)]
        _Update(fused)(tuple(Tensor(g) for g in grads), Tensor([scale], ms.float32), Tensor(applied))
        if not applied:
            after = [t.asnumpy() for t in params + list(fused.moments1) + list(fused.moments2)]
            assert all(np.array_equal(a, b) for a, b in zip(before, after))
            assert int(fused.global_step.asnumpy()[0]) == lr_step
            continue
        scaled = [g * np.float32(scale) for g in grads]                   # float32 products, as the clip's
        _Update(ref)(tuple(Tensor(g) for g in scaled))
        lr = float(table.asnumpy()[lr_step])
        lr_step += 1
        for i, g in enumerate(scaled):
            g = g.astype(np.float64)
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.95 * v[i] + 0.05 * g * g
            p[i] = p[i] - lr * (m[i] / (np.sqrt(v[i]) + 1e-8) + (0.1 if i < 2 else 0.0) * p[i])
    assert int(fused.global_step.asnumpy()[0]) == int(ref.global_step.asnumpy()[0]) == 4
    for i in range(len(shapes)):
        for got, want, exact in [(params[i], ref_params[i], p[i]), (fused.moments1[i], ref.moments1[i], m[i]),
                                 (fused.moments2[i], ref.moments2[i], v[i])]:
            got, want = got.asnumpy(), want.asnumpy()
            np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-7)       # a few ulp apart
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=2e-7)
            np.testing.assert_allclose(want, exact, rtol=1e-5, atol=2e-7)
    assert not np.array_equal(params[0].asnumpy(), start[0])


def _micro(*over):
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    return load_recipe(str(root / "recipes/tiny.yaml"),
                       ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=2", "model.ffn_hidden_size=96",
                        "model.seq_length=32", "train.global_batch_size=4", "train.micro_batch_size=4",
                        "train.warmup_steps=0", "train.grad_clip=0.05", *over])


@pytest.mark.parametrize("micro", [4, 2])
def test_a_recipe_opting_in_trains_as_the_composed_graph_does(micro):
    """``train.cpu_reductions: fused`` through the builder (one step, and host accumulation of two
    micro-batches): the norms are the fused cells, the note says so, and six steps with the clip acting on
    every one give the losses and gradient norms of the default build to float32 accuracy, and weights to 1e-5
    (Adam moves a weight whose gradient is near 0 by up to lr either way: 3 embedding rows of 131,072 moved 2.7e-6)."""
    from naohai.strategy.run_plan import plan_run
    from naohai.train.builder import build
    ms.set_context(mode=ms.GRAPH_MODE)
    tokens = [np.random.RandomState(0).randint(0, 2048, (4, 33)).astype(np.int32)] * 6      # one batch, six times
    results = {}
    for mode in ("mindspore", "fused"):
        built = build(plan_run(_micro(f"train.micro_batch_size={micro}", f"train.cpu_reductions={mode}")))
        norms = [c for _, c in built.model.cells_and_names() if isinstance(c, layers.Norm)]
        assert norms and all((c.fused is not None) == (mode == "fused") for c in norms)
        fused_note = [n for n in built.steps.notes if "cpu_reductions" in n]
        assert fused_note == (["norms, attention softmax, SwiGLU activation, cross entropy, global gradient norm, "
                               "clip and AdamW update by naohai's fused kernels (train.cpu_reductions)"]
                              if mode == "fused" else [])
        assert isinstance(built.optimizer, AdamWeightDecayAll) == (mode == "fused")
        heads = [c for _, c in built.model.cells_and_names() if isinstance(c, ChunkedHeadLoss)]
        assert heads and all((c.fused is not None) == (mode == "fused") for c in heads)
        rows = []
        for t in tokens:
            r = built.steps.train(Tensor(t))
            assert r.applied
            rows.append((r.loss, r.grad_norm))
        results[mode] = rows, {p.name: p.asnumpy() for p in built.model.trainable_params()}
    (plain, plain_w), (fused, fused_w) = results["mindspore"], results["fused"]
    assert min(n for _, n in plain) > 0.05                        # the clip acts on every step
    for (l0, n0), (l1, n1) in zip(plain, fused):
        assert l1 == pytest.approx(l0, rel=2e-6) and n1 == pytest.approx(n0, rel=1e-5)
    assert plain[-1][0] < plain[0][0]
    for name, w in plain_w.items():
        np.testing.assert_allclose(fused_w[name], w, rtol=1e-5, atol=1e-5, err_msg=name)   # lr 3e-3: Adam


def test_the_key_is_checked_and_where_fused_cannot_apply_the_note_says_why(monkeypatch):
    with pytest.raises(UserError) as e:
        _micro("train.cpu_reductions=fast")
    assert "train.cpu_reductions" in str(e.value) and "'fast' is not one of mindspore, fused" in str(e.value)
    from naohai.train import builder
    params = [ms.Parameter(Tensor(np.ones(3, np.float32)), name="w")]
    assert builder.cpu_reductions("mindspore", params) == (None, None)
    monkeypatch.setattr(builder, "fused_gradient_kernels", lambda: None)
    monkeypatch.setattr(cpu_kernels, "why_not", lambda: "NAOHAI_CPU_KERNELS=0")
    kernel, note = builder.cpu_reductions("fused", params)
    assert kernel is None and note == ("train.cpu_reductions is 'fused' but naohai's compiled CPU kernels are not "
                                       "in use (NAOHAI_CPU_KERNELS=0): MindSpore's ops sum, as with 'mindspore'")
    monkeypatch.setattr(builder, "fused_gradient_kernels", lambda: "kernel")
    half = [ms.Parameter(Tensor(np.ones(3, np.float16)), name="h")]
    assert builder.cpu_reductions("fused", half) == (
        None, "train.cpu_reductions is 'fused' but its kernels take float32 parameters only: MindSpore's ops "
              "sum, as with 'mindspore'")
    assert builder.cpu_reductions("fused", params)[0] == "kernel"
