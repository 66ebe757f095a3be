"""The matmul floor of a train step: its matrix products alone, on MindSpore and on PyTorch.

Issue 30 asks, where naohai's step does not beat PyTorch's, for the profile that says why.  This measures the
part of the step that the two sides share and cannot fuse away: the model's matrix products, forward and
backward, exactly as MindSpore compiled them for naohai's train step (``MatMul`` and ``BatchMatMul``, shapes
and transposes read from the compiled kernel graph; not the *helper* products, with which naohai computes
row sums, broadcasts and RoPE's rotation and PyTorch does not), run back to back with nothing else -- on
MindSpore (one compiled graph of those products in order) and on PyTorch (``torch.matmul`` on the same
shapes and transposes).  With naohai's and PyTorch's whole steps measured in the same rounds, ``step -
floor`` is each side's time outside the model's matmuls.

- :func:`matmuls_of_ir` reads the products of a kernel graph that MindSpore wrote with ``save_graphs``;
  :func:`extract` compiles and runs one step of the bench row (:class:`naohai.bench.naohai_row.NaohaiRun`)
  with graph saving on, in a temporary folder that it deletes, and returns the train step's products (the
  largest kernel graph: the train step's, larger than the evaluation step's).
- ``python -m naohai.bench.matmul_floor extract MODEL OUT.json`` writes them; ``python -m
  naohai.bench.matmul_floor worker mindspore|torch PRODUCTS.json`` is a benchmark worker
  (:mod:`naohai.bench.worker`'s protocol) whose round runs the products ``steps`` times.
- :func:`extract_in_child` and :class:`FloorWorker` are the parent's side, which :mod:`naohai.bench.suite` runs
  beside each model's rows (rounds alternating); :func:`summary` is the report's table row.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

from naohai.bench.process import WorkerProcess, worker_env


class Product(NamedTuple):
    """One ``MatMul`` (2-D operands) or ``BatchMatMul`` of a compiled graph.  ``helper``: a product that stands
    in for another op -- one operand a constant (a norm's column of 1/hidden, RoPE's rotation) or an inner or
    outer size of 1 (row sums, a column broadcast back): the model's math does not need it, PyTorch's step
    has none of it."""
    batched: bool
    a: Tuple[int, ...]
    b: Tuple[int, ...]
    transpose_a: bool
    transpose_b: bool
    helper: bool = False

    def mnk(self) -> Tuple[int, int, int]:
        """Rows and columns of the result, and the inner size."""
        return (self.a[-1] if self.transpose_a else self.a[-2], self.b[-2] if self.transpose_b else self.b[-1],
                self.a[-2] if self.transpose_a else self.a[-1])

    def flops(self) -> int:
        m, n, k = self.mnk()
        batch = 1
        for d in self.a[:-2]:
            batch *= d
        return 2 * batch * m * n * k


_CALL = re.compile(r"= PrimFunc_(MatMul|BatchMatMul)\(")
_FLAGS = re.compile(r"Bool\(([01])\), Bool\(([01])\)\)")
_SHAPE = re.compile(r"<Tensor\[Float32\], \(([\d, ]+)\)")


def matmuls_of_ir(text: str) -> List[Product]:
    """The fp32 ``MatMul`` / ``BatchMatMul`` calls of one IR file, in its order: the transposes from the call's
    last two arguments (a constant operand may print over several lines), the operand shapes from the
    call's abstract, the first line after it that starts with ``: (``."""
    lines = text.split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = _CALL.search(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].lstrip().startswith(": ("):
            j += 1
        call = " ".join(lines[i:j])
        flags = _FLAGS.findall(call)
        shapes = _SHAPE.findall(lines[j]) if j < len(lines) else []
        if flags and len(shapes) >= 2:
            a, b = (tuple(int(x) for x in s.split(",")) for s in shapes[:2])
            p = Product(m.group(1) == "BatchMatMul", a, b, flags[-1][0] == "1", flags[-1][1] == "1")
            out.append(p._replace(helper="Tensor(shape=" in call or 1 in p.mnk()))
        i = j
    return out


def largest_kernel_graph(folder: str) -> str:
    """The largest kernel graph MindSpore saved in ``folder`` (after its last backend pass)."""
    files = glob.glob(os.path.join(folder, "hwopt_comm_after_eliminate_nopnode_kernel_graph*.ir"))
    if not files:
        raise RuntimeError(f"MindSpore saved no kernel graph in {folder}")
    return max(files, key=os.path.getsize)


def extract(model: str) -> List[Product]:
    """The products of the bench row ``model``'s compiled train step (one step run with graph saving on)."""
    import mindspore as ms
    from naohai.bench.models import bench_models
    from naohai.bench.naohai_row import NaohaiRun

    work = tempfile.mkdtemp(prefix="naohai-floor-")
    try:
        ms.set_context(save_graphs=True, save_graphs_path=os.path.join(work, "ir"))
        NaohaiRun(bench_models()[model], work, 0.2).round(1)
        with open(largest_kernel_graph(os.path.join(work, "ir")), encoding="utf-8", errors="replace") as fh:
            return matmuls_of_ir(fh.read())
    finally:
        shutil.rmtree(work, ignore_errors=True)


