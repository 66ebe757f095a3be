"""Starting a training job: device, communication, data, build, then the loop.

``start(run)`` (a :class:`naohai.strategy.run_plan.Run`: the recipe and the strategy
resolved for it) does, in order, what every rank of every layout does before its
first step: resolve the device (``train.device`` / ``--device``), set the MindSpore
context and seeds, initialise communication for the strategy
(:func:`naohai.strategy.runtime.init_runtime`, which refuses a layout the device
cannot run), make sure the data is prepared (rank 0 prepares, the others wait), build the
steps, and return a :class:`naohai.train.loop.Trainer` with its checkpoint store and its
callbacks, in the order the loop calls them: :class:`RunFiles` (writes the resolved recipe
and strategy into the run folder once the loop has a step to take), throughput / MFU, the
console, the metrics files, the plots, the downstream tasks, held-out exact match, then the
caller's.  ``train(...)`` also resumes and runs it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import mindspore as ms

from naohai.checkpoint.store import CheckpointStore
from naohai.config import Recipe
from naohai.errors import UserError
from naohai.model.flops import flops_per_token
from naohai.runfiles import check_writable, created_here, lock_folder
from naohai.strategy.host_collectives import HostComm
from naohai.strategy.resolve import ResolvedStrategy
from naohai.strategy.run_plan import Run
from naohai.strategy.runtime import Runtime, check_runnable, describe, init_runtime, layout_mode, plan_runtime
from naohai.train.builder import build
from naohai.train.callbacks import Callback, ConsoleLog, LossPlot, MetricsFiles, Throughput
from naohai.devices import resolve_device
from naohai.train.device import peak_tflops
from naohai.train.downstream import DownstreamEval
from naohai.train.exact_match import ExactMatch, refuse_sharded
from naohai.train.loop import Trainer, TrainResult

_USER_COMPILER_CACHE = os.environ.get("MS_COMPILER_CACHE_PATH")   # the user's own choice wins


def set_context(recipe: Recipe, device: str) -> None:
    """Graph or PyNative mode, the device, seeds; bfloat16 on CPU is refused.  MindSpore's kernel
    compilers (graph-kernel fusion, custom ops) write their build files (``akg_kernel_meta/``,
    ``kernel_build_tmp.key``) under ``MS_COMPILER_CACHE_PATH``, the working directory by default:
    unless the user set it, it is the run folder's ``kernel_meta/``."""
    if device == "CPU" and recipe.model.compute_dtype == "bfloat16":
        raise UserError("bfloat16 compute needs an Ascend 910B: MindSpore 2.10's CPU MatMul has no bfloat16 "
                        "kernel. Use float32 (or float16 with train.loss_scale.dynamic) on CPU.",
                        where=recipe.source, key="model.compute_dtype")
    if _USER_COMPILER_CACHE is None:
        os.environ["MS_COMPILER_CACHE_PATH"] = os.path.abspath(os.path.join(recipe.train.output_dir, "kernel_meta"))
    ms.set_context(mode=ms.GRAPH_MODE if recipe.train.mode == "graph" else ms.PYNATIVE_MODE)
    ms.set_device(device)
    if device == "CPU" and recipe.train.cpu_affinity:
        bind_cpu_threads()
    ms.set_seed(recipe.train.seed)
    np.random.seed(recipe.train.seed)


_BOUND = {"done": False}


def bind_cpu_threads() -> None:
    """Once per process: MindSpore's thread binding (``ms.runtime.set_cpu_affinity``) with its main and runtime
    modules on all the cores this process may use (``os.sched_getaffinity``), the recipe's ``train.cpu_affinity``.
    Measured on the 2-core bench VM (tiny bench model, rounds of 20 steps, two busy processes for 5 s between
    rounds): without it the rounds after the busy spells ran at 0.166 s a step against 0.121-0.127 before them, for
    several seconds; with it every round ran at 0.12-0.13 s (PyTorch's eager step was not slowed either way).
    MindSpore prints one line for it ("Success to bind core to {...}"); binding the main module alone or all four
    made it print a warning of its own instead.  Binding already set (by msrun's bind file, or by the user) is left
    as it is."""
    if _BOUND["done"]:
        return
    _BOUND["done"] = True
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    logging.disable(logging.WARNING)     # MindSpore logs the policy it was given as a warning
    try:
        ms.runtime.set_cpu_affinity(True, module_to_cpu_dict={"main": cores, "runtime": cores})
    except RuntimeError:                 # "cannot be set repeatedly": someone bound the threads already
        pass
    finally:
        logging.disable(logging.NOTSET)


