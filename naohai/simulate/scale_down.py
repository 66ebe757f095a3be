"""Shrinking a cluster strategy (and its model) so it compiles on a few simulated devices.

Owns :func:`scale_down`: from a recipe and a strategy file's raw mapping, produce a
recipe mapping and a strategy mapping that fit ``max_ranks`` devices while keeping
what decides MindSpore's parallel passes:

* kept: the model-parallel size, the sharding rules (global and per layer), the
  per-layer recompute settings, vocab / sequence parallel, optimizer parallel
  settings, the scheduler, the model family's structure (PanGu query layer,
  tied head, biases, position and norm kinds, compute dtype);
* kept if it fits, else reduced (and said so): the pipeline stage count;
* shrunk: data parallel, layers (one per stage, at least two so that a normal
  layer and the last (query) layer both exist), widths (heads, hidden, ffn,
  vocab, all divisible by the model-parallel size), sequence length, batch, and
  micro-batches beyond 2 x stages (the graph holds one network copy per micro-batch).

Every change is returned as a human-readable line; nothing is changed silently.

Also owns :func:`reduce_depth` (and :func:`default_depth`): for a compile of chosen ranks of
the real layout (``naohai check --compile --ranks ...``), keep at most N layers per pipeline
stage and nothing else changed (widths, mesh, micro-batches, batch, rules, recompute).
"""
from __future__ import annotations

import copy
import math
from typing import Any, Dict, List, Optional, Tuple

from naohai.errors import UserError

HEAD_DIM = 16
SEQ_LENGTH = 32
VOCAB = 1024


def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m)


def _layer_map(old_n: int, new_n: int) -> List[int]:
    """Original layer each new layer stands for: first and last are kept (query layer)."""
    if new_n == 1:
        return [old_n - 1]
    return [round(j * (old_n - 1) / (new_n - 1)) for j in range(new_n)]


