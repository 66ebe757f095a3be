"""The plan of a resolved strategy: memory, bubble, communication, step time, MFU.

``build_plan(cfg, resolved, profile)`` returns a :class:`Plan` (plain data, JSON
ready); ``render_text(plan)`` prints it.  Memory figures come from
``naohai.strategy.memory``.  The time model:

* per micro-batch, stage k computes its layers' forward matmul FLOPs x3
  (forward + backward), +1 forward for fully recomputed layers, + the forward
  FLOPs of selected matmuls; the last stage adds the head (2*tokens*h*V x3).
  Time = FLOPs / (devices per stage * peak * matmul_efficiency), plus the
  tensor-parallel all-reduces of that micro-batch (not overlapped), plus on the
  last stage the all-gather of the float32 logits to the whole vocabulary
  before the loss and the reduce-scatter of their gradient (4sbV each way).
* step = (m + p - 1) * slowest micro-batch (interleaved: (m + (p-1)/v) * ...),
  times gradient accumulation, + the exposed part of the data-parallel sync.
* ring collectives: all-reduce moves 2(n-1)/n of the buffer per device;
  reduce-scatter and all-gather (n-1)/n.
* data-parallel traffic is float32: naohai keeps float32 parameters, so the
  gradients reduced and the weights gathered are 4 bytes each.
* topology: ranks are numbered model-innermost (rank = (stage * data + d) *
  model + m), so a model-parallel group spans ``model`` consecutive devices, a
  data-parallel group ``data * model`` and a pipeline hop ``2 * devices per
  stage``; each group runs at the speed of the profile's smallest link group
  that holds that span (:meth:`DeviceProfile.link_for`), and the plan names it.
* model FLOPs per token from :mod:`naohai.model.flops` (PaLM appendix B, the
  same definition as the trainer's MFU); MFU = model FLOPs per second /
  (devices * peak).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from naohai.config import ModelConfig
from naohai.model.flops import flops_per_token
from naohai.model.params import count_params
from naohai.strategy.memory import (ParamPlacement, dtype_bytes, layer_forward_flops, loss_buffers,
                                    place_params, stage_activations, stage_states, state_bytes)
from naohai.strategy.profiles import DeviceProfile
from naohai.strategy.resolve import ResolvedStrategy

GB = 1024.0 ** 3


@dataclass
class StagePlan:
    stage: int
    layers: str                      # "0-3" (several ranges when interleaved)
    num_layers: int
    params_per_device: int
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    activation_per_micro_batch: float
    micro_batches_in_flight: float
    recompute_working_set: float
    loss_bytes: float                # last stage: loss gradient per micro-batch in flight + loss transient
    total_bytes: float
    limit_bytes: float
    fits: bool
    micro_batch_seconds: float


@dataclass
class CommPlan:
    axis: str
    group_size: int
    bytes_per_step: float            # per device, busiest stage
    seconds_per_step: float
    what: str
    link: str = ""                   # the profile link this group is limited by


@dataclass
class Plan:
    strategy: str
    source: str
    model: str
    devices: int
    mesh: Dict[str, int]
    micro_batches: int
    micro_batch_size: int
    gradient_accumulation: int
    global_batch: int
    scheduler: str
    virtual_chunks: int
    profile: str
    stages: List[StagePlan]
    comm: List[CommPlan]
    bubble_fraction: float
    step_seconds: float
    tokens_per_second_per_device: float
    model_flops_per_token: float
    mfu: float
    fits: bool
    params_total: int
    param_sharding: List[Dict]
    warnings: List[str] = field(default_factory=list)
    # a fine-tuning run: adapter parameters, and per stage the model-state bytes per device that full
    # training would need (the stage rows hold the fine-tuning ones: frozen weights, no grads or moments)
    adapter_params: int = 0
    full_training_state_bytes: List[float] = field(default_factory=list)
    assumptions: List[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)


def _ranges(idx: List[int]) -> str:
    out, start = [], None
    for j, i in enumerate(idx):
        start = i if start is None else start
        if j + 1 == len(idx) or idx[j + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ",".join(out)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    return (p - 1) / (v * m + p - 1)


def _ring(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "allreduce" else (n - 1) / n


def _sharding_table(placements: List[ParamPlacement], r: ResolvedStrategy) -> List[Dict]:
    """One row per distinct (relative name, slices) pair, with the layers it covers."""
    rows: Dict = {}
    for pl in placements:
        parts = pl.name.split(".")
        rel, layer = (".".join(parts[2:]), int(parts[1])) if parts[0] == "layers" else (pl.name, None)
        key = (rel, pl.slices, pl.opt_sharded)
        row = rows.setdefault(key, {"param": rel, "shape": list(pl.shape), "axes": list(pl.axes),
                                    "slices": list(pl.slices), "per_device": pl.per_device,
                                    "optimizer_sharded": pl.opt_sharded, "stages": sorted(set(pl.stages)),
                                    "layers": []})
        if layer is not None:
            row["layers"].append(layer)
        row["stages"] = sorted(set(row["stages"]) | set(pl.stages))
    out = []
    for row in rows.values():
        row["layers"] = _ranges(row["layers"]) if row["layers"] else ""
        out.append(row)
    return out


class LayerCosts:
    """Seconds one decoder layer adds to a stage's micro-batch, by recompute mode (shared with the search)."""

    def __init__(self, cfg: ModelConfig, r: ResolvedStrategy, profile: DeviceProfile):
        self.r = r
        gmb = r.micro_batch_size * r.data                   # global micro-batch (sequences)
        self.fwd = layer_forward_flops(cfg, gmb)
        self.layer_fwd = sum(self.fwd.values())
        self.head_fwd = 2.0 * gmb * cfg.seq_length * cfg.hidden_size * cfg.padded_vocab_size
        self.flops_per_second = (r.devices_per_stage * profile.peak_tflops(cfg.compute_dtype) * 1e12
                                 * profile.matmul_efficiency)
        self.mp_link = profile.link_for(r.model_parallel)
        # one micro-batch's hidden states per data-parallel rank
        self.row_bytes = r.micro_batch_size * cfg.seq_length * cfg.hidden_size * dtype_bytes(cfg.compute_dtype)
        self.allreduce_bytes = _ring("allreduce", r.model_parallel) * self.row_bytes

    def flops(self, spec) -> float:
        extra = 0.0
        if spec.mode == "full":
            extra = self.layer_fwd
        elif spec.mode == "select":
            extra = sum(self.fwd.get(op, 0.0) for op in spec.ops)
        return 3 * self.layer_fwd + extra

    def allreduces(self, spec) -> int:
        """Model-parallel all-reduces of b*s*h: 2 forward + 2 backward, +2 when the comm is recomputed."""
        return 4 + (2 if spec.mode == "full" and spec.comm else 0)

    def seconds(self, spec) -> float:
        return (self.flops(spec) / self.flops_per_second
                + self.allreduces(spec) * self.allreduce_bytes / (self.mp_link.gbs * 1e9))