def prepare_data(recipe: Recipe, runtime: Runtime, comm, log, progress: bool) -> str:
    """The prepared data folder; with several ranks rank 0 prepares and the others wait for it."""
    from naohai.data.pipeline import ensure_prepared
    if runtime.world == 1:
        return ensure_prepared(recipe, progress=progress, log=log)[0]
    # shared file system assumed (or run `naohai data prepare` first)
    failed = None
    if runtime.rank == 0:
        try:
            ensure_prepared(recipe, progress=False, log=log)
        except UserError as exc:
            failed = exc
    if not comm.all_ok(failed is None):
        raise failed or UserError("rank 0 could not prepare the data (see its log)", where=recipe.source,
                                  key="data")
    return ensure_prepared(recipe, progress=False)[0]


def adopt_token_ids(recipe: Recipe, prepared_dir: str, log) -> Recipe:
    """The recipe with the prepared data's EOD / pad ids in the model (the loader joins documents with
    the tokenizer's EOD, so EOD resets and the loss's pad mask must look for that id)."""
    from naohai.data.prepared_dir import open_prepared
    from naohai.data.sft import FORMAT as SFT_FORMAT
    meta = open_prepared(prepared_dir, verify=False).meta
    tok = meta["tokenizer"]
    model = recipe.model.with_token_ids(tok["eod_id"], tok["pad_id"])
    for key in ("eod_id", "loss_pad_id"):
        before, after = getattr(recipe.model, key), getattr(model, key)
        if before != after:
            log(f"model.{key}: {before} -> {after} (the tokenizer's id for the same role)")
    if meta.get("format") == SFT_FORMAT:
        inside = (meta.get("eod_inside") or {}).get("conversations") or 0
        if inside and (model.eod_reset or model.eod_reset_positions):
            key = "model.eod_reset" if model.eod_reset else "model.eod_reset_positions"
            raise UserError(
                f"cannot be on with this SFT data: the chat template puts the EOD token (id {tok['eod_id']}) inside "
                f"{inside} of its conversations, at the end of each turn (e.g. "
                f"{meta['eod_inside'].get('example')!r}), and resetting at EOD would cut every conversation at its "
                f"turns, so an answer could not see its question (a LoRA run over an imported llama with it learned "
                f"nothing: held-out loss 0.41 against 0.03 without it). Set {key}=false, and data.packing=false "
                f"to give each conversation a window of its own (else packed conversations also see the ones "
                f"before them in their window, as most trainers pack)", where=recipe.source or
                "recipe", key=key, rule="no EOD reset when the template puts EOD inside a conversation")
        if meta.get("packing", True) and not model.eod_reset:     # packed windows, attention not reset at EOD
            if inside:
                log("note: model.eod_reset is off, so each packed conversation also attends to the conversations "
                    "before it in its window (the chat template puts EOD inside conversations, so resetting at EOD "
                    "cannot keep them apart; data.packing=false gives each conversation a window of its own)")
            else:
                log("warning: model.eod_reset is off, so each packed conversation also attends to the conversations "
                    f"before it in its window (set model.eod_reset=true model.eod_id={tok['eod_id']}, this "
                    "tokenizer's EOD id, to keep them apart)")
    return dataclasses.replace(recipe, model=model)


def claim_output_dir(out: str, runtime: Runtime, comm, where: Optional[str]) -> None:
    """Rank 0 checks the run folder is writable and locks it for the life of the job (one job per
    folder, :func:`naohai.runfiles.lock_folder`); every rank learns whether it succeeded."""
    error = None
    if runtime.rank == 0:
        try:
            lock_folder(out, "training run", key="train.output_dir")
        except UserError as exc:
            error = exc
    if not comm.all_ok(error is None):
        raise error or UserError("rank 0 could not claim the output folder (see its log)", where=out,
                                 key="train.output_dir")
    if runtime.rank != 0:
        check_writable(out, key="train.output_dir")


