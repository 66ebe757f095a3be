"""The catalog of named, shardable operations of the model, with logical axes.

This is the contract between the model and the strategy layer.  For a model
configuration it lists every operation a strategy may shard: its stable full
name (``layers.7.attention.q``), the primitive kind, and for each input the
logical axis of every dimension and its size for a given micro-batch.

The catalog is pure Python (no MindSpore import): the strategy validator and
planner use it without building any cell.  The cells in ``naohai.model`` take
their op names and axes from here, so the two cannot drift apart.

Logical axes:
  batch     sequences in the micro-batch (also flattened batch*seq token rows)
  seq       query positions              kv_seq   key/value positions
  embed     hidden size                  heads    attention heads (or heads*head_dim)
  kv_heads  key/value heads (GQA)        head_dim per-head width
  mlp       feed-forward width           vocab    (padded) vocabulary
  None      a dimension no rule may shard
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from naohai.config import ModelConfig

LOGICAL_AXES = ("batch", "seq", "kv_seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")

Axes = Tuple[Optional[str], ...]


@dataclass(frozen=True)
class OpSpec:
    """One shardable operation: ``name`` is relative to its cell owner."""

    name: str
    kind: str                       # MatMul | BatchMatMul | Softmax | Gather | Add | Mul | Activation | ...
    inputs: Tuple[Axes, ...]        # logical axes of each input
    shapes: Tuple[Tuple[int, ...], ...]  # size of each input dimension, for micro-batch b
    weight_inputs: Tuple[int, ...] = ()  # indices of inputs that are parameters

    def check(self) -> None:
        assert len(self.inputs) == len(self.shapes), self.name
        for axes, shape in zip(self.inputs, self.shapes):
            assert len(axes) == len(shape), (self.name, axes, shape)


def _norm_ops(cfg: ModelConfig, name: str, t: int) -> List[OpSpec]:
    """A LayerNorm primitive is shardable; RMSNorm is composed of elementwise ops left to propagation."""
    h = cfg.hidden_size
    if cfg.norm == "rmsnorm":
        return []
    return [OpSpec(name, "LayerNorm", (("batch", "embed"), ("embed",), ("embed",)), ((t, h), (h,), (h,)), (1, 2))]


def layer_ops(cfg: ModelConfig, b: int, is_query_layer: bool = False) -> List[OpSpec]:
    """Ops of one decoder layer, names relative to ``layers.<i>``."""
    s, h, nh, hd = cfg.seq_length, cfg.hidden_size, cfg.num_heads, cfg.head_dim
    nkv, f = cfg.kv_heads, cfg.ffn_hidden_size
    t = b * s  # token rows of the flattened activations
    ops: List[OpSpec] = []
    ops += _norm_ops(cfg, "input_norm", t)
    q_src = ("batch", "embed")
    ops.append(OpSpec("attention.q", "MatMul", (q_src, ("heads", "embed")), ((t, h), (nh * hd, h)), (1,)))
    ops.append(OpSpec("attention.k", "MatMul", (q_src, ("kv_heads", "embed")), ((t, h), (nkv * hd, h)), (1,)))
    ops.append(OpSpec("attention.v", "MatMul", (q_src, ("kv_heads", "embed")), ((t, h), (nkv * hd, h)), (1,)))
    if cfg.bias:
        ops.append(OpSpec("attention.q_bias", "Add", (("batch", "heads"), ("heads",)), ((t, nh * hd), (nh * hd,)), (1,)))
        ops.append(OpSpec("attention.k_bias", "Add", (("batch", "kv_heads"), ("kv_heads",)),
                          ((t, nkv * hd), (nkv * hd,)), (1,)))
        ops.append(OpSpec("attention.v_bias", "Add", (("batch", "kv_heads"), ("kv_heads",)),
                          ((t, nkv * hd), (nkv * hd,)), (1,)))
    bhsd = ("batch", "heads", "seq", "head_dim")
    bhkd = ("batch", "heads", "kv_seq", "head_dim")
    bhss = ("batch", "heads", "seq", "kv_seq")
    ops.append(OpSpec("attention.scores", "BatchMatMul", (bhsd, bhkd), ((b, nh, s, hd), (b, nh, s, hd))))
    ops.append(OpSpec("attention.scale", "Mul", (bhss, ()), ((b, nh, s, s), ())))
    if cfg.position == "alibi":
        ops.append(OpSpec("attention.mask", "Add", (bhss, ("heads", "seq", "kv_seq")), ((b, nh, s, s), (nh, s, s))))
    else:
        ops.append(OpSpec("attention.mask", "Add", (bhss, (None, "seq", "kv_seq")), ((b, nh, s, s), (1, s, s))))
    ops.append(OpSpec("attention.softmax", "Softmax", (bhss,), ((b, nh, s, s),)))
    ops.append(OpSpec("attention.context", "BatchMatMul", (bhss, bhkd), ((b, nh, s, s), (b, nh, s, hd))))
    ops.append(OpSpec("attention.out", "MatMul", (("batch", "heads"), ("embed", "heads")), ((t, nh * hd), (h, nh * hd)), (1,)))
    if cfg.bias:
        ops.append(OpSpec("attention.out_bias", "Add", (("batch", "embed"), ("embed",)), ((t, h), (h,)), (1,)))
    ops.append(OpSpec("attention.residual", "Add", (("batch", "embed"), ("batch", "embed")), ((t, h), (t, h))))
    ops += _norm_ops(cfg, "post_attention_norm", t)
    ops.append(OpSpec("mlp.up", "MatMul", (("batch", "embed"), ("mlp", "embed")), ((t, h), (f, h)), (1,)))
    if cfg.bias:
        ops.append(OpSpec("mlp.up_bias", "Add", (("batch", "mlp"), ("mlp",)), ((t, f), (f,)), (1,)))
    if cfg.activation == "swiglu":
        ops.append(OpSpec("mlp.gate", "MatMul", (("batch", "embed"), ("mlp", "embed")), ((t, h), (f, h)), (1,)))
        if cfg.bias:
            ops.append(OpSpec("mlp.gate_bias", "Add", (("batch", "mlp"), ("mlp",)), ((t, f), (f,)), (1,)))
        ops.append(OpSpec("mlp.act", "Activation", (("batch", "mlp"),), ((t, f),)))
        ops.append(OpSpec("mlp.act_mul", "Mul", (("batch", "mlp"), ("batch", "mlp")), ((t, f), (t, f))))
        ops.append(OpSpec("mlp.mul", "Mul", (("batch", "mlp"), ("batch", "mlp")), ((t, f), (t, f))))
    else:
        ops.append(OpSpec("mlp.act", "Activation", (("batch", "mlp"),), ((t, f),)))
        if cfg.activation == "gelu":  # exact GeLU: x * (1 + erf(x / sqrt 2)) / 2
            ops.append(OpSpec("mlp.act_mul", "Mul", (("batch", "mlp"), ("batch", "mlp")), ((t, f), (t, f))))
    ops.append(OpSpec("mlp.down", "MatMul", (("batch", "mlp"), ("embed", "mlp")), ((t, f), (h, f)), (1,)))
    if cfg.bias:
        ops.append(OpSpec("mlp.down_bias", "Add", (("batch", "embed"), ("embed",)), ((t, h), (h,)), (1,)))
    ops.append(OpSpec("mlp.residual", "Add", (("batch", "embed"), ("batch", "embed")), ((t, h), (t, h))))
    if is_query_layer:
        ops.append(OpSpec("attention.query_lookup", "Gather", ((None, "embed"), (None, "seq")),
                          ((cfg.positions, h), (1, s)), (0,)))
    return ops


def top_ops(cfg: ModelConfig, b: int) -> List[OpSpec]:
    """Ops outside the decoder layers (embedding, head, loss), with full names."""
    s, h, v = cfg.seq_length, cfg.hidden_size, cfg.padded_vocab_size
    t = b * s
    ops = [OpSpec("embedding.lookup", "Gather", (("vocab", "embed"), ("batch", "seq")), ((v, h), (b, s)), (0,))]
    if cfg.position == "learned":
        ops.append(OpSpec("embedding.position", "Gather", ((None, "embed"), (None, "seq")),
                          ((cfg.positions, h), (1, s)), (0,)))
    ops += _norm_ops(cfg, "final_norm", t)
    ops.append(OpSpec("head.logits", "MatMul", (("batch", "embed"), ("vocab", "embed")), ((t, h), (v, h)), (1,)))
    # The class axis of the loss is declared unshardable (None): MindSpore 2.10's
    # SoftmaxCrossEntropyWithLogits refuses to split it ("The strategy corresponding to axis
    # dimension is not 1"), so with a vocab-parallel head the logits are gathered before the loss.
    ops.append(OpSpec("loss.xent", "SoftmaxCrossEntropy", (("batch", None), ("batch", None)), ((t, v), (t, v))))
    return ops


def op_catalog(cfg: ModelConfig, micro_batch: int = 1) -> Dict[str, OpSpec]:
    """Every shardable op of the model by full name, in model order."""
    out: Dict[str, OpSpec] = {}
    for spec in top_ops(cfg, micro_batch)[:2 if cfg.position == "learned" else 1]:
        out[spec.name] = spec
    for i in range(cfg.num_layers):
        is_q = cfg.query_layer and i == cfg.num_layers - 1
        for spec in layer_ops(cfg, micro_batch, is_q):
            out[f"layers.{i}.{spec.name}"] = spec
    for spec in top_ops(cfg, micro_batch):
        if not spec.name.startswith("embedding."):
            out[spec.name] = spec
    return out


def layer_op_names(cfg: ModelConfig, query_layer: bool = False) -> List[str]:
    """Names of the ops inside one layer (relative), e.g. for per-layer rules and recompute lists."""
    return [spec.name for spec in layer_ops(cfg, 1, query_layer)]