def save_products(products: Sequence[Product], path: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump([list(p) for p in products], fh)


def load_products(path: str) -> List[Product]:
    with open(path, encoding="utf-8") as fh:
        return [Product(bool(p[0]), tuple(p[1]), tuple(p[2]), bool(p[3]), bool(p[4]), bool(p[5:6] and p[5]))
                for p in json.load(fh)]


def extract_in_child(model: str, workdir: str) -> Dict[str, Any]:
    """:func:`extract` in a process of its own (graph saving is global to MindSpore's context): the products'
    file, the products and their GFLOP."""
    path = os.path.join(workdir, f"matmuls-{model}.json")
    log_path = os.path.join(workdir, f"matmuls-{model}.log")
    with open(log_path, "w", encoding="utf-8") as log:
        rc = subprocess.run([sys.executable, "-m", "naohai.bench.matmul_floor", "extract", model, path],
                            stdout=log, stderr=subprocess.STDOUT, env=worker_env()).returncode
    if rc != 0:
        raise RuntimeError(f"reading {model}'s matmuls failed (exit {rc}; log: {log_path})")
    products = load_products(path)
    own = [p for p in products if not p.helper]
    return {"path": path, "products": products, "gflop": sum(p.flops() for p in own) / 1e9,
            "count": len(own), "helpers": len(products) - len(own)}


class FloorWorker(WorkerProcess):
    """The products of a step alone on ``side`` (``mindspore`` or ``torch``), as a benchmark worker."""

    def __init__(self, side: str, products_path: str, workdir: str, model: str):
        super().__init__(f"matmul floor {side}", ["naohai.bench.matmul_floor", "worker", side, products_path],
                         os.path.join(workdir, f"worker-{model}-{side}-products.log"))


def summary(products: Dict[str, Any], seconds: Dict[str, List[float]]) -> Dict[str, Any]:
    """The report's figures: per worker the median and the fastest of its timed steps over all rounds, and each
    side's step median less its products' median (``outside``: the time a step spends outside its matmuls)."""
    med = {k: statistics.median(v) for k, v in seconds.items() if v}
    pairs = {"naohai": "mindspore products", "eager": "torch products", "compile": "torch products"}
    return {"count": products["count"], "helpers": products["helpers"], "gflop": products["gflop"], "median_s": med,
            "fastest_s": {k: min(v) for k, v in seconds.items() if v},
            "outside_s": {k: med[k] - med[f] for k, f in pairs.items() if k in med and f in med}}


def _operands(products: Sequence[Product]) -> Tuple[List[Tuple], Dict[Tuple, int]]:
    """One pair of random operands per distinct (shape, shape) -- kept small: values ~0.01."""
    import numpy as np
    rng = np.random.default_rng(0)
    keys = sorted({(p.a, p.b) for p in products})
    pairs = [(rng.standard_normal(a).astype(np.float32) * 0.01, rng.standard_normal(b).astype(np.float32) * 0.01)
             for a, b in keys]
    return pairs, {k: i for i, k in enumerate(keys)}


def mindspore_products(products: Sequence[Product]):
    """A callable running the products in order as one compiled MindSpore graph (``jit``: in either mode, the
    context left as it is); each product waits for the one before (``ops.depend``), as in the train step, where
    MindSpore's CPU runtime runs kernels one at a time, and equal products on equal operands stay distinct
    kernels."""
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    pairs, index = _operands(products)
    args = [Tensor(x) for pair in pairs for x in pair]
    kernels = [(ops.BatchMatMul if p.batched else ops.MatMul)(transpose_a=p.transpose_a, transpose_b=p.transpose_b)
               for p in products]
    slots = [index[(p.a, p.b)] for p in products]

    class Products(nn.Cell):
        def __init__(self):
            super().__init__()
            self.kernels = kernels
            self.slots = slots

        @ms.jit
        def construct(self, *xs):
            out = xs[0]
            for j in range(len(self.slots)):
                i = self.slots[j]
                out = self.kernels[j](ops.depend(xs[2 * i], out), xs[2 * i + 1])
            return out

    graph = Products()
    return lambda: graph(*args).asnumpy()


def torch_products(products: Sequence[Product]):
    """A callable running the products in order with ``torch.matmul`` (transposes as views, as PyTorch's
    ``linear`` and its backward take them)."""
    import torch
    pairs, index = _operands(products)
    tensors = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in pairs]
    plan = []
    for p in products:
        a, b = tensors[index[(p.a, p.b)]]
        plan.append((a.transpose(-1, -2) if p.transpose_a else a, b.transpose(-1, -2) if p.transpose_b else b))

    def run():
        with torch.no_grad():
            for a, b in plan:
                out = torch.matmul(a, b)
        return out
    return run


def main(argv) -> int:
    if argv[:1] == ["extract"] and len(argv) == 3:
        products = extract(argv[1])
        save_products(products, argv[2])
        helpers = sum(p.helper for p in products)
        print(f"{len(products) - helpers} products of the model, {helpers} helpers -> {argv[2]}")
        return 0
    if argv[:1] == ["worker"] and len(argv) == 3 and argv[1] in ("mindspore", "torch"):
        from naohai.bench.worker import peak_rss_bytes, say
        if argv[1] == "mindspore":
            import mindspore as ms
            ms.set_context(mode=ms.GRAPH_MODE)  # the train step's mode
        products = [p for p in load_products(argv[2]) if not p.helper]
        run = (mindspore_products if argv[1] == "mindspore" else torch_products)(products)
        run()                                   # the compile (MindSpore), first touches (both)
        say({"ready": True, "products": len(products)})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] != "round":
                say({"bye": True})
                break
            times = []
            for _ in range(int(cmd["steps"])):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            say({"times": times, "first_step_s": None, "peak_rss": peak_rss_bytes()})
        return 0
    sys.stderr.write("usage: python -m naohai.bench.matmul_floor extract MODEL OUT.json | "
                     "worker mindspore|torch PRODUCTS.json\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
