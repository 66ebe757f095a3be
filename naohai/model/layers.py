"""Building blocks of the decoder: norms, position encodings, attention, MLP, embedding.

Every operation a strategy may shard is a MindSpore Primitive held by its cell
and listed by ``shardable_ops()`` under the name the model description
(:mod:`naohai.model.spec`) gives it; the cells create their parameters from
that description's lists (names, shapes, initialisers).  These cells contain no parallel logic:
sharding, stages and recompute are applied from outside by
``naohai/strategy/annotate.py``.

Activations between blocks are 2-D ``[tokens, hidden]`` in float32 (the
residual stream); matrix multiplications run in ``compute_dtype``; softmax and
norms run in float32 when the config says so.  Parameters are float32 master
weights, initialised from a numpy RandomState so that initialisation is exact
and independent of MindSpore's RNG.

On MindSpore's CPU backend two blocks compute the same math in another form,
because 2.10's CPU kernels for them are slow (:func:`cpu_backend`): LayerNorm
from elementwise ops with MatMul row means, and attention's softmax backward with
MatMul row sums (:class:`RowSumSoftmax`).  There too, broadcasting arithmetic
(:func:`add_full` and its siblings), the heads' transposes (:func:`swap_axes_1_2`),
SwiGLU's products, the softmax backward's tail and the generation cache's write
(:func:`write_column`) run as naohai's compiled kernels
(:mod:`naohai.model.cpu_kernels`), MindSpore's numbers bit for bit.  The strategy's
primitives are the same on every backend; CPU runs are one-device runs.
"""
from __future__ import annotations

import contextlib
import math
from typing import Dict, NamedTuple, Optional

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from naohai.model.config import ModelConfig
from naohai.model import cpu_kernels, spec

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def ms_dtype(name: str):
    return _DTYPES[name]


class _Deferred:
    on = False


@contextlib.contextmanager
def deferred_parameters():
    """Build cells whose Parameters hold no data yet: each is an ``initializer`` (normal with the
    description's std, zeros, ones) that MindSpore materialises only when asked -- at compile time, as
    this rank's slice, or never (``AutoParallel.no_init_parameters_in_compile``).  Inside, MindSpore's
    ``no_init_parameters`` (present in 2.10, deprecated after 2.9) keeps clones such as optimizer
    moments lazy too.  For compile-only checks: the values are MindSpore's draws, not the numpy
    RandomState's of an ordinary build."""
    from mindspore.nn.utils import no_init_parameters
    _Deferred.on = True
    try:
        with no_init_parameters():
            yield
    finally:
        _Deferred.on = False


def parameters_deferred() -> bool:
    """Whether cells are being built inside :func:`deferred_parameters`."""
    return _Deferred.on


def _param(rng: np.random.RandomState, shape, std: float, name: str, kind: str = "normal") -> Parameter:
    if _Deferred.on:
        from mindspore.common.initializer import Normal, initializer
        init = kind if kind in ("zeros", "ones") else Normal(sigma=std)
        return Parameter(initializer(init, tuple(shape), ms.float32), name=name)
    if kind == "zeros":
        value = np.zeros(shape, np.float32)
    elif kind == "ones":
        value = np.ones(shape, np.float32)
    else:
        value = (rng.standard_normal(shape) * std).astype(np.float32)
    return Parameter(Tensor(value), name=name)


def make_params(cell: nn.Cell, specs, cfg: ModelConfig, rng: np.random.RandomState) -> None:
    """Create ``cell.<leaf>`` for every ParamSpec, in order (normal draws consume ``rng``)."""
    for p in specs:
        setattr(cell, p.leaf, _param(rng, p.shape, spec.init_std(cfg, p), p.leaf, p.init))


def layer_slice(weight, layer):
    """``weight`` itself, or with ``layer`` (an int32 scalar tensor) its slice ``weight[layer]``: the cells
    of a :class:`~naohai.model.stack.LayerStack` hold each weight stacked over its layers.  An absent
    weight (None: no bias, no norm shift) stays None."""
    if layer is None or weight is None:
        return weight
    return ops.gather(weight, layer, 0)


# ------------------------------------------------------------------------------ norms
def cpu_backend() -> bool:
    """Whether the cells are being built for MindSpore's CPU backend, where some fused kernels are slow
    enough that a composite form of the same math pays (see :class:`Norm`)."""
    return ms.get_context("device_target") == "CPU"


def full(b, like, on: bool):
    """``b`` repeated to ``like``'s shape when ``on``, else ``b`` as it is.

    The CPU backend's form of :func:`add_full` and its siblings when naohai's compiled kernels are not built
    (or the operands are not float32): for the second operand of an elementwise ``Add`` / ``Sub`` / ``Mul``
    whose shapes differ (a bias, a norm's row statistics or gamma, RoPE's tables, the attention
    bias).  MindSpore 2.10's CPU arithmetic kernel keeps, for every such kernel of a compiled graph, two
    index vectors of one ``size_t`` per output element (16 bytes: 4x an fp32 output;
    ``arithmetic_cpu_kernel.cc`` ``InitBroadCast``), for as long as the graph lives: 3.5 GB of the 27M
    bench model's train step.  With the operand repeated first the kernel takes its same-shape path
    and the repeat is an ordinary output that the memory pool frees and reuses.  The repeat is ``Tile``
    (``b`` reshaped to ``like``'s rank first), not ``BroadcastTo``: the same copy, but 2.10's CPU
    ``BroadcastTo`` is slow, above all for a column of row statistics ([2048, 1] to [2048, 512]: 3.1 ms
    against 0.66 ms): in one process, rounds alternating, the 27M bench model's median step went from 3.02
    to 2.61 s and tiny's from 0.264 to 0.215 s.  The backward is BroadcastTo's (:class:`_Repeat`), so the
    losses are the same bit for bit.  Other backends keep the broadcasting op (the one strategies shard).
    """
    if not on:
        return b
    return _REPEAT(b, like)


class _Repeat(nn.Cell):
    """``b`` reshaped to the rank of ``like`` and tiled to its shape (:func:`full`); the backward is the
    sum over the repeated axes in the form MindSpore derives for ``BroadcastTo`` (one ``ReduceSum``
    over those axes), not the one it derives for ``Tile`` (a reshape to interleaved axes, then a
    ``ReduceSum``), so that the gradients are BroadcastTo's bit for bit.  ``like`` only lends its shape:
    its zero gradient is dropped by MindSpore's graph passes (no ``ZerosLike`` kernel in a profile of the
    27M train step).  One instance serves every call; a cell with a ``bprop`` must not be called inside
    another's ``bprop`` or forward-with-``bprop`` (2.10's compile fails: "The func graph is empty"), which is
    what :func:`repeat` is for."""

    def __init__(self):
        super().__init__()
        self.reduce = ops.ReduceSum(keep_dims=True)

    def construct(self, b, like):
        return repeat(b, like)

    def bprop(self, b, like, out, dout):
        return _summed_to(dout, b, self.reduce), ops.zeros_like(like)


