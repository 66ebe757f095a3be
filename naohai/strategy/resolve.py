"""Resolve a parsed strategy against a model into the concrete plan the rest of the package applies.

Owns :class:`ResolvedStrategy` and the three entry points:

* ``check_strategy(strategy, recipe_or_model_cfg, devices=None)`` -- every
  semantic rule, then resolution (what the CLI and trainer call);
* ``resolve(strategy, model_cfg, micro_batch_size)`` -- the same without a recipe;
* ``default_strategy(model_cfg)`` -- the one-device plan (every slice count 1) of
  :func:`single_device_strategy`, the strategy of a run without a strategy file.

``micro_batch_size`` is the number of sequences ONE data-parallel rank feeds per
micro-batch (the recipe's ``train.micro_batch_size``).  Shard tuples refer to the
global tensor of one micro-batch, whose batch dimension is
``micro_batch_size * data``; divisibility is checked against those catalog shapes.

Sequence parallel (Megatron style, on the model axis): the token-row dimension
of the ops outside the tensor-parallel regions (layer norms, residual adds, the
biases added after the row-parallel matmuls) is split over data x model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

from naohai.config import MODEL_PRESETS, ModelConfig, Recipe
from naohai.errors import UserError, did_you_mean
from naohai.model.catalog import RENAMED_OPS, OpSpec, layer_op_names, layer_ops, op_catalog
from naohai.strategy import checks
from naohai.strategy.lora import adapter_op_refusal
from naohai.strategy.schema import (LayerEntry, MeshSizes, OpTuple, RecomputeEntry, RuleValue, Strategy,  # noqa: F401
                                    load_strategy, parse_strategy)
from naohai.strategy.stages import layer_placement, stage_split

SEQUENCE_PARALLEL_OPS = ("input_norm", "post_attention_norm", "final_norm", "attention.residual",
                         "mlp.residual", "attention.out_bias", "mlp.down_bias")


@dataclass(frozen=True)
class OptimizerParallel:
    enabled: bool = False
    shard_size: int = 1            # resolved: -1 in the file becomes the data-parallel size
    level: str = "level1"          # level1: optimizer state, level2: + grads, level3: + weights
    threshold_kb: int = 64


@dataclass(frozen=True)
class RecomputeSpec:
    mode: str = "none"             # none | full | select
    ops: Tuple[str, ...] = ()      # relative op names (select)
    comm: bool = False             # mp_comm_recompute
    optimizer_comm: bool = False   # parallel_optimizer_comm_recompute
    slice_activation: bool = False  # recompute_slice_activation


@dataclass(frozen=True)
class ResolvedStrategy(MeshSizes):
    name: str
    source: str
    mesh: Dict[str, int]
    device_num: int
    micro_batches: int
    scheduler: str
    virtual_chunks: int
    stage_of_layer: List[int]
    layers_per_stage: List[int]
    op_strategy: Dict[str, Tuple[Tuple[int, ...], ...]]
    recompute: List[RecomputeSpec]
    optimizer_parallel: OptimizerParallel
    vocab_parallel: bool
    sequence_parallel: bool
    gradient_accumulation: int = 1
    micro_batch_size: int = 1                  # sequences per data-parallel rank per micro-batch
    chunk_of_layer: List[int] = field(default_factory=list)   # virtual chunk (interleaved), else 0
    virtual_split: List[int] = field(default_factory=list)    # layers per virtual stage, model order
    layer_rules: List[Dict[str, RuleValue]] = field(default_factory=list)  # effective rules per layer
    rules: Dict[str, RuleValue] = field(default_factory=dict)              # global rules (incl. vocab)
    model: Optional[str] = None
    warnings: Tuple[str, ...] = ()

    @property
    def from_file(self) -> bool:
        """Read from a strategy file (not the built-in one-device strategy of a plain run)."""
        return self.source != SINGLE_DEVICE_SOURCE

    @property
    def devices_per_stage(self) -> int:
        return self.device_num // self.stages


# --------------------------------------------------------------------------- helpers
def _fail(s: Strategy, key: str, msg: str, rule: str) -> None:
    raise UserError(msg, where=s.source, key=key, rule=rule)


def _layer_index(name: str) -> Optional[int]:
    if name.startswith("layers."):
        return int(name.split(".")[1])
    return None


def _rel(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def _entries_for(s: Strategy, i: int, n: int) -> List[LayerEntry]:
    return [e for e in s.layers if e.start <= i <= (n - 1 if e.stop == -1 else e.stop)]


def _global_rules(s: Strategy) -> Dict[str, RuleValue]:
    rules = dict(s.rules)
    want = ("model",) if s.vocab_parallel else None
    if "vocab" in rules and rules["vocab"] != want:
        _fail(s, "rules.vocab", f"rule {rules['vocab']} contradicts embedding.vocab_parallel: {s.vocab_parallel}",
              "vocab rule agrees with embedding.vocab_parallel")
    rules["vocab"] = want
    return rules


def _slices(rule: RuleValue, mesh: Dict[str, int]) -> int:
    n = 1
    for axis in rule or ():
        n *= mesh[axis]
    return n


def _rule_key(s: Strategy, i: Optional[int], axis: str, n: int) -> str:
    """Key path of the rule that decided ``axis`` for layer ``i`` (last override wins)."""
    if i is not None:
        for e in reversed(_entries_for(s, i, n)):
            if axis in e.rules:
                return f'layers."{e.key}".rules.{axis}'
    return f"rules.{axis}"


# --------------------------------------------------------------------------- op strategies
def _from_rules(s: Strategy, name: str, spec: OpSpec, rules: Dict[str, RuleValue], n_layers: int) -> OpTuple:
    i = _layer_index(name)
    sp = s.sequence_parallel and _rel(name) in SEQUENCE_PARALLEL_OPS
    out = []
    for k, axes in enumerate(spec.inputs):
        used: Dict[str, str] = {}
        dims = []
        for axis in axes:
            targets = tuple(rules.get(axis) or ()) if axis else ()
            # sequence parallel splits the token rows of the activation input, and of every other
            # input of the same shape (both operands of a residual Add: MindSpore 2.10 refuses an
            # elementwise op whose equal-shape inputs are split differently)
            if sp and axis == "batch" and spec.shapes[k] == spec.shapes[0]:
                targets = tuple(dict.fromkeys(targets + ("model",)))
            for t in targets:
                if t in used:
                    _fail(s, _rule_key(s, i, axis, n_layers),
                          f"op {name} input {k} would use mesh axis '{t}' for both logical axes "
                          f"'{used[t]}' and '{axis}'", "mesh axis used once per input")
                used[t] = axis
            dims.append(_slices(targets, s.mesh))
        out.append(tuple(dims))
    return tuple(out)


def _check_tuple(s: Strategy, key: str, name: str, spec: OpSpec, strat: OpTuple, stage_devices: int) -> None:
    """Validate an escape-hatch tuple against the op's catalog entry."""
    if len(strat) != len(spec.inputs):
        _fail(s, key, f"op {name} has {len(spec.inputs)} inputs, the strategy gives {len(strat)}",
              "one slice list per op input")
    for k, (dims, shape, axes) in enumerate(zip(strat, spec.shapes, spec.inputs)):
        if len(dims) != len(shape):
            _fail(s, f"{key}[{k}]", f"input {k} of {name} has {len(shape)} dims {tuple(axes)}, the strategy "
                                    f"gives {len(dims)}", "one slice count per input dimension")
        prod = 1
        for d in dims:
            prod *= d
        if prod > stage_devices or stage_devices % prod:
            _fail(s, f"{key}[{k}]", f"slices {list(dims)} multiply to {prod}, which does not divide the "
                                    f"{stage_devices} devices of a stage", "product of slices divides devices per stage")
    seen: Dict[str, Tuple[int, int]] = {}
    for k, (dims, axes) in enumerate(zip(strat, spec.inputs)):
        for d, axis in zip(dims, axes):
            if axis is None:
                continue
            if axis in seen and seen[axis][1] != d:
                _fail(s, f"{key}[{k}]", f"logical axis '{axis}' is split {seen[axis][1]} ways in input "
                                        f"{seen[axis][0]} but {d} ways in input {k}",
                      "same logical axis, same slices within an op")
            seen.setdefault(axis, (k, d))


