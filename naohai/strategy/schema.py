"""Strategy files: the YAML format, parsed into typed objects with syntax checks.

This module owns the *shape* of a strategy file: which keys exist, their types,
allowed values, and the checks that need no model (unknown keys with
did-you-mean, mesh axis and logical axis names, layer range syntax, positive
integers).  Checks that need the model or recipe live in ``naohai.strategy.checks``.

Format (every key optional except ``mesh``)::

    name: pangu-alpha-200b-2048p
    model: pangu-alpha-200b          # preset this layout targets (warned on mismatch)
    devices: 2048                    # if given, must equal the mesh product
    global_batch: 2048               # sequences per step, and per rank per micro-batch: adopted where the
    micro_batch_size: 1              #   recipe leaves them to defaults, an error where it states others
                                     #   (naohai.strategy.batch); `plan --search --write` records both
    mesh: {data: 16, model: 8, pipeline: 16}
    sequence_parallel: false         # Megatron-style, on the model axis (needs model > 1)
    micro_batches: 32                # pipeline micro-batches per step (>= pipeline stages)
    pipeline:
      scheduler: 1f1b                # 1f1b | gpipe | interleaved
      virtual_chunks: 1              # > 1 only with interleaved
      layers_per_stage: auto         # or a list, one entry per (virtual) stage
      embedding_cost: auto           # layer-equivalents used by 'auto' (number or auto)
      head_cost: auto
    optimizer_parallel: {enabled: true, shard_size: -1, level: level1, threshold_kb: 64}
    embedding: {vocab_parallel: true}
    rules: {batch: data, heads: model, kv_heads: model, mlp: model}   # logical -> mesh axis
    require_full_coverage: false     # if true every layer must be named in `layers`
    layers:                          # index ranges; later entries override earlier ones
      "0-3":  {rules: {mlp: null}, recompute: full}
      "4-59": {recompute: {select: [attention.softmax, mlp.act], comm: true}}
      "60-63": {recompute: none, ops: {attention.q: [[16, 1], [8, 1]]}}
    ops:                             # escape hatch: exact shard tuples by full op name
      layers.63.attention.q: [[16, 1], [8, 1]]

A rule value is a mesh axis name, ``null`` (replicate) or a list of mesh axes
(their sizes multiply).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple, Union

from naohai import validate
from naohai.config import read_yaml
from naohai.errors import UserError, did_you_mean
from naohai.model.catalog import LOGICAL_AXES

MESH_AXES = ("data", "model", "pipeline")
SCHEDULERS = ("1f1b", "gpipe", "interleaved")
OPT_LEVELS = ("level1", "level2", "level3")
RECOMPUTE_MODES = ("none", "full", "select")
MAX_MICRO_BATCHES = 1_000_000

RuleValue = Optional[Tuple[str, ...]]          # None = replicate; tuple of mesh axes
OpTuple = Tuple[Tuple[int, ...], ...]


@dataclass(frozen=True)
class PipelineSpec:
    scheduler: str = "1f1b"
    virtual_chunks: int = 1
    layers_per_stage: Union[str, Tuple[int, ...]] = "auto"
    embedding_cost: Optional[float] = None     # None = auto (embedding params / layer params)
    head_cost: Optional[float] = None


@dataclass(frozen=True)
class OptimizerSpec:
    enabled: bool = False
    shard_size: int = -1                        # -1 = the whole data-parallel group
    level: str = "level1"
    threshold_kb: int = 64


@dataclass(frozen=True)
class RecomputeEntry:
    mode: str = "none"                          # none | full | select
    select: Tuple[str, ...] = ()                # relative op names (mode select)
    comm: bool = False                          # recompute model-parallel communication
    optimizer_comm: bool = False                # recompute optimizer-parallel all-gathers
    slice_activation: bool = False              # keep the saved layer input sliced over model


@dataclass(frozen=True)
class LayerEntry:
    key: str                                    # the range text as written, for error paths
    start: int
    stop: int                                   # inclusive; -1 = last layer ("all")
    rules: Dict[str, RuleValue] = field(default_factory=dict)
    recompute: Optional[RecomputeEntry] = None
    ops: Dict[str, OpTuple] = field(default_factory=dict)   # relative op names


class MeshSizes:
    """The sizes of a ``mesh`` (axis name -> size; a missing axis has size 1), by axis."""

    mesh: Dict[str, int]

    @property
    def data(self) -> int:
        return self.mesh.get("data", 1)

    @property
    def model_parallel(self) -> int:
        return self.mesh.get("model", 1)

    @property
    def stages(self) -> int:
        return self.mesh.get("pipeline", 1)


@dataclass(frozen=True)
class Strategy(MeshSizes):
    mesh: Dict[str, int]
    name: str = "strategy"
    source: str = "strategy"
    model: Optional[str] = None
    devices: Optional[int] = None
    global_batch: Optional[int] = None          # sequences per optimizer step
    micro_batch_size: Optional[int] = None      # sequences per data-parallel rank per micro-batch
    sequence_parallel: bool = False
    micro_batches: int = 1
    pipeline: PipelineSpec = PipelineSpec()
    optimizer_parallel: OptimizerSpec = OptimizerSpec()
    vocab_parallel: bool = True
    rules: Dict[str, RuleValue] = field(default_factory=dict)
    require_full_coverage: bool = False
    layers: Tuple[LayerEntry, ...] = ()
    ops: Dict[str, OpTuple] = field(default_factory=dict)
    comment: str = ""

    @property
    def device_count(self) -> int:
        n = 1
        for v in self.mesh.values():
            n *= v
        return n


DEFAULT_RULES: Dict[str, RuleValue] = {
    "batch": ("data",), "heads": ("model",), "kv_heads": ("model",), "mlp": ("model",),
}

TOP_KEYS = ("name", "model", "devices", "global_batch", "micro_batch_size", "mesh", "sequence_parallel", "micro_batches", "pipeline",
            "optimizer_parallel", "embedding", "rules", "require_full_coverage", "layers", "ops", "comment")


# --------------------------------------------------------------------------- helpers
class _Ctx:
    """Carries the file name so every error names it; the checks are :mod:`naohai.validate`'s."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, key: str, msg: str, rule: str) -> None:
        raise UserError(msg, where=self.where, key=key, rule=rule)

    def mapping(self, value: Any, key: str) -> Dict[str, Any]:
        return validate.mapping(value, self.where, key)

    def known(self, data: Dict[str, Any], allowed, prefix: str) -> None:
        validate.known_keys(data, allowed, self.where, prefix)

    def integer(self, value: Any, key: str, minimum: Optional[int] = 1, maximum: int = validate.INT_MAX) -> int:
        return validate.integer(value, self.where, key, minimum, maximum)

    def boolean(self, value: Any, key: str) -> bool:
        return validate.boolean(value, self.where, key)

    def choice(self, value: Any, allowed, key: str) -> str:
        return validate.choice(value, allowed, self.where, key)


