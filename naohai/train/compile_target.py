"""The compile entry of ``naohai check --compile``: naohai's real training step, per rank.

Owns :func:`build_for_compile`, the target every simulated-device worker calls
(``naohai.train.compile_target:build_for_compile``).  It goes through the same
code path as ``naohai train``: recipe + strategy file -> the run plan
(:func:`naohai.strategy.run_plan.plan_run`: batch adoption, every strategy rule, the
MindSpore 2.10 compatibility rules) -> ``init_runtime`` -> ``build`` (which marks the
model and wires the train and eval steps through :mod:`naohai.strategy`), and returns
every graph this rank would compile.

``op_overrides`` replaces per-op shard tuples AFTER validation and
``check_compat=False`` skips the compatibility rules: both exist to show what
MindSpore itself says about a strategy our validator would refuse (raw path).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple

#: kernels this model uses when compiled here vs what an Ascend build would pick
PORTABLE_KERNELS = (
    ("attention core", "BatchMatMul + Mul + Add(mask) + Softmax + BatchMatMul",
     "FlashAttentionScore (Ascend-only fused kernel)"),
    ("layer norm", "LayerNorm primitive (RMSNorm: Square/ReduceMean/Rsqrt/Mul)",
     "fused RmsNorm / AddRmsNorm (Ascend-only) for RMSNorm models"),
    ("optimizer", "nn.AdamWeightDecay (composed element-wise update)",
     "fused AdamW (Ascend-only kernel)"),
    ("activation", "Sigmoid * x (SwiGLU), GeLU / FastGeLU",
     "fused SwiGLU on Ascend"),
)


def kernel_note() -> str:
    """Printed by ``naohai check --compile``: what is compiled vs what Ascend would run."""
    lines = ["kernels: the compiled graph uses only portable MindSpore primitives (no Ascend-only kernel "
             "is implemented in naohai); on Ascend these would be the candidates:"]
    for what, here, ascend in PORTABLE_KERNELS:
        lines.append(f"  {what:15s} compiled: {here};  Ascend: {ascend}")
    return "\n".join(lines)


def compile_layout(recipe, strategy_path: str, workdir, *, stages: int, ranks: int, timeout: float = 900.0,
                   keep_ir: bool = False, save_slices: bool = False,
                   recipe_file: Optional[str] = None, progress=None):
    """Compile what ``naohai train`` runs for ``recipe`` under a strategy file on simulated devices.

    The recipe is written into ``workdir/recipe.yaml`` (unless ``recipe_file`` already holds it) so
    every worker loads the same one; the IR deadlock checks run with the strategy's ``stages`` and the
    recipe's clipping.  Returns the harness's CompileReport (per-rank strategy files under
    ``workdir/rank_<r>/``).  ``naohai check --compile`` and ``naohai ckpt reshard`` both call this.
    ``progress(line)`` gets one line per rank as it finishes.
    """
    from pathlib import Path

    from naohai.config import write_recipe
    from naohai.simulate.harness import run_compile

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if recipe_file is None:
        recipe_file = write_recipe(recipe, str(workdir / "recipe.yaml"))
    kwargs = {"recipe_path": str(recipe_file), "strategy_path": str(Path(strategy_path).resolve()),
              "overrides": [], "deferred": not save_slices}
    return run_compile("naohai.train.compile_target:build_for_compile", ranks, workdir, timeout=timeout,
                       kwargs=kwargs, keep_ir=keep_ir, save_slices=save_slices, progress=progress,
                       ir_check=ir_check(recipe, stages))


def ir_check(recipe, stages: int) -> Dict[str, Any]:
    """What the IR checks need to know of ``recipe``: the stages, whether the step clips (the global
    norm), for a fine-tuning run the only parameters that train (no other gradient may be reduced), and on
    SFT data the masked loss's token-weight Parameter (the loss and its gradients must be scaled by it)."""
    check: Dict[str, Any] = {"stages": stages, "clip": recipe.train.optimizer.grad_clip > 0}
    if recipe.finetune is not None and recipe.finetune.method == "lora":   # the other methods: one device only
        from naohai.model.lora import select_targets
        check["trainable"] = [f"{op}.{factor}" for op in select_targets(recipe.model, recipe.finetune)
                              for factor in ("lora_a", "lora_b")]
    if masked_loss(recipe):
        from naohai.train.builder import TOKEN_WEIGHT
        check["token_weight"] = TOKEN_WEIGHT
    return check