def _ranges(idx: List[int]) -> List[Tuple[int, int]]:
    out: List[Tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _parse_key(key: str, n: int) -> Tuple[int, int]:
    text = str(key).strip()
    if text in ("all", "*"):
        return 0, n - 1
    if "-" in text:
        a, b = text.split("-", 1)
        return int(a), int(b)
    return int(text), int(text)


def _remap_layers(s: Dict[str, Any], rep: List[int], old_layers: int, changes: List[str]) -> None:
    """Rewrite the strategy's per-layer entries (``layers``, and ``ops`` named ``layers.<i>.*``) for a
    model whose layer ``j`` stands for the original layer ``rep[j]``."""
    if s.get("layers"):
        new_entries: Dict[str, Any] = {}
        for key, body in s["layers"].items():
            a, b = _parse_key(key, old_layers)
            covered = [j for j, orig in enumerate(rep) if a <= orig <= b]
            if not covered:
                changes.append(f'layers."{key}": no remaining layer stands for layers {a}-{b}; entry dropped')
                continue
            for lo, hi in _ranges(covered):
                new_key = f"{lo}-{hi}" if hi > lo else str(lo)
                new_entries[new_key] = copy.deepcopy(body)
            changes.append(f'layers."{key}" -> ' + ", ".join(f'"{lo}-{hi}"' for lo, hi in _ranges(covered)))
        s["layers"] = new_entries
    if s.get("ops"):
        new_ops: Dict[str, Any] = {}
        for name, strat in s["ops"].items():
            parts = str(name).split(".")
            if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
                new_ops[name] = strat
                continue
            for j, orig in enumerate(rep):
                if orig == int(parts[1]):
                    new_ops[".".join(["layers", str(j)] + parts[2:])] = strat
            if int(parts[1]) not in rep:
                changes.append(f"ops.{name}: layer {parts[1]} is not kept; entry dropped")
        s["ops"] = new_ops


#: up to this many layers, a rank of the real depth compiles here within minutes and a few GB, the
#: micro-batches folded (:func:`naohai.strategy.annotate.fold_micro_batches`: each layer in the graph
#: once).  Measured on 2 cores, the 3,456-card naohai-200b layout, 64 micro-batches: 27 layers 61 s /
#: 2.2 GB, 104 layers 114-151 s / 5.3-5.6 GB per rank
REAL_DEPTH_MAX_LAYERS = 300


def default_depth(resolved) -> Tuple[Optional[int], str]:
    """(layers per stage to keep or None for the real depth, why) for a compile of chosen ranks, which
    folds the micro-batches (each layer is in the graph once, whatever their number)."""
    layers = sum(resolved.layers_per_stage)
    if layers <= REAL_DEPTH_MAX_LAYERS:
        return None, "the micro-batches folded, each layer is in the graph once"
    return 1, (f"1 layer per stage: {layers} layers is more than the {REAL_DEPTH_MAX_LAYERS} this kind of machine "
               f"compiles within minutes (pass --depth N to choose)")


def reduce_depth(recipe, raw_strategy: Dict[str, Any], resolved, depth: int) -> Tuple[Dict[str, Any], Dict[str, Any],
                                                                                     List[str]]:
    """(recipe mapping, strategy mapping, changes) keeping at most ``depth`` layers on every pipeline stage.

    Everything else stays as it is: widths, mesh, micro-batches, batch, rules, recompute, optimizer
    parallel.  Stage s keeps its first ``depth`` layers; the last stage keeps its last ones (the
    query layer, or the final norm's position, stays where it is).  Per-layer entries move with
    the layers they name."""
    if depth < 1:
        raise UserError(f"--depth must be >= 1, got {depth}", where="command line", key="--depth", rule="depth >= 1")
    cfg = recipe.model
    split = list(resolved.layers_per_stage)
    keep: List[int] = []
    start = 0
    for stage, n in enumerate(split):
        idx = list(range(start, start + n))
        start += n
        k = min(depth, n)
        keep += idx[-k:] if stage == len(split) - 1 and len(split) > 1 else idx[:k]
    s = copy.deepcopy(raw_strategy)
    changes = [f"layers {cfg.num_layers} -> {len(keep)} (at most {depth} per stage; kept layers "
               + ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in _ranges(keep)) + ")"]
    if len(split) > 1:
        pipe = dict(s.get("pipeline") or {})
        pipe["layers_per_stage"] = [min(depth, n) for n in split]
        s["pipeline"] = pipe
        changes.append(f"pipeline.layers_per_stage {split} -> {pipe['layers_per_stage']}")
    _remap_layers(s, keep, cfg.num_layers, changes)
    if s.get("model"):
        changes.append(f"strategy model key '{s.pop('model')}' dropped (the model has fewer layers than the preset)")
    s["name"] = f"{s.get('name', 'strategy')}-depth{depth}"
    raw = recipe.to_dict()
    raw["name"] = f"{recipe.name}-depth{depth}"
    raw["model"] = dict(raw["model"], num_layers=len(keep))
    return raw, s, changes