def _check_divides(s: Strategy, key: str, name: str, spec: OpSpec, strat: OpTuple) -> None:
    for k, (dims, shape, axes) in enumerate(zip(strat, spec.shapes, spec.inputs)):
        for j, (d, size, axis) in enumerate(zip(dims, shape, axes)):
            if size % d:
                _fail(s, key, f"op {name} input {k} dim {j} ('{axis}', size {size}) cannot be split {d} ways",
                      "slices divide the op's input shape")


def _op_strategies(s: Strategy, cfg: ModelConfig, catalog: Dict[str, OpSpec],
                   layer_rules: List[Dict[str, RuleValue]], grules: Dict[str, RuleValue]) -> Dict[str, OpTuple]:
    n = cfg.num_layers
    stage_devices = s.device_count // s.stages
    out: Dict[str, OpTuple] = {}
    signature = [tuple(sorted(r.items())) for r in layer_rules]
    memo: Dict[tuple, OpTuple] = {}
    for name, spec in catalog.items():
        i = _layer_index(name)
        if i is None:
            out[name] = _from_rules(s, name, spec, grules, n)
            continue
        key = (_rel(name), signature[i], spec.shapes)   # layers with equal rules share tuples
        if key not in memo:
            memo[key] = _from_rules(s, name, spec, layer_rules[i], n)
        out[name] = memo[key]
    # logical-axis divisibility with named rules first (clearer messages)
    sharded: Dict[str, int] = {}
    for name, strat in {(_rel(k), v): k for k, v in out.items()}.items():
        name, strat = strat, out[strat]
        for dims, axes in zip(strat, catalog[name].inputs):
            for d, axis in zip(dims, axes):
                if axis:
                    sharded[axis] = max(sharded.get(axis, 1), d)
    checks.check_model_dims(s, cfg, sharded)
    checked = set()
    for name, strat in out.items():
        i = _layer_index(name)
        if (_rel(name), strat, catalog[name].shapes) in checked:
            continue
        checked.add((_rel(name), strat, catalog[name].shapes))
        for k, axes in enumerate(catalog[name].inputs):
            for j, axis in enumerate(axes):
                if catalog[name].shapes[k][j] % strat[k][j]:
                    key = "sequence_parallel" if (axis == "batch" and s.sequence_parallel
                                                  and _rel(name) in SEQUENCE_PARALLEL_OPS) \
                        else _rule_key(s, i, axis, n)
                    _check_divides(s, key, name, catalog[name], strat)
    # escape hatch: per-layer (relative names) then global (full names) -- later wins
    for e in s.layers:
        stop = n - 1 if e.stop == -1 else e.stop
        for rel, strat in e.ops.items():
            key = f'layers."{e.key}".ops.{rel}'
            for i in range(e.start, stop + 1):
                full = f"layers.{i}.{rel}"
                if full not in catalog:
                    if adapter_op_refusal(rel):
                        _fail(s, key, adapter_op_refusal(rel), "LoRA ops follow their base op")
                    names = layer_op_names(cfg, cfg.query_layer and i == n - 1)
                    _fail(s, key, f"layer {i} has no op '{rel}'.{did_you_mean(rel, names)}", "op name exists")
                _check_tuple(s, key, full, catalog[full], strat, stage_devices)
                _check_divides(s, key, full, catalog[full], strat)
                out[full] = strat
    for full, strat in s.ops.items():
        key = f"ops.{full}"
        if full in RENAMED_OPS:
            now = RENAMED_OPS[full]
            rows = strat[0][0] if strat and strat[0] else 1
            wanted = "; ".join(f"{n}: {[[rows] + [1] * (len(a) - 1) for a in catalog[n].inputs]}"
                               for n in now if n in catalog)
            _fail(s, key, f"there is no op '{full}' any more: it was replaced by {' and '.join(now)}; give "
                  f"each its own strategy (keeping your batch split: {wanted})", "op name exists")
        if full not in catalog:
            if adapter_op_refusal(full):
                _fail(s, key, adapter_op_refusal(full), "LoRA ops follow their base op")
            _fail(s, key, f"no op named '{full}'.{did_you_mean(full, catalog)}", "op name exists")
        _check_tuple(s, key, full, catalog[full], strat, stage_devices)
        _check_divides(s, key, full, catalog[full], strat)
        out[full] = strat
    return out