def run_identity(recipe: Recipe, prepared_dir: str) -> Dict[str, Any]:
    """What a run folder's checkpoints belong to: the model, the tokenizer (SHA-256 of its file) and the
    prepared data (corpus fingerprint, holdout, seed, sequence length).  Resuming needs all three equal."""
    from naohai.data.prepared_dir import open_prepared
    meta = open_prepared(prepared_dir, verify=False).meta
    data = {k: meta.get(k) for k in ("source", "holdout_fraction", "seed", "seq_length")}
    return {"model": recipe.to_dict()["model"], "tokenizer_sha256": (meta.get("tokenizer") or {}).get("sha256"),
            "data": hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()}


def planned_checkpoint_layout(resolved: ResolvedStrategy) -> Dict[str, Any]:
    """:func:`checkpoint_layout` of a strategy without starting it (e.g. the destination of a reshard)."""
    return checkpoint_layout(resolved, plan_runtime(resolved))


def checkpoint_layout(resolved: ResolvedStrategy, runtime: Runtime) -> Dict[str, Any]:
    """What a checkpoint records about the layout that wrote it."""
    if runtime.mode == "semi_auto":
        key = {"mesh": resolved.mesh, "ops": sorted((k, [list(d) for d in v]) for k, v in resolved.op_strategy.items()),
               "stages": list(resolved.stage_of_layer), "opt": list(resolved.optimizer_parallel.__dict__.items())
               if hasattr(resolved.optimizer_parallel, "__dict__") else str(resolved.optimizer_parallel)}
        signature = "sharded-" + hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        ranks = list(range(runtime.world))
    else:
        signature, ranks = "full", [0]
    return {"mode": runtime.mode, "world": runtime.world, "signature": signature, "ranks_with_files": ranks,
            "mesh": dict(resolved.mesh), "stages": runtime.stages, "describe": describe(resolved, runtime)}


def _strategy_text(resolved: ResolvedStrategy) -> Optional[str]:
    if resolved.from_file and os.path.isfile(resolved.source):
        with open(resolved.source, "r", encoding="utf-8") as fh:
            return fh.read()
    return None


