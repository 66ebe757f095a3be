"""naohai's compiled CPU kernels (naohai/model/cpu_kernels.cc) and the cells' broadcasting ops that use them.

References: NumPy's float32 broadcasting arithmetic (one IEEE operation per element, as the kernels), and
MindSpore's own broadcasting ``Add`` / ``Sub`` / ``Mul`` with their derived backward, compiled the same way."""
import os
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

from naohai.errors import UserError
from naohai.model import cpu_kernels, layers

SHAPES = [((64, 48), (64, 1)),              # a norm's row statistic
          ((64, 48), (48,)),                # gamma, a bias
          ((2, 4, 8, 8), (1, 1, 8, 8)),     # the attention bias
          ((2, 4, 8, 8), (2, 1, 8, 8)),     # a per-sequence attention bias (EOD resets)
          ((2, 3, 8, 6), (8, 6)),           # RoPE's tables
          ((2, 3, 8, 6), (2, 1, 8, 6)),     # RoPE's tables at given positions
          ((3, 1, 5), (3, 1, 1)),           # axes of size 1 in both
          ((1, 7), (7,)),                   # nothing repeated
          ((2048, 512), (2048, 1)),         # large enough for several threads
          ((8, 8, 128, 128), (1, 1, 128, 128))]
NP = {"add": np.add, "sub": np.subtract, "mul": np.multiply}


def _operands(xs, bs, seed=0):
    rng = np.random.RandomState(seed)
    x = (rng.standard_normal(xs) * 3).astype(np.float32)
    b = (rng.standard_normal(bs) * rng.uniform(0.1, 10, bs[-1])).astype(np.float32)
    return x, b


class _Call(nn.Cell):
    """A graph that calls ``prim`` on its inputs."""

    def __init__(self, prim):
        super().__init__()
        self.prim = prim

    def construct(self, *args):
        return self.prim(*args)


@pytest.fixture(scope="module")
def prims():
    p = cpu_kernels.primitives()
    assert p is not None, cpu_kernels.why_not()
    return p


@pytest.mark.parametrize("xs, bs", SHAPES)
def test_kernels_equal_numpys_float32_broadcasting(prims, xs, bs):
    x, b = _operands(xs, bs)
    for kind in NP:
        got = _Call(prims[kind])(Tensor(x), Tensor(b)).asnumpy()
        assert got.shape == xs and got.dtype == np.float32
        np.testing.assert_array_equal(got, NP[kind](x, b), err_msg=kind)


@pytest.mark.parametrize("kind", ["add", "sub", "mul"])
@pytest.mark.parametrize("xs, bs", SHAPES[:8])
def test_broadcast_ops_equal_mindspores_own_forward_and_backward_bit_for_bit(kind, xs, bs):
    """``add_full`` / ``sub_full`` / ``mul_full`` on (the kernels) against MindSpore's broadcasting op (off) and
    against the Tile form (:func:`layers.full`, the kernels not built): the output and the gradients of both
    operands are equal exactly in graph mode, so the train step's losses do not change (measured: the first 20
    losses of the tiny, 27m and 42m bench models bit-identical)."""
    assert layers.prepare_broadcast() and layers._KERNELS_ON
    helper = {"add": layers.add_full, "sub": layers.sub_full, "mul": layers.mul_full}[kind]
    op = {"add": ops.Add(), "sub": ops.Sub(), "mul": ops.Mul()}[kind]
    x, b = _operands(xs, bs, seed=1)
    w = Tensor(np.random.RandomState(2).standard_normal(xs).astype(np.float32))

    def results(on):
        def loss(u, v):
            y = helper(op, u, v, on)
            return (y * y * w).sum()
        value, grads = ms.jit(ops.value_and_grad(loss, grad_position=(0, 1)))(Tensor(x), Tensor(b))
        return [value.asnumpy()] + [g.asnumpy() for g in grads]

    kernels, tiled = _with_and_without_kernels(lambda: results(True))
    own = results(False)
    for got, want, form in [(kernels, own, "MindSpore's broadcasting op"), (kernels, tiled, "the Tile form")]:
        for a, r in zip(got, want):
            assert a.shape == r.shape
            np.testing.assert_array_equal(a, r, err_msg=form)