def _recompute(s: Strategy, cfg: ModelConfig) -> List[RecomputeSpec]:
    n = cfg.num_layers
    out = []
    for i in range(n):
        chosen: Optional[Tuple[LayerEntry, RecomputeEntry]] = None
        for e in _entries_for(s, i, n):
            if e.recompute is not None:
                chosen = (e, e.recompute)
        if chosen is None:
            out.append(RecomputeSpec())
            continue
        e, r = chosen
        kinds = {o.name: o.kind for o in layer_ops(cfg, 1, cfg.query_layer and i == n - 1)}
        names = list(kinds)
        for j, op in enumerate(r.select):
            if op not in names:
                _fail(s, f'layers."{e.key}".recompute.select[{j}]',
                      f"layer {i} has no op '{op}'.{did_you_mean(op, names)}", "op name exists")
            if kinds[op] == "Dropout":
                _fail(s, f'layers."{e.key}".recompute.select[{j}]',
                      f"'{op}' is a dropout: recomputing it alone would draw a new random mask, so the "
                      f"backward pass would not match the forward; remove it from the list (its output "
                      f"is kept)", "no dropout in a recompute list")
        out.append(RecomputeSpec(r.mode, r.select, r.comm, r.optimizer_comm, r.slice_activation))
    return out


def _model_warnings(s: Strategy, cfg: ModelConfig) -> Tuple[str, ...]:
    if not s.model:
        return ()
    if s.model not in MODEL_PRESETS:
        return (f"{s.source}: model '{s.model}' is not a known preset{did_you_mean(s.model, MODEL_PRESETS)}",)
    ref = ModelConfig(**MODEL_PRESETS[s.model])
    keys = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "vocab_size", "seq_length")
    diff = [f"{k} {getattr(cfg, k)} vs {getattr(ref, k)}" for k in keys if getattr(cfg, k) != getattr(ref, k)]
    if diff:
        return (f"{s.source}: written for preset '{s.model}', used with a different model ({'; '.join(diff)})",)
    return ()


