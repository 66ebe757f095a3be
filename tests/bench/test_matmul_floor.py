"""The matmul floor: the products read from a compiled graph, and the two sides running the same products."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from naohai.bench import matmul_floor as mf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: a forward and backward of x @ w.T and of a batched product, compiled with graph saving on (in a process of
#: its own: save_graphs is global to MindSpore's context)
SCRIPT = r"""
import sys, mindspore as ms, numpy as np
from mindspore import nn, ops, Tensor, Parameter
ms.set_context(mode=ms.GRAPH_MODE, save_graphs=True, save_graphs_path=sys.argv[1])
class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.w = Parameter(Tensor(np.ones((5, 6), np.float32)), name="w")
        self.v = Parameter(Tensor(np.ones((2, 5, 7), np.float32)), name="v")
        self.mm = ops.MatMul(transpose_b=True)
        self.bmm = ops.BatchMatMul()
    def construct(self, x):
        y = self.mm(x, self.w)                               # [4, 6] x [5, 6]^T -> [4, 5]
        z = self.bmm(ops.reshape(y, (2, 2, 5)), self.v)      # [2, 2, 5] x [2, 5, 7] -> [2, 2, 7]
        return z.sum()
net = Net()
grad = ms.value_and_grad(net, None, net.trainable_params())
print(grad(Tensor(np.ones((4, 6), np.float32)))[0])
"""


def test_products_of_a_compiled_forward_and_backward(tmp_path):
    """Each product of the forward appears with those of its backward that the gradients need (dA = dC B^T,
    dB = A^T dC; the input x is not differentiated, so x @ w.T has no dx), read from the kernel graph MindSpore
    compiled: shapes, transposes and FLOPs."""
    script = tmp_path / "net.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ir")], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert res.returncode == 0, res.stderr[-2000:]
    with open(mf.largest_kernel_graph(str(tmp_path / "ir")), encoding="utf-8") as fh:
        products = mf.matmuls_of_ir(fh.read())
    flat = [p for p in products if not p.batched]
    batched = [p for p in products if p.batched]
    assert len(flat) == 2 and len(batched) == 3, products
    fwd = mf.Product(False, (4, 6), (5, 6), False, True)
    assert fwd in flat
    # the results' shapes, whatever operand order and transposes MindSpore's bprop picks: y, then dw
    assert sorted(_result_shape(p) for p in flat) == [(4, 5), (5, 6)]
    assert sorted(_result_shape(p) for p in batched) == [(2, 2, 5), (2, 2, 7), (2, 5, 7)]
    assert sum(p.flops() for p in flat) == 2 * 2 * 4 * 5 * 6
    assert sum(p.flops() for p in batched) == 3 * 2 * 2 * 2 * 5 * 7
    # helpers: the backward's batched products take the sum's gradient, a constant of ones (folded in); the
    # forward products and dw (from the computed dy) are the model's own
    assert not any(p.helper for p in flat)
    assert [p.helper for p in batched if p == mf.Product(True, (2, 2, 5), (2, 5, 7), False, False)] == [False]
    assert sorted(p.helper for p in batched) == [False, True, True]


def _result_shape(p):
    m, n, _ = p.mnk()
    return tuple(p.a[:-2]) + (m, n)


def test_no_kernel_graph_is_an_error(tmp_path):
    with pytest.raises(RuntimeError, match="no kernel graph"):
        mf.largest_kernel_graph(str(tmp_path))


CASES = [mf.Product(False, (8, 6), (5, 6), False, True), mf.Product(False, (8, 6), (8, 5), True, False),
         mf.Product(True, (2, 3, 4), (2, 5, 4), False, True), mf.Product(False, (8, 6), (6, 5), False, False)]


@pytest.mark.parametrize("last", range(len(CASES)))
def test_both_sides_compute_the_same_products(last):
    """MindSpore's graph and PyTorch's loop give the last product NumPy gives on the same operands."""
    torch = pytest.importorskip("torch")   # the bench extra; the test extra installs it
    del torch
    products = CASES[:last + 1]
    pairs, index = mf._operands(products)
    p = products[-1]
    a, b = pairs[index[(p.a, p.b)]]
    want = np.matmul(np.swapaxes(a, -1, -2) if p.transpose_a else a, np.swapaxes(b, -1, -2) if p.transpose_b else b)
    import mindspore as ms
    # the device before this process's first kernel, as naohai's commands set it: a later test module's
    # set_device("CPU") in the same pytest worker is then still allowed (MindSpore refuses it once kernels ran)
    ms.set_device("CPU")
    mode = ms.get_context("mode")
    got_ms = mf.mindspore_products(products)()
    assert ms.get_context("mode") == mode          # compiled with jit; the test process's context is left alone
    got_torch = mf.torch_products(products)().numpy()
    np.testing.assert_allclose(got_ms, want, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(got_torch, want, rtol=1e-5, atol=1e-9)


def test_products_file_round_trip(tmp_path):
    mf.save_products(CASES, str(tmp_path / "p.json"))
    assert mf.load_products(str(tmp_path / "p.json")) == CASES
    assert json.loads((tmp_path / "p.json").read_text())[2] == [True, [2, 3, 4], [2, 5, 4], False, True, False]
    (tmp_path / "old.json").write_text("[[false, [8, 6], [5, 6], false, true]]")      # written before `helper`
    assert mf.load_products(str(tmp_path / "old.json")) == CASES[:1]


def test_helpers_are_products_with_a_size_of_one():
    """A row sum (one column out) or a column broadcast back (inner size 1) is a helper, without a constant."""
    abstract = "      : (<Tensor[Float32], {a}>, <Tensor[Float32], {b}>, <Bool, NoShape>, <Bool, NoShape>) -> (x)"
    calls = [("(2048, 512)", "(512, 1)", 0), ("(2048, 1)", "(512, 1)", 1), ("(2048, 512)", "(512, 512)", 1)]
    text = "\n".join(f"  %{i}(y) = PrimFunc_MatMul(%a, %b, Bool(0), Bool({tb})) {{instance name: y}}\n"
                     + abstract.format(a=a, b=b) for i, (a, b, tb) in enumerate(calls))
    got = mf.matmuls_of_ir(text)
    assert [p.mnk() for p in got] == [(2048, 1, 512), (2048, 512, 1), (2048, 512, 512)]
    assert [p.helper for p in got] == [True, True, False]


@pytest.mark.slow
def test_tiny_rows_products_are_the_models_flops_and_run_in_a_worker(tmp_path):
    """The bench row tiny's compiled step, read back: its model products hold the PaLM count of training FLOPs
    (6 x the matrix parameters + 12 L h s per token; the flops module's count less the norms' and biases'
    vectors, which multiply nothing) and it has no other products, and the floor worker runs them in rounds."""
    from naohai.bench.models import bench_models
    from naohai.model.flops import LOOKUP_ONLY, flops_per_token
    from naohai.model.params import param_shapes
    bm = bench_models()["tiny"]
    got = mf.extract_in_child("tiny", str(tmp_path))
    model = [p for p in got["products"] if not p.helper]
    vectors = sum(p.size for p in param_shapes(bm.model) if len(p.shape) == 1 and not p.name.endswith(LOOKUP_ONLY))
    tokens = bm.batch * bm.seq
    assert sum(p.flops() for p in model) == (flops_per_token(bm.model) - 6 * vectors) * tokens
    # the bench's train.cpu_reductions: fused takes the norms, the softmax and RoPE by kernels: no helper products
    assert got["count"] == len(model) and got["helpers"] == len(got["products"]) - len(model) == 0
    worker = mf.FloorWorker("mindspore", got["path"], str(tmp_path), "tiny")
    try:
        assert worker.ready["products"] == len(model)
        ans = worker.request(cmd="round", steps=2)
        assert len(ans["times"]) == 2 and all(t > 0 for t in ans["times"]) and ans["peak_rss"] > 0
    finally:
        worker.close()