def repeat(b, like):
    """``b`` tiled to ``like``'s shape (reshaped to its rank first): :func:`full`'s copy without its backward,
    for code that is not differentiated (a custom ``bprop``, the forward of a cell that has one)."""
    shape = like.shape
    ranked = _ranked(b.shape, shape)
    return _TILE(_RESHAPE(b, ranked), _repeats(shape, ranked))


def _ranked(bshape, shape):
    """``bshape`` with leading 1s up to the rank of ``shape``."""
    return (1,) * (len(shape) - len(bshape)) + bshape


def _repeats(shape, ranked):
    """How many times :func:`full` repeats each axis of ``ranked`` to reach ``shape``."""
    return tuple([shape[i] // ranked[i] for i in range(len(shape))])


def _repeated_axes(shape, ranked):
    """The axes :func:`full` repeats."""
    return tuple([i for i in range(len(shape)) if shape[i] != ranked[i]])


_REPEAT = _Repeat()
_TILE = ops.Tile()
_RESHAPE = ops.Reshape()


# ------------------------------------------------------------------------------ broadcasting Add / Sub / Mul on CPU
def add_full(op, x, b, on: bool):
    """``op(x, b)`` (an ``Add``, the strategy's op) with ``b`` broadcast to ``x``'s shape: as it is when not
    ``on``; on the CPU backend (``on``) by naohai's compiled kernel (:mod:`naohai.model.cpu_kernels`), or
    with ``b`` repeated by :func:`full` when the kernels are not built or the operands are not float32.
    Every form gives the same numbers bit for bit, forward and backward."""
    return _broadcast_op(op, _BROADCAST_ADD, x, b, on)


def sub_full(op, x, b, on: bool):
    """``op(x, b)`` (a ``Sub``) with ``b`` broadcast: :func:`add_full`'s forms."""
    return _broadcast_op(op, _BROADCAST_SUB, x, b, on)


def mul_full(op, x, b, on: bool):
    """``op(x, b)`` (a ``Mul``) with ``b`` broadcast: :func:`add_full`'s forms."""
    return _broadcast_op(op, _BROADCAST_MUL, x, b, on)


def _broadcast_op(op, kernel, x, b, on: bool):
    if not on:
        return op(x, b)
    if _KERNELS_ON and x.dtype == ms.float32 and b.dtype == ms.float32:
        return kernel(x, b)
    return op(x, full(b, x, True))


def _summed_to(d, b, reduce):
    """``d`` (x's shape) summed over the axes along which ``b`` was broadcast, in ``b``'s shape: the one
    ``ReduceSum`` MindSpore derives for ``BroadcastTo`` (as :class:`_Repeat`)."""
    axes = _repeated_axes(d.shape, _ranked(b.shape, d.shape))
    if not axes:
        return _RESHAPE(d, b.shape)
    return _RESHAPE(reduce(d, axes), b.shape)


class _BroadcastAdd(nn.Cell):
    """``x + b`` by the compiled kernel; backward: ``dout``, and ``dout`` summed to ``b``."""

    def __init__(self, prim):
        super().__init__()
        self.op = prim
        self.reduce = ops.ReduceSum(keep_dims=True)

    def construct(self, x, b):
        return self.op(x, b)

    def bprop(self, x, b, out, dout):
        return dout, _summed_to(dout, b, self.reduce)


class _BroadcastSub(nn.Cell):
    """``x - b`` by the compiled kernel; backward: ``dout``, and ``-dout`` summed to ``b`` (``Sub``'s
    derived backward negates before the sum)."""

    def __init__(self, prim):
        super().__init__()
        self.op = prim
        self.neg = ops.Neg()
        self.reduce = ops.ReduceSum(keep_dims=True)

    def construct(self, x, b):
        return self.op(x, b)

    def bprop(self, x, b, out, dout):
        return dout, _summed_to(self.neg(dout), b, self.reduce)


class _BroadcastMul(nn.Cell):
    """``x * b`` by the compiled kernel; backward: ``dout * b`` (the kernel again: ``b`` is never repeated
    into memory, forward or backward) and ``dout * x`` summed to ``b``."""

    def __init__(self, prim):
        super().__init__()
        self.op = prim
        self.mul = ops.Mul()
        self.reduce = ops.ReduceSum(keep_dims=True)

    def construct(self, x, b):
        return self.op(x, b)

    def bprop(self, x, b, out, dout):
        return self.op(dout, b), _summed_to(self.mul(dout, x), b, self.reduce)


class _SwapAxes12(nn.Cell):
    """[a, b, c, d] -> [a, c, b, d] by the compiled copy; its backward is the same swap of ``dout``."""

    def __init__(self, prim):
        super().__init__()
        self.op = prim

    def construct(self, x):
        return self.op(x)

    def bprop(self, x, out, dout):
        return (self.op(dout),)


class _SwiGLU(nn.Cell):
    """``(g * s) * u`` (``s = sigmoid(g)``, computed outside by the strategy's op) in one pass, without keeping
    ``g * s``; backward: the gradients MindSpore derives for the two products, in one pass (``ds`` goes on to
    Sigmoid's own backward, and ``g``'s two gradients are added by MindSpore as before)."""

    def __init__(self, prim, grad):
        super().__init__()
        self.op = prim
        self.grad = grad

    def construct(self, g, s, u):
        return self.op(g, s, u)

    def bprop(self, g, s, u, out, dout):
        dg, ds, du = self.grad(dout, g, s, u)
        return dg, ds, du


def swiglu_product(mul, act_mul, gate, sig, up, on: bool):
    """``mul(act_mul(gate, sig), up)``, SwiGLU's products (the strategy's two ``Mul``); on the CPU backend with
    the compiled kernels (float32) one kernel forward and one backward, the same numbers."""
    if on and _KERNELS_ON and gate.dtype == ms.float32 and sig.dtype == ms.float32 and up.dtype == ms.float32:
        return _SWIGLU(gate, sig, up)
    return mul(act_mul(gate, sig), up)


class _Rope(nn.Cell):
    """RoPE's ``x * cos + (x @ R) * sin`` for R a signed permutation matrix (:func:`rotation_matrix`) by one
    compiled kernel forward and one backward, the numbers MindSpore's ``Mul``, ``MatMul``, ``Add`` (and their
    derived backward) give, bit for bit; ``code`` [d] int32 says which dimension of x, with which sign, each
    column of R takes (:func:`rotation_code`)."""

    def __init__(self, prim, grad, code: np.ndarray):
        super().__init__()
        self.op = prim
        self.grad = grad
        self.code = Tensor(code)
        self.zeros_like = ops.ZerosLike()

    def construct(self, x, cos, sin):
        return self.op(x, cos, sin, self.code)

    def bprop(self, x, cos, sin, out, dout):
        return self.grad(dout, cos, sin, self.code), self.zeros_like(cos), self.zeros_like(sin)


def rotation_code(r: np.ndarray) -> Optional[np.ndarray]:
    """For a rotation matrix R [d, d] whose every column holds one +1 or -1 (or nothing): per column j,
    ``sign * (the row of its nonzero + 1)``, 0 for an empty column (int32 [d]); None for any other R."""
    code = np.zeros(r.shape[1], np.int32)
    for j in range(r.shape[1]):
        rows = np.flatnonzero(r[:, j])
        if len(rows) > 1 or (len(rows) == 1 and abs(float(r[rows[0], j])) != 1.0):
            return None
        if len(rows) == 1:
            code[j] = int(np.sign(r[rows[0], j])) * (int(rows[0]) + 1)
    return code


def rope_kernel(rot: np.ndarray):
    """The compiled RoPE cell (:class:`_Rope`) for rotation matrix ``rot`` when the CPU kernels are built and
    ``rot`` is a signed permutation, else None."""
    code = rotation_code(rot)
    if not _KERNELS_ON or code is None:
        return None
    return _Rope(_ROPE[0], _ROPE[1], code)


def sub_mul_rows(sub, mul, yd, y, m):
    """``yd - y * m`` with ``m`` one value per row (``[..., 1]``), for code that is not differentiated: the
    compiled kernel when built (float32), else ``sub`` and ``mul`` on :func:`repeat`'s copy of ``m``."""
    if _KERNELS_ON and yd.dtype == ms.float32 and y.dtype == ms.float32 and m.dtype == ms.float32:
        return _SUB_MUL_ROWS(yd, y, m)
    return sub(yd, mul(y, repeat(m, y)))


def write_column(past, new, slot, on: bool):
    """The fixed-size generation cache ``past`` [b, n, S, d] with its columns where ``slot`` [1, 1, S, 1] is true
    replaced by ``new`` [b, n, 1, d]: ``ops.select`` over the broadcast operands, or when ``on`` (the CPU
    backend, as :func:`full`) with the compiled kernels (float32) one copy, the same numbers."""
    if on and _KERNELS_ON and past.dtype == ms.float32 and new.dtype == ms.float32:
        return _WRITE_COLUMN(past, new, slot)
    return ops.select(ops.broadcast_to(slot, past.shape), ops.broadcast_to(new, past.shape), past)


_KERNELS_ON = False
_FUSED = {}
_BROADCAST_ADD = _BROADCAST_SUB = _BROADCAST_MUL = _SWAP_AXES_1_2 = _SWIGLU = _SUB_MUL_ROWS = _WRITE_COLUMN = None
_ROPE = (None, None)


def prepare_broadcast() -> bool:
    """Build (once) the compiled CPU kernels :func:`add_full` and its siblings use, when on the CPU
    backend; returns whether the cells take the CPU forms (:func:`cpu_backend`)."""
    global _KERNELS_ON, _BROADCAST_ADD, _BROADCAST_SUB, _BROADCAST_MUL, _SWAP_AXES_1_2, _SWIGLU, _SUB_MUL_ROWS, \
        _WRITE_COLUMN, _ROPE
    if not cpu_backend():
        return False
    if not _KERNELS_ON:
        prims = cpu_kernels.primitives()
        if prims is not None:
            _BROADCAST_ADD = _BroadcastAdd(prims["add"])
            _BROADCAST_SUB = _BroadcastSub(prims["sub"])
            _BROADCAST_MUL = _BroadcastMul(prims["mul"])
            _SWAP_AXES_1_2 = _SwapAxes12(prims["swap_axes_1_2"])
            _SWIGLU = _SwiGLU(prims["swiglu"], prims["swiglu_grad"])
            _SUB_MUL_ROWS = prims["sub_mul_rows"]
            _WRITE_COLUMN = prims["write_column"]
            _ROPE = (prims["rope"], prims["rope_grad"])
            _FUSED.update({name: prims[name] for name in (
                "layer_norm", "layer_norm_grad", "rms_norm", "rms_norm_grad", "scaled_softmax",
                "scaled_softmax_grad", "silu_product", "silu_product_grad", "square_sums",
                "softmax_cross_entropy", "adam_all")})
            _KERNELS_ON = True
    return True


def swap_axes_1_2(x, transpose, on: bool):
    """``x`` [a, b, c, d] -> [a, c, b, d] (the attention's heads in or out): ``transpose`` (the op strategies
    address), or when ``on`` (the CPU backend, as :func:`full`) a split over the smaller of axes 1 and 2, each
    piece reshaped (the moved axis has size 1: its elements keep their order) and concatenated.  MindSpore 2.10's
    CPU ``Transpose`` kernel keeps about 2.5x its output in index state for as long as the graph lives (0.8 GB of
    the 27M bench model's train step); split and concat are plain copies, the same numbers.  With naohai's
    compiled CPU kernels (float32) the copy is one kernel, forward and backward (:mod:`naohai.model.cpu_kernels`)."""
    if not on:
        return transpose(x, (0, 2, 1, 3))
    if _KERNELS_ON and x.dtype == ms.float32:
        return _SWAP_AXES_1_2(x)
    a, b, c, d = x.shape
    if c <= b:
        return ops.concat([ops.reshape(p, (a, 1, b, d)) for p in ops.split(x, 1, axis=2)], 1)
    return ops.concat([ops.reshape(p, (a, c, 1, d)) for p in ops.split(x, 1, axis=1)], 2)


class Norm(nn.Cell):
    """LayerNorm, RMSNorm or non-parametric LayerNorm over the last axis of [tokens, hidden].

    The LayerNorms are MindSpore's fused ``LayerNorm`` (the op strategies address it), except on the
    CPU backend: there they are computed from elementwise ops with the row means taken as a MatMul
    against a [hidden, 1] column of 1/hidden, because MindSpore 2.10's CPU ``LayerNormGrad`` kernel
    and its row reductions are slow (forward and backward on [2048, 128]: 4.7 ms fused, 2.4 ms so;
    on [2048, 512]: 19.9 and 7.8 ms).  CPU runs are one-device runs: the strategy's shard of the
    fused op has nothing to apply to there; recomputing the norm recomputes this cell, either form.
    Built inside :func:`fused_reductions` (``train.cpu_reductions: fused``) on CPU, any of the three kinds
    is one compiled kernel forward and one backward instead (:class:`_FusedLayerNorm`), summing in the
    kernels' own order.
    """

    def __init__(self, cfg: ModelConfig, rng=None):
        super().__init__()
        h = cfg.hidden_size
        self.h = h
        self.kind = cfg.norm
        self.eps = cfg.norm_eps
        self.fp32 = cfg.norm_fp32
        self.cast = ops.Cast()
        self.beta = None                  # RMSNorm has no shift
        make_params(self, spec.norm_params(cfg, ""), cfg, rng)
        if self.kind == "rmsnorm":
            self.square = ops.Square()
            self.mean = ops.ReduceMean(keep_dims=True)
            self.rsqrt = ops.Rsqrt()
            self.add_eps = ops.Add()
            self.mul = ops.Mul()
            self.mul_gamma = ops.Mul()
            self.norm = None
        else:
            self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=self.eps)
            if self.kind == "nonparam_layernorm":  # non-parametric (OLMo): fixed unit scale, zero shift
                self.gamma = Tensor(np.ones(h, np.float32))
                self.beta = Tensor(np.zeros(h, np.float32))
        self.composite = self.norm is not None and cpu_backend()
        self.full = prepare_broadcast()
        self.fused = _fused_norm(self.kind, self.eps) if self.full and fused_reductions_on() else None
        if self.composite:
            self.reshape = ops.Reshape()
            self.row_mean = ops.MatMul()
            self.row_mean_sq = ops.MatMul()
            self.average = Tensor(np.full((h, 1), 1.0 / h, np.float32))
            self.center = ops.Sub()
            self.square = ops.Mul()
            self.add_eps = ops.Add()
            self.rsqrt = ops.Rsqrt()
            self.mul = ops.Mul()
            self.mul_gamma = ops.Mul()
            self.add_beta = ops.Add()

    def construct(self, x, layer=None):
        """``layer``: see :func:`layer_slice`."""
        dtype = x.dtype
        gamma, beta = self.gamma, self.beta
        if self.kind != "nonparam_layernorm":         # (its fixed gamma / beta are not stacked)
            gamma, beta = layer_slice(gamma, layer), layer_slice(beta, layer)
        if self.fp32:
            x = self.cast(x, ms.float32)
        if self.fused is not None and x.dtype == ms.float32 and gamma.dtype == ms.float32:
            shape = x.shape
            x2 = ops.reshape(x, (-1, self.h))
            y = self.fused(x2, gamma) if self.beta is None else self.fused(x2, gamma, beta)
            y = ops.reshape(y, shape)
        elif self.composite:
            shape = x.shape
            x2 = self.reshape(x, (-1, self.h))
            average = self.cast(self.average, x2.dtype)
            c = sub_full(self.center, x2, self.row_mean(x2, average), self.full)
            var = self.row_mean_sq(self.square(c, c), average)
            y = mul_full(self.mul, c, self.rsqrt(self.add_eps(var, self.eps)), self.full)
            y = add_full(self.add_beta, mul_full(self.mul_gamma, y, gamma, self.full), beta, self.full)
            y = self.reshape(y, shape)
        elif self.norm is None:
            var = self.mean(self.square(x), -1)
            y = mul_full(self.mul, x, self.rsqrt(self.add_eps(var, self.eps)), self.full)
            y = mul_full(self.mul_gamma, y, gamma, self.full)
        else:
            y, _, _ = self.norm(x, gamma, beta)
        return self.cast(y, dtype)

    def primitive(self):
        return self.norm


class _FusedLayerNorm(nn.Cell):
    """LayerNorm of x [rows, h] by one compiled kernel forward and one backward (``train.cpu_reductions:
    fused``); the backward recomputes each row's statistics from x as the forward took them (nothing is kept
    between the two but x, which the graph keeps anyway)."""

    def __init__(self, prim, grad, eps: float):
        super().__init__()
        self.op = prim
        self.grad = grad
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x, gamma, beta):
        return self.op(x, gamma, beta, self.eps)

    def bprop(self, x, gamma, beta, out, dout):
        dx, dgamma, dbeta = self.grad(dout, x, gamma, self.eps)
        return dx, dgamma, dbeta


