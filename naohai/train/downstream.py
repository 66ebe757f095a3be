"""In-loop downstream evaluation (``train.eval``): lm-eval tasks on the live weights of the run.

:class:`DownstreamEval` is a training-loop callback.  ``on_start`` checks and loads the tasks
(:func:`naohai.downstream.tasks.prepare`), so an unknown task, a YAML file that does not parse or a
missing data file stops the run before step 1; it then wraps the model being trained (no checkpoint
round trip) in naohai's lm-eval backend.  Before step 1 (of a fresh run), every ``train.eval.every``
steps and at the last step it scores the tasks and hands one row per task to the other callbacks
(``on_downstream(trainer, step, rows)``: ``metrics.jsonl`` rows with ``split: "downstream"``,
TensorBoard scalars ``downstream/<task>/<metric>``, the console, ``downstream.png``).  Its scoring
graph is compiled in ``on_start`` (one padding request), like the train and eval steps before the
loop.  At the end the time it took (evaluations plus that compile) is reported against the run's
wall time since the job started (``job_started``, set by :func:`naohai.train.job.start`) and
against the training loop's.

Every rank evaluates the same requests, so every rank has the same results; rank 0 writes.  On one
device and under data parallel each rank scores them with the full weights it holds (the model's
packed scoring graph).  Under a semi-auto layout (operator and pipeline parallel) no rank holds the
weights whole: the requests go through the scoring graph compiled with the train step
(:meth:`naohai.train.builder.CompiledSteps.score_forward`, :mod:`naohai.strategy.scoring`), each
data-parallel group scoring its share of every batch of ``train.eval.batch`` requests (rounded up
to a multiple of data parallel x micro-batches), the graph returning every request's result to
every rank; generation tasks run greedily through the same graph, one forward per new token.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

from naohai.config import Recipe
from naohai.train.callbacks import Callback


def task_names(recipe: Recipe) -> List[str]:
    from naohai.downstream.tasks import split_names
    items = [part for item in recipe.train.eval.tasks for part in str(item).split(",")]
    return split_names(items, recipe.source or "recipe", "train.eval.tasks") if items else []


def _percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "n/a"


class DownstreamEval(Callback):
    """The ``train.eval`` callback (see the module docstring)."""

    def __init__(self, recipe: Recipe, log=print):
        self.recipe = recipe
        self.cfg = recipe.train.eval
        self.names = task_names(recipe)
        self.log = log
        self.prepared = None
        self.lm = None
        self.seconds = 0.0
        self.evaluations = 0
        self.started = None            # the training loop's start (on_start)
        self.job_started = None        # the job's start: naohai.train.job.start sets it
        self.compile_seconds = 0.0
        self.last_step = None

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def check(self) -> None:
        """Load the tasks (raises :class:`naohai.errors.UserError` for a bad task setup)."""
        if not self.enabled or self.prepared is not None:
            return
        from naohai.downstream.tasks import prepare
        where = self.recipe.source or "recipe"
        self.prepared = prepare(self.names, include=self.cfg.include_path, num_fewshot=self.cfg.num_fewshot,
                                limit=self.cfg.limit, where=where, key="train.eval.tasks",
                                include_key="train.eval.include_path")

    def _backend(self, trainer):
        from naohai.data.prepared_dir import open_prepared
        from naohai.data.tokenizer import Tokenizer
        from naohai.downstream.backend import NaohaiEvalLM
        from naohai.downstream.engine import Scorer, greedy_settings, padding_id, text_encoding

        tok = Tokenizer.load(open_prepared(trainer.prepared_dir, verify=False).meta["tokenizer"]["path"])
        forward = trainer.steps.score_forward()
        scorer = Scorer(trainer.built.model, self.recipe.model, pad_id=padding_id(tok), eod_id=tok.eod_id, stop_ids=tok.stop_ids,
                        batch=getattr(forward, "rows", self.cfg.batch), forward=forward,
                        **text_encoding(tok, self.recipe), **greedy_settings(tok))
        return NaohaiEvalLM(scorer=scorer, tok=tok, step=None)

    # ------------------------------------------------------------------ hooks
    def on_start(self, trainer) -> None:
        if not self.enabled:
            return
        self.started = time.time()
        self.check()
        self.lm = self._backend(trainer)
        self.compile_seconds = self.lm.scorer.warm_up()
        self.log(f"downstream evaluation: scoring graph compiled in {self.compile_seconds:.1f} s")
        if trainer.step == 0:
            self.evaluate(trainer)

    def on_step(self, trainer, rec: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.due(trainer, self.cfg.every):
            self.evaluate(trainer)

    def on_end(self, trainer) -> None:
        if not self.enabled or self.started is None or not trainer.writer:
            return
        now = time.time()
        loop = now - self.started
        job = now - (self.job_started or self.started)
        spent = self.seconds + self.compile_seconds
        graph = self.lm.scorer.graph_seconds if self.lm is not None else 0.0
        self.log(f"downstream evaluation: {self.evaluations} evaluation(s) in {self.seconds:.1f} s ({graph:.1f} s "
                 f"of it in the compiled scoring graph) + {self.compile_seconds:.1f} s compiling that graph = "
                 f"{spent:.1f} s: {_percent(spent, job)} of the run's {job:.1f} s since the job started, "
                 f"{_percent(spent, loop)} of the {loop:.1f} s since the training loop started")

    # ------------------------------------------------------------------ work
    def evaluate(self, trainer) -> Optional[List[Dict[str, Any]]]:
        if self.last_step == trainer.step:
            return None
        from naohai.downstream.tasks import rows as result_rows
        from naohai.downstream.tasks import run

        t0 = time.time()
        before = self.lm.scorer.truncated.total()
        graph_before = self.lm.scorer.graph_seconds
        self.lm.step = trainer.step
        results = run(self.lm, self.prepared, progress=False)
        seconds = time.time() - t0
        self.seconds += seconds
        self.evaluations += 1
        self.last_step = trainer.step
        per_task: Dict[str, Dict[str, Any]] = {}
        for r in result_rows(results, trainer.step, self.prepared):
            row = per_task.setdefault(r["task"], {"split": "downstream", "step": trainer.step, "task": r["task"],
                                                  "n": r["n"], "num_fewshot": r["num_fewshot"]})
            row[r["metric"]] = r["value"]
            if r["stderr"] is not None:
                row[f"{r['metric']}_stderr"] = r["stderr"]
        out = list(per_task.values())
        for row in out:
            row["seconds"] = seconds
            row["graph_seconds"] = self.lm.scorer.graph_seconds - graph_before
            row["truncated"] = self.lm.scorer.truncated.total() - before
        trainer.callbacks.on_downstream(trainer, trainer.step, out)
        return out
