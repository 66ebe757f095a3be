"""Semantic rules of a strategy against a model (and optionally a recipe / device count).

Each check raises :class:`naohai.errors.UserError` naming the strategy file, the
key path and the rule.  Op-level checks (op names, shard tuples dividing the
catalog shapes) are done while resolving, in ``naohai.strategy.resolve``.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

from naohai.config import ModelConfig
from naohai.errors import UserError
from naohai.strategy.schema import Strategy


def _fail(s: Strategy, key: str, msg: str, rule: str) -> None:
    raise UserError(msg, where=s.source, key=key, rule=rule)


def check_mesh(s: Strategy, devices: Optional[int]) -> None:
    n = s.device_count
    dims = " x ".join(f"{k} {v}" for k, v in s.mesh.items())
    for key, want in (("devices", s.devices), ("mesh", devices)):
        if want is not None and n != want:
            _fail(s, "mesh", f"{dims} = {n} devices, but {'the file says' if key == 'devices' else 'you asked for'} "
                             f"{want}", "data * model * pipeline == devices")
    if s.sequence_parallel and s.model_parallel < 2:
        _fail(s, "sequence_parallel", f"sequence parallel runs on the model axis, which has size {s.model_parallel}",
              "sequence parallel requires model > 1")
    opt = s.optimizer_parallel
    if opt.enabled and opt.shard_size != -1:
        if opt.shard_size > s.data or s.data % opt.shard_size:
            _fail(s, "optimizer_parallel.shard_size", f"shard size {opt.shard_size} does not divide the data-parallel "
                                                      f"size {s.data}", "optimizer shard size divides data")


def check_model_dims(s: Strategy, cfg: ModelConfig, sharded: Dict[str, int]) -> None:
    """Divisibility of model dimensions by the mesh; ``sharded`` = logical axis -> largest slice count used."""
    mp = s.model_parallel
    if mp > 1 and cfg.hidden_size % mp:
        _fail(s, "mesh.model", f"hidden_size {cfg.hidden_size} is not divisible by model {mp}",
              "hidden_size % model == 0")
    checks = (("heads", cfg.num_heads, "num_heads", "rules.heads"),
              ("kv_heads", cfg.kv_heads, "num_kv_heads", "rules.kv_heads"),
              ("mlp", cfg.ffn_hidden_size, "ffn_hidden_size", "rules.mlp"),
              ("embed", cfg.hidden_size, "hidden_size", "rules.embed"))
    for axis, size, label, key in checks:
        k = sharded.get(axis, 1)
        if k > 1 and size % k:
            _fail(s, key, f"{label} {size} is not divisible by the {k} slices of logical axis '{axis}'",
                  f"{label} % {k} == 0")
    k = sharded.get("vocab", 1)
    if k > 1 and cfg.padded_vocab_size % k:
        _fail(s, "embedding.vocab_parallel", f"padded vocabulary {cfg.padded_vocab_size} is not divisible by "
                                             f"{k} (vocab-parallel embedding)", "vocab % model == 0")


def check_pipeline(s: Strategy, cfg: ModelConfig, split: Sequence[int]) -> None:
    pp, v, m = s.stages, s.pipeline.virtual_chunks, s.micro_batches
    if cfg.num_layers < pp * v:
        _fail(s, "mesh.pipeline", f"{cfg.num_layers} layers cannot fill {pp} stages x {v} chunks",
              "layers >= stages")
    if m < pp:
        _fail(s, "micro_batches", f"{m} micro-batches for {pp} pipeline stages", "micro_batches >= stages")
    if s.pipeline.scheduler == "interleaved" and m % pp:
        _fail(s, "micro_batches", f"interleaved scheduling needs micro_batches ({m}) to be a multiple of the "
                                  f"stages ({pp})", "micro_batches % stages == 0 when interleaved")
    if isinstance(s.pipeline.layers_per_stage, tuple):
        if len(split) != pp * v:
            _fail(s, "pipeline.layers_per_stage", f"has {len(split)} entries, the mesh has {pp} stages"
                  + (f" x {v} chunks" if v > 1 else ""), "one entry per stage")
        if sum(split) != cfg.num_layers:
            _fail(s, "pipeline.layers_per_stage", f"{list(split)} sums to {sum(split)}, the model has "
                                                  f"{cfg.num_layers} layers", "stage list sums to layers")


def check_batch(s: Strategy, global_batch: Optional[int], micro_batch_size: int, where_recipe: str) -> int:
    """Return gradient-accumulation steps; global batch must be dp * micro_batch_size * micro_batches * k."""
    if micro_batch_size < 1:
        _fail(s, "micro_batches", f"micro-batch size {micro_batch_size}", "micro_batch_size >= 1")
    if global_batch is None:
        return 1
    unit = s.data * micro_batch_size * s.micro_batches
    if global_batch % s.data:
        _fail(s, "mesh.data", f"global batch {global_batch} ({where_recipe}) is not divisible by data {s.data}",
              "batch % data == 0")
    if global_batch % unit:
        _fail(s, "micro_batches", f"global batch {global_batch} ({where_recipe}) is not a multiple of data {s.data} x "
                                  f"micro-batch size {micro_batch_size} x micro_batches {s.micro_batches} = {unit}",
              "global_batch % (data * micro_batch_size * micro_batches) == 0")
    return global_batch // unit


def check_coverage(s: Strategy, cfg: ModelConfig) -> None:
    n = cfg.num_layers
    covered = [False] * n
    for e in s.layers:
        stop = n - 1 if e.stop == -1 else e.stop
        if e.start >= n or stop >= n:
            _fail(s, f'layers."{e.key}"', f"range {e.key} is outside layers 0-{n - 1}", "layer range in bounds")
        for i in range(e.start, stop + 1):
            covered[i] = True
    if s.require_full_coverage:
        gaps = [i for i, c in enumerate(covered) if not c]
        if gaps:
            _fail(s, "layers", f"layers {_ranges(gaps)} are covered by no entry", "no gaps in layer coverage")


def _ranges(idx: Sequence[int]) -> str:
    out, start = [], None
    for j, i in enumerate(idx):
        if start is None:
            start = i
        if j + 1 == len(idx) or idx[j + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out)