def write_run_files(recipe: Recipe, resolved: ResolvedStrategy, out: str) -> None:
    """The resolved recipe and the strategy (as given and as resolved) in the run folder; a run without
    a strategy file (the built-in one-device strategy) writes the recipe only."""
    import yaml
    os.makedirs(out, exist_ok=True)
    raw = recipe.to_dict()
    with open(os.path.join(out, "recipe.resolved.yaml"), "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh, sort_keys=False)
    if not resolved.from_file:
        return
    if os.path.isfile(resolved.source):
        shutil.copyfile(resolved.source, os.path.join(out, "strategy.yaml"))
    summary = {"name": resolved.name, "mesh": resolved.mesh, "micro_batches": resolved.micro_batches,
               "layers_per_stage": list(resolved.layers_per_stage), "stage_of_layer": list(resolved.stage_of_layer),
               "optimizer_parallel": str(resolved.optimizer_parallel), "recompute": [str(r) for r in resolved.recompute],
               "op_strategy": {k: [list(d) for d in v] for k, v in resolved.op_strategy.items()}}
    with open(os.path.join(out, "strategy.resolved.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)


def _remove_unused_folder(out: str) -> None:
    """Remove a run folder this process created when it holds nothing but its lock (the data could not
    be prepared, e.g. a corpus pattern that matches no file): a failed start leaves no empty run behind."""
    from naohai.runfiles import LOCK_NAME, unlock_folder
    if set(os.listdir(out)) <= {LOCK_NAME}:
        unlock_folder(out)
        shutil.rmtree(out, ignore_errors=True)


class RunFiles(Callback):
    """Writes the run folder's recipe and strategy files (:func:`write_run_files`) when the loop starts
    stepping (rank 0): a run with nothing left to do (resumed at or past ``train.steps``) keeps the
    recipe its checkpoints were trained with."""

    def __init__(self, recipe: Recipe, resolved: ResolvedStrategy, out: str):
        self.recipe, self.resolved, self.out = recipe, resolved, out

    def on_start(self, trainer) -> None:
        if trainer.writer:
            write_run_files(self.recipe, self.resolved, self.out)


def start(run: Run, *, device: Optional[str] = None, log: Callable[[str], None] = print,
          progress: bool = True, max_steps: Optional[int] = None, callbacks: Sequence[Any] = ()) -> Trainer:
    """Everything before the first step (see the module docstring)."""
    job_started = time.time()
    recipe, resolved = run.recipe, run.strategy
    where = "command line" if device else (recipe.source or "recipe")
    device = resolve_device(device or recipe.train.device, where=where,
                            key="--device" if where == "command line" else "train.device")
    refuse_sharded(recipe, layout_mode(resolved))
    check_runnable(resolved, device)
    downstream = DownstreamEval(recipe, log)
    downstream.job_started = job_started
    downstream.check()            # tasks that do not load stop the run before anything is prepared or compiled
    set_context(recipe, device)
    runtime = init_runtime(resolved, device)
    writer_log = log if runtime.is_writer else (lambda *_: None)
    comm = HostComm(runtime)
    out = recipe.train.output_dir
    claim_output_dir(out, runtime, comm, where=recipe.source)
    try:
        prepared_dir = prepare_data(recipe, runtime, comm, writer_log, progress and runtime.is_writer)
    except UserError:
        if created_here(out) and runtime.rank == 0:
            _remove_unused_folder(out)
        raise
    recipe = adopt_token_ids(recipe, prepared_dir, writer_log)
    run = dataclasses.replace(run, recipe=recipe)
    strategy_file = None
    if runtime.mode == "semi_auto":
        strategy_file = os.path.join(out, "strategy", f"rank_{runtime.rank}.ckpt")
        os.makedirs(os.path.dirname(strategy_file), exist_ok=True)
    from naohai.data.sft import is_sft_dir
    built = build(run, runtime, strategy_file=strategy_file, masked_loss=is_sft_dir(prepared_dir))
    t = recipe.train
    peak, peak_source = peak_tflops(device, recipe.model.compute_dtype, t.logging.device_peak_tflops,
                                    t.logging.device_profile)
    writer_log(f"device: {device} (train.device={t.device if where != 'command line' else device}); "
               f"MFU peak {peak:.3g} TFLOP/s per device: {peak_source}")
    info = checkpoint_layout(resolved, runtime)
    manifest = {"recipe": recipe.to_dict(), "seed": t.seed, "layout": info, "identity": run_identity(recipe, prepared_dir),
                "strategy": None if not resolved.from_file else {"name": resolved.name, "source": resolved.source,
                                                                 "text": _strategy_text(resolved)}}
    if recipe.finetune is not None:      # the base of the adapters until train.init_from names another
        from naohai.checkpoint.adapters import BASE_KEY, base_record
        manifest[BASE_KEY] = base_record(None, t.seed)
    store = CheckpointStore(out, runtime.rank, runtime.world, writes=runtime.rank in info["ranks_with_files"],
                            all_ok=comm.all_ok, keep_last=t.checkpoints.keep_checkpoints,
                            keep_every=t.checkpoints.keep_every)
    downstream.recipe, downstream.log = recipe, (log if runtime.is_writer else (lambda *_: None))
    throughput = Throughput(t.global_batch_size * recipe.model.seq_length, flops_per_token(recipe.model), peak,
                            runtime.world, t.logging.log_every)
    hooks = [RunFiles(recipe, resolved, out), throughput, ConsoleLog(log), MetricsFiles(out), LossPlot(out, log),
             downstream, ExactMatch(recipe, log if runtime.is_writer else (lambda *_: None)), *callbacks]
    return Trainer(recipe, built, prepared_dir, store=store, manifest=manifest, log=log, callbacks=hooks,
                   max_steps=max_steps, strategy_file=strategy_file)


def train(run: Run, *, resume: bool = True, resume_from: Optional[str] = None, **kwargs) -> TrainResult:
    """Start, resume (unless told not to) or else start from ``train.init_from``'s weights, run."""
    recipe = run.recipe
    trainer = start(run, **kwargs)
    resumed = False
    finetune_base = recipe.finetune is not None and recipe.train.init_from
    if finetune_base:             # adapters-only checkpoints: the base first, then (maybe) the adapters
        trainer.init_from(recipe.train.init_from)
    if resume or resume_from:
        resumed = trainer.resume(resume_from)
    else:
        trainer.start_over()
    if recipe.train.init_from and not finetune_base:
        if resumed:
            trainer.log(f"train.init_from ({recipe.train.init_from}) not used: this run resumed from its own "
                        f"checkpoint")
        else:
            trainer.init_from(recipe.train.init_from)
    return trainer.run()