# --------------------------------------------------------------------------- entry points
def _resolve(s: Strategy, cfg: ModelConfig, micro_batch_size: int, devices: Optional[int],
             global_batch: Optional[int], recipe_name: str) -> ResolvedStrategy:
    checks.check_mesh(s, devices)
    accum = checks.check_batch(s, global_batch, micro_batch_size, recipe_name)
    checks.check_coverage(s, cfg)
    pp, v = s.stages, s.pipeline.virtual_chunks
    explicit = s.pipeline.layers_per_stage if isinstance(s.pipeline.layers_per_stage, tuple) else None
    if explicit is None:
        checks.check_pipeline(s, cfg, ())
    split = stage_split(cfg, pp, v, explicit, s.pipeline.embedding_cost, s.pipeline.head_cost) \
        if cfg.num_layers >= pp * v else []
    checks.check_pipeline(s, cfg, split)
    stage_of, chunk_of, per_stage = layer_placement(split, pp, v)
    grules = _global_rules(s)
    layer_rules = []
    for i in range(cfg.num_layers):
        rules = dict(grules)
        for e in _entries_for(s, i, cfg.num_layers):
            rules.update(e.rules)
        layer_rules.append(rules)
    catalog = op_catalog(cfg, micro_batch_size * s.data)
    op_strategy = _op_strategies(s, cfg, catalog, layer_rules, grules)
    recompute = _recompute(s, cfg)
    opt = s.optimizer_parallel
    warnings = _model_warnings(s, cfg)
    if opt.enabled and s.data == 1:
        warnings += (f"{s.source}: optimizer_parallel is enabled but data parallel is 1 (no effect)",)
    return ResolvedStrategy(
        name=s.name, source=s.source, mesh=dict(s.mesh), device_num=s.device_count,
        micro_batches=s.micro_batches, scheduler=s.pipeline.scheduler, virtual_chunks=v,
        stage_of_layer=stage_of, layers_per_stage=per_stage, op_strategy=op_strategy, recompute=recompute,
        optimizer_parallel=OptimizerParallel(opt.enabled, s.data if opt.shard_size == -1 else opt.shard_size,
                                             opt.level, opt.threshold_kb),
        vocab_parallel=s.vocab_parallel, sequence_parallel=s.sequence_parallel, gradient_accumulation=accum,
        micro_batch_size=micro_batch_size, chunk_of_layer=chunk_of, virtual_split=list(split),
        layer_rules=layer_rules, rules=grules, model=s.model, warnings=warnings)


