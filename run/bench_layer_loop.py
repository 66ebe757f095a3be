"""Design probe (not a test, not product code): decoder layers as a graph-mode loop.

Issue 11 asks for 64 layers to compile within 1.5x of 4 layers. With one cell per layer
(``train.layer_loop: never``) MindSpore 2.10 on CPU compiles them with
``lazy_inline(policy="front")``, and compile time grows with depth (README, benchmark
section). This script measured the alternative on a stand-in block before naohai's model
took it up (``naohai/model/stack.py``, ``naohai bench`` times the real step): one
transformer block written once, run by a ``while`` loop over a tensor counter, with each
weight kind stored as one stacked Parameter ``[layers, ...]`` and picked per iteration by
``Gather``.

Forms, each compiled in a fresh process (one CPU device, graph mode, AdamW through
``nn.TrainOneStepCell``):
- ``loop``: stacked weights, ``while i < layers`` loop;
- ``unrolled``: the same stacked weights, a Python ``for`` (one copy of the block per layer);
- ``per-layer``: one Parameter per layer and kind (as ``layer_loop: never`` has), stacked inside
  the graph, then the same ``while`` loop: the optimizer sees one tensor per layer again.

The block is pre-LayerNorm attention (fused q/k/v with bias, causal softmax) and a SwiGLU
MLP with a tied head, the shape of naohai's tiny family without RoPE. ``loop``,
``unrolled`` and ``per-layer`` start from the same weights and batch, so their losses must
agree: the first (before any update) and, with ``--steps``, the last (printed).

``--semi-auto`` instead compiles a two-matmul block (stacked weights, ``loop`` and
``unrolled``) on 2 simulated GPUs under semi-auto parallel (``naohai.simulate``), once data
parallel and once with the weights split over the 2 devices, and prints each rank's verdict and
the IR checks' (Send/Receive pairing, the same collectives in every group) for graphs that compiled.

``--trainer`` instead times naohai's own train step (``naohai.train.builder.build`` on the tiny
recipe, ``CompiledSteps.train``) with ``train.layer_loop`` ``never`` and ``always``, each form in a fresh
process, rounds alternating between the forms; it prints ms per step (best round) and the last loss.

Usage::

    python run/bench_layer_loop.py                        # compile, 4/16/64 layers, probe size
    python run/bench_layer_loop.py --steps 20 --size tiny --layers 4 16   # also ms per step
    python run/bench_layer_loop.py --size 42m --layers 8 --steps 4 --forms loop unrolled
    python run/bench_layer_loop.py --semi-auto
    python run/bench_layer_loop.py --trainer --layers 4 16 32 --steps 10
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

SIZES = {  # hidden, heads, ffn, vocab, seq, batch
    "probe": (64, 2, 128, 256, 32, 2),       # naohai.bench.compile_time's probe model
    "tiny": (128, 4, 352, 2048, 128, 16),    # the tiny preset
    "42m": (512, 8, 1408, 32128, 256, 8),    # the bench's 42m model
}
FORMS = ("loop", "unrolled", "per-layer")


def probe(form: str, layers: int, size: str, steps: int) -> dict:
    """In this process: build ``form`` with ``layers`` layers, time compile (and steps)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    hidden, heads, ffn, vocab, seq, batch = SIZES[size]
    rng = np.random.default_rng(0)
    kinds = {  # name: (shape of one layer's tensor, init: None = normal(0, 0.02), else constant)
        "wqkv": ((hidden, 3 * hidden), None), "bqkv": ((3 * hidden,), 0.0),
        "wo": ((hidden, hidden), None), "bo": ((hidden,), 0.0),
        "wgu": ((hidden, 2 * ffn), None), "wd": ((ffn, hidden), None),
        "g1": ((hidden,), 1.0), "b1": ((hidden,), 0.0), "g2": ((hidden,), 1.0), "b2": ((hidden,), 0.0),
    }
    stacked = {}
    for name, (shape, const) in kinds.items():
        full = (layers,) + shape
        stacked[name] = (np.full(full, const, np.float32) if const is not None
                         else (rng.standard_normal(full) * 0.02).astype(np.float32))
    emb = (rng.standard_normal((vocab, hidden)) * 0.02).astype(np.float32)
    head_dim = hidden // heads

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.emb = Parameter(Tensor(emb), name="emb")
            self.gf = Parameter(Tensor(np.ones(hidden, np.float32)), name="gf")
            self.bf = Parameter(Tensor(np.zeros(hidden, np.float32)), name="bf")
            if form == "per-layer":
                self.per = ms.ParameterTuple([Parameter(Tensor(stacked[k][j]), name=f"layers.{j}.{k}")
                                              for k in kinds for j in range(layers)])
            else:
                self.stk = ms.ParameterTuple([Parameter(Tensor(stacked[k]), name=k) for k in kinds])
            self.count = Tensor(layers, ms.int32)
            self.mask = Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))
            self.ln = ops.LayerNorm(-1, -1, 1e-5)

        def block(self, x, i, w):
            wqkv, bqkv, wo, bo, wgu, wd, g1, b1, g2, b2 = [ops.gather(t, i, 0) for t in w]
            h = self.ln(x, g1, b1)[0]
            q, k, v = ops.split(ops.matmul(h, wqkv) + bqkv, hidden, -1)
            q, k, v = [t.reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3) for t in (q, k, v)]
            scores = ops.matmul(q, k.swapaxes(-1, -2)) * (1.0 / float(np.sqrt(head_dim))) + self.mask
            o = ops.matmul(ops.softmax(scores, -1), v).transpose(0, 2, 1, 3).reshape(batch * seq, hidden)
            x = x + ops.matmul(o, wo) + bo
            gate, up = ops.split(ops.matmul(self.ln(x, g2, b2)[0], wgu), ffn, -1)
            return x + ops.matmul(ops.silu(gate) * up, wd)

        def construct(self, ids, labels):
            x = ops.gather(self.emb, ids.reshape(-1), 0)
            if form == "per-layer":
                w = [ops.stack([self.per[k * layers + j] for j in range(layers)]) for k in range(len(kinds))]
            else:
                w = list(self.stk)
            if form == "unrolled":
                for j in range(layers):
                    x = self.block(x, Tensor(j, ms.int32), w)
            else:
                i = Tensor(0, ms.int32)
                while i < self.count:
                    x = self.block(x, i, w)
                    i = i + 1
            logp = ops.log_softmax(ops.matmul(self.ln(x, self.gf, self.bf)[0], self.emb.T), -1)
            return -ops.gather_elements(logp, 1, labels.reshape(-1, 1)).mean()

    net = Net()
    step = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 1e-3))
    ids = Tensor(rng.integers(0, vocab, (batch, seq)).astype(np.int32))
    labels = Tensor(np.roll(ids.asnumpy(), -1, axis=1))
    t0 = time.perf_counter()
    step.compile(ids, labels)
    compile_s = time.perf_counter() - t0
    out = {"form": form, "layers": layers, "size": size, "params": len(net.trainable_params()),
           "compile_s": compile_s, "first_loss": float(step(ids, labels).asnumpy())}
    if steps:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = step(ids, labels)
            loss.asnumpy()
            best = min(best, (time.perf_counter() - t0) / steps)
        out["ms_per_step"] = best * 1e3
        out["last_loss"] = float(loss.asnumpy())
    import resource
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return out