def _q(text: str) -> str:
    """Quote a layer range in a key path: layers."4-59"."""
    return f'"{text}"'


# --------------------------------------------------------------------------- pieces
def parse_rules(ctx: _Ctx, raw: Any, prefix: str, mesh: Dict[str, int]) -> Dict[str, RuleValue]:
    out: Dict[str, RuleValue] = {}
    for axis, target in ctx.mapping(raw, prefix).items():
        path = f"{prefix}.{axis}"
        if axis not in LOGICAL_AXES:
            ctx.fail(path, f"unknown logical axis '{axis}'.{did_you_mean(str(axis), LOGICAL_AXES)} "
                           f"Logical axes: {', '.join(LOGICAL_AXES)}.", "logical axis exists")
        targets = target if isinstance(target, list) else ([] if target is None else [target])
        for j, t in enumerate(targets):
            tpath = path if not isinstance(target, list) else f"{path}[{j}]"
            if not isinstance(t, str) or t not in mesh:
                ctx.fail(tpath, f"unknown mesh axis '{t}'.{did_you_mean(str(t), list(mesh))} "
                                f"Mesh axes: {', '.join(mesh)}.", "mesh axis exists")
            if t == "pipeline":
                ctx.fail(tpath, "the pipeline axis splits layers into stages; it cannot shard a tensor axis",
                         "no tensor axis on the pipeline mesh axis")
        if len(set(targets)) != len(targets):
            ctx.fail(path, f"mesh axis listed twice in {targets}", "mesh axis used once per input")
        out[axis] = tuple(targets) if targets else None
    return out


def parse_op_tuple(ctx: _Ctx, raw: Any, path: str) -> OpTuple:
    if not isinstance(raw, list):
        ctx.fail(path, f"must be a list with one list of slice counts per input, got {raw!r}", "op strategy form")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, list):
            ctx.fail(f"{path}[{i}]", f"must be a list of slice counts (one per dimension), got {item!r}",
                     "op strategy form")
        out.append(tuple(ctx.integer(v, f"{path}[{i}][{j}]", 1, validate.MAX_DEVICES) for j, v in enumerate(item)))
    return tuple(out)


