"""Sharding rules of LoRA adapters: the factors follow their base op's strategy.

A targeted op ``y = x W^T`` (a ``MatMul(transpose_b)`` with strategy ``((b, k), (n, k))``: ``b``
slices of the token rows, ``k`` of the input axis, ``n`` of the output axis) becomes
``y = x W^T + (scale * (x A^T)) B^T`` (:class:`naohai.model.lora.LoRAMatMul`, ``A`` [rank, in],
``B`` [out, rank]).  :func:`adapter_strategies` derives every op of that path from the base's
tuple, so a column-parallel base (``k = 1, n > 1``), a row-parallel one (``k > 1, n = 1``) and a
data-parallel one (``k = n = 1``) each get the matching adapter layout:

=============  =======================  ==========================================================
op             strategy                 why
=============  =======================  ==========================================================
``drop``       ``((b, k),)``            dropout on ``x``, laid out as the base reads it
``mm_a``       ``((b, k), (1, k))``     ``A`` split on the input axis as ``W`` is; a row-parallel
                                        base gives partial sums, all-reduced over the ``k`` ranks
``scale_mul``  ``((b, 1), ())``         the [tokens, rank] product, rank axis whole
``mm_b``       ``((b, 1), (n, 1))``     ``B`` split on the output axis as ``W`` is
``add``        ``((b, n), (b, n))``     the base's output layout: no redistribution
=============  =======================  ==========================================================

The rank axis is never split, by construction: no strategy file can name an adapter op
(:func:`adapter_op_refusal` says why and what to shard instead), and the factors stay out of
optimizer sharding (MindSpore's optimizer parallel splits a parameter's first axis, which for ``A``
is the rank axis; the factors are ``rank x (in + out)`` values per op, a few KB).

Pipeline stages need no rule: the adapter cell sits inside its base layer's cell and belongs to
that layer's stage.  :func:`adapter_layout` is the per-parameter split the planner and the tests
read; :func:`shard_adapter` is what :func:`naohai.strategy.annotate.shard_ops` calls.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

from naohai.errors import UserError

OpTuple = Tuple[Tuple[int, ...], ...]

#: the suffixes of the adapter parameters' names (``<op>.lora_a``, ``<op>.lora_b``)
FACTORS = ("lora_a", "lora_b")


def _base_dims(base: OpTuple) -> Tuple[int, int, int]:
    """``(b, k, n)`` of a base ``MatMul(transpose_b)`` strategy ``((b, k), (n, k))``."""
    (b, k), (n, k2) = base
    if k != k2:
        raise ValueError(f"base strategy {base}: the input axis is split {k} ways in x and {k2} in the weight")
    return int(b), int(k), int(n)


def adapter_strategies(base: OpTuple) -> Dict[str, OpTuple]:
    """The strategy of each op of a LoRA path (keys: the cell's attribute names), from its base op's."""
    b, k, n = _base_dims(base)
    return {"drop": ((b, k),), "mm_a": ((b, k), (1, k)), "scale_mul": ((b, 1), ()),
            "mm_b": ((b, 1), (n, 1)), "add": ((b, n), (b, n))}


def factor_splits(base: OpTuple) -> Dict[str, Tuple[int, int]]:
    """How many slices each axis of ``A`` [rank, in] and ``B`` [out, rank] is cut into."""
    _, k, n = _base_dims(base)
    return {"lora_a": (1, k), "lora_b": (n, 1)}


def adapter_layout(resolved, targets) -> Dict[str, Tuple[int, int]]:
    """Parameter name (``<op>.lora_a`` / ``.lora_b``) -> slices per axis, for every targeted op of
    ``targets`` (names from :func:`naohai.model.lora.select_targets`) under ``resolved``."""
    out = {}
    for op in targets:
        base = resolved.op_strategy.get(op)
        splits = factor_splits(base) if base is not None else {f: (1, 1) for f in FACTORS}
        for factor, s in splits.items():
            out[f"{op}.{factor}"] = s
    return out


def check_adapters(recipe, resolved) -> Dict[str, Tuple[int, int]]:
    """The recipe's ``finetune`` targets checked against the model (exit 2 naming the key: a regex that
    matches no op, a rank outside 1..min(out, in)) and laid out under ``resolved``; {} without
    ``finetune``.  Imports MindSpore (the adapter module), so only a fine-tuning run pays for it."""
    if recipe.finetune is None:
        return {}
    refuse_unsharded_method(recipe, resolved)
    if recipe.finetune.method != "lora":
        return {}
    from naohai.model.lora import select_targets

    targets = select_targets(recipe.model, recipe.finetune, recipe.source or "recipe")
    return adapter_layout(resolved, targets)


def planned_adapters(recipe, resolved) -> Dict[str, Tuple[Tuple[int, int], Tuple[int, int]]]:
    """Parameter name -> (full shape, slices per axis) of every LoRA factor of ``recipe`` under
    ``resolved`` (A [rank, in], B [out, rank]); {} without ``finetune`` or for another method.  What the
    planner places."""
    if recipe.finetune is None or recipe.finetune.method != "lora":
        return {}
    from naohai.model.lora import select_targets

    rank = int(recipe.finetune.rank)
    targets = select_targets(recipe.model, recipe.finetune, recipe.source or "recipe")
    layout = adapter_layout(resolved, targets)
    out = {}
    for op, (o, i) in targets.items():
        out[f"{op}.lora_a"] = ((rank, i), layout[f"{op}.lora_a"])
        out[f"{op}.lora_b"] = ((o, rank), layout[f"{op}.lora_b"])
    return out


def refuse_unsharded_method(recipe, resolved, world: int = 1) -> None:
    """Prefix / prompt tuning, llama_adapter and the Houlsby adapter have no sharding rules yet: under a
    strategy file or on more than one device, exit 2 naming ``finetune.method``."""
    ft = recipe.finetune
    if ft is not None and ft.method != "lora" and (resolved.from_file or resolved.device_num > 1 or world > 1):
        raise UserError(f"{ft.method} runs on one device so far (its parameters have no sharding rules yet; "
                        f"LoRA has them); drop the strategy file or use method: lora", where=recipe.source or "recipe",
                        key="finetune.method")


def adapter_op_refusal(name: str) -> Optional[str]:
    """Why a strategy file may not name ``name`` when it is an op or factor of a LoRA adapter, else None."""
    parts = name.split(".")
    if not any(p in FACTORS or p.startswith("lora") for p in parts):
        return None
    base = ".".join(p for p in parts if not (p in FACTORS or p.startswith("lora")))
    return (f"'{name}' is part of a LoRA adapter, and adapters have no strategy of their own: they follow "
            f"their base op's (A split on the base's input axis, B on its output axis, the rank axis never "
            f"split); give the strategy to the base op '{base}' instead")


def shard_adapter(cell, base: OpTuple) -> None:
    """Shard the ops of one :class:`naohai.model.lora.LoRAMatMul` from its base op's strategy, the base
    op too, and keep the factors out of optimizer sharding (see the module docstring)."""
    cell.base.shard(tuple(tuple(s) for s in base))
    for attr, strategy in adapter_strategies(base).items():
        prim = getattr(cell, attr)
        if attr == "drop":
            prim = prim.drop
            if prim is None:      # no dropout
                continue
        prim.shard(strategy)
    for factor in FACTORS:
        getattr(cell, factor).parallel_optimizer = False