def _with_and_without_kernels(results):
    """``results()`` with the compiled kernels, then without them (MindSpore's ops)."""
    assert layers.prepare_broadcast() and layers._KERNELS_ON
    on = results()
    layers._KERNELS_ON = False
    try:
        off = results()
    finally:
        layers._KERNELS_ON = True
    return on, off


def test_head_swap_is_numpys_transpose_and_its_gradient_mindspores(prims):
    x = np.random.RandomState(4).standard_normal((3, 5, 7, 4)).astype(np.float32)
    np.testing.assert_array_equal(_Call(prims["swap_axes_1_2"])(Tensor(x)).asnumpy(), x.transpose(0, 2, 1, 3))
    w = Tensor(np.random.RandomState(5).standard_normal((3, 7, 5, 4)).astype(np.float32))
    transpose = ops.Transpose()

    def results():
        def loss(t):
            return (layers.swap_axes_1_2(t * t, transpose, True) * w).sum()
        value, grad = ms.jit(ops.value_and_grad(loss))(Tensor(x))
        return [value.asnumpy(), grad.asnumpy()]
    on, off = _with_and_without_kernels(results)

    def own():
        def loss(t):
            return (layers.swap_axes_1_2(t * t, transpose, False) * w).sum()
        value, grad = ms.jit(ops.value_and_grad(loss))(Tensor(x))
        return [value.asnumpy(), grad.asnumpy()]
    for a, r, t in zip(on, off, own()):
        np.testing.assert_array_equal(a, r)
        np.testing.assert_array_equal(a, t)


@pytest.mark.parametrize("shape", [(12, 24), (256, 1408)])
def test_swiglu_products_equal_mindspores_two_muls_forward_and_backward(shape):
    rng = np.random.RandomState(6)
    g, u, w = (Tensor((rng.standard_normal(shape) * 3).astype(np.float32)) for _ in range(3))
    mul, act_mul, sigmoid = ops.Mul(), ops.Mul(), ops.Sigmoid()

    def results():
        def loss(a, b):
            return (layers.swiglu_product(mul, act_mul, a, sigmoid(a), b, True) * w).sum()
        value, grads = ms.jit(ops.value_and_grad(loss, grad_position=(0, 1)))(g, u)
        return [value.asnumpy()] + [t.asnumpy() for t in grads]
    on, off = _with_and_without_kernels(results)
    for a, r in zip(on, off):
        np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (8, 8, 64, 64)])
def test_softmax_backward_tail_equals_mindspores_sub_and_mul(shape):
    rng = np.random.RandomState(7)
    x, w = (Tensor((rng.standard_normal(shape) * 4).astype(np.float32)) for _ in range(2))
    softmax = layers.RowSumSoftmax(ops.Softmax())

    def results():
        def loss(t):
            return (softmax(t) * w).sum()
        value, grad = ms.jit(ops.value_and_grad(loss))(x)
        return [value.asnumpy(), grad.asnumpy()]
    on, off = _with_and_without_kernels(results)
    for a, r in zip(on, off):
        np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize("style, rotary_dim, cos_batch", [("rotate_half", 0, 1), ("interleaved", 0, 2),
                                                          ("rotate_half", 4, 2)])
