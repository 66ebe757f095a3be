"""Search for the fastest layouts that fit: enumerate meshes, choose recompute per stage, plan, rank.

Meshes: every data x model x pipeline factorisation of the device count with the
model axis a power of two inside one node, whose model states could fit at all
(float32 weights / (model x pipeline) under the usable memory); one micro-batch
count per mesh (global batch / (data * micro-batch size), no accumulation when
pipelined; for one stage, accumulation fills the batch); 1F1B, plus, when asked
(``schedulers``), interleaved with 2 chunks where the layers allow it; sequence
parallel off and on (model > 1); optimizer parallel off, level1 and level2 (data > 1).
Interleaved layouts are planning-only (MindSpore 2.10 cannot compile naohai's,
:mod:`naohai.strategy.compat`): they are left out unless asked for, and each row
carries whether `naohai check` accepts it (``Candidate.runnable``, marked in the
table); `naohai plan --write` saves the first row that it accepts (:func:`best_runnable`).

Recompute is chosen per stage, as published plans do: each stage takes the
fastest of "a base mode (none or selective, the Korthikanti attention chain) on
every layer, with its first n layers fully recomputed (with or without the
model-parallel communication)" that fits its own memory.  Stages are
independent in memory and the step is paced by the slowest stage, so choosing
each stage's fastest fitting option gives the fastest fitting layout of this
family.  The screening uses :func:`naohai.strategy.memory.layer_activation_bytes`
and :class:`naohai.strategy.plan.LayerCosts` on one resolution per mesh; every
reported row is then re-planned exactly from its strategy mapping (the one
``--write`` saves, with the global batch and micro-batch size), so a written file
reproduces its row.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import yaml

from naohai.config import ModelConfig
from naohai.errors import UserError
from naohai.model.params import count_params
from naohai.strategy.memory import (ATTENTION_CHAIN, layer_activation_bytes, loss_buffers, dtype_bytes, in_flight,
                                    place_params, stage_states)
from naohai.strategy.plan import GB, LayerCosts, Plan, build_plan
from naohai.strategy.profiles import DeviceProfile
from naohai.strategy.compat import check_compat
from naohai.strategy.resolve import OptimizerParallel, RecomputeSpec, ResolvedStrategy, check_strategy, resolve
from naohai.strategy.schema import parse_strategy

NONE = RecomputeSpec("none")
SELECT = RecomputeSpec("select", ATTENTION_CHAIN)
FULL = RecomputeSpec("full", comm=False)
FULL_COMM = RecomputeSpec("full", comm=True)
OPTIMIZER_CHOICES = (None, "level1", "level2")


@dataclass
class Candidate:
    raw: Dict[str, Any]            # the strategy as a YAML-ready mapping
    plan: Plan
    runnable: bool = True          # naohai can compile and train it with MindSpore 2.10 (naohai.strategy.compat)

    @property
    def peak_bytes(self) -> float:
        return max(s.total_bytes for s in self.plan.stages)

    def recompute_summary(self) -> str:
        """Layers per recompute kind: none / select / full (of which with comm recompute)."""
        counts = {"none": 0, "select": 0, "full": 0, "comm": 0}
        for key, body in self.raw["layers"].items():
            start, _, stop = key.partition("-")
            n = int(stop or start) - int(start) + 1
            rc = body["recompute"]
            mode = rc if isinstance(rc, str) else rc.get("mode", "select")
            counts[mode] += n
            if mode == "full" and isinstance(rc, dict) and rc.get("comm"):
                counts["comm"] += n
        return f"{counts['none']}/{counts['select']}/{counts['full']}" + (f"c{counts['comm']}" if counts["comm"] else "")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _entry(spec: RecomputeSpec) -> Any:
    if spec.mode == "select":
        return {"select": list(spec.ops)}
    if spec.mode == "full":
        return {"mode": "full", "comm": spec.comm}
    return "none"


#: the schedulers the search can plan; only the first compiles and trains with MindSpore 2.10
SCHEDULERS = ("1f1b", "interleaved")
RUNNABLE_SCHEDULERS = ("1f1b",)


def meshes(cfg: ModelConfig, devices: int, global_batch: int, micro_batch_size: int,
           profile: DeviceProfile, schedulers=RUNNABLE_SCHEDULERS) -> List[Tuple[int, int, int, int, str, int]]:
    """(data, model, pipeline, micro_batches, scheduler, chunks) worth planning, for the ``schedulers`` asked
    (:data:`SCHEDULERS`)."""
    usable = (profile.memory_gb - profile.reserve_gb) * GB
    n_params = count_params(cfg)
    out = []
    for mp in _divisors(devices):
        if mp & (mp - 1) or mp > profile.devices_per_node:
            continue
        for pp in _divisors(devices // mp):
            if pp > cfg.num_layers:
                continue
            if 4.0 * n_params / (mp * pp) > usable:        # float32 weights alone cannot fit
                continue
            dp = devices // (mp * pp)
            unit = dp * micro_batch_size
            if global_batch % unit:
                continue
            m = global_batch // unit if pp > 1 else 1
            if m < pp:
                continue
            if "1f1b" in schedulers:
                out.append((dp, mp, pp, m, "1f1b", 1))
            if "interleaved" in schedulers and pp > 1 and cfg.num_layers >= 2 * pp and m % pp == 0:
                out.append((dp, mp, pp, m, "interleaved", 2))
    return out


def _base_mapping(dp: int, mp: int, pp: int, m: int, sched: str, v: int) -> Dict[str, Any]:
    return {"mesh": {"data": dp, "model": mp, "pipeline": pp}, "sequence_parallel": False, "micro_batches": m,
            "pipeline": {"scheduler": sched, "virtual_chunks": v, "layers_per_stage": "auto"},
            "optimizer_parallel": {"enabled": False, "shard_size": -1, "level": "level1"},
            "embedding": {"vocab_parallel": mp > 1}}


def _stage_choice(cfg: ModelConfig, r: ResolvedStrategy, k: int, layers: List[int], fixed: float, extra: float,
                  transient: float, limit: float, costs: LayerCosts) -> Optional[Tuple[float, float, List]]:
    """(seconds, bytes, per-layer specs) of stage k's fastest fitting recompute, or None."""
    f = in_flight(r, k)
    act = {spec: [layer_activation_bytes(cfg, r, i, spec) for i in layers] for spec in (NONE, SELECT, FULL, FULL_COMM)}
    work = [layer_activation_bytes(cfg, r, i, ignore_recompute=True) for i in layers]
    sec = {spec: costs.seconds(spec) for spec in (NONE, SELECT, FULL, FULL_COMM)}
    best = None
    for base in (NONE, SELECT):
        for full in (FULL, FULL_COMM):
            for n_full in range(len(layers) + 1):
                saved = sum(act[full][:n_full]) + sum(act[base][n_full:])
                peak = max(max(work[:n_full], default=0.0), transient)
                total = fixed + f * (extra + saved) + peak
                if total > limit:
                    continue
                seconds = n_full * sec[full] + (len(layers) - n_full) * sec[base]
                if best is None or (seconds, total) < best[:2]:
                    best = (seconds, total, [full] * n_full + [base] * (len(layers) - n_full))
                break                     # more full layers only cost more time
            if full is FULL and r.model_parallel == 1:
                break                     # comm recompute changes nothing without a model axis
    return best


