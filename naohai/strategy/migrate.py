"""Import the parallel settings of a MindFormers-style YAML into a naohai strategy.

Read keys (anything else in the file is ignored; unsupported parallel keys are
reported as notes or errors, never dropped silently):

  parallel_config: data_parallel, model_parallel, pipeline_stage, micro_batch_num,
      vocab_emb_dp (true = replicated embedding), use_seq_parallel, optimizer_shard,
      gradient_aggregation_group (no equivalent: noted), pp_interleave_num,
      context_parallel (> 1 is an error: not supported)
  recompute_config: recompute (bool, or per-stage counts of layers), select_recompute
      (bool, list of op patterns, per-stage counts, or {pattern: counts}),
      mp_comm_recompute, parallel_optimizer_comm_recompute, recompute_slice_activation
  parallel: enable_parallel_optimizer, parallel_optimizer_config
      (optimizer_weight_shard_size, parallel_optimizer_threshold, optimizer_level,
      gradient_accumulation_shard -> level2)
  model.model_config: num_layers, offset (int or per-stage list), pp_interleave_num

Stage split: with a list offset, stage k gets ``num_layers // pp`` layers (the
remainder one each to the last stages) plus ``offset[k]``; with an int offset,
the PanGu reference rule ``stage = min((layer + offset) // max(L // pp, 1), pp - 1)``.
Per-stage recompute counts apply to the first n layers of each stage.
MindFormers op patterns (regexes such as ``feed_forward\\.w1\\.activation``) are
mapped to catalog op names by keyword; patterns with no counterpart (reshapes,
transposes) are noted.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

import yaml

from naohai.config import read_yaml
from naohai.errors import UserError
from naohai.strategy.memory import ATTENTION_CHAIN
from naohai.strategy.schema import parse_strategy

# (keyword found in the pattern, our relative op names); first match wins, most specific first.
PATTERN_MAP: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("reshape", ()), ("transpose", ()), ("merger_head", ()), ("cast", ()),
    ("batch_matmul_q_k", ("attention.scores",)), ("q_k", ("attention.scores",)),
    ("softmax", ("attention.softmax",)), ("batch_matmul", ("attention.context",)),
    ("attention_mask", ("attention.mask",)), ("mask", ("attention.mask",)),
    ("activation", ("mlp.act",)), ("silu", ("mlp.act",)), ("gelu", ("mlp.act",)),
    ("feed_forward.mul", ("mlp.mul",)), ("mlp.mul", ("mlp.mul",)),
    ("w1", ("mlp.gate",)), ("w3", ("mlp.up",)), ("w2", ("mlp.down",)),
    ("output.mapping", ("mlp.up",)), ("output.projection", ("mlp.down",)),
    ("wq", ("attention.q",)), ("wk", ("attention.k",)), ("wv", ("attention.v",)), ("wo", ("attention.out",)),
    ("dense1", ("attention.q",)), ("dense2", ("attention.k",)), ("dense3", ("attention.v",)),
    ("attention.projection", ("attention.out",)),
    ("ffn_norm", ("post_attention_norm",)), ("attention_norm", ("input_norm",)),
    ("layernorm1", ("input_norm",)), ("layernorm2", ("post_attention_norm",)),
)


def map_pattern(pattern: str, swiglu: bool = True) -> Tuple[str, ...]:
    plain = pattern.replace("\\.", ".").replace("\\", "").lower()
    for key, ops in PATTERN_MAP:
        if key in plain:
            if key == "w1" and not swiglu:
                return ("mlp.up",)
            return ops
    return ()


def _fail(where: str, key: str, msg: str, rule: str) -> None:
    raise UserError(msg, where=where, key=key, rule=rule)


def _int(where: str, key: str, value: Any, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        _fail(where, key, f"must be a positive integer, got {value!r}", "type")
    return value


def stage_split_from_offset(num_layers: int, pp: int, offset: Any, where: str) -> List[int]:
    if isinstance(offset, list):
        if len(offset) != pp:
            _fail(where, "model.model_config.offset", f"has {len(offset)} entries for {pp} pipeline stages",
                  "one offset per stage")
        base, rem = divmod(num_layers, pp)
        split = [base + (1 if k >= pp - rem else 0) + int(o) for k, o in enumerate(offset)]
        if sum(split) != num_layers or min(split) < 1:
            _fail(where, "model.model_config.offset", f"offsets {offset} turn the even split into {split}, which "
                                                      f"does not give every stage layers summing to {num_layers}",
                  "stage list sums to layers")
        return split
    off = int(offset or 0)
    dis = max(num_layers // pp, 1)
    split = [0] * pp
    for i in range(num_layers):
        split[min((i + off) // dis, pp - 1)] += 1
    if min(split) < 1:
        _fail(where, "model.model_config.offset", f"offset {off} leaves a stage empty: {split}", "no empty stage")
    return split


def _per_stage_counts(value: Any, pp: int, where: str, key: str) -> Optional[List[int]]:
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if len(value) != pp:
            _fail(where, key, f"has {len(value)} per-stage counts for {pp} stages", "one count per stage")
        return [int(v) for v in value]
    return None


def import_mindformers(path: str, model: Optional[str] = None, swiglu: bool = True) -> Tuple[Dict[str, Any], List[str]]:
    """Return (strategy mapping, notes).  The mapping passes ``parse_strategy``."""
    raw = read_yaml(path, "MindFormers config")
    pc = raw.get("parallel_config") or {}
    if not isinstance(pc, dict) or not pc:
        _fail(path, "parallel_config", "no parallel_config section found", "MindFormers parallel_config present")
    rc = raw.get("recompute_config") or {}
    par = raw.get("parallel") or {}
    mc = ((raw.get("model") or {}).get("model_config") or {}) if isinstance(raw.get("model"), dict) else {}
    notes: List[str] = []
    dp = _int(path, "parallel_config.data_parallel", pc.get("data_parallel"), 1)
    mp = _int(path, "parallel_config.model_parallel", pc.get("model_parallel"), 1)
    pp = _int(path, "parallel_config.pipeline_stage", pc.get("pipeline_stage"), 1)
    cp = _int(path, "parallel_config.context_parallel", pc.get("context_parallel"), 1)
    if cp > 1:
        _fail(path, "parallel_config.context_parallel", f"context parallel {cp} has no naohai equivalent",
              "context_parallel == 1")
    m = _int(path, "parallel_config.micro_batch_num", pc.get("micro_batch_num"), 1)
    chunks = _int(path, "parallel_config.pp_interleave_num",
                  pc.get("pp_interleave_num", mc.get("pp_interleave_num")), 1)
    if pc.get("gradient_aggregation_group") not in (None, 4):
        notes.append(f"gradient_aggregation_group {pc['gradient_aggregation_group']} (gradient fusion) has no "
                     f"strategy key; MindSpore's comm_fusion defaults apply")
    if (raw.get("micro_batch_interleave_num") or 1) > 1:
        notes.append("micro_batch_interleave_num (MicroBatchInterleaved) is not a pipeline setting; ignored")

    out: Dict[str, Any] = {"name": f"imported-{re.sub(r'[^A-Za-z0-9_.-]+', '-', str(raw.get('run_name') or 'mindformers'))}"}
    if model:
        out["model"] = model
    out["mesh"] = {"data": dp, "model": mp, "pipeline": pp}
    out["sequence_parallel"] = bool(pc.get("use_seq_parallel", False)) and mp > 1
    if pc.get("use_seq_parallel") and mp == 1:
        notes.append("use_seq_parallel ignored: model_parallel is 1")
    out["micro_batches"] = m if pp > 1 else 1
    if pp == 1 and m > 1:
        notes.append(f"micro_batch_num {m} without pipeline stages: use recipe gradient accumulation instead")

    num_layers = mc.get("num_layers")
    offset = mc.get("offset", 0)
    pipe: Dict[str, Any] = {"scheduler": "interleaved" if chunks > 1 else "1f1b", "virtual_chunks": chunks}
    split: Optional[List[int]] = None
    if pp > 1:
        if isinstance(num_layers, int) and num_layers >= pp * chunks:
            if chunks > 1 and offset not in (0, None):
                notes.append("offset with pp_interleave_num is not translated; using auto")
                pipe["layers_per_stage"] = "auto"
            elif chunks == 1:
                split = stage_split_from_offset(num_layers, pp, offset, path)
                pipe["layers_per_stage"] = split
            else:
                pipe["layers_per_stage"] = "auto"
        else:
            pipe["layers_per_stage"] = "auto"
            notes.append("model.model_config.num_layers missing: layers_per_stage set to auto")
    out["pipeline"] = pipe

    opt_cfg = par.get("parallel_optimizer_config") or {}
    enabled = bool(par.get("enable_parallel_optimizer", False) or pc.get("optimizer_shard", False))
    level = opt_cfg.get("optimizer_level") or ("level2" if opt_cfg.get("gradient_accumulation_shard") else "level1")
    out["optimizer_parallel"] = {"enabled": enabled, "shard_size": int(opt_cfg.get("optimizer_weight_shard_size", -1)),
                                 "level": level, "threshold_kb": int(opt_cfg.get("parallel_optimizer_threshold", 64))}
    out["embedding"] = {"vocab_parallel": not bool(pc.get("vocab_emb_dp", True))}

    # MindSpore's Cell.recompute and MindFormers' recompute_config both default mp_comm_recompute to True
    flags = {"comm": bool(rc.get("mp_comm_recompute", True)),
             "optimizer_comm": bool(rc.get("parallel_optimizer_comm_recompute", False)),
             "slice_activation": bool(rc.get("recompute_slice_activation", False))}
    out["layers"] = _recompute_layers(rc, flags, pp, split, swiglu, path, notes)
    parse_strategy(out, where=f"strategy imported from {path}")   # the result must be a valid file
    return out, notes


def _select_ops(value: Any, swiglu: bool, notes: List[str]) -> List[str]:
    if value is True:
        return list(ATTENTION_CHAIN)
    ops: List[str] = []
    for pattern in value:
        mapped = map_pattern(str(pattern), swiglu)
        if not mapped:
            notes.append(f"select_recompute pattern {pattern!r} has no catalog op (reshape/transpose/unknown); ignored")
        for op in mapped:
            if op not in ops:
                ops.append(op)
    return ops


def _recompute_layers(rc: Dict[str, Any], flags: Dict[str, bool], pp: int, split: Optional[List[int]],
                      swiglu: bool, where: str, notes: List[str]) -> Dict[str, Any]:
    full = rc.get("recompute", False)
    select = rc.get("select_recompute", False)
    layers: Dict[str, Any] = {}

    def per_stage(counts: List[int], entry: Dict[str, Any]) -> None:
        if split is None:
            notes.append("per-stage recompute counts need num_layers; applied to all layers")
            layers["all"] = {"recompute": entry}
            return
        start = 0
        for k, n in enumerate(counts):
            n = min(n, split[k])
            if n > 0:
                layers[f"{start}-{start + n - 1}"] = {"recompute": entry}
            start += split[k]

    if select and not (isinstance(select, bool) or isinstance(select, (list, dict))):
        _fail(where, "recompute_config.select_recompute", f"unsupported form {select!r}", "type")
    if isinstance(select, dict):
        # {pattern: per-stage counts or bool}: the same op list for each count entry
        ops, counts = [], None
        for pattern, c in select.items():
            ops += [o for o in _select_ops([pattern], swiglu, notes) if o not in ops]
            counts = _per_stage_counts(c, pp, where, f"recompute_config.select_recompute.{pattern}") or counts
        if ops:
            entry = {"select": ops, **flags}
            per_stage(counts, entry) if counts else layers.setdefault("all", {"recompute": entry})
    elif select:
        counts = _per_stage_counts(select, pp, where, "recompute_config.select_recompute")
        ops = list(ATTENTION_CHAIN) if counts else _select_ops(select, swiglu, notes)
        if ops:
            entry = {"select": ops, **flags}
            per_stage(counts, entry) if counts else layers.setdefault("all", {"recompute": entry})
    counts = _per_stage_counts(full, pp, where, "recompute_config.recompute")
    entry = {"mode": "full", **flags}
    if counts:
        per_stage(counts, entry)                 # full recompute overrides select (later entries win)
    elif full is True:
        layers.pop("all", None)
        layers["all"] = {"recompute": entry}
    return layers


def write_imported(out: Dict[str, Any], notes: List[str], source: str, path: str) -> None:
    header = [f"# Imported by `naohai plan --import-mindformers {source}`."]
    header += [f"# note: {n}" for n in notes]
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(header) + "\n" + yaml.safe_dump(out, sort_keys=False, default_flow_style=None))