def parse_recompute(ctx: _Ctx, raw: Any, path: str) -> RecomputeEntry:
    if raw is None or raw is False or raw == "none":
        return RecomputeEntry("none")
    if raw is True or raw == "full":
        return RecomputeEntry("full")
    if isinstance(raw, str):
        ctx.choice(raw, RECOMPUTE_MODES[:2], path)
    if isinstance(raw, list):
        raw = {"select": raw}
    data = ctx.mapping(raw, path)
    ctx.known(data, ("mode", "select", "comm", "optimizer_comm", "slice_activation"), path)
    select = data.get("select") or []
    if not isinstance(select, list):
        ctx.fail(f"{path}.select", f"must be a list of op names, got {select!r}", "type")
    for i, name in enumerate(select):
        if not isinstance(name, str):
            ctx.fail(f"{path}.select[{i}]", f"must be an op name, got {name!r}", "type")
    mode = data.get("mode", "select" if select else "none")
    ctx.choice(mode, RECOMPUTE_MODES, f"{path}.mode")
    if mode == "select" and not select:
        ctx.fail(f"{path}.select", "mode 'select' needs a non-empty list of op names", "select lists ops")
    if mode != "select" and select:
        ctx.fail(f"{path}.select", f"a select list only applies to mode 'select', not '{mode}'",
                 "select lists ops")
    flags = {k: ctx.boolean(data[k], f"{path}.{k}") for k in ("comm", "optimizer_comm", "slice_activation")
             if k in data}
    return RecomputeEntry(mode, tuple(select), **flags)


_RANGE = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")


def parse_range(ctx: _Ctx, key: Any, path: str) -> Tuple[int, int]:
    text = str(key)
    if text.strip() in ("all", "*"):
        return 0, -1
    m = _RANGE.match(text)
    if not m:
        ctx.fail(path, f"'{text}' is not a layer index or range like \"4-59\" (or \"all\")", "layer range syntax")
    start = int(m.group(1))
    stop = int(m.group(2)) if m.group(2) is not None else start
    if stop < start:
        ctx.fail(path, f"range '{text}' ends before it starts", "layer range start <= end")
    return start, stop


def parse_layers(ctx: _Ctx, raw: Any, mesh: Dict[str, int]) -> Tuple[LayerEntry, ...]:
    entries = []
    for key, body in ctx.mapping(raw, "layers").items():
        base = f"layers.{_q(str(key))}"
        start, stop = parse_range(ctx, key, base)
        body = ctx.mapping(body, base)
        ctx.known(body, ("rules", "recompute", "ops"), base)
        rules = parse_rules(ctx, body.get("rules"), f"{base}.rules", mesh)
        recompute = parse_recompute(ctx, body["recompute"], f"{base}.recompute") if "recompute" in body else None
        ops = {str(n): parse_op_tuple(ctx, v, f"{base}.ops.{n}")
               for n, v in ctx.mapping(body.get("ops"), f"{base}.ops").items()}
        entries.append(LayerEntry(str(key), start, stop, rules, recompute, ops))
    return tuple(entries)


def _cost(ctx: _Ctx, value: Any, path: str) -> Optional[float]:
    if value is None or value == "auto":
        return None
    return validate.number(value, ctx.where, path, minimum=0, maximum=1e6)


def parse_pipeline(ctx: _Ctx, raw: Any) -> PipelineSpec:
    data = ctx.mapping(raw, "pipeline")
    ctx.known(data, ("scheduler", "virtual_chunks", "layers_per_stage", "embedding_cost", "head_cost"), "pipeline")
    scheduler = ctx.choice(data.get("scheduler", "1f1b"), SCHEDULERS, "pipeline.scheduler")
    chunks = ctx.integer(data.get("virtual_chunks", 2 if scheduler == "interleaved" else 1),
                         "pipeline.virtual_chunks", 1, 1024)
    if scheduler == "interleaved" and chunks < 2:
        ctx.fail("pipeline.virtual_chunks", f"interleaved scheduling needs virtual_chunks >= 2, got {chunks}",
                 "interleaved needs virtual_chunks >= 2")
    if scheduler != "interleaved" and chunks != 1:
        ctx.fail("pipeline.virtual_chunks", f"virtual_chunks {chunks} needs scheduler 'interleaved'",
                 "virtual_chunks > 1 only with interleaved")
    split = data.get("layers_per_stage", "auto")
    if split != "auto":
        if not isinstance(split, list) or not split:
            ctx.fail("pipeline.layers_per_stage", f"must be 'auto' or a non-empty list of layer counts, got {split!r}",
                     "type")
        split = tuple(ctx.integer(v, f"pipeline.layers_per_stage[{i}]", 0) for i, v in enumerate(split))
        for i, v in enumerate(split):
            if v == 0:
                ctx.fail(f"pipeline.layers_per_stage[{i}]", "stage has no layers", "no empty stage")
    return PipelineSpec(scheduler, chunks, split, _cost(ctx, data.get("embedding_cost"), "pipeline.embedding_cost"),
                        _cost(ctx, data.get("head_cost"), "pipeline.head_cost"))