def test_rope_equals_mindspores_mul_matmul_add_forward_and_backward(style, rotary_dim, cos_batch):
    """RoPE's rotation by the kernel: NumPy's ``x * cos + (x @ R) * sin`` and, backward, ``dout * cos +
    (dout * sin) @ R^T`` (exact: one nonzero per column of R), and MindSpore's own ops (``Mul``, ``MatMul``,
    ``Add`` and their derived backward), bit for bit; tables per sequence (positions given) or shared."""
    b, n, s, d = 2, 3, 8, 8
    rng = np.random.RandomState(8)
    x, dout = ((rng.standard_normal((b, n, s, d)) * 3).astype(np.float32) for _ in range(2))
    angles = rng.uniform(-7, 7, (cos_batch, 1, s, d))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    r = layers.rotation_matrix(d, style, rotary_dim)
    assert layers.prepare_broadcast()
    rope = layers.rope_kernel(r)
    assert rope is not None
    rot = (x.reshape(-1, d) @ r).reshape(x.shape)
    np.testing.assert_array_equal(rope(Tensor(x), Tensor(cos), Tensor(sin)).asnumpy(), x * cos + rot * sin)
    back = ((dout * sin).reshape(-1, d) @ r.T).reshape(x.shape)
    grad = ops.GradOperation(sens_param=True)(rope)(Tensor(x), Tensor(cos), Tensor(sin), Tensor(dout))
    np.testing.assert_array_equal(grad.asnumpy(), dout * cos + back)
    mul_cos, mul_sin, matmul, add = ops.Mul(), ops.Mul(), ops.MatMul(), ops.Add()

    tables = Tensor(r), Tensor(cos), Tensor(sin), Tensor(dout)

    def loss(t):
        flat = matmul(t.reshape(-1, d), tables[0]).reshape(t.shape)
        return (add(mul_cos(t, tables[1]), mul_sin(flat, tables[2])) * tables[3]).sum()
    own = ms.jit(ops.grad(loss))(Tensor(x))
    np.testing.assert_array_equal(own.asnumpy(), grad.asnumpy())
    assert layers.rotation_code(np.eye(d, dtype=np.float32) * 2) is None        # not a signed permutation


def test_a_model_step_is_the_same_with_and_without_the_kernels():
    """Loss and every parameter gradient of a small decoder (LayerNorm, biases, RoPE, SwiGLU, causal bias),
    built with the kernels and built without them (the Tile form): equal bit for bit."""
    from naohai.config import ModelConfig
    from naohai.model.transformer import NaohaiLM
    cfg = ModelConfig(vocab_size=64, vocab_pad_multiple=8, hidden_size=32, num_layers=2, num_heads=4,
                      ffn_hidden_size=48, seq_length=16, position="rope", activation="swiglu", norm="layernorm",
                      bias=True, compute_dtype="float32")
    cfg.validate()
    tokens = np.random.RandomState(5).randint(0, 64, (2, 17)).astype(np.int32)
    ids, labels = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])

    def step():
        model = NaohaiLM(cfg, seed=3)
        params = model.trainable_params()

        def loss(i, t):
            return model(i, t)
        value, grads = ms.jit(ops.value_and_grad(loss, None, params))(ids, labels)
        return [value.asnumpy()] + [g.asnumpy() for g in grads]

    with_kernels, without = _with_and_without_kernels(step)
    assert len(with_kernels) == len(without) > 10
    for a, r in zip(with_kernels, without):
        np.testing.assert_array_equal(a, r)


def test_the_library_is_built_once_per_cache_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("NAOHAI_CACHE_DIR", str(tmp_path))
    first = cpu_kernels.build()
    assert os.path.dirname(first) == str(tmp_path / "cpu_kernels")
    stamp = os.stat(first).st_mtime_ns
    assert cpu_kernels.build() == first and os.stat(first).st_mtime_ns == stamp
    assert os.listdir(tmp_path / "cpu_kernels") == [os.path.basename(first)]       # no temporary left


def test_without_a_compiler_the_cells_keep_the_tile_form(tmp_path):
    """No C++ compiler: a one-line notice on stderr, the kernels are off, and training still runs (the Tile
    form, the same numbers); ``NAOHAI_CPU_KERNELS=0`` turns them off without a notice."""
    code = "\n".join([
        "import numpy as np, mindspore as ms",
        "from mindspore import Tensor, ops",
        "from naohai.model import layers, cpu_kernels",
        "assert layers.prepare_broadcast() and not layers._KERNELS_ON",
        "print('why:', cpu_kernels.why_not())",
        "mul = ops.Mul()",
        "def f(x, b):",
        "    return layers.mul_full(mul, x, b, True)",
        "print(ms.jit(f)(Tensor(np.ones((4, 3), np.float32)), Tensor(np.full((3,), 2, np.float32))).asnumpy().sum())"])
    script = tmp_path / "probe.py"
    script.write_text(code + "\n")
    env = dict(os.environ, NAOHAI_CACHE_DIR=str(tmp_path), CXX="no-such-c++-compiler")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "why: no C++ compiler 'no-such-c++-compiler' on PATH" in done.stdout
    assert done.stdout.strip().endswith("24.0")
    assert "naohai: the compiled CPU kernels are not used (no C++ compiler" in done.stderr
    env = dict(os.environ, NAOHAI_CACHE_DIR=str(tmp_path), NAOHAI_CPU_KERNELS="0")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "why: NAOHAI_CPU_KERNELS=0" in done.stdout and "not used" not in done.stderr
    assert not (tmp_path / "cpu_kernels").exists()