def _recompute_layers(r: ResolvedStrategy, specs: List[RecomputeSpec]) -> Dict[str, Any]:
    """Per-layer specs as layer-range entries (consecutive equal specs merged)."""
    out: Dict[str, Any] = {}
    start = 0
    for i in range(1, len(specs) + 1):
        if i == len(specs) or specs[i] != specs[start]:
            key = str(start) if i - 1 == start else f"{start}-{i - 1}"
            out[key] = {"recompute": _entry(specs[start])}
            start = i
    return out


def _screen(cfg: ModelConfig, r0: ResolvedStrategy, profile: DeviceProfile, raw0: Dict[str, Any]):
    """Yield (step seconds, mapping) for every sequence-parallel / optimizer variant that fits."""
    limit = (profile.memory_gb - profile.reserve_gb) * GB
    scale = dtype_bytes(cfg.compute_dtype) / 2
    s, h = cfg.seq_length, cfg.hidden_size
    for sp in (False, True) if r0.model_parallel > 1 else (False,):
        for level in OPTIMIZER_CHOICES if r0.data > 1 else (None,):
            opt = OptimizerParallel(level is not None, r0.data, level or "level1", 64)
            r = dataclasses.replace(r0, sequence_parallel=sp, optimizer_parallel=opt)
            placements = place_params(cfg, r)
            states = stage_states(cfg, r, placements)
            loss = loss_buffers(cfg, r)
            costs = LayerCosts(cfg, r, profile)
            specs: List[Optional[RecomputeSpec]] = [None] * cfg.num_layers
            for k in range(r.stages):
                layers = [i for i, st in enumerate(r.stage_of_layer) if st == k]
                last = k == r.stages - 1
                extra = loss.kept + scale * 4 * s * r.micro_batch_size * h if last else 0.0
                got = _stage_choice(cfg, r, k, layers, states[k].total, extra, loss.transient if last else 0.0,
                                    limit, costs)
                if got is None:
                    break
                for i, spec in zip(layers, got[2]):
                    specs[i] = spec
            else:
                raw = dict(raw0)
                raw["sequence_parallel"] = sp
                raw["optimizer_parallel"] = {"enabled": level is not None, "shard_size": -1,
                                             "level": level or "level1"}
                raw["layers"] = _recompute_layers(r, specs)
                tag = f"{'-sp' if sp else ''}{'-opt' + level[-1] if level else ''}"
                raw["name"] = raw["name"] + tag
                plan = build_plan(cfg, dataclasses.replace(r, recompute=specs), profile, placements=placements,
                                  sharding_table=False)
                yield plan.step_seconds, raw