def parse_optimizer(ctx: _Ctx, raw: Any) -> OptimizerSpec:
    if isinstance(raw, bool):
        return OptimizerSpec(enabled=raw)
    data = ctx.mapping(raw, "optimizer_parallel")
    ctx.known(data, ("enabled", "shard_size", "level", "threshold_kb"), "optimizer_parallel")
    shard = data.get("shard_size", -1)
    shard = -1 if shard == -1 else ctx.integer(shard, "optimizer_parallel.shard_size", 1)
    return OptimizerSpec(
        enabled=ctx.boolean(data.get("enabled", True), "optimizer_parallel.enabled"),
        shard_size=shard,
        level=ctx.choice(data.get("level", "level1"), OPT_LEVELS, "optimizer_parallel.level"),
        threshold_kb=ctx.integer(data.get("threshold_kb", 64), "optimizer_parallel.threshold_kb", 0))


def parse_mesh(ctx: _Ctx, raw: Any) -> Dict[str, int]:
    if raw is None:
        ctx.fail("mesh", "a strategy needs a mesh, e.g. mesh: {data: 2, model: 1, pipeline: 1}", "mesh required")
    data = ctx.mapping(raw, "mesh")
    ctx.known(data, MESH_AXES, "mesh")
    mesh = {axis: 1 for axis in MESH_AXES}
    for axis, size in data.items():
        mesh[axis] = ctx.integer(size, f"mesh.{axis}", 1, validate.MAX_DEVICES)
    total = mesh["data"] * mesh["model"] * mesh["pipeline"]
    if total > validate.MAX_DEVICES:
        ctx.fail("mesh", f"data x model x pipeline = {total:,} devices, more than {validate.MAX_DEVICES:,}",
                 f"devices <= {validate.MAX_DEVICES}")
    return mesh


# --------------------------------------------------------------------------- entry points
def parse_strategy(raw: Dict[str, Any], where: str = "strategy") -> Strategy:
    """Turn a YAML mapping into a :class:`Strategy`, checking everything that needs no model."""
    ctx = _Ctx(where)
    ctx.known(raw, TOP_KEYS, "")
    mesh = parse_mesh(ctx, raw.get("mesh"))
    emb = ctx.mapping(raw.get("embedding"), "embedding")
    ctx.known(emb, ("vocab_parallel",), "embedding")
    rules = dict(DEFAULT_RULES)
    rules.update(parse_rules(ctx, raw.get("rules"), "rules", mesh))
    ops = {str(n): parse_op_tuple(ctx, v, f"ops.{n}") for n, v in ctx.mapping(raw.get("ops"), "ops").items()}
    devices = raw.get("devices")
    model = raw.get("model")
    if model is not None and not isinstance(model, str):
        ctx.fail("model", f"must be a preset name, got {model!r}", "type")
    name = validate.text(raw.get("name"), where, "name", default="strategy")
    comment = validate.text(raw.get("comment"), where, "comment")
    return Strategy(
        mesh=mesh,
        name=name,
        source=where,
        model=model,
        devices=None if devices is None else ctx.integer(devices, "devices", 1, validate.MAX_DEVICES),
        global_batch=None if raw.get("global_batch") is None else ctx.integer(raw["global_batch"], "global_batch"),
        micro_batch_size=(None if raw.get("micro_batch_size") is None
                          else ctx.integer(raw["micro_batch_size"], "micro_batch_size")),
        sequence_parallel=ctx.boolean(raw.get("sequence_parallel", False), "sequence_parallel"),
        micro_batches=ctx.integer(raw.get("micro_batches", 1), "micro_batches", 1, MAX_MICRO_BATCHES),
        pipeline=parse_pipeline(ctx, raw.get("pipeline")),
        optimizer_parallel=parse_optimizer(ctx, raw.get("optimizer_parallel")),
        vocab_parallel=ctx.boolean(emb.get("vocab_parallel", True), "embedding.vocab_parallel"),
        rules=rules,
        require_full_coverage=ctx.boolean(raw.get("require_full_coverage", False), "require_full_coverage"),
        layers=parse_layers(ctx, raw.get("layers"), mesh),
        ops=ops,
        comment=comment,
    )


def load_strategy(path: str) -> Strategy:
    """Read and parse a strategy file; errors name the file, the key path and the rule."""
    return parse_strategy(read_yaml(path, "strategy file"), where=path)


def is_strategy_mapping(raw: Dict[str, Any]) -> bool:
    """True if a YAML mapping looks like a strategy (has a mesh) rather than a recipe."""
    return "mesh" in raw


def is_strategy_file(path: str) -> bool:
    """True if ``path`` is a YAML file holding a strategy (:func:`is_strategy_mapping`); a YAML file that does not
    read as a mapping is a UserError naming it (:func:`naohai.config.read_yaml`)."""
    if not (os.path.isfile(path) and path.endswith((".yaml", ".yml"))):
        return False
    return is_strategy_mapping(read_yaml(path))