def scale_down(recipe, raw_strategy: Dict[str, Any], max_ranks: int = 8) -> Tuple[Dict[str, Any], Dict[str, Any],
                                                                                 List[str]]:
    """(recipe mapping, strategy mapping, changes) for a run on ``max_ranks`` devices."""
    cfg = recipe.model
    s = copy.deepcopy(raw_strategy)
    changes: List[str] = []
    mesh = dict(s.get("mesh") or {})
    dp, mp, pp = int(mesh.get("data", 1)), int(mesh.get("model", 1)), int(mesh.get("pipeline", 1))
    if mp > max_ranks:
        raise UserError(f"the model-parallel size {mp} alone needs more than {max_ranks} ranks; --scale-down keeps "
                        f"it (it decides every op's sharding): use --ranks {mp} or more",
                        where=s.get("name"), key="mesh.model", rule="model parallel <= ranks")
    new_pp = pp
    if mp * pp > max_ranks:
        new_pp = max(1, max_ranks // mp)
        changes.append(f"pipeline stages {pp} -> {new_pp}: model {mp} x pipeline {pp} needs {mp * pp} ranks at "
                       f"data 1, more than {max_ranks}")
    new_dp = max(1, min(dp, max_ranks // (mp * new_pp)))
    if new_dp != dp:
        changes.append(f"data parallel {dp} -> {new_dp}")
    mesh.update({"data": new_dp, "model": mp, "pipeline": new_pp})
    s["mesh"] = mesh
    world = new_dp * mp * new_pp
    if s.get("devices") is not None:
        changes.append(f"devices {s['devices']} -> {world}")
        s["devices"] = world

    pipe = dict(s.get("pipeline") or {})
    chunks = int(pipe.get("virtual_chunks", 1))
    old_layers = cfg.num_layers
    new_layers = max(2, new_pp * chunks)
    if new_pp > 1 and chunks == 1:
        per_stage = [1] * new_pp
        per_stage[-1] += new_layers - sum(per_stage)
        pipe["layers_per_stage"] = per_stage
    else:
        pipe.pop("layers_per_stage", None) if new_pp == 1 else pipe.update({"layers_per_stage": "auto"})
    s["pipeline"] = pipe
    changes.append(f"layers {old_layers} -> {new_layers}"
                   + (f" (layers per stage {pipe.get('layers_per_stage')})" if new_pp > 1 else ""))

    micro = int(s.get("micro_batches", 1))
    if new_pp == 1 and micro != 1:
        changes.append(f"micro_batches {micro} -> 1 (no pipeline left)")
        micro = 1
    elif micro < new_pp:
        micro = new_pp
    elif micro > 2 * new_pp:
        # the compiled graph holds one copy of the network per micro-batch: compile time grows with
        # them, while 2 x stages already has 1F1B's warm-up, steady state and cool-down
        changes.append(f"micro_batches {micro} -> {2 * new_pp} (2 x stages: every 1F1B phase, "
                       f"a shorter compile)")
        micro = 2 * new_pp
    s["micro_batches"] = micro

    opt = s.get("optimizer_parallel")
    if isinstance(opt, dict) and int(opt.get("shard_size", -1)) > new_dp:
        changes.append(f"optimizer_parallel.shard_size {opt['shard_size']} -> -1 (data parallel is {new_dp})")
        opt["shard_size"] = -1
    if isinstance(opt, dict) and opt.get("enabled", True) and new_dp == 1:
        changes.append("optimizer parallel stays enabled but has no effect at data parallel 1 "
                       "(MindSpore shards optimizer state over data-parallel ranks only)")

    # per-layer entries: keep each rule / recompute setting on the new layers that stand for its layers
    _remap_layers(s, _layer_map(old_layers, new_layers), old_layers, changes)
    for key in ("global_batch", "micro_batch_size"):
        if s.get(key) is not None:
            changes.append(f"strategy {key} {s.pop(key)} dropped (the scaled recipe sets the batch below)")
    if s.get("model"):
        changes.append(f"strategy model key '{s['model']}' dropped (the scaled model is not that preset)")
        s.pop("model")
    s["name"] = f"{s.get('name', 'strategy')}-scaled-{world}"

    # widths: every mp-split axis stays divisible by mp
    heads = max(2, mp)
    kv = cfg.kv_heads
    new_kv = None
    if kv != cfg.num_heads:
        new_kv = max(mp, 1)
        heads = max(heads, 2 * new_kv)
    hidden = heads * HEAD_DIM
    ratio = cfg.ffn_hidden_size / cfg.hidden_size
    ffn = _round_up(hidden * ratio, max(mp, 8))
    vocab = _round_up(VOCAB, mp)
    seq = min(cfg.seq_length, SEQ_LENGTH)
    model = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    model.update({"num_layers": new_layers, "num_heads": heads, "num_kv_heads": new_kv, "hidden_size": hidden,
                  "ffn_hidden_size": ffn, "vocab_size": vocab, "vocab_pad_multiple": 1, "seq_length": seq,
                  "max_positions": None})
    changes.append(f"widths: heads {cfg.num_heads} -> {heads}, hidden {cfg.hidden_size} -> {hidden} "
                   f"(head dim {HEAD_DIM}), ffn {cfg.ffn_hidden_size} -> {ffn}, vocab {cfg.padded_vocab_size} -> "
                   f"{vocab}" + (f", kv heads {kv} -> {new_kv}" if new_kv else ""))
    if seq != cfg.seq_length:
        changes.append(f"sequence length {cfg.seq_length} -> {seq}")
    mbs = 1
    train = recipe.to_dict().get("train", {}) if hasattr(recipe, "to_dict") else {}
    train = dict(train)
    train.update({"micro_batch_size": mbs, "global_batch_size": new_dp * mbs * micro, "steps": 10,
                  "warmup_steps": 1})
    changes.append(f"batch: micro_batch_size 1, global batch {new_dp * mbs * micro} "
                   f"(data {new_dp} x 1 x {micro} micro-batches)")
    recipe_out = {"name": f"{recipe.name}-scaled", "model": model, "train": train}
    return recipe_out, s, changes