class _FusedRMSNorm(_FusedLayerNorm):
    """RMSNorm of x [rows, h] as :class:`_FusedLayerNorm` (no shift)."""

    def construct(self, x, gamma):
        return self.op(x, gamma, self.eps)

    def bprop(self, x, gamma, out, dout):
        dx, dgamma = self.grad(dout, x, gamma, self.eps)
        return dx, dgamma


def _fused_norm(kind: str, eps: float):
    """The fused norm cell of ``kind``, or None when the compiled kernels are not built."""
    if not _FUSED:
        return None
    if kind == "rmsnorm":
        return _FusedRMSNorm(_FUSED["rms_norm"], _FUSED["rms_norm_grad"], eps)
    return _FusedLayerNorm(_FUSED["layer_norm"], _FUSED["layer_norm_grad"], eps)


class _FusedSoftmax(nn.Cell):
    """The attention's probabilities softmax(x * scale + bias) over the last axis by one compiled kernel
    forward and one backward (``train.cpu_reductions: fused``); x float32 [b, n, s, t], bias broadcast to it,
    scale [1] or a scalar.  The backward gives x's gradient (the bias is a constant of the batch)."""

    def __init__(self, prim, grad):
        super().__init__()
        self.op = prim
        self.grad = grad
        self.zeros_like = ops.ZerosLike()

    def construct(self, x, bias, scale):
        return self.op(x, bias, scale)

    def bprop(self, x, bias, scale, out, dout):
        return self.grad(dout, out, scale), self.zeros_like(bias), self.zeros_like(scale)