def compile_chosen_ranks(recipe, strategy_path: str, workdir, *, world: int, ranks, stages: int,
                         timeout: float = 900.0, keep_ir: bool = False, recipe_file: Optional[str] = None,
                         progress=None, fold_micro: bool = True):
    """Compile only ``ranks`` of the ``world``-device layout, each in its own scheduler + worker pair
    (:func:`naohai.simulate.rank_of_n.compile_ranks`), at full width, parameters deferred.  The IR
    checks compare the compiled ranks among themselves.  ``fold_micro``: see :func:`naohai.strategy.annotate.fold_micro_batches`
    (the parameter layouts, Send/Receive and the memory table are the same either way; collectives
    inside the model are then counted once per graph, not once per micro-batch).  Returns the
    CompileReport."""
    from pathlib import Path

    from naohai.config import write_recipe
    from naohai.simulate.rank_of_n import compile_ranks

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if recipe_file is None:
        recipe_file = write_recipe(recipe, str(workdir / "recipe.yaml"))
    kwargs = {"recipe_path": str(recipe_file), "strategy_path": str(Path(strategy_path).resolve()),
              "overrides": [], "deferred": True, "fold_micro": bool(fold_micro)}
    return compile_ranks("naohai.train.compile_target:build_for_compile", world, list(ranks), workdir,
                         timeout=timeout, kwargs=kwargs, keep_ir=keep_ir, progress=progress,
                         ir_check=ir_check(recipe, stages))


def masked_loss(recipe) -> bool:
    """Whether ``naohai train`` would build ``recipe``'s steps with the masked (SFT) loss: its data is
    SFT data (``data.format: sft``, or a prepared folder of SFT shards)."""
    from naohai.data.sft import is_sft_dir
    prepared = recipe.data.prepared_dir
    return recipe.data.format == "sft" or bool(prepared and is_sft_dir(prepared))


def build_for_compile(recipe_path: str, strategy_path: str, overrides: Sequence[str] = (),
                      portable: bool = True, op_overrides: Optional[Dict[str, Any]] = None,
                      check_compat: bool = True, device: str = "GPU",
                      deferred: bool = False, fold_micro: bool = False) -> List[Tuple[str, Any, Tuple[Any, ...], Any]]:
    """Build naohai's steps for this rank, as ``naohai train`` does; returns the graphs to compile,
    ``[(name, network, compile_args, prepare), ...]`` in the order training runs them (train, then eval, then
    with ``train.eval.tasks`` the downstream scoring graph, ``score``).

    ``deferred`` builds every Parameter unmaterialised (:func:`naohai.model.layers.deferred_parameters`)
    and has MindSpore initialise none while compiling, so host memory is bounded by the compile, not
    by the model (a 200B model's float32 state is about 800 GB); the slices then hold no values, so
    ``--save-slices`` builds eagerly.  Call after ``set_device`` and communication ``init()`` (the
    worker does both).  ``fold_micro``: :func:`naohai.strategy.annotate.fold_micro_batches` on the built graphs.
    """
    if not portable:
        from naohai.errors import UserError
        raise UserError("only the portable kernel path exists in naohai (no Ascend-only kernels are "
                        "implemented); compile with portable=True", key="portable")
    from naohai.strategy.autoparallel import skip_parameter_init_in_compile
    from naohai.strategy.run_plan import plan_run
    from naohai.strategy.runtime import init_runtime
    from naohai.train.builder import build

    run = plan_run(recipe_path, strategy_path, overrides, compat=check_compat)
    if op_overrides:
        table = dict(run.strategy.op_strategy)
        for name, strat in op_overrides.items():
            table[name] = tuple(tuple(int(d) for d in dims) for dims in strat)
        run = dataclasses.replace(run, strategy=dataclasses.replace(run.strategy, op_strategy=table))
    runtime = init_runtime(run.strategy, device)
    masked = masked_loss(run.recipe)
    if not deferred:
        targets = build(run, runtime, masked_loss=masked).steps.compile_targets()
    else:
        from naohai.model.layers import deferred_parameters
        with deferred_parameters():
            targets = build(run, runtime, masked_loss=masked).steps.compile_targets()
        for _, network, *_ in targets:
            skip_parameter_init_in_compile(network)
    if fold_micro:
        from naohai.strategy.annotate import fold_micro_batches
        fold_micro_batches([network for _, network, *_ in targets])
    return targets

