"""Per-rank memory from a compiled rank's parameter layouts, beside the planner's figures.

Owns :func:`compiled_state` (model-state bytes of one compiled rank, read from MindSpore's
``parameter_layout_dict`` as :mod:`naohai.simulate.worker` records it in ``result.json``),
:func:`rank_rows` (compiled vs planned per rank, with the difference) and :func:`render`.

What each figure is, for rank r of stage k (float32 everywhere, as naohai keeps it):

* **params**: elements of the model-parameter slices the rank computes with (``slice_shape``
  of every model parameter in the layout: a parameter of another stage has no layout there).
* **weights**: 4 bytes per slice element, divided by its optimizer-shard group at level3
  (the planner's convention, :mod:`naohai.strategy.memory`).  MindSpore holds an optimizer-sharded
  weight as its shard between steps already at level1 and all-gathers it for use
  (``local_shape``); that smaller figure is ``weights_held``.
* **grads**: the accumulation buffers MindSpore keeps per parameter when the step accumulates
  micro-batches in the graph (``accu_grads.*``, pipeline / gradient accumulation: their
  ``local_shape``), else 4 bytes per slice element (divided by the group at level2), plus
  naohai's host accumulation buffers (``accum.*``) when the global batch needs several steps.
* **optimizer**: Adam's ``adam_m.*`` and ``adam_v.*`` as MindSpore placed them (``local_shape``,
  i.e. after optimizer sharding).
* **activations**: naohai's activation model (MindSpore reports no device memory on the
  simulated path): :func:`naohai.strategy.memory.stage_activations` of the rank's stage.

Parameters, weights, gradients and optimizer state must equal the planner's exactly; the
activations are the planner's own model, so their difference is 0 by construction and the
table says so (their tolerance against hardware is the planner's, see the README).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional

from naohai.config import ModelConfig
from naohai.strategy.memory import place_params, stage_activations, stage_states
from naohai.strategy.resolve import ResolvedStrategy

GB = 1024.0 ** 3
#: names of the step's own state in a layout (not model parameters)
STATE_PREFIXES = ("accu_grads.", "accum.", "adam_m.", "adam_v.", "moments.", "learning_rate", "global_step",
                  "beta1_power", "beta2_power", "guard.", "args")


def _n(shape) -> int:
    out = 1
    for d in shape or ():
        out *= int(d)
    return out


@dataclass
class RankState:
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    weights_held: Optional[float] = None

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations


def compiled_state(parameters: Dict[str, Dict[str, Any]], resolved: ResolvedStrategy, cfg: ModelConfig,
                   stage: int) -> RankState:
    """Model-state bytes of one compiled rank from its recorded layouts; activations from the model."""
    level = {"level1": 1, "level2": 2, "level3": 3}[resolved.optimizer_parallel.level]
    params = weights = held = grads_plain = accu = host = opt = 0.0
    for name, e in parameters.items():
        if "slice_shape" not in e:
            continue   # another stage's parameter: no layout on this rank
        local = _n(e.get("local_shape") or e["slice_shape"])
        if name.startswith("accu_grads."):
            accu += 4 * local
        elif name.startswith("accum."):
            host += 4 * local
        elif name.startswith(("adam_m.", "adam_v.", "moments.")):
            opt += 4 * local
        elif not name.startswith(STATE_PREFIXES):
            n = _n(e["slice_shape"])
            g = int(e.get("opt_shard_size") or 1)
            params += n
            weights += 4 * n / (g if level >= 3 else 1)
            held += 4 * local
            grads_plain += 4 * n / (g if level >= 2 else 1)
    grads = (accu if accu else grads_plain) + host
    act = stage_activations(cfg, resolved)[stage].total
    return RankState(int(params), weights, grads, opt, act, held)


def planned_state(resolved: ResolvedStrategy, cfg: ModelConfig, stage: int, adapters=None) -> RankState:
    """The planner's bytes for ``stage``; ``adapters`` (:func:`naohai.strategy.memory.adapter_placements`):
    a fine-tuning run, where only they hold gradients and moments."""
    if adapters is None:
        st = stage_states(cfg, resolved)[stage]
    else:
        st = stage_states(cfg, resolved, place_params(cfg, resolved) + list(adapters),
                          {a.name for a in adapters})[stage]
    return RankState(st.params, st.weights, st.grads, st.optimizer, stage_activations(cfg, resolved)[stage].total)


def rank_rows(per_rank, resolved: ResolvedStrategy, cfg: ModelConfig, limit_bytes: float,
              real=None, adapters=None) -> List[Dict[str, Any]]:
    """One record per compiled rank: stage, verdict, compiled and planned bytes, their difference,
    and whether the rank fits ``limit_bytes`` (the device profile's memory less its reserve).

    ``real`` = (resolved, cfg) of the real layout when fewer layers were compiled: the planner's
    figures for the rank's stage at the real depth are added, and decide whether it fits.  ``adapters``:
    see :func:`planned_state` (the compiled layout's)."""
    rows = []
    for r in per_rank:
        stage = r.rank // resolved.devices_per_stage
        row: Dict[str, Any] = {"rank": r.rank, "stage": stage, "verdict": r.verdict(),
                               "compile_s": (r.result or {}).get("compile_s"),
                               "peak_rss_mb": (r.result or {}).get("peak_rss_mb")}
        plan = planned_state(resolved, cfg, stage, adapters)
        row["planned"] = dict(asdict(plan), total=plan.total)
        if r.ok:
            got = compiled_state(r.parameters, resolved, cfg, stage)
            row["compiled"] = dict(asdict(got), total=got.total)
            row["difference"] = {k: got_v - row["planned"][k] for k, got_v in row["compiled"].items()
                                 if k in ("params", "weights", "grads", "optimizer", "activations", "total")}
            row["exact"] = all(row["difference"][k] == 0 for k in ("params", "weights", "grads", "optimizer"))
            row["fits"] = got.total <= limit_bytes
        if real is not None:
            full = planned_state(real[0], real[1], stage)
            row["planned_real_depth"] = dict(asdict(full), total=full.total)
            row["fits"] = full.total <= limit_bytes if r.ok else None
        rows.append(row)
    return rows


def _g(x: Optional[float]) -> str:
    return "-" if x is None else f"{x / GB:.3f}"


def render(rows: List[Dict[str, Any]], limit_bytes: float, profile: str) -> str:
    """The per-rank memory table (GiB): compiled, planned and the difference."""
    head = ["rank", "stage", "source", "params", "weights", "grads", "optimizer", "activations", "total", "fits"]
    body = []
    for row in rows:
        if row.get("compiled") is None:
            body.append([str(row["rank"]), str(row["stage"]), "not compiled", row["verdict"][:60]] + [""] * 6)
            continue
        for src in ("compiled", "planned", "difference", "planned_real_depth"):
            v = row.get(src)
            if v is None:
                continue
            fits = ""
            if src == "compiled" and "planned_real_depth" not in row:
                fits = "yes" if row["fits"] else "NO"
            elif src == "planned_real_depth":
                fits = "yes" if row["fits"] else "NO"
            elif src == "difference":
                fits = "exact" if row["exact"] else "DIFFERS"
            body.append([str(row["rank"]) if src == "compiled" else "", str(row["stage"]) if src == "compiled" else "",
                         src.replace("_", " "),
                         f"{v['params'] / 1e6:.2f}M" if src != "difference" else f"{v['params']:+d}",
                         _g(v["weights"]), _g(v["grads"]), _g(v["optimizer"]), _g(v["activations"]),
                         _g(v["total"]), fits])
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    lines = [f"per-rank memory, GiB (device {profile}: {limit_bytes / GB:.1f} GiB usable); compiled = MindSpore's "
             "slices and optimizer groups, activations = naohai's model (MindSpore reports none on this path)"]
    for row in [head] + body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    held = [r for r in rows if r.get("compiled") and r["compiled"].get("weights_held") is not None
            and r["compiled"]["weights_held"] < r["compiled"]["weights"]]
    if held:
        r = held[0]
        lines.append(f"note: MindSpore holds optimizer-sharded weights as shards between steps (rank {r['rank']}: "
                     f"{_g(r['compiled']['weights_held'])} GiB held vs {_g(r['compiled']['weights'])} GiB gathered "
                     f"for use); the table counts the gathered slice, as the planner does")
    return "\n".join(lines)