class _FusedSiluProduct(nn.Cell):
    """SwiGLU's ``(g * sigmoid(g)) * u`` by one compiled kernel forward and one backward
    (``train.cpu_reductions: fused``), float32."""

    def __init__(self, prim, grad):
        super().__init__()
        self.op = prim
        self.grad = grad

    def construct(self, g, u):
        return self.op(g, u)

    def bprop(self, g, u, out, dout):
        dg, du = self.grad(dout, g, u)
        return dg, du


def fused_kernel(name: str):
    """The fused kernel primitive ``name`` (:mod:`naohai.model.cpu_kernels`) when built inside
    :func:`fused_reductions` with the compiled kernels built, else None."""
    if not (fused_reductions_on() and _FUSED):
        return None
    return _FUSED[name]


def _fused_cell(cls, name: str):
    """``cls(kernel, its backward)`` for the fused kernel ``name`` (:func:`fused_kernel`), else None."""
    op = fused_kernel(name)
    return None if op is None else cls(op, _FUSED[name + "_grad"])


class _FusedReductions:
    on = False


@contextlib.contextmanager
def fused_reductions(on: bool = True):
    """Build cells that take their norms, the attention's softmax, SwiGLU's activation (forward and backward) and
    the head's cross entropy (:class:`naohai.model.head_loss.ChunkedHeadLoss`) with naohai's fused kernels (the
    recipe's ``train.cpu_reductions: fused``; on the CPU backend with the compiled kernels built, else no effect):
    faster, in their own summation order and with their own exp (:mod:`naohai.model.cpu_kernels`)."""
    before = _FusedReductions.on
    _FusedReductions.on = bool(on)
    try:
        yield
    finally:
        _FusedReductions.on = before


def fused_reductions_on() -> bool:
    """Whether cells are being built inside :func:`fused_reductions`."""
    return _FusedReductions.on


class GradientKernels(NamedTuple):
    """The fused kernels for all of a step's float32 gradients at once: ``square_sums(*grads)`` -> the sum of
    their sums of squares ([1]), ``adam_all(*params, *m, *v, *grads, lr, beta1, beta2, eps, decays, scale, go)``:
    AdamW's update of every parameter with the gradients times ``scale`` where ``go`` is not 0, in place
    (:class:`naohai.train.adam_all.AdamWeightDecayAll`)."""
    square_sums: object
    adam_all: object


def fused_gradient_kernels() -> Optional[GradientKernels]:
    """:class:`GradientKernels` when the CPU kernels are built (:func:`prepare_broadcast` ran on the CPU
    backend), else None."""
    if not _FUSED:
        return None
    return GradientKernels(_FUSED["square_sums"], _FUSED["adam_all"])


