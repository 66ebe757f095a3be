"""The compile entry of ``naohai check --compile``: naohai's real training step, per rank.

Owns :func:`build_for_compile`, the target every simulated-device worker calls
(``naohai.train.compile_target:build_for_compile``).  It goes through the same
code path as ``naohai train``: recipe -> ``check_strategy`` (+ the MindSpore 2.10
compatibility rules of :mod:`naohai.strategy.compat`) -> ``init_runtime`` ->
``build`` (which applies the strategy and wires the train and eval steps through
``naohai/strategy/apply.py``), and returns every graph this rank would compile.

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


def compile_layout(recipe, strategy_path: str, workdir, *, stages: int, timeout: float = 900.0,
                   keep_ir: bool = False, save_slices: bool = False, ranks: Optional[int] = None,
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
    from naohai.strategy.resolve import check_strategy, load_strategy

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if recipe_file is None:
        recipe_file = write_recipe(recipe, str(workdir / "recipe.yaml"))
    if ranks is None:
        ranks = check_strategy(load_strategy(strategy_path), recipe).device_num
    kwargs = {"recipe_path": str(recipe_file), "strategy_path": str(Path(strategy_path).resolve()),
              "overrides": [], "deferred": not save_slices}
    return run_compile("naohai.train.compile_target:build_for_compile", ranks, workdir, timeout=timeout,
                       kwargs=kwargs, keep_ir=keep_ir, save_slices=save_slices, progress=progress,
                       ir_check={"stages": stages, "clip": recipe.train.grad_clip > 0})


def compile_chosen_ranks(recipe, strategy_path: str, workdir, *, world: int, ranks, stages: int,
                         timeout: float = 900.0, keep_ir: bool = False, recipe_file: Optional[str] = None,
                         progress=None):
    """Compile only ``ranks`` of the ``world``-device layout, each in its own scheduler + worker pair
    (:func:`naohai.simulate.rank_of_n.compile_ranks`), at full width, parameters deferred.  The IR
    checks compare the compiled ranks among themselves.  Returns the CompileReport."""
    from pathlib import Path

    from naohai.config import write_recipe
    from naohai.simulate.rank_of_n import compile_ranks

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    if recipe_file is None:
        recipe_file = write_recipe(recipe, str(workdir / "recipe.yaml"))
    kwargs = {"recipe_path": str(recipe_file), "strategy_path": str(Path(strategy_path).resolve()),
              "overrides": [], "deferred": True}
    return compile_ranks("naohai.train.compile_target:build_for_compile", world, list(ranks), workdir,
                         timeout=timeout, kwargs=kwargs, keep_ir=keep_ir, progress=progress,
                         ir_check={"stages": stages, "clip": recipe.train.grad_clip > 0})


def resolve_for_compile(recipe_path: str, strategy_path: str, overrides: Sequence[str] = (),
                        check_compat: bool = True):
    """(recipe, resolved): the validation ``naohai train`` does, plus the 2.10 compatibility rules."""
    from naohai.config import load_recipe
    from naohai.strategy.resolve import check_strategy, load_strategy

    recipe = load_recipe(recipe_path, list(overrides))
    resolved = check_strategy(load_strategy(strategy_path), recipe)
    if check_compat:
        from naohai.strategy.compat import check_compat as _check
        _check(resolved, recipe)
    return recipe, resolved


def build_for_compile(recipe_path: str, strategy_path: str, overrides: Sequence[str] = (),
                      portable: bool = True, op_overrides: Optional[Dict[str, Any]] = None,
                      check_compat: bool = True, device: str = "GPU",
                      deferred: bool = False) -> List[Tuple[str, Any, Tuple[Any, ...]]]:
    """Build naohai's steps for this rank, as ``naohai train`` does; returns the graphs to compile,
    ``[(name, network, compile_args), ...]`` in the order training runs them (train, then eval).

    ``deferred`` builds every Parameter unmaterialised (:func:`naohai.model.layers.deferred_parameters`)
    and has MindSpore initialise none while compiling, so host memory is bounded by the compile, not
    by the model (a 200B model's float32 state is about 800 GB); the slices then hold no values, so
    ``--save-slices`` builds eagerly.  Call after ``set_device`` and communication ``init()`` (the
    worker does both).
    """
    if not portable:
        from naohai.errors import UserError
        raise UserError("only the portable kernel path exists in naohai (no Ascend-only kernels are "
                        "implemented); compile with portable=True", key="portable")
    from naohai.strategy import apply as strategy_apply
    from naohai.train.builder import build

    recipe, resolved = resolve_for_compile(recipe_path, strategy_path, overrides, check_compat)
    if op_overrides:
        table = dict(resolved.op_strategy)
        for name, strat in op_overrides.items():
            table[name] = tuple(tuple(int(d) for d in dims) for dims in strat)
        resolved = dataclasses.replace(resolved, op_strategy=table)
    runtime = strategy_apply.init_runtime(resolved, device)
    if not deferred:
        return build(recipe, resolved, runtime).steps.compile_targets()
    from naohai.model.layers import deferred_parameters
    with deferred_parameters():
        targets = build(recipe, resolved, runtime).steps.compile_targets()
    for _, network, _ in targets:
        strategy_apply.skip_parameter_init_in_compile(network)
    return targets