def sharded_loop(layers: int = 4, loop: bool = True, model_parallel: bool = True):
    """Simulated-device compile target: ``layers`` two-matmul blocks over stacked weights."""
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops
    from mindspore.parallel.auto_parallel import AutoParallel

    mp = 2 if model_parallel else 1
    dp = 2 // mp

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1 = Parameter(Tensor(np.full((layers, 64, 128), 0.01, np.float32)), name="w1")
            self.w2 = Parameter(Tensor(np.full((layers, 128, 64), 0.01, np.float32)), name="w2")
            self.pick1 = ops.Gather().shard(((1, 1, mp), ()))
            self.pick2 = ops.Gather().shard(((1, mp, 1), ()))
            self.up = ops.MatMul().shard(((dp, 1), (1, mp)))
            self.act = ops.Tanh().shard(((dp, mp),))
            self.down = ops.MatMul().shard(((dp, mp), (mp, 1)))
            self.count = Tensor(layers, ms.int32)

        def block(self, x, i):
            return self.down(self.act(self.up(x, self.pick1(self.w1, i, 0))), self.pick2(self.w2, i, 0))

        def construct(self, x):
            if loop:
                i = Tensor(0, ms.int32)
                while i < self.count:
                    x = self.block(x, i)
                    i = i + 1
            else:
                for j in range(layers):
                    x = self.block(x, Tensor(j, ms.int32))
            return x.sum()

    net = Net()
    step = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), 1e-3))
    return AutoParallel(step, parallel_mode="semi_auto"), (Tensor(np.ones((16, 64), np.float32)),)