class RowSumSoftmax(nn.Cell):
    """``op(x)``, a Softmax primitive over the last axis, whose backward dx = y * dy - y * sum(y * dy)
    takes the row sums as a MatMul against a column of ones.  Used on the CPU backend only, where the
    backward MindSpore 2.10 derives reduces with a slow ReduceSum (softmax forward and backward on
    [16, 4, 128, 128]: 6.5 ms so, 3.1 ms with this); the primitive itself is the strategy's op."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.mul = ops.Mul()
        self.sub = ops.Sub()
        self.row_sum = ops.MatMul()
        self.reshape = ops.Reshape()

    def construct(self, x):
        return self.op(x)

    def bprop(self, x, out, dout):
        width = out.shape[-1]
        yd = self.mul(out, dout)
        sums = self.row_sum(self.reshape(yd, (-1, width)), ops.ones((width, 1), yd.dtype))
        return (sub_mul_rows(self.sub, self.mul, yd, out, self.reshape(sums, out.shape[:-1] + (1,))),)


# ------------------------------------------------------------------------------ positions
def rope_frequencies(rd: int, base: float, cfg=None) -> np.ndarray:
    """theta_i = base^(-2i/rd) per rotated pair, then ``cfg``'s ``rope_scaling``: ``linear`` divides them by
    ``rope_factor``; ``llama3`` (Llama 3.1 / 3.2) divides those whose wavelength 2 pi / theta is longer than
    ``rope_original_positions / rope_low_freq_factor`` by it, keeps those shorter than ``... /
    rope_high_freq_factor``, and blends the ones between, s * theta + (1 - s) * theta / factor with
    s = (original / wavelength - low) / (high - low) (Meta's reference, as transformers computes it)."""
    inv = 1.0 / (base ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    kind = getattr(cfg, "rope_scaling", "none")
    if kind == "linear":
        inv = inv / cfg.rope_factor
    elif kind == "llama3":
        factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        original = cfg.rope_original_positions
        wavelength = 2 * np.pi / inv
        scaled = np.where(wavelength > original / low, inv / factor, inv)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < original / high) & ~(wavelength > original / low)
        inv = np.where(medium, blended, scaled)
    return inv


def rope_tables(positions: int, head_dim: int, base: float, style: str = "rotate_half", rotary_dim: int = 0,
                cfg=None):
    """cos/sin tables [positions, head_dim]; theta_i = base^(-2i/r) for the i-th rotated pair of the
    first ``r = rotary_dim`` dimensions (0 = all), scaled as ``cfg.rope_scaling`` says
    (:func:`rope_frequencies`); the other dimensions pass through (cos 1, sin 0).

    rotate_half pairs dimension i with i + r/2 (angles laid out [a, a]); interleaved pairs 2i with
    2i + 1 (angles repeated element-wise), as PengCheng-Mind 200B's and GLM's RoPE do.  Partial
    rotation is GPT-NeoX's ``rotary_pct`` and GLM's ``partial_rotary_factor``.
    """
    rd = rotary_dim or head_dim
    inv = rope_frequencies(rd, base, cfg)
    ang = np.outer(np.arange(positions, dtype=np.float64), inv)           # [s, r/2]
    if style == "interleaved":
        ang = np.repeat(ang, 2, axis=-1)                                  # [s, r]
    else:
        ang = np.concatenate([ang, ang], axis=-1)                         # [s, r]
    cos, sin = np.ones((positions, head_dim)), np.zeros((positions, head_dim))
    cos[:, :rd], sin[:, :rd] = np.cos(ang), np.sin(ang)
    return cos.astype(np.float32), sin.astype(np.float32)


def rotation_matrix(head_dim: int, style: str = "rotate_half", rotary_dim: int = 0) -> np.ndarray:
    """R with x @ R the rotated partner of x: concat(-x2, x1) for rotate_half, (-x[2i+1], x[2i]) pairs
    for interleaved, over the first ``rotary_dim`` dimensions (0 = all; the rest map to 0)."""
    r = np.zeros((head_dim, head_dim), np.float32)
    half = (rotary_dim or head_dim) // 2
    for i in range(half):
        if style == "interleaved":
            r[2 * i + 1, 2 * i] = -1.0   # out[2i] = -x[2i + 1]
            r[2 * i, 2 * i + 1] = 1.0    # out[2i + 1] = x[2i]
        else:
            r[i + half, i] = -1.0        # out[i] = -x[i + half]
            r[i, i + half] = 1.0         # out[i + half] = x[i]
    return r


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Head slopes from the ALiBi paper (geometric; extended for non powers of two)."""
    def pow2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * (start ** i) for i in range(n)]
    if math.log2(num_heads).is_integer():
        return np.array(pow2(num_heads), np.float32)
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    extra = pow2(2 * closest)[0::2][: num_heads - closest]
    return np.array(pow2(closest) + extra, np.float32)


def alibi_bias(cfg: ModelConfig) -> np.ndarray:
    """ALiBi distance bias [heads, s, s]: slope * (j - i)."""
    s = cfg.seq_length
    dist = (np.arange(s)[None, :] - np.arange(s)[:, None]).astype(np.float32)       # j - i (<= 0 below diag)
    return (alibi_slopes(cfg.num_heads)[:, None, None] * dist[None]).astype(np.float32)


def attention_bias(cfg: ModelConfig) -> np.ndarray:
    """Additive bias on the scores: causal mask, plus ALiBi distances when configured."""
    s = cfg.seq_length
    causal = np.triu(np.ones((s, s), np.bool_), k=1)
    neg = np.float32(-1e9)
    if cfg.position == "alibi":
        return np.where(causal[None], neg, alibi_bias(cfg)).astype(np.float32)      # [heads, s, s]
    return np.where(causal, neg, np.float32(0.0))[None].astype(np.float32)        # [1, s, s]


# ------------------------------------------------------------------------------ dropout
class Dropout(nn.Cell):
    """Dropout with keep probability 1 - rate, active only while the cell is in training mode."""

    def __init__(self, rate: float):
        super().__init__()
        self.rate = float(rate)
        self.drop = ops.Dropout(keep_prob=1.0 - self.rate) if self.rate > 0 else None

    def construct(self, x):
        if self.training and self.drop is not None:
            x, _ = self.drop(x)
        return x


# ------------------------------------------------------------------------------ attention
class Attention(nn.Cell):
    """Multi-head (optionally grouped-query) causal self-attention on [tokens, hidden].

    With ``query_layer`` (PanGu-alpha's top query layer) the queries are projected
    from a learned per-position embedding instead of the hidden state.

    ``construct(x, positions=None, bias=None)``: ``positions`` [b, s] int32 are the
    per-token position ids when they restart at EOD (else 0..s-1 are used), ``bias``
    [b, 1, s, s] the additive document-causal mask when attention is reset at EOD
    (else the fixed causal table).
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState, query_layer: bool = False):
        super().__init__()
        nh, nkv, hd = cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.nh, self.nkv, self.hd, self.s = nh, nkv, hd, cfg.seq_length
        self.group = nh // nkv
        self.dtype = ms_dtype(cfg.compute_dtype)
        softmax_fp32 = cfg.softmax_fp32
        if query_layer and cfg.query_softmax_fp32 is not None:
            softmax_fp32 = cfg.query_softmax_fp32
        self.softmax_dtype = ms.float32 if softmax_fp32 else self.dtype
        self.qkv_bias, self.use_out_bias = cfg.has_qkv_bias, cfg.has_out_bias
        self.q_bias = self.k_bias = self.v_bias = self.out_bias = None
        make_params(self, spec.attention_params(cfg, "", query_layer), cfg, rng)
        self.query_layer = query_layer
        self.reset_positions = cfg.eod_reset_positions
        self.reset_attention = cfg.eod_reset
        self.position_ids = Tensor(np.arange(cfg.seq_length, dtype=np.int32)[None])
        self.offset = 0                                   # virtual tokens before the sequence
        self.prefix_zeros = ops.Zeros()
        if query_layer:
            self.query_lookup = ops.Gather()
        self.q = ops.MatMul(transpose_b=True)
        self.k = ops.MatMul(transpose_b=True)
        self.v = ops.MatMul(transpose_b=True)
        self.q_add = ops.Add()
        self.k_add = ops.Add()
        self.v_add = ops.Add()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.scale = ops.Mul()
        self.scale_value = Tensor(1.0 / math.sqrt(hd), ms.float32)
        self.mask = ops.Add()
        self.alibi = cfg.position == "alibi"
        if self.reset_attention:
            if self.alibi:
                self.alibi_add = ops.Add()
                self.alibi_table = Tensor(alibi_bias(cfg))                       # [heads, s, s]
        else:
            self.bias_table = Tensor(attention_bias(cfg))
        self.softmax = ops.Softmax(axis=-1)
        self.probs = RowSumSoftmax(self.softmax) if cpu_backend() else self.softmax
        self.full = prepare_broadcast()
        self.fused_probs = _fused_cell(_FusedSoftmax, "scaled_softmax") if self.full else None
        self.prob_dropout = Dropout(cfg.dropout)
        self.context = ops.BatchMatMul()
        self.out = ops.MatMul(transpose_b=True)
        self.out_add = ops.Add()
        self.dropout = Dropout(cfg.dropout)
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.cast = ops.Cast()
        self.rope = cfg.position == "rope"
        if self.rope:
            cos, sin = rope_tables(cfg.positions, hd, cfg.rope_base, cfg.rope_style, cfg.rotary_dim, cfg)
            self.cos_table = Tensor(cos)                # [positions, d]
            self.sin_table = Tensor(sin)
            self.cos = Tensor(cos[None, None, : cfg.seq_length])          # [1, 1, s, d]
            self.sin = Tensor(sin[None, None, : cfg.seq_length])
            rot = rotation_matrix(hd, cfg.rope_style, cfg.rotary_dim)
            self.rot = Tensor(rot)                                                  # [d, d]
            self.rope_lookup = ops.Gather()
            self.rot_mm = ops.MatMul()
            self.rope_mul_cos = ops.Mul()
            self.rope_mul_sin = ops.Mul()
            self.rope_add = ops.Add()
            self.rope_fused = rope_kernel(rot) if self.full else None
        if self.group > 1:
            self.expand = ops.Tile()

    def _proj(self, mm, add, x, w, b):
        y = mm(self.cast(x, self.dtype), self.cast(w, self.dtype))
        if b is not None:
            y = add_full(add, y, self.cast(b, self.dtype), self.full)
        return y

    def _heads(self, y, n, s):
        """[b*s, n*d] -> [b, n, s, d]"""
        y = self.reshape(y, (-1, s, n, self.hd))
        return swap_axes_1_2(y, self.transpose, self.full)

    def rope_angles(self, positions):
        """cos, sin broadcastable to [b, n, s, d]: fixed 0..s-1, or gathered at ``positions`` [b, s]."""
        if positions is None:
            return self.cos, self.sin
        b, s = positions.shape
        cos = self.reshape(self.rope_lookup(self.cos_table, positions, 0), (b, 1, s, self.hd))
        sin = self.reshape(self.rope_lookup(self.sin_table, positions, 0), (b, 1, s, self.hd))
        return cos, sin

    def apply_rope(self, x, cos, sin):
        if self.rope_fused is not None and x.dtype == ms.float32:
            return self.rope_fused(x, self.cast(cos, x.dtype), self.cast(sin, x.dtype))
        b, n, s = x.shape[0], x.shape[1], x.shape[2]
        flat = self.reshape(x, (-1, self.hd))
        rot = self.reshape(self.rot_mm(flat, self.cast(self.rot, x.dtype)), (b, n, s, self.hd))
        return self.rope_add(mul_full(self.rope_mul_cos, x, self.cast(cos, x.dtype), self.full),
                             mul_full(self.rope_mul_sin, rot, self.cast(sin, x.dtype), self.full))

    def _expand_kv(self, x):
        """[b, nkv, t, d] -> [b, nh, t, d] by repeating each kv head for its query group."""
        if self.group == 1:
            return x
        b, t = x.shape[0], x.shape[2]
        x = self.reshape(x, (b, self.nkv, 1, t, self.hd))
        x = self.expand(x, (1, 1, self.group, 1, 1))
        return self.reshape(x, (b, self.nh, t, self.hd))

    def query_source(self, x, positions, batch: int):
        """The rows the queries are projected from: x, or the query layer's position embeddings."""
        if not self.query_layer:
            return x
        if positions is None:
            qe = self.query_lookup(self.query_embedding, self.position_ids, 0)     # [1, s, h]
            qe = ops.tile(qe, (batch, 1, 1))
        else:
            qe = self.query_lookup(self.query_embedding, positions, 0)             # [b, s, h]
        return self.reshape(qe, (-1, qe.shape[-1]))

    def project_qkv(self, x, q_src, s: int, positions, layer=None):
        """Heads [b, n, s, d] of q, k, v (RoPE applied at ``positions``, default 0..s-1)."""
        q = self._proj(self.q, self.q_add, q_src, layer_slice(self.q_weight, layer), layer_slice(self.q_bias, layer))
        k, v = self.project_kv(x, s, layer)
        q = self._heads(q, self.nh, s)
        if self.rope:
            cos, sin = self.rope_angles(positions)
            q = self.apply_rope(q, cos, sin)
            k = self.apply_rope(k, cos, sin)
        return q, k, v

    def project_kv(self, x, s: int, layer=None):
        """Heads [b, nkv, s, d] of k and v, no position applied."""
        k = self._proj(self.k, self.k_add, x, layer_slice(self.k_weight, layer), layer_slice(self.k_bias, layer))
        v = self._proj(self.v, self.v_add, x, layer_slice(self.v_weight, layer), layer_slice(self.v_bias, layer))
        return self._heads(k, self.nkv, s), self._heads(v, self.nkv, s)

    def own_positions(self, positions):
        """The positions ``construct`` uses: ``positions`` when they restart at EOD (shifted past virtual
        tokens, see :meth:`shift_positions`), else None (the fixed 0..s-1, or offset..offset+s-1)."""
        if not self.reset_positions:
            return None
        return positions + self.offset if self.offset else positions

    def shift_positions(self, offset: int) -> None:
        """Number the sequence's tokens from ``offset`` (prefix / prompt tuning put ``offset`` virtual
        tokens before them); needs ``offset + seq_length <= max_positions``."""
        self.offset = int(offset)
        s, o = self.s, self.offset
        self.position_ids = Tensor(np.arange(o, o + s, dtype=np.int32)[None])
        if self.rope:
            cos, sin = rope_tables(self.cfg.positions, self.hd, self.cfg.rope_base, self.cfg.rope_style,
                                   self.cfg.rotary_dim, self.cfg)
            self.cos = Tensor(cos[None, None, o:o + s])
            self.sin = Tensor(sin[None, None, o:o + s])

    def attend(self, q, k, v, bias, layer=None):
        """softmax(q k^T / sqrt(d) + bias) v merged to [b*s, nh*d], then the output projection."""
        k = self._expand_kv(k)
        v = self._expand_kv(v)
        scores = self.scores(q, k)                                             # [b, nh, s, t]
        scores = self.cast(scores, self.softmax_dtype)
        if self.fused_probs is not None and scores.dtype == ms.float32:
            probs = self.fused_probs(scores, self.cast(bias, ms.float32), self.scale_value)
        else:
            scores = self.scale(scores, self.cast(self.scale_value, self.softmax_dtype))
            scores = add_full(self.mask, scores, self.cast(bias, self.softmax_dtype), self.full)
            probs = self.probs(scores)
        probs = self.prob_dropout(self.cast(probs, self.dtype))
        ctx = self.context(probs, v)                                           # [b, nh, s, d]
        ctx = self.reshape(swap_axes_1_2(ctx, self.transpose, self.full), (-1, self.nh * self.hd))
        out = self._proj(self.out, self.out_add, ctx, layer_slice(self.out_weight, layer),
                         layer_slice(self.out_bias, layer))
        return self.cast(self.dropout(out), ms.float32)

    def construct(self, x, positions=None, bias=None, layer=None, prefix=None):
        """x: [b*s, h] normalised hidden states -> [b*s, h]; ``layer``: see :func:`layer_slice`.

        ``prefix`` (keys, values) [1, nkv, n, d]: n earlier positions every token attends to (prefix /
        prompt tuning, :mod:`naohai.model.finetune`), their keys taken as given (no RoPE applied)."""
        batch = x.shape[0] // self.s
        pos = self.own_positions(positions)
        q, k, v = self.project_qkv(x, self.query_source(x, pos, batch), self.s, pos, layer)
        if self.reset_attention:
            if self.alibi:
                bias = self.alibi_add(bias, self.alibi_table)
        else:
            bias = self.bias_table
        if prefix is not None:
            k, v, bias = self.with_prefix(k, v, bias, prefix)
        return self.attend(q, k, v, bias, layer)

    def with_prefix(self, k, v, bias, prefix):
        """Keys, values and bias with the ``prefix`` positions in front (attended by every row)."""
        pk, pv = prefix
        b, n = k.shape[0], pk.shape[2]
        shape = (b, self.nkv, n, self.hd)
        k = ops.concat((ops.broadcast_to(self.cast(pk, k.dtype), shape), k), 2)
        v = ops.concat((ops.broadcast_to(self.cast(pv, v.dtype), shape), v), 2)
        open_ = self.prefix_zeros(bias.shape[:-1] + (n,), bias.dtype)
        return k, v, ops.concat((open_, bias), -1)

    def step(self, x, positions, bias, past_k=None, past_v=None, slot=None):
        """Incremental attention for generation: x [b*t, h] are the t newest tokens at ``positions``
        [b, t]; keys/values of earlier tokens come from the cache (``past_k``/``past_v`` [b, nkv, T, d]).
        ``bias`` [1 or b, 1 or nh, t, T + t].  Returns (out [b*t, h], keys, values) with the new ones
        appended.

        With ``slot`` ([1, 1, S, 1] bool, true at one column; t = 1) the cache has a fixed size S:
        the new key/value is written at that column instead of appended, ``bias`` is [b, 1, 1, S]
        and blocks the columns not yet written, so every step has the same shapes (one compiled
        graph, the same work at every length)."""
        t = positions.shape[1]
        q, k, v = self.project_qkv(x, self.query_source(x, positions, positions.shape[0]), t, positions)
        if slot is not None:
            k = write_column(past_k, k, slot, self.full)
            v = write_column(past_v, v, slot, self.full)
        elif past_k is not None:
            k = ops.concat((past_k, k), 2)
            v = ops.concat((past_v, v), 2)
        return self.attend(q, k, v, bias), k, v

    def shardable_ops(self) -> Dict[str, object]:
        out = {"q": self.q, "k": self.k, "v": self.v, "scores": self.scores, "scale": self.scale,
               "mask": self.mask, "softmax": self.softmax, "context": self.context, "out": self.out}
        if self.qkv_bias:
            out.update({"q_bias": self.q_add, "k_bias": self.k_add, "v_bias": self.v_add})
        if self.use_out_bias:
            out["out_bias"] = self.out_add
        if self.query_layer:
            out["query_lookup"] = self.query_lookup
        if self.prob_dropout.drop is not None:
            out["prob_dropout"] = self.prob_dropout.drop
            out["dropout"] = self.dropout.drop
        return out


# ------------------------------------------------------------------------------ MLP
class MLP(nn.Cell):
    """GeLU (exact or tanh), FastGeLU or SwiGLU feed-forward on [tokens, hidden]."""

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState):
        super().__init__()
        self.dtype = ms_dtype(cfg.compute_dtype)
        self.use_bias = cfg.has_mlp_bias
        self.swiglu = cfg.activation == "swiglu"
        self.up_bias = self.gate_bias = self.down_bias = None
        make_params(self, spec.mlp_params(cfg, ""), cfg, rng)
        self.up = ops.MatMul(transpose_b=True)
        self.gate = ops.MatMul(transpose_b=True)
        self.down = ops.MatMul(transpose_b=True)
        self.up_add = ops.Add()
        self.gate_add = ops.Add()
        self.down_add = ops.Add()
        self.mul = ops.Mul()
        self.act_mul = ops.Mul()          # SiLU(g) = g * sigmoid(g): 2.10 has no SiLU primitive
        if cfg.activation == "swiglu":
            self.act = ops.Sigmoid()
        elif cfg.activation == "fast_gelu":
            self.act = ops.FastGeLU()
        elif cfg.activation == "gelu_tanh":
            # GPT-2's gelu_new, BLOOM's gelu: x * (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) / 2, composed
            # so that every backend computes this form
            self.act = ops.Tanh()
        else:
            # exact GeLU x * Phi(x) = x * (1 + erf(x / sqrt 2)) / 2; ops.GeLU on CPU in 2.10 is the
            # tanh approximation (measured up to 4.7e-4 off on [-4, 4])
            self.act = ops.Erf()
        self.full = prepare_broadcast()
        self.fused_glu = _fused_cell(_FusedSiluProduct, "silu_product") if self.full and self.swiglu else None
        self.exact_gelu = cfg.activation == "gelu"
        self.tanh_gelu = cfg.activation == "gelu_tanh"
        self.dropout = Dropout(cfg.dropout)
        self.cast = ops.Cast()

    def _weight(self, weight, layer):
        return self.cast(layer_slice(weight, layer), self.dtype)

    def construct(self, x, layer=None):
        """``layer``: see :func:`layer_slice`."""
        x = self.cast(x, self.dtype)
        up = self.up(x, self._weight(self.up_weight, layer))
        if self.use_bias:
            up = add_full(self.up_add, up, self._weight(self.up_bias, layer), self.full)
        if self.swiglu:
            gate = self.gate(x, self._weight(self.gate_weight, layer))
            if self.use_bias:
                gate = add_full(self.gate_add, gate, self._weight(self.gate_bias, layer), self.full)
            if self.fused_glu is not None and gate.dtype == ms.float32 and up.dtype == ms.float32:
                hidden = self.fused_glu(gate, up)
            else:
                hidden = swiglu_product(self.mul, self.act_mul, gate, self.act(gate), up, self.full)
        else:
            hidden = self.activation(up)
        out = self.down(hidden, self._weight(self.down_weight, layer))
        if self.use_bias:
            out = add_full(self.down_add, out, self._weight(self.down_bias, layer), self.full)
        return self.cast(self.dropout(out), ms.float32)

    def activation(self, x):
        """GeLU (exact or tanh) or FastGeLU of x (the non-gated activations)."""
        if self.exact_gelu:
            return self.act_mul(x, (self.act(x * 0.7071067811865476) + 1.0) * 0.5)
        if self.tanh_gelu:
            return self.act_mul(x, (self.act((x + x * x * x * 0.044715) * 0.7978845608028654) + 1.0) * 0.5)
        return self.act(x)

    def shardable_ops(self) -> Dict[str, object]:
        out = {"up": self.up, "act": self.act, "down": self.down}
        if self.exact_gelu or self.tanh_gelu:
            out["act_mul"] = self.act_mul
        if self.swiglu:
            out.update({"gate": self.gate, "mul": self.mul, "act_mul": self.act_mul})
        if self.use_bias:
            out.update({"up_bias": self.up_add, "down_bias": self.down_add})
            if self.swiglu:
                out["gate_bias"] = self.gate_add
        if self.dropout.drop is not None:
            out["dropout"] = self.dropout.drop
        return out


