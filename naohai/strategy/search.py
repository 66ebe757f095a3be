"""Search for the fastest layouts that fit: enumerate, check, plan, rank.

Candidates: every data x model x pipeline factorisation of the device count with
the model axis a power of two inside one node; one micro-batch count per mesh
(global batch / (data * micro-batch size), no accumulation when pipelined; for
one stage, accumulation fills the batch); recompute none / selective (the
Korthikanti attention chain) / full on every layer; optimizer parallel off /
level1; sequence parallel on whenever the model axis is > 1 (it only removes
memory); 1F1B, plus interleaved with 2 chunks when the layers allow it.  Each
candidate goes through ``resolve`` (so it obeys every rule) and ``build_plan``;
the ones that fit are ranked by predicted step time (ties: less memory).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import yaml

from naohai.config import ModelConfig
from naohai.errors import UserError
from naohai.strategy.memory import ATTENTION_CHAIN
from naohai.strategy.plan import Plan, build_plan
from naohai.strategy.profiles import DeviceProfile
from naohai.strategy.resolve import resolve
from naohai.strategy.schema import parse_strategy

RECOMPUTE_CHOICES = ("none", "select", "full")


@dataclass
class Candidate:
    raw: Dict[str, Any]            # the strategy as a YAML-ready mapping
    plan: Plan

    @property
    def peak_bytes(self) -> float:
        return max(s.total_bytes for s in self.plan.stages)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _recompute_entry(mode: str) -> Any:
    if mode == "select":
        return {"select": list(ATTENTION_CHAIN)}
    return mode


def candidate_mappings(cfg: ModelConfig, devices: int, global_batch: int, micro_batch_size: int,
                       devices_per_node: int = 8) -> List[Dict[str, Any]]:
    out = []
    for mp in _divisors(devices):
        if mp & (mp - 1) or mp > devices_per_node:
            continue
        for pp in _divisors(devices // mp):
            if pp > cfg.num_layers:
                continue
            dp = devices // (mp * pp)
            unit = dp * micro_batch_size
            if global_batch % unit:
                continue
            m = global_batch // unit if pp > 1 else 1
            if m < pp:
                continue
            schedules = [("1f1b", 1)]
            if pp > 1 and cfg.num_layers >= 2 * pp and m % pp == 0:
                schedules.append(("interleaved", 2))
            for sched, v in schedules:
                for rc in RECOMPUTE_CHOICES:
                    for opt in (False, True) if dp > 1 else (False,):
                        out.append({
                            "name": f"search-dp{dp}-mp{mp}-pp{pp}-m{m}-{sched}-{rc}{'-opt' if opt else ''}",
                            "mesh": {"data": dp, "model": mp, "pipeline": pp},
                            "sequence_parallel": mp > 1,
                            "micro_batches": m,
                            "pipeline": {"scheduler": sched, "virtual_chunks": v, "layers_per_stage": "auto"},
                            "optimizer_parallel": {"enabled": opt, "shard_size": -1, "level": "level1"},
                            "embedding": {"vocab_parallel": mp > 1},
                            "layers": {"all": {"recompute": _recompute_entry(rc)}},
                        })
    return out


def search(cfg: ModelConfig, devices: int, global_batch: int, micro_batch_size: int, profile: DeviceProfile,
           top: int = 5, model_name: str = "") -> List[Candidate]:
    """Fitting layouts, fastest first (at most ``top``)."""
    fits: List[Candidate] = []
    for raw in candidate_mappings(cfg, devices, global_batch, micro_batch_size, profile.devices_per_node):
        try:
            strategy = parse_strategy(raw, where=f"search candidate {raw['name']}")
            resolved = resolve(strategy, cfg, micro_batch_size)
        except UserError:
            continue  # breaks a rule for this model (e.g. heads % model)
        accum = global_batch // (resolved.data * micro_batch_size * resolved.micro_batches)
        resolved = dataclasses.replace(resolved, gradient_accumulation=accum)
        plan = build_plan(cfg, resolved, profile, model_name)
        if plan.fits:
            fits.append(Candidate(raw, plan))
    fits.sort(key=lambda c: (c.plan.step_seconds, c.peak_bytes))
    return fits[:top]


def render_table(cands: List[Candidate]) -> str:
    if not cands:
        return "no layout fits (try more devices, a smaller micro-batch or a larger device profile)"
    lines = [" #  data model pipe  m  sched        recompute opt  sp   peak GB  bubble  step s  tok/s/dev   MFU"]
    for i, c in enumerate(cands, 1):
        r, p = c.raw, c.plan
        rc = r["layers"]["all"]["recompute"]
        rc = "select" if isinstance(rc, dict) else rc
        lines.append(f"{i:>2}  {r['mesh']['data']:>4} {r['mesh']['model']:>5} {r['mesh']['pipeline']:>4} "
                     f"{r['micro_batches']:>3}  {r['pipeline']['scheduler']:<11}  {rc:<9} "
                     f"{'on ' if r['optimizer_parallel']['enabled'] else 'off'}  {'on ' if r['sequence_parallel'] else 'off'} "
                     f"{c.peak_bytes / 1024 ** 3:>8.2f}  {p.bubble_fraction:>5.1%}  {p.step_seconds:>6.3f}  "
                     f"{p.tokens_per_second_per_device:>9.0f}  {p.mfu:>5.1%}")
    return "\n".join(lines)


def write_strategy(cand: Candidate, path: str, model_name: Optional[str], devices: int) -> None:
    raw = dict(cand.raw)
    if model_name:
        raw = {"model": model_name, **raw}
    raw["devices"] = devices
    header = (f"# Written by `naohai plan --search` for {model_name or 'the given model'} on {devices} devices.\n"
              f"# Predicted: step {cand.plan.step_seconds:.3f} s, MFU {cand.plan.mfu:.1%}, peak "
              f"{cand.peak_bytes / 1024 ** 3:.2f} GB/device ({cand.plan.profile}).\n")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(header + yaml.safe_dump(raw, sort_keys=False, default_flow_style=None))
