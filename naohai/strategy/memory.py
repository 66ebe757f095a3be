"""Per-device memory of a resolved strategy: model states and activations.

Model states (bytes per parameter, before optimizer sharding): naohai's model keeps
float32 parameters whatever the compute dtype (layers cast them to the compute
dtype at each matmul), so: 4 weight + 4 gradient + 8 optimizer (Adam m, v) = 16,
plus a 4-byte float32 accumulation buffer per parameter when the step accumulates
gradients over several micro-steps (``naohai.train.step.make_buffers``).
Optimizer parallel over a group of ``g`` data-parallel ranks divides the optimizer
state by g (level1), also the gradients (level2), also the weights (level3).  As in
MindSpore, the group of a parameter (with shard_size -1) is every device of its stage
holding the same slice, so a parameter the model axis does not split is divided over
data x model ranks; it stays whole if the whole (unsliced) parameter is smaller than
``threshold_kb`` or its slice's first dimension does not split g ways (checked
against MindSpore's compile in tests/strategy/test_plan_vs_compile.py).

A parameter's slice counts come from the op that consumes it (as the model
description, naohai.model.spec, records; so escape-hatch tuples count), else
from its logical axes and the layer's rules.  The embedding
lives on stage 0; a tied table is also held by the last stage; the final norm
and an untied head live on the last stage.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models").  Per layer and micro-batch, in bytes at 2-byte activations,
with s seq, b sequences per device, h hidden, a heads, f FFN, t the model slices:
every saved tensor is attributed to the op that PRODUCES it --

  unsharded (divided by t under sequence parallel):
    layer input 2sbh (always kept), input_norm 2sbh, attention.residual 3sbh
    (output + dropout mask), post_attention_norm 2sbh, mlp.residual 1sbh (mask)
  split over the model axis (/t):
    Q 2sbh, K and V 2sbh*kv/a each (producer: the bias add if any, else the matmul),
    attention.context 2sbh, attention.softmax 5as^2b (probabilities, dropout mask
    and dropped probabilities), MLP 2sbf per tensor: GeLU: up, act;
    SwiGLU: gate, up, act, mul.
With GeLU, f = 4h and no GQA this sums to the published sbh(10 + 24/t + 5as/(ht)).

Recompute modes:
  none    everything above.
  select  drops the tensors produced by the selected ops.  The softmax tensors
          are only dropped if the whole chain that feeds them is selected
          (attention.scores, .scale, .mask, .softmax), because otherwise the
          input of the recomputed softmax must be kept and nothing is saved.
          Korthikanti's "selective recompute" sbh(10 + 24/t) is exactly that chain.
  full    the layer input: 2sbh (divided by t with slice_activation or sequence
          parallel), the published 2sbh; plus, once per stage, the working set of
          one layer being recomputed during its backward.  Without ``comm: true``
          (MindSpore's mp_comm_recompute) the model-parallel communication ops are
          not recomputed, so their outputs are kept too: with t > 1 the two
          all-reduces (after attention.out and mlp.down) 2 x 2sbh, or under
          sequence parallel the two all-gathers 2 x 2sbh and the two
          reduce-scatters 2 x 2sbh/t.
Activation bytes are scaled by (bytes of compute dtype)/2.  Masks are counted
as in the paper even when dropout is 0 (conservative).

Micro-batches in flight on stage k of p, with m micro-batches: GPipe m;
1F1B min(m, p - k); interleaved with v chunks (Megatron warm-up count)
min(m, (2(p - k - 1) + (v - 1)p + 1) / v).

The last stage and the loss, nll = -log_softmax(logits)[label] (``loss.log_softmax``
then ``loss.pick``).  MindSpore 2.10's LogSoftmax cannot split the class axis (see
``naohai.strategy.compat``), so the head's logits, cast to float32 (4sbV/t_vocab per
device), are all-gathered to the whole padded vocabulary V on every model-parallel
rank.  Per micro-batch in flight the stage keeps the final norm's input and output
(4sbh) and the log-probabilities (float32, 4sbV), which LogSoftmax's backward reads,
from forward to backward; once, while the loss runs, it also holds two more float32
4sbV tensors (the gathered logits in the forward; in the backward the pick's dense
gradient and the log-softmax's input gradient are both [t, V]) and the logits slice
(4sbV/t_vocab).  That transient and the full-recompute working set are never live
together: the stage counts the larger of the two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Dict, List, Optional, Sequence, Tuple

from naohai.config import ModelConfig
from naohai.model.catalog import layer_op_names, layer_ops
from naohai.model.params import ParamSpec, param_shapes
from naohai.model.spec import param_consumers
from naohai.strategy.resolve import RecomputeSpec, ResolvedStrategy

ATTENTION_CHAIN = ("attention.scores", "attention.scale", "attention.mask", "attention.softmax")


def dtype_bytes(compute_dtype: str) -> int:
    return 4 if compute_dtype == "float32" else 2


def state_bytes(compute_dtype: str) -> Tuple[int, int, int]:
    """(weight, grad, optimizer) bytes per parameter: float32 parameters and Adam m, v in any compute dtype."""
    del compute_dtype
    return 4, 4, 8


#: float32 gradient-accumulation buffer per parameter when a step accumulates micro-steps
ACCUMULATION_BYTES = 4


# --------------------------------------------------------------------------- parameters
def param_slices(p: ParamSpec, r: ResolvedStrategy, consumers: Dict[str, Tuple[str, int]]) -> Tuple[int, ...]:
    """Slices of a parameter: from the op that consumes it (the model description says which),
    else from its logical axes and the rules."""
    hit = consumers.get(p.name)
    if hit and hit[0] in r.op_strategy:
        dims = r.op_strategy[hit[0]][hit[1]]
        if len(dims) == len(p.shape):
            return tuple(dims)
    rules = r.layer_rules[int(p.owner.split(".")[1])] if p.owner.startswith("layers.") else r.rules
    out = []
    for axis in p.axes:
        n = 1
        for mesh_axis in (rules.get(axis) or ()) if axis else ():
            n *= r.mesh[mesh_axis]
        out.append(n)
    return tuple(out)


def param_stages(p: ParamSpec, r: ResolvedStrategy, cfg: ModelConfig) -> List[int]:
    last = r.stages - 1
    if p.owner.startswith("layers."):
        return [r.stage_of_layer[int(p.owner.split(".")[1])]]
    if p.owner == "embedding":
        tied = cfg.tie_embeddings and p.name == "embedding.word_embedding"
        return sorted({0, last}) if tied else [0]
    return [last]


@dataclass(frozen=True)
class ParamPlacement:
    name: str
    shape: Tuple[int, ...]
    axes: Tuple[Optional[str], ...]
    slices: Tuple[int, ...]
    stages: Tuple[int, ...]
    per_device: int                # elements per device (before optimizer sharding)
    copies: int                    # devices of a stage holding this same slice (its gradient-reduction group)
    opt_group: int                 # optimizer-parallel group it is split over (1 = whole)

    @property
    def opt_sharded(self) -> bool:
        return self.opt_group > 1


@dataclass(frozen=True)
class StateBytes:
    params: int                    # parameter elements held per device
    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def optimizer_group(r: ResolvedStrategy, copies: int) -> int:
    """Ranks a parameter's optimizer state is split over, before the size and divisibility rules.

    ``shard_size`` equal to the data-parallel size is MindSpore's -1 (``naohai.strategy.runtime.hsdp_args``
    passes it so): every device holding the same slice, i.e. data x the model-axis replication for
    a parameter the model axis does not split.  Otherwise the given size.
    """
    opt = r.optimizer_parallel
    if not opt.enabled:
        return 1
    return copies if opt.shard_size == r.data else opt.shard_size


def place_params(cfg: ModelConfig, r: ResolvedStrategy) -> List[ParamPlacement]:
    wb = state_bytes(cfg.compute_dtype)[0]
    opt = r.optimizer_parallel
    out = []
    consumers = param_consumers(cfg)
    for p in param_shapes(cfg):
        sl = param_slices(p, r, consumers)
        local = [d // k for d, k in zip(p.shape, sl)]
        n = 1
        for d in local:
            n *= d
        slices = 1
        for k in sl:
            slices *= k
        copies = max(1, r.devices_per_stage // slices)
        g = optimizer_group(r, copies)
        # MindSpore compares the WHOLE parameter's size with the threshold (parallel_optimizer_threshold:
        # "Parameter size = shape[0] * ... * shape[n] * size(dtype)"), and splits the slice's first dimension
        sharded = g > 1 and p.size * wb >= opt.threshold_kb * 1024 and bool(local) and local[0] % g == 0
        stages = tuple(param_stages(p, r, cfg))
        if len(stages) > 1:
            # a table shared by two pipeline stages (the tied word embedding) stays whole for the
            # optimizer: naohai.strategy.annotate sets parallel_optimizer=False (MindSpore 2.10 fails otherwise)
            sharded = False
        out.append(ParamPlacement(p.name, p.shape, p.axes, sl, stages, n, copies, g if sharded else 1))
    return out


def adapter_placements(r: ResolvedStrategy,
                       adapters: Dict[str, Tuple[Tuple[int, ...], Tuple[int, ...]]]) -> List[ParamPlacement]:
    """Placements of LoRA factors (``name -> (full shape, slices per axis)``, from
    :func:`naohai.strategy.lora.planned_adapters`): on their layer's stage, never optimizer-sharded
    (:mod:`naohai.strategy.lora` keeps them out of it)."""
    out = []
    for name, (shape, sl) in adapters.items():
        n = 1
        for d, k in zip(shape, sl):
            n *= d // k
        slices = 1
        for k in sl:
            slices *= k
        stage = int(r.stage_of_layer[int(name.split(".")[1])])
        out.append(ParamPlacement(name, tuple(shape), (None,) * len(shape), tuple(sl), (stage,), n,
                                  max(1, r.devices_per_stage // slices), 1))
    return out


def stage_states(cfg: ModelConfig, r: ResolvedStrategy,
                 placements: Optional[Sequence[ParamPlacement]] = None,
                 trainable: Optional[AbstractSet[str]] = None) -> List[StateBytes]:
    """Model-state bytes per device on each stage.  ``trainable`` (a fine-tuning run: the names of the
    only parameters that train): every other parameter is frozen and holds its weight alone, no
    gradient, no optimizer moments (``requires_grad=False``)."""
    wb, gb, ob = state_bytes(cfg.compute_dtype)
    gb += ACCUMULATION_BYTES if r.gradient_accumulation > 1 else 0
    opt = r.optimizer_parallel
    level = {"level1": 1, "level2": 2, "level3": 3}[opt.level]
    acc = [[0, 0.0, 0.0, 0.0] for _ in range(r.stages)]
    for pl in placements if placements is not None else place_params(cfg, r):
        div = pl.opt_group
        learns = trainable is None or pl.name in trainable
        for k in pl.stages:
            a = acc[k]
            a[0] += pl.per_device
            a[1] += pl.per_device * wb / (div if level >= 3 else 1)
            if learns:
                a[2] += pl.per_device * gb / (div if level >= 2 else 1)
                a[3] += pl.per_device * ob / div
    return [StateBytes(int(a[0]), a[1], a[2], a[3]) for a in acc]


# --------------------------------------------------------------------------- activations
def _slices_of(rules: Dict, axis: str, mesh: Dict[str, int]) -> int:
    n = 1
    for m in rules.get(axis) or ():
        n *= mesh[m]
    return n


def saved_tensors(cfg: ModelConfig) -> List[Tuple[Optional[str], float, str]]:
    """(producer op, coefficient of sbh at 2 bytes, kind) with kind 'rows' | 'heads' | 'mlp' | 'scores'.

    The 'scores' coefficient is in units of a*s*s*b (not sbh).
    """
    kv = cfg.kv_heads / cfg.num_heads
    fh = cfg.ffn_hidden_size / cfg.hidden_size
    q = "attention.q_bias" if cfg.has_qkv_bias else "attention.q"
    k = "attention.k_bias" if cfg.has_qkv_bias else "attention.k"
    v = "attention.v_bias" if cfg.has_qkv_bias else "attention.v"
    up = "mlp.up_bias" if cfg.has_mlp_bias else "mlp.up"
    out: List[Tuple[Optional[str], float, str]] = [
        (None, 2, "rows"), ("input_norm", 2, "rows"), ("attention.residual", 3, "rows")]
    if not cfg.shared_block_norm:
        out.append(("post_attention_norm", 2, "rows"))
    out += [("mlp.residual", 1, "rows"),
            (q, 2, "heads"), (k, 2 * kv, "heads"), (v, 2 * kv, "heads"), ("attention.context", 2, "heads"),
            ("attention.softmax", 5, "scores"),
            (up, 2 * fh, "mlp"), ("mlp.act", 2 * fh, "mlp")]
    if cfg.activation == "swiglu":
        gate = "mlp.gate_bias" if cfg.has_mlp_bias else "mlp.gate"
        out += [(gate, 2 * fh, "mlp"), ("mlp.mul", 2 * fh, "mlp")]
        if "mlp.act_mul" in layer_op_names(cfg):
            out.append(("mlp.act_mul", 2 * fh, "mlp"))
    return out


def layer_activation_bytes(cfg: ModelConfig, r: ResolvedStrategy, i: int, spec: Optional[RecomputeSpec] = None,
                           ignore_recompute: bool = False, tensors=None) -> float:
    """Bytes one micro-batch leaves saved in layer ``i`` on one device."""
    spec = spec or r.recompute[i]
    tensors = tensors if tensors is not None else saved_tensors(cfg)
    rules = r.layer_rules[i]
    s, h, a = cfg.seq_length, cfg.hidden_size, cfg.num_heads
    b = r.micro_batch_size * r.data / _slices_of(rules, "batch", r.mesh)
    t_heads = _slices_of(rules, "heads", r.mesh)
    t_mlp = _slices_of(rules, "mlp", r.mesh)
    t_rows = r.model_parallel if r.sequence_parallel else 1
    scale = dtype_bytes(cfg.compute_dtype) / 2
    sbh = s * b * h
    mode = "none" if ignore_recompute else spec.mode
    if mode == "full":
        t_in = r.model_parallel if (spec.slice_activation or r.sequence_parallel) else 1
        return scale * (2 * sbh / t_in + kept_comm_outputs(r, spec, sbh))
    selected = set(spec.ops) if mode == "select" else set()
    chain_done = all(op in selected for op in ATTENTION_CHAIN)
    total = 0.0
    for producer, coef, kind in tensors:
        if producer is not None and producer in selected:
            if producer != "attention.softmax" or chain_done:
                continue
        if kind == "rows":
            total += coef * sbh / t_rows
        elif kind == "heads":
            total += coef * sbh / t_heads
        elif kind == "mlp":
            total += coef * sbh / t_mlp
        else:
            total += coef * a * s * s * b / t_heads
    return scale * total


def kept_comm_outputs(r: ResolvedStrategy, spec: RecomputeSpec, sbh: float) -> float:
    """sbh-units (2-byte) of model-parallel communication outputs a fully recomputed layer keeps."""
    t = r.model_parallel
    if spec.mode != "full" or spec.comm or t == 1:
        return 0.0
    if r.sequence_parallel:
        return 2 * 2 * sbh + 2 * 2 * sbh / t      # two all-gathers (whole rows), two reduce-scatters
    return 2 * 2 * sbh                             # two all-reduces


def in_flight(r: ResolvedStrategy, k: int) -> float:
    m, p, v = r.micro_batches, r.stages, r.virtual_chunks
    if r.scheduler == "gpipe":
        return float(m)
    if r.scheduler == "interleaved":
        return min(float(m), (2 * (p - k - 1) + (v - 1) * p + 1) / v)
    return float(min(m, p - k))


@dataclass(frozen=True)
class LossBuffers:
    kept: float                  # per micro-batch in flight: the float32 log-probabilities
    transient: float             # once: two float32 [t, V] (gathered logits; pick and log-softmax gradients) + the logits slice
    gathered: bool               # the logits are all-gathered over the vocab slices


def loss_buffers(cfg: ModelConfig, r: ResolvedStrategy) -> LossBuffers:
    b = r.micro_batch_size * r.data / _slices_of(r.rules, "batch", r.mesh)
    sbv = cfg.seq_length * b * cfg.padded_vocab_size
    t_vocab = _slices_of(r.rules, "vocab", r.mesh)
    gathered = t_vocab > 1
    return LossBuffers(kept=4 * sbv, transient=4 * sbv + 4 * sbv / t_vocab + (4 * sbv if gathered else 0.0),
                       gathered=gathered)


@dataclass(frozen=True)
class StageActivations:
    per_micro_batch: float       # saved bytes of one micro-batch on this stage (layers + head + loss gradient)
    in_flight: float
    working_set: float           # one layer recomputed in backward (full recompute), once
    loss_transient: float        # last stage: two float32 [t, V] + logits slice, once
    total: float


def stage_activations(cfg: ModelConfig, r: ResolvedStrategy) -> List[StageActivations]:
    out = []
    scale = dtype_bytes(cfg.compute_dtype) / 2
    b = r.micro_batch_size * r.data / _slices_of(r.rules, "batch", r.mesh)
    s, h = cfg.seq_length, cfg.hidden_size
    loss = loss_buffers(cfg, r)
    tensors = saved_tensors(cfg)
    for k in range(r.stages):
        layers = [i for i, st in enumerate(r.stage_of_layer) if st == k]
        per_mb = sum(layer_activation_bytes(cfg, r, i, tensors=tensors) for i in layers)
        working = max([layer_activation_bytes(cfg, r, i, ignore_recompute=True, tensors=tensors)
                       for i in layers if r.recompute[i].mode == "full"] or [0.0])
        transient = 0.0
        if k == r.stages - 1:
            per_mb += loss.kept + scale * 4 * s * b * h
            transient = loss.transient
        n = in_flight(r, k)
        out.append(StageActivations(per_mb, n, working, transient, per_mb * n + max(working, transient)))
    return out


# --------------------------------------------------------------------------- FLOPs
def layer_forward_flops(cfg: ModelConfig, micro_batch: int) -> Dict[str, float]:
    """Forward FLOPs of each matmul op of layer 0 for a global micro-batch (relative names)."""
    out: Dict[str, float] = {}
    for spec in layer_ops(cfg, micro_batch):
        if spec.kind not in ("MatMul", "BatchMatMul"):
            continue
        a, bshape = spec.shapes
        n_in0 = 1
        for d in a:
            n_in0 *= d
        transposed = spec.inputs[0][-1] == spec.inputs[1][-1]
        out[spec.name] = 2.0 * n_in0 * (bshape[-2] if transposed else bshape[-1])
    return out
