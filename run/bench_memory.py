"""Where naohai's resident memory goes on CPU: RSS after each phase of a train run, in this process.

    python run/bench_memory.py [--layer-loop auto|always|never] [--separate] [--set-memory-o1]
                               [--steps 3] [--no-eval] [--workdir DIR]

Builds the issue-30 model (the tiny family at hidden 512, 8 layers, 8 heads, FFN 1408, vocabulary
2048, seq 256; 26.80M parameters) with batch 8 the way ``naohai train`` does (``set_context``,
``build``: model, AdamW, ``TrainStep`` and eval step), on random tokens, then prints the resident set
(VmRSS) and its peak (VmHWM) after: import, build, compiling the train step, compiling the eval step,
each train step, one eval call; then the losses (to compare variants: they must be equal) and
``ru_maxrss``.  ``--separate``: ``train.reuse_layer_graphs: false``; ``--set-memory-o1``:
``mindspore.runtime.set_memory(optimize_level="O1")`` (SOMAS on CPU).  Run one at a time: the default
variant peaks near 11.5 GB.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _status() -> str:
    vals = {}
    with open("/proc/self/status", "r", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(("VmRSS:", "VmHWM:")):
                vals[line.split(":")[0]] = int(line.split()[1]) / 1e6
    return f"RSS {vals['VmRSS']:.2f} GB, peak {vals['VmHWM']:.2f} GB"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layer-loop", default="auto", choices=("auto", "always", "never"))
    p.add_argument("--separate", action="store_true")
    p.add_argument("--set-memory-o1", action="store_true")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-eval", action="store_true")
    p.add_argument("--workdir")
    a = p.parse_args(argv)
    t0 = time.time()
    say = lambda tag: print(f"{tag:20s} {_status()}  ({time.time() - t0:.0f} s)", flush=True)  # noqa: E731
    import mindspore as ms
    if a.set_memory_o1:
        ms.runtime.set_memory(optimize_level="O1")
    from naohai.bench.models import BenchModel, _tiny_family
    from naohai.bench.naohai_row import bench_recipe
    from naohai.bench.randdata import write_random_prepared
    from naohai.data.loader import TokenWindowLoader
    from naohai.strategy.run_plan import plan_run
    from naohai.train import job
    from naohai.train.builder import build

    bm = BenchModel("27m", _tiny_family(hidden_size=512, num_layers=8, num_heads=8, ffn_hidden_size=1408,
                                        seq_length=256), 8)
    work = a.workdir or tempfile.mkdtemp(prefix="naohai-memory-")
    prepared = write_random_prepared(os.path.join(work, "data"), bm.model.vocab_size, bm.seq, train_windows=64)
    recipe = bench_recipe(bm, os.path.join(work, "run"), prepared)
    recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, layer_loop=a.layer_loop,
                                                                   reuse_layer_graphs=not a.separate))
    say("import")
    job.set_context(recipe, "CPU")
    built = build(plan_run(recipe))
    say("build")
    steps = built.steps
    for name, cell, args, prepare in steps.compile_targets():
        if not (name == "eval" and a.no_eval):
            prepare()
            cell.compile(*args)
            say(f"compile {name}")
    loader = TokenWindowLoader(prepared, "train", bm.batch, seed=1)
    losses = []
    for i in range(a.steps):
        losses.append(steps.train(loader.next_batch()).loss)
        say(f"train step {i + 1}")
    if not a.no_eval:
        steps.evaluate(TokenWindowLoader(prepared, "train", bm.batch, seed=2).next_batch())
        say("eval call")
    print("losses", " ".join(f"{x:.9f}" for x in losses))
    print(f"ru_maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