# ------------------------------------------------------------------------------ embedding
class DocumentLayout(nn.Cell):
    """Position ids and the document-causal attention bias of packed windows.

    A token attends to earlier tokens of its own document; a document ends with
    (and includes) its EOD token, so the token after an EOD starts a new one at
    position 0.  ``construct(input_ids [b, s]) -> (positions [b, s] int32,
    bias [b, 1, s, s] float32: 0 where attended, -1e9 elsewhere)``.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        s = cfg.seq_length
        self.eod = int(cfg.eod_id)
        self.causal = Tensor(np.tril(np.ones((s, s), np.bool_))[None])               # [1, s, s]
        self.one = Tensor(1.0, ms.float32)
        self.neg = Tensor(-1e9, ms.float32)
        self.blocked = ops.Sub()
        self.to_bias = ops.Mul()
        self.cumsum = ops.CumSum(exclusive=True)
        self.cast = ops.Cast()
        self.equal = ops.Equal()
        self.same = ops.Equal()
        self.both = ops.LogicalAnd()
        self.count = ops.ReduceSum()
        self.expand = ops.ExpandDims()

    def construct(self, input_ids):
        is_eod = self.cast(self.equal(input_ids, self.eod), ms.float32)              # [b, s]
        doc = self.cumsum(is_eod, 1)                                                # documents closed before
        allowed = self.both(self.same(self.expand(doc, 2), self.expand(doc, 1)), self.causal)  # [b, s, s]
        allowed = self.cast(allowed, ms.float32)
        positions = self.cast(self.count(allowed, -1), ms.int32) - 1                 # tokens before, same doc
        bias = self.to_bias(self.blocked(self.one, allowed), self.neg)
        return positions, self.expand(bias, 1)


class Embedding(nn.Cell):
    """Word embedding (+ learned positions, + BLOOM's embedding LayerNorm) -> [b*s, h] float32.

    ``construct(input_ids) -> x``; learned positions restart after each EOD with
    ``eod_reset_positions`` (see :class:`DocumentLayout`).
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState):
        super().__init__()
        h = cfg.hidden_size
        self.h = h
        make_params(self, spec.embedding_table_params(cfg), cfg, rng)
        self.lookup = ops.Gather()
        self.learned = cfg.position == "learned"
        self.reset_positions = self.learned and cfg.eod_reset_positions
        if self.reset_positions:
            self.layout = DocumentLayout(cfg)
        self.offset = 0
        if self.learned:
            self.position = ops.Gather()
            self.position_ids = Tensor(np.arange(cfg.seq_length, dtype=np.int32)[None])
            self.add_pos = ops.Add()
        self.use_norm = cfg.embedding_norm
        if self.use_norm:
            self.norm = Norm(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.reshape = ops.Reshape()

    def construct(self, input_ids):
        x = self.lookup(self.word_embedding, input_ids, 0)                        # [b, s, h]
        if self.learned:
            if self.reset_positions:
                pos = self.layout(input_ids)[0] + self.offset if self.offset else self.layout(input_ids)[0]
            else:
                pos = self.position_ids
            x = self.add_pos(x, self.position(self.position_embedding, pos, 0))
        x = self.reshape(x, (-1, self.h))
        if self.use_norm:
            x = self.norm(x)
        return self.dropout(x)

    def shift_positions(self, offset: int) -> None:
        """Number the sequence's tokens from ``offset`` (see :meth:`Attention.shift_positions`)."""
        self.offset = int(offset)
        if self.learned:
            s = int(self.position_ids.shape[1])
            self.position_ids = Tensor(np.arange(self.offset, self.offset + s, dtype=np.int32)[None])

    def virtual(self, vectors, positions):
        """Input vectors [n, h] in place of word embeddings (prompt tuning) at ``positions`` [1, n]: the
        rest of the embedding (positions, norm) applied as to a token's."""
        return self.added(self.reshape(vectors, (1, -1, self.h)), positions)

    def step(self, input_ids, positions):
        """Embeddings of the newest tokens [b, t] at absolute ``positions`` [b, t] (generation)."""
        return self.added(self.lookup(self.word_embedding, input_ids, 0), positions)

    def added(self, x, positions):
        """Word vectors [b, t, h] at ``positions`` [b, t] -> [b*t, h], positions and norm added."""
        if self.learned:
            x = self.add_pos(x, self.position(self.position_embedding, positions, 0))
        x = self.reshape(x, (-1, self.h))
        if self.use_norm:
            x = self.norm(x)
        return x

    def shardable_ops(self) -> Dict[str, object]:
        out = {"lookup": self.lookup}
        if self.learned:
            out["position"] = self.position
        if self.dropout.drop is not None:
            out["dropout"] = self.dropout.drop
        return out