def search(cfg: ModelConfig, devices: int, global_batch: int, micro_batch_size: int, profile: DeviceProfile,
           top: int = 5, model_name: str = "", progress: Optional[Callable[[int, int], None]] = None,
           schedulers=RUNNABLE_SCHEDULERS) -> List[Candidate]:
    """Fitting layouts, fastest first (at most ``top``), each planned exactly from its mapping.
    ``progress(done, total)`` is called after each mesh is screened; ``schedulers``: see :func:`meshes`."""
    screened: List[Tuple[float, Dict[str, Any]]] = []
    grid = list(meshes(cfg, devices, global_batch, micro_batch_size, profile, schedulers))
    for done, (dp, mp, pp, m, sched, v) in enumerate(grid, 1):
        if progress is not None:
            progress(done - 1, len(grid))
        raw0 = _base_mapping(dp, mp, pp, m, sched, v)
        raw0 = {"name": f"search-dp{dp}-mp{mp}-pp{pp}-m{m}-{sched}", **raw0}
        try:
            r0 = resolve(parse_strategy(raw0, where=f"search candidate {raw0['name']}"), cfg, micro_batch_size)
        except UserError:
            continue  # breaks a rule for this model (e.g. heads % model)
        accum = global_batch // (dp * micro_batch_size * m)
        r0 = dataclasses.replace(r0, gradient_accumulation=accum)
        screened.extend(_screen(cfg, r0, profile, raw0))
    if progress is not None:
        progress(len(grid), len(grid))
    screened.sort(key=lambda x: x[0])
    out: List[Candidate] = []
    for _, raw in screened[:max(3 * top, 10)]:
        raw = {**raw, "global_batch": global_batch, "micro_batch_size": micro_batch_size}
        resolved = _resolved(cfg, raw)
        plan = build_plan(cfg, resolved, profile, model_name)
        if plan.fits:
            out.append(Candidate(raw, plan, _compiles(resolved)))
    out.sort(key=lambda c: (c.plan.step_seconds, c.peak_bytes))
    return out[:top]


def _resolved(cfg: ModelConfig, raw: Dict[str, Any]) -> ResolvedStrategy:
    """A candidate's mapping (with its own batch keys: what a written file holds) checked and resolved."""
    return check_strategy(parse_strategy(raw, where=f"search candidate {raw['name']}"), cfg)


def _compiles(resolved: ResolvedStrategy) -> bool:
    """Whether MindSpore 2.10 can compile the layout as naohai applies it (the rules `naohai check` applies)."""
    try:
        check_compat(resolved)
    except UserError:
        return False
    return True


def best_runnable(cands: List[Candidate]) -> Optional[int]:
    """The index of the fastest row naohai can compile and train (``Candidate.runnable``), or None."""
    return next((i for i, c in enumerate(cands) if c.runnable), None)


def render_table(cands: List[Candidate]) -> str:
    if not cands:
        return "no layout fits (try more devices, a smaller micro-batch or a larger device profile)"
    lines = [" #  data model pipe    m  sched         recompute n/s/f  opt     sp   peak GB  bubble  step s  "
             "tok/s/dev   MFU"]
    for i, c in enumerate(cands, 1):
        r, p = c.raw, c.plan
        opt = r["optimizer_parallel"]
        lines.append(f"{i:>2}  {r['mesh']['data']:>4} {r['mesh']['model']:>5} {r['mesh']['pipeline']:>4} "
                     f"{r['micro_batches']:>4}  {r['pipeline']['scheduler'] + ('' if c.runnable else '*'):<12}  "
                     f"{c.recompute_summary():<15}  "
                     f"{opt['level'] if opt['enabled'] else 'off':<6}  {'on ' if r['sequence_parallel'] else 'off'} "
                     f"{c.peak_bytes / GB:>8.2f}  {p.bubble_fraction:>5.1%}  {p.step_seconds:>6.3f}  "
                     f"{p.tokens_per_second_per_device:>9.0f}  {p.mfu:>5.1%}")
    lines.append("recompute n/s/f: layers with none / selective (attention chain) / full recompute "
                 "(cN: N of them also recompute the model-parallel communication)")
    if not all(c.runnable for c in cands):
        lines.append("*: planning only: MindSpore 2.10 cannot compile this layout as naohai applies it "
                     "(naohai check / train / launch refuse it; naohai check FILE says why)")
    return "\n".join(lines)


def write_strategy(cand: Candidate, path: str, model_name: Optional[str], devices: int) -> None:
    raw = dict(cand.raw)
    if model_name:
        raw = {"model": model_name, **raw}
    raw["devices"] = devices
    header = (f"# Written by `naohai plan --search` for {model_name or 'the given model'} on {devices} devices.\n"
              f"# Predicted: step {cand.plan.step_seconds:.3f} s, MFU {cand.plan.mfu:.1%}, peak "
              f"{cand.peak_bytes / GB:.2f} GB/device ({cand.plan.profile}); recompute chosen per stage.\n")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(header + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None))