def resolve(strategy: Strategy, model_cfg: ModelConfig, micro_batch_size: int = 1) -> ResolvedStrategy:
    """Resolve without a recipe (no global-batch rule)."""
    return _resolve(strategy, model_cfg, micro_batch_size, None, None, "")


def check_strategy(strategy: Strategy, recipe_or_model_cfg: Union[Recipe, ModelConfig], devices: Optional[int] = None,
                   micro_batch_size: Optional[int] = None, global_batch: Optional[int] = None) -> ResolvedStrategy:
    """Every semantic rule, then resolution.

    The batch: ``micro_batch_size`` / ``global_batch`` (command-line flags) win; else, with a recipe,
    its train section as it stands (:func:`naohai.strategy.run_plan.plan_run` adopts the strategy's
    batch keys into it first, once); else the strategy's keys, else micro-batch size 1 and no
    global-batch rule.
    """
    s = strategy
    if isinstance(recipe_or_model_cfg, Recipe):
        r = recipe_or_model_cfg
        mbs = micro_batch_size or r.train.micro_batch_size
        gb = global_batch or r.train.global_batch_size
        adopted = "train.global_batch_size" not in r.stated and s.global_batch == gb
        gb_where = ("--global-batch" if global_batch else f"global_batch in {s.source}" if adopted else
                    f"train.global_batch_size in {r.source or r.name}")
        return _resolve(s, r.model, mbs, devices, gb, gb_where)
    mbs = micro_batch_size or s.micro_batch_size or 1
    gb = global_batch or s.global_batch
    gb_where = "--global-batch" if global_batch else f"global_batch in {s.source}"
    return _resolve(s, recipe_or_model_cfg, mbs, devices, gb, gb_where)


#: where the built-in one-device strategy says it comes from (no file)
SINGLE_DEVICE_SOURCE = "built-in single-device strategy"


def single_device_strategy() -> Strategy:
    """The strategy of a run without a strategy file: one device, every slice count 1, no recompute."""
    return parse_strategy({"name": "single-device", "mesh": {"data": 1, "model": 1, "pipeline": 1},
                           "optimizer_parallel": {"enabled": False}},   # nothing to shard it over
                          where=SINGLE_DEVICE_SOURCE)


def default_strategy(model_cfg: ModelConfig, micro_batch_size: int = 1) -> ResolvedStrategy:
    """The single-device plan: every slice count 1, one stage, no recompute."""
    return resolve(single_device_strategy(), model_cfg, micro_batch_size)