def semi_auto() -> int:
    import tempfile
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from naohai.simulate.harness import run_compile

    work = Path(tempfile.mkdtemp(prefix="naohai-layer-loop-"))
    print("| form | layout | rank 0 | rank 1 | IR checks |\n|---|---|---|---|---|")
    for loop in (True, False):
        for mp in (False, True):
            out = work / f"{'loop' if loop else 'unrolled'}-{'mp2' if mp else 'dp2'}"
            rep = run_compile("bench_layer_loop:sharded_loop", 2, out, timeout=600,
                              kwargs={"loop": loop, "model_parallel": mp}, sys_path=[str(Path(__file__).parent)],
                              ir_check={"stages": 1, "clip": False})
            checks = "-" if rep.ir_checks is None else ("passed" if rep.ir_checks.get("passed") else "FAILED")
            print(f"| {'loop' if loop else 'unrolled'} | {'weights split over 2' if mp else 'data parallel 2'} | "
                  + " | ".join(r.verdict() for r in rep.per_rank) + f" | {checks} |")
    print(f"(logs under {work})")
    return 0


def trainer_probe(form: str, layers: int, steps: int) -> dict:
    """In this process: naohai's tiny train step with ``layers`` layers, ``train.layer_loop: form``."""
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import numpy as np
    import mindspore as ms
    from naohai.config import load_recipe
    from naohai.strategy.run_plan import plan_run
    from naohai.train.builder import build

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    recipe = load_recipe(str(Path(__file__).resolve().parents[1] / "recipes" / "tiny.yaml"),
                         [f"train.layer_loop={form}", f"model.num_layers={layers}"])
    built = build(plan_run(recipe))
    batch = np.random.RandomState(0).randint(0, recipe.model.vocab_size,
                                             (recipe.train.global_batch_size, recipe.model.seq_length + 1))
    built.steps.train(batch)                      # compile and first step, not timed
    t0 = time.perf_counter()
    for _ in range(steps):
        out = built.steps.train(batch)
    return {"form": form, "layers": layers, "loop": built.model.layer_loop,
            "ms_per_step": (time.perf_counter() - t0) / steps * 1e3, "loss": out.loss}


def trainer(layers, steps: int, rounds: int = 3) -> int:
    print("| layers | one cell per layer, ms / step | loop, ms / step | loop / cells | last losses |\n|---|---|---|---|---|")
    for n in layers:
        best = {}
        for _ in range(rounds):
            for form in ("never", "always"):
                r = child_result(["--trainer-probe", form, str(n), str(steps)])
                if "error" in r:
                    print(f"| {n} | {form} failed: {r['error']} |")
                    return 1
                if form not in best or r["ms_per_step"] < best[form]["ms_per_step"]:
                    best[form] = r
        a, b = best["never"], best["always"]
        print(f"| {n} | {a['ms_per_step']:.1f} | {b['ms_per_step']:.1f} | {b['ms_per_step'] / a['ms_per_step']:.2f} "
              f"| {a['loss']:.6f} / {b['loss']:.6f} |")
    return 0


def child_result(args) -> dict:
    """This script run with ``args`` in a fresh process: its last JSON line, or ``{"error": ...}``."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"exit {proc.returncode}: {tail}"}


def measure(form: str, layers: int, size: str, steps: int) -> dict:
    return {"form": form, "layers": layers, "size": size,
            **child_result(["--probe", form, str(layers), size, str(steps)])}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--trainer-probe":
        print(json.dumps(trainer_probe(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))), flush=True)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        form, layers, size, steps = sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
        print(json.dumps(probe(form, layers, size, steps)), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    ap.add_argument("--size", choices=sorted(SIZES), default="probe")
    ap.add_argument("--steps", type=int, default=0, help="also time this many steps (best of 3)")
    ap.add_argument("--semi-auto", action="store_true",
                    help="compile loop / unrolled blocks on 2 simulated GPUs under semi-auto parallel instead")
    ap.add_argument("--trainer", action="store_true",
                    help="time naohai's tiny train step, layer_loop never against always, instead")
    args = ap.parse_args()
    if args.semi_auto:
        return semi_auto()
    if args.trainer:
        return trainer(args.layers, args.steps or 10)
    rows = [measure(f, n, args.size, args.steps) for f in args.forms for n in args.layers]
    base = {r["form"]: r.get("compile_s") for r in rows if r["layers"] == min(args.layers)}
    print(f"| form | layers | trainable tensors | compile | x {min(args.layers)} layers | first loss"
          + (" | ms / step | loss after the timed steps |" if args.steps else " |") + " peak RSS |")
    print("|---|---|---|---|---|---|" + ("---|---|" if args.steps else "") + "---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['form']} | {r['layers']} | | {r['error']} | | |" + (" | |" if args.steps else "") + " |")
            continue
        ratio = r["compile_s"] / base[r["form"]] if base.get(r["form"]) else float("nan")
        line = (f"| {r['form']} | {r['layers']} | {r['params']} | {r['compile_s']:.2f} s | {ratio:.2f} "
                f"| {r['first_loss']:.6f} |")
        if args.steps:
            line += f" {r['ms_per_step']:.1f} | {r['last_loss']:.6f} |"
        print(line + f" {r['peak_rss_mb']:,.0f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
