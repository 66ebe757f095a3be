"""Graph compile time of the train step for 4, 16, 64 layers, each in a fresh process.

The configuration is the one the README starts with (`naohai train tiny`: one CPU
device, graph mode, the tiny preset's architecture) at a small width -- hidden 64,
2 heads, FFN 128, sequence 32, vocabulary 256, batch 2 -- so the time is compile, not
kernels.  Each measurement runs ``python -m naohai.bench.compile_time LAYERS FORM`` in
a subprocess: it builds the steps with :func:`naohai.train.builder.build` and times
``train_step.compile(ids, labels)`` (MindSpore's whole graph pipeline, no execution).
The probe turns on MindSpore's own compile profile (``compile_config.COMPILE_PROFILE``), and
:func:`measure` splits the time into its phases: type inference (the front end, where
shared layers are inferred once), graph passes (``optimize``, where the ``front`` policy
inlines every layer) and the backend's kernel build (``task_emit``).

``FORM`` is how the decoder layers are compiled (:data:`FORMS`):

* ``loop`` (``train.layer_loop: always``; ``auto``'s choice on CPU from 12 layers): one layer
  graph run by a loop over stacked weights (:mod:`naohai.model.stack`);
* ``shared`` (``layer_loop: never``; ``auto``'s choice below 12 layers): one cell per layer,
  equal layers sharing one graph
  through MindSpore's ``lazy_inline`` key (``train.reuse_layer_graphs``, policy ``front`` on
  CPU, set by :func:`naohai.strategy.annotate.reuse_layer_graphs`), inlined before the backend;
* ``separate`` (``layer_loop: never``, ``reuse_layer_graphs: false``): every layer on its own.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from typing import Dict, Optional

PROBE_MODEL = dict(hidden_size=64, num_heads=2, ffn_hidden_size=128, seq_length=32, vocab_size=256,
                   vocab_pad_multiple=128)
PROBE_BATCH = 2
FORMS = {"loop": dict(layer_loop="always"), "shared": dict(layer_loop="never", reuse_layer_graphs=True),
         "separate": dict(layer_loop="never", reuse_layer_graphs=False)}


def probe(layers: int, form: str) -> Dict[str, float]:
    """In this process: build the tiny-family step with ``layers`` layers and time its compile."""
    import dataclasses

    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from mindspore.graph._parse import compile_config
    # MindSpore then prints its compile phase times to stdout (measure() reads them).  Set before the context
    # and the build: set just before compile() it had no effect.
    compile_config.COMPILE_PROFILE = "1"

    from naohai.config import MODEL_PRESETS, ModelConfig, recipe_from_dict
    from naohai.strategy.run_plan import plan_run
    from naohai.train.builder import build
    from naohai.train.job import set_context

    model = dataclasses.asdict(dataclasses.replace(ModelConfig(**MODEL_PRESETS["tiny"]), num_layers=int(layers),
                                                   **PROBE_MODEL))
    recipe = recipe_from_dict({"name": "compile-probe", "model": model,
                               "train": dict(steps=10, global_batch_size=PROBE_BATCH, micro_batch_size=PROBE_BATCH,
                                             device="CPU", mode="graph", output_dir="unused", **FORMS[form])},
                              where="probe")
    set_context(recipe, "CPU")
    t0 = time.perf_counter()
    built = build(plan_run(recipe))
    t_build = time.perf_counter() - t0
    ids = Tensor(np.zeros((PROBE_BATCH, recipe.model.seq_length), np.int32))
    t0 = time.perf_counter()
    built.steps.train_step.compile(ids, ids)
    t_compile = time.perf_counter() - t0
    del ms
    return {"layers": int(layers), "form": form, "build_s": t_build, "compile_s": t_compile}


PHASES = {"type_inference": "type_inference", "optimize": "graph_passes", "task_emit": "kernel_build"}
_PHASE_LINE = re.compile(r"^\[([A-Za-z_\-]+)\]: ([0-9.eE+\-]+)")


def phases_from_profile(text: str) -> Dict[str, float]:
    """The top-level phase seconds of MindSpore's compile profile, grouped as :data:`PHASES` (rest: ``other``).

    The profile starts with ``TotalTime = S, [N]`` and lists each top-level action as
    ``[name]: seconds`` at column 0 (nested passes are indented).
    """
    out: Dict[str, float] = {}
    total = None
    for line in text.splitlines():
        if line.startswith("TotalTime = "):
            total = float(line.split("=", 1)[1].split(",", 1)[0])
            out = {}
            continue
        m = _PHASE_LINE.match(line)
        if total is not None and m:
            key = PHASES.get(m.group(1), "other")
            out[key] = out.get(key, 0.0) + float(m.group(2))
    if total is not None:
        out["profiled_total"] = total
    return out


def measure(layers: int, form: str = "loop", timeout: float = 900.0) -> Dict[str, Optional[float]]:
    """:func:`probe` in a fresh Python process; on failure the figures are None and ``error`` says why."""
    cmd = [sys.executable, "-m", "naohai.bench.compile_time", str(int(layers)), form]
    env = dict(os.environ, GLOG_v="3")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"layers": layers, "form": form, "compile_s": None, "error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line), phases=phases_from_profile(proc.stdout))
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"layers": layers, "form": form, "compile_s": None, "error": f"exit {proc.returncode}: {tail}"}


if __name__ == "__main__":
    print(json.dumps(probe(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "loop")), flush=True)
