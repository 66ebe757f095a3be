"""naohai's row of the benchmark: a training run built and driven the way `naohai train` does it.

:class:`NaohaiRun` goes through :mod:`naohai.train.job`'s own steps for one CPU device --
``set_context``, ``init_runtime``, ``adopt_token_ids``, :func:`naohai.train.builder.build`
(model, AdamW with the decay groups, ``TrainStep`` with clipping, guard and the eval step),
the measured MFU peak, a :class:`~naohai.checkpoint.store.CheckpointStore` and a
:class:`~naohai.train.loop.Trainer` with the console and metrics-file callbacks -- except
that the data folder holds random tokens (:mod:`naohai.bench.randdata`) instead of a
tokenized corpus.  Each :meth:`NaohaiRun.round` runs the trainer's loop for some steps and
returns the duration of each full loop iteration (loader, learning-rate read, step, record,
callbacks) except the round's first; the first round's first step includes the graph compile.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Dict, List, Optional

from naohai.bench.models import BenchModel
from naohai.bench.randdata import write_random_prepared
from naohai.train.callbacks import Callback


def rss_bytes(field: str = "VmRSS") -> int:
    """This process's resident set (``VmRSS``) or its peak (``VmHWM``) in bytes; 0 where /proc is absent."""
    try:
        with open("/proc/self/status", "r", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class StepTimer(Callback):
    """Callback: the start of every loop iteration, and the end of the last one."""

    def __init__(self):
        self.begins: List[float] = []
        self.last_end = 0.0

    def on_start(self, trainer) -> None:
        self.begins, self.last_end = [], 0.0

    def on_step_begin(self, trainer) -> None:
        self.begins.append(time.perf_counter())

    def on_step(self, trainer, rec) -> None:
        self.last_end = time.perf_counter()

    def iterations(self) -> List[float]:
        """Seconds of each iteration but the first: begin-to-begin, the last one begin-to-end."""
        b = self.begins
        return [b[i + 1] - b[i] for i in range(1, len(b) - 1)] + ([self.last_end - b[-1]] if len(b) > 1 else [])


#: the environment variable through which `naohai bench --cpu-reductions` reaches its workers
CPU_REDUCTIONS_ENV = "NAOHAI_BENCH_CPU_REDUCTIONS"


def bench_recipe(bm: BenchModel, output_dir: str, prepared_dir: str, finetune: Optional[Dict] = None):
    """The recipe of a benchmark run: the model, one device, no accumulation, AdamW, clip 1.0, fp32;
    evaluation and checkpoints only outside the timed iterations; ``finetune``: the recipe's ``finetune``
    section (None: every parameter trained); ``train.cpu_reductions`` from :data:`CPU_REDUCTIONS_ENV`, else
    ``fused`` (naohai's fastest, as `naohai bench` runs it by default)."""
    from naohai.config import recipe_from_dict
    model = {k: v for k, v in dataclasses.asdict(bm.model).items()}
    train = dict(steps=100000, global_batch_size=bm.batch, micro_batch_size=bm.batch, grad_clip=1.0,
                 weight_decay=0.1, log_every=10, eval_every=100000, eval_batches=1, save_every=100000,
                 keep_checkpoints=1, output_dir=output_dir, device="CPU", mode="graph",
                 cpu_reductions=os.environ.get(CPU_REDUCTIONS_ENV) or "fused")
    d = {"name": f"bench-{bm.name}", "model": model, "data": {"prepared_dir": prepared_dir}, "train": train}
    if finetune is not None:
        d["finetune"] = dict(finetune)
    return recipe_from_dict(d, where=f"naohai bench {bm.name}")


class NaohaiRun:
    """A built trainer for ``bm`` in ``workdir`` (see the module docstring)."""

    def __init__(self, bm: BenchModel, workdir: str, peak_tflops: float, prepared_dir: Optional[str] = None,
                 finetune: Optional[Dict] = None, tag: str = ""):
        """``finetune``: see :func:`bench_recipe`; a prepared SFT folder trains with the masked loss, as
        `naohai train` does; ``tag`` names the run folder apart (``run-<model><tag>``)."""
        from naohai.checkpoint.store import CheckpointStore
        from naohai.data.sft import is_sft_dir
        from naohai.strategy.run_plan import plan_run
        from naohai.train import job
        from naohai.train.builder import build
        from naohai.model.flops import flops_per_token
        from naohai.train.callbacks import ConsoleLog, MetricsFiles, Throughput
        from naohai.train.loop import Trainer

        self.bm = bm
        self.lines: List[str] = []
        out = os.path.join(workdir, f"run-{bm.name}{tag}")
        prepared = prepared_dir or write_random_prepared(os.path.join(workdir, f"data-{bm.name}"),
                                                         bm.model.vocab_size, bm.seq, train_windows=max(64, 8 * bm.batch))
        self.prepared_dir = prepared
        recipe = bench_recipe(bm, out, prepared, finetune)
        job.set_context(recipe, "CPU")
        recipe = job.adopt_token_ids(recipe, prepared, self._log)
        run = plan_run(recipe)
        self.recipe = recipe
        self.rss_before_build = rss_bytes()
        built = build(run, masked_loss=is_sft_dir(prepared))
        self.rss_after_build = rss_bytes()
        self.built = built
        store = CheckpointStore(out, keep_last=1)
        manifest = {"recipe": recipe.to_dict(), "seed": recipe.train.seed, "layout": job.checkpoint_layout(run.strategy, built.runtime),
                    "strategy": None}
        if recipe.finetune is not None:          # as naohai.train.job: the adapters' base (here: the seed's)
            from naohai.checkpoint.adapters import BASE_KEY, base_record
            manifest[BASE_KEY] = base_record(None, recipe.train.seed)
        self.timer = StepTimer()
        self.trainer = Trainer(recipe, built, prepared, store=store, manifest=manifest, log=self._log,
                               callbacks=[Throughput(recipe.train.global_batch_size * recipe.model.seq_length,
                                                     flops_per_token(recipe.model), peak_tflops, 1,
                                                     recipe.train.logging.log_every),
                                          ConsoleLog(self._log), MetricsFiles(out), self.timer])
        self.rss_after_first_round = 0
        self.first_step_s = None

    def _log(self, line: str) -> None:
        """Keep the trainer's line and write it to stderr (a worker's log file), so a warning such as a
        failed checkpoint is on record when the row fails."""
        self.lines.append(line)
        print(line, file=sys.stderr, flush=True)

    def round(self, steps: int) -> List[float]:
        """Run ``steps`` loop iterations; seconds of each but the first."""
        self.trainer.max_steps = int(steps)
        first = self.trainer.step == 0
        self.trainer.run()
        if first:
            b = self.timer.begins
            self.first_step_s = b[1] - b[0] if len(b) > 1 else None
            self.rss_after_first_round = rss_bytes()
        return self.timer.iterations()

    def allocated(self) -> Dict[str, int]:
        """Bytes of the built step's parameters, by role."""
        def nbytes(params):
            return int(sum(int(p.nbytes) for p in params))
        opt = self.built.optimizer
        model = list(self.built.model.trainable_params())
        moments = list(opt.moments1) + list(opt.moments2)
        return {"parameters": nbytes(model), "optimizer_state": nbytes(moments),
                "optimizer_state_tensors": len(moments),
                "optimizer_state_shapes": [[p.name, list(p.shape), str(p.dtype)] for p in moments],
                "parameters_count": int(sum(int(p.size) for p in model)),
                "rss_before_build": self.rss_before_build, "rss_after_build": self.rss_after_build,
                "rss_after_first_round": self.rss_after_first_round, "rss_peak": rss_bytes("VmHWM")}