def build_plan(cfg: ModelConfig, r: ResolvedStrategy, profile: DeviceProfile, model_name: str = "",
               placements: Optional[List[ParamPlacement]] = None, sharding_table: bool = True,
               adapters: Optional[List[ParamPlacement]] = None) -> Plan:
    """The plan; ``placements`` (from :func:`place_params`) may be passed in to save recomputing them.
    ``adapters`` (from :func:`naohai.strategy.memory.adapter_placements`): a fine-tuning run, where only
    they train and every other parameter is frozen (its weight alone: no gradient, no moments, no
    gradient reduction)."""
    p, m, v, acc = r.stages, r.micro_batches, r.virtual_chunks, r.gradient_accumulation
    dp, mp = r.data, r.model_parallel
    per_stage_devices = r.devices_per_stage
    placements = placements if placements is not None else place_params(cfg, r)
    full_states = stage_states(cfg, r, placements)
    trainable = None if adapters is None else {a.name for a in adapters}
    states = full_states if adapters is None else stage_states(cfg, r, placements + adapters, trainable)
    acts = stage_activations(cfg, r)
    loss = loss_buffers(cfg, r)
    limit = (profile.memory_gb - profile.reserve_gb) * GB
    costs = LayerCosts(cfg, r, profile)
    mp_link = costs.mp_link
    mp_bw = mp_link.gbs * 1e9
    row_bytes = costs.row_bytes
    # the float32 logits gathered before the loss, and their gradient reduce-scattered back
    gather_bytes = 2 * _ring("allgather", mp) * loss.kept if loss.gathered else 0.0

    stages: List[StagePlan] = []
    tp_bytes_stage: List[float] = []
    for k in range(p):
        layers = [i for i, st in enumerate(r.stage_of_layer) if st == k]
        flops = sum(costs.flops(r.recompute[i]) for i in layers)
        tp_ar = sum(costs.allreduces(r.recompute[i]) for i in layers)
        if k == p - 1:
            flops += 3 * costs.head_fwd
            tp_ar += 1 if r.vocab_parallel else 0
        if k == 0 and r.vocab_parallel:
            tp_ar += 1
        tp_bytes = tp_ar * costs.allreduce_bytes + (gather_bytes if k == p - 1 else 0.0)
        tp_bytes_stage.append(tp_bytes)
        mb_seconds = flops / costs.flops_per_second + tp_bytes / mp_bw
        st, ac = states[k], acts[k]
        total = st.total + ac.total
        loss_bytes = loss.kept * ac.in_flight + ac.loss_transient if k == p - 1 else 0.0
        stages.append(StagePlan(
            stage=k, layers=_ranges(layers), num_layers=len(layers), params_per_device=st.params,
            weight_bytes=st.weights, grad_bytes=st.grads, optimizer_bytes=st.optimizer,
            activation_bytes=ac.total, activation_per_micro_batch=ac.per_micro_batch,
            micro_batches_in_flight=ac.in_flight, recompute_working_set=ac.working_set, loss_bytes=loss_bytes,
            total_bytes=total, limit_bytes=limit, fits=total <= limit, micro_batch_seconds=mb_seconds))

    slowest = max(st.micro_batch_seconds for st in stages)
    pipe_seconds = (m + (p - 1) / v) * slowest * acc
    # data-parallel gradient sync (busiest stage), once per step; float32 gradients and weights.  A parameter's
    # gradient is reduced over the devices holding its slice; an optimizer-sharded one is reduce-scattered
    # over its group, all-reduced across the group's replicas, and its weights all-gathered back.
    opt = r.optimizer_parallel
    wb, gb, _ = state_bytes(cfg.compute_dtype)
    vols = [0.0] * p
    for pl in placements + (adapters or []):
        e, n, g = pl.per_device, pl.copies, pl.opt_group
        if trainable is not None and pl.name not in trainable:    # frozen: only its sharded weight is gathered
            vol = e * wb * _ring("allgather", g) * (1 + (2 * m * acc if opt.level == "level3" else 0)) if g > 1 else 0.0
        elif g > 1:
            vol = e * gb * _ring("reducescatter", g) + e / g * gb * _ring("allreduce", n // g)
            vol += e * wb * _ring("allgather", g)
            if opt.level == "level3":
                vol += 2 * m * acc * e * wb * _ring("allgather", g)      # re-gather fwd + bwd per micro-batch
        else:
            vol = e * gb * _ring("allreduce", n)
        for k in pl.stages:
            vols[k] += vol
    dp_bytes = max(vols)
    dp_link = profile.link_for(dp * mp)
    dp_seconds = dp_bytes / (dp_link.gbs * 1e9)
    pp_bytes = 0.0 if p == 1 else 2 * m * acc * v * row_bytes / (mp if r.sequence_parallel else 1)
    pp_link = profile.link_for(per_stage_devices * 2)
    pp_seconds = pp_bytes / (pp_link.gbs * 1e9)
    step = pipe_seconds + (1 - profile.dp_overlap) * dp_seconds + pp_seconds
    tp_step = max(tp_bytes_stage) * m * acc
    comm = [CommPlan("model", mp, tp_step, tp_step / mp_bw,
                     "tensor-parallel all-reduce of b*s*h per layer: 2 forward + 2 backward (+2 with comm "
                     "recompute), + vocab-parallel embedding/head"
                     + ("; last stage: all-gather of the float32 logits to the whole vocabulary for the loss "
                        "and reduce-scatter of their gradient" if loss.gathered else ""),
                     mp_link.describe() if mp > 1 else ""),
            CommPlan("data", dp, dp_bytes, dp_seconds,
                     "float32 gradient all-reduce; with optimizer parallel reduce-scatter + all-gather of the "
                     "float32 weights", dp_link.describe() if dp > 1 else ""),
            CommPlan("pipeline", p, pp_bytes, pp_seconds, "send/recv of b*s*h activations and their gradients",
                     pp_link.describe() if p > 1 else "")]
    gmb = r.micro_batch_size * dp                      # global micro-batch (sequences)
    tokens = gmb * m * acc * cfg.seq_length
    mft = flops_per_token(cfg)
    mfu = mft * tokens / step / (r.device_num * profile.peak_tflops(cfg.compute_dtype) * 1e12)
    links = " < ".join(l.describe() for l in profile.links)
    return Plan(
        strategy=r.name, source=r.source, model=model_name, devices=r.device_num, mesh=dict(r.mesh),
        micro_batches=m, micro_batch_size=r.micro_batch_size, gradient_accumulation=acc,
        global_batch=gmb * m * acc, scheduler=r.scheduler, virtual_chunks=v, profile=profile.name, stages=stages,
        comm=comm, bubble_fraction=bubble_fraction(p, m, v) if p > 1 else 0.0, step_seconds=step,
        tokens_per_second_per_device=tokens / step / r.device_num, model_flops_per_token=mft, mfu=mfu,
        fits=all(st.fits for st in stages), params_total=count_params(cfg),
        param_sharding=_sharding_table(placements, r) if sharding_table else [], warnings=list(r.warnings),
        adapter_params=sum(_numel(a.shape) for a in adapters or []),
        full_training_state_bytes=[st.total for st in full_states] if adapters is not None else [],
        assumptions=[profile.source, f"links {links}",
                     f"matmul efficiency {profile.matmul_efficiency:.0%}, data-parallel overlap "
                     f"{profile.dp_overlap:.0%}, reserve {profile.reserve_gb} GB"])


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# --------------------------------------------------------------------------- text
def _gb(x: float) -> str:
    return f"{x / GB:.2f}" if x >= 0.01 * GB or x == 0 else f"{x / GB:.1e}"


def _count(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def render_text(plan: Plan, sharding_rows: int = 40) -> str:
    L = []
    mesh = " x ".join(f"{k} {v}" for k, v in plan.mesh.items())
    L.append(f"plan: {plan.strategy} ({plan.source}) for {plan.model or 'model'}; {_count(plan.params_total)} params")
    L.append(f"mesh: {mesh} = {plan.devices} devices; profile {plan.profile}")
    L.append(f"batch: {plan.micro_batch_size} seq/rank/micro-batch x data {plan.mesh.get('data', 1)} x "
             f"{plan.micro_batches} micro-batches x {plan.gradient_accumulation} accumulation = "
             f"{plan.global_batch} sequences/step; scheduler {plan.scheduler}"
             + (f" ({plan.virtual_chunks} chunks)" if plan.virtual_chunks > 1 else ""))
    L.append("")
    L.append("stage  layers     n  params/dev  weights  grads  optim  activ (per-mb x in-flight)  loss  total GB  "
             "limit  verdict")
    for st in plan.stages:
        act = f"{_gb(st.activation_bytes)} ({_gb(st.activation_per_micro_batch)} x {st.micro_batches_in_flight:g})"
        L.append(f"{st.stage:>5}  {st.layers:<9} {st.num_layers:>2}  {_count(st.params_per_device):>10}  "
                 f"{_gb(st.weight_bytes):>7}  {_gb(st.grad_bytes):>5}  {_gb(st.optimizer_bytes):>5}  "
                 f"{act:<27}  {_gb(st.loss_bytes):>4}  {_gb(st.total_bytes):>8}  {_gb(st.limit_bytes):>5}  "
                 f"{'FITS' if st.fits else 'DOES NOT FIT'}")
    if plan.full_training_state_bytes:
        saved = ", ".join(f"stage {st.stage} {_gb(full - st.weight_bytes - st.grad_bytes - st.optimizer_bytes)}"
                          for st, full in zip(plan.stages, plan.full_training_state_bytes))
        L.append(f"fine-tuning: {_count(plan.adapter_params)} adapter parameters train; the frozen base weights "
                 f"keep no gradients or optimizer moments, saving per device (GB of model states): {saved} "
                 f"(the adapters' own [tokens, rank] activations are not counted)")
    L.append("")
    L.append(f"pipeline bubble: {plan.bubble_fraction:.1%}")
    for c in plan.comm:
        L.append(f"comm {c.axis:<8} group {c.group_size:>4}: {c.bytes_per_step / GB:9.2f} GB/step/device, "
                 f"{c.seconds_per_step:8.3g} s" + (f" over {c.link}" if c.link else "") + f"  ({c.what})")
    L.append(f"predicted step: {plan.step_seconds:.4g} s, {plan.tokens_per_second_per_device:.0f} tokens/s/device, "
             f"MFU {plan.mfu:.1%} (model FLOPs/token {plan.model_flops_per_token:.3g})")
    L.append(f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'} on every stage" if plan.fits else
             f"verdict: DOES NOT FIT on stage(s) {', '.join(str(s.stage) for s in plan.stages if not s.fits)}")
    L.append("")
    L.append("parameter sharding (slices per dim; per-device elements; opt = split over optimizer group):")
    rows = plan.param_sharding
    for row in rows[:sharding_rows]:
        where = f"layers {row['layers']}" if row["layers"] else f"stage {','.join(map(str, row['stages']))}"
        axes = ",".join(a or "-" for a in row["axes"])
        L.append(f"  {row['param']:<28} {str(tuple(row['shape'])):<16} ({axes}) -> {tuple(row['slices'])} "
                 f"{row['per_device']:>11,}{' opt' if row['optimizer_sharded'] else ''}  [{where}]")
    if len(rows) > sharding_rows:
        L.append(f"  ... {len(rows) - sharding_rows} more rows (use --json for all)")
    for w in plan.warnings:
        L.append(f"warning: {w}")
    L.append("assumptions: " + " | ".join(plan.assumptions))
    return "\n".join(L)