@pytest.mark.parametrize("value", ["2", "yes", "nan", "1e999", " 0x1"])
def test_other_values_of_the_switch_are_refused(monkeypatch, value):
    monkeypatch.setenv("NAOHAI_CPU_KERNELS", value)
    with pytest.raises(UserError) as e:
        cpu_kernels.enabled()
    assert "NAOHAI_CPU_KERNELS" in str(e.value) and "is not 0 or 1" in str(e.value)


class _WriteColumn(nn.Cell):
    def __init__(self, on):
        super().__init__()
        self.on = on

    def construct(self, past, new, slot):
        return layers.write_column(past, new, slot, self.on)


@pytest.mark.parametrize("columns", [[5], [0], [15], [], [2, 9]])
def test_cache_column_write_equals_mindspores_select(prims, columns):
    """The generation cache's write: the kernel's copy against ops.select over the broadcast operands (the
    form without kernels) and NumPy's indexing, bit for bit; a slot with no or two true columns included."""
    rng = np.random.RandomState(8)
    past = rng.standard_normal((2, 3, 16, 8)).astype(np.float32)
    past[0, 0, 1, 0] = np.nan                           # copied bits, not arithmetic
    new = rng.standard_normal((2, 3, 1, 8)).astype(np.float32)
    slot = np.zeros((1, 1, 16, 1), np.bool_)
    slot[0, 0, columns, 0] = True
    args = Tensor(past), Tensor(new), Tensor(slot)
    kernel, select = _WriteColumn(True)(*args).asnumpy(), _WriteColumn(False)(*args).asnumpy()
    expected = past.copy()
    expected[:, :, columns, :] = new
    assert kernel.tobytes() == select.tobytes() == expected.tobytes()


def test_operands_a_kernel_does_not_take_fail_the_launch(prims):
    """A kernel given operands it does not take (never passed by the cells) returns 1, and MindSpore stops with an
    error naming it instead of going on with an unwritten output."""
    past = Tensor(np.zeros((2, 3, 16, 8), np.float32))
    wrong = Tensor(np.zeros((2, 3, 2, 8), np.float32))                   # two columns, not one
    slot = Tensor(np.zeros((1, 1, 16, 1), np.bool_))
    with pytest.raises(RuntimeError, match="NaohaiWriteColumn"):
        prims["write_column"](past, wrong, slot).asnumpy()


def _split_cases():
    """Inputs (large enough for every kernel to split its rows on two cores) by primitive name."""
    rng = np.random.RandomState(11)

    def f(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    code = np.array([-(k + 17) if k < 16 else k - 15 for k in range(32)], np.int32)      # rotate_half's signs
    causal = np.where(np.tril(np.ones((128, 128), bool)), 0.0, -1e9).astype(np.float32)
    return {"add": [f(2048, 512), f(512)],
            "swap_axes_1_2": [f(16, 128, 4, 32)],
            "swiglu_grad": [f(2048, 352), f(2048, 352), f(2048, 352), f(2048, 352)],
            "rope": [f(16, 4, 128, 32), f(1, 1, 128, 32), f(1, 1, 128, 32), code],
            "rope_grad": [f(16, 4, 128, 32), f(1, 1, 128, 32), f(1, 1, 128, 32), code],
            "layer_norm": [f(2048, 128, scale=3.0), f(128), f(128), np.array([1e-5], np.float32)],
            "layer_norm_grad": [f(2048, 128), f(2048, 128, scale=3.0), f(128), np.array([1e-5], np.float32)],
            "rms_norm_grad": [f(2048, 128), f(2048, 128, scale=3.0), f(128), np.array([1e-6], np.float32)],
            "scaled_softmax": [f(4, 4, 128, 128, scale=4.0), causal, np.array([0.17], np.float32)],
            "scaled_softmax_grad": [f(4, 4, 128, 128), np.abs(f(4, 4, 128, 128)), np.array([0.17], np.float32)],
            "silu_product": [f(2048, 352, scale=3.0), f(2048, 352)],
            "silu_product_grad": [f(2048, 352), f(2048, 352, scale=3.0), f(2048, 352)],
            "softmax_cross_entropy": [f(256, 2048, scale=5.0), rng.randint(0, 2048, 256).astype(np.int32),
                                      np.array([1 / 256], np.float32)]}


_SINGLE_THREAD = r"""
import ctypes, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
lib.NaohaiKernelThreads.restype = ctypes.c_int64
assert lib.NaohaiKernelThreads() == 0          # no MindSpore here: every call runs on this thread
data = np.load(sys.argv[2], allow_pickle=True)
for name, entry in data["entries"]:
    ins = [data[f"{name}:in{i}"] for i in range(int(data[f"{name}:nin"]))]
    want = [data[f"{name}:out{i}"] for i in range(int(data[f"{name}:nout"]))]
    outs = [np.empty_like(w) for w in want]
    arrays = [np.ascontiguousarray(a) for a in ins] + outs
    n = len(arrays)
    shapes = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    rc = getattr(lib, entry)(n, (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
                             (ctypes.c_int * n)(*[a.ndim for a in arrays]),
                             (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64))
                                                                    for s in shapes]),
                             (ctypes.c_char_p * n)(*[str(a.dtype).encode() for a in arrays]), None, None)
    assert rc == 0, name
    for o, w in zip(outs, want):
        assert o.tobytes() == w.tobytes(), name
print("same", len(data["entries"]))
"""


def test_kernels_split_over_mindspores_threads_give_the_one_thread_results(prims, tmp_path):
    """In a MindSpore process the kernels hand part of their rows to MindSpore's CPU thread pool (they find it
    by its exported symbols); each row is still computed whole by one thread, with the caller's floating-point
    mode, so the results are those of one thread: every output equals, bit for bit, the same kernel's called in
    a process without MindSpore (where it finds no pool and runs every row itself)."""
    import ctypes
    ms.set_context(mode=ms.GRAPH_MODE)
    lib = ctypes.CDLL(cpu_kernels.build())
    lib.NaohaiKernelThreads.restype = lib.NaohaiKernelSplits.restype = ctypes.c_int64
    cases = _split_cases()
    splits = lib.NaohaiKernelSplits()
    saved = {"entries": np.array([(name, cpu_kernels.ENTRY[name][0]) for name in cases])}
    for name, ins in cases.items():
        out = _Call(prims[name])(*[Tensor(a) for a in ins])
        outs = [o.asnumpy() for o in (out if isinstance(out, tuple) else (out,))]
        assert all(np.isfinite(o).all() for o in outs), name
        saved.update({f"{name}:nin": len(ins), f"{name}:nout": len(outs)})
        saved.update({f"{name}:in{i}": a for i, a in enumerate(ins)})
        saved.update({f"{name}:out{i}": o for i, o in enumerate(outs)})
    threads = lib.NaohaiKernelThreads()
    kernel_threads = sum(open(f"/proc/self/task/{t}/comm").read().startswith("KernelThread_")
                         for t in os.listdir("/proc/self/task"))
    assert threads == min(len(os.sched_getaffinity(0)), kernel_threads + 1)       # its idle threads and the caller
    if threads > 1:                                  # CI's 2 cores: every case above was split
        assert lib.NaohaiKernelSplits() - splits >= len(cases)
    np.savez(tmp_path / "cases.npz", **saved)
    (tmp_path / "single.py").write_text(_SINGLE_THREAD)
    done = subprocess.run([sys.executable, str(tmp_path / "single.py"), cpu_kernels.build(),
                           str(tmp_path / "cases.npz")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["same", str(len(cases))]
