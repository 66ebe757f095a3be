"""The one description of the model: its shardable ops and its parameters, in pure Python.

For a :class:`~naohai.model.config.ModelConfig` this module lists

* every operation a strategy may shard (:class:`OpSpec`): its stable full name
  (``layers.7.attention.q``), primitive kind, the logical axis and size of
  every input dimension for a micro-batch, and which inputs are parameters
  (and which parameter each one is);
* every parameter (:class:`ParamSpec`): full name as MindSpore names it, shape,
  logical axes, owning block, whether weight decay applies, and how it is
  initialised.

The cells in :mod:`naohai.model.layers` create their parameters from these
lists (names, shapes, initialisers) and expose their primitives under the op
names; :mod:`naohai.model.catalog` and :mod:`naohai.model.params` are views of
it, and the planner's memory model finds the op that consumes each parameter
here (:func:`param_consumers`) instead of by name matching.  Adding a family
means extending these builders and writing one ``construct``.

No MindSpore import: the strategy validator and planner use this without
building any cell.

Logical axes:
  batch     sequences in the micro-batch (also flattened batch*seq token rows)
  seq       query positions              kv_seq   key/value positions
  embed     hidden size                  heads    attention heads (or heads*head_dim)
  kv_heads  key/value heads (GQA)        head_dim per-head width
  mlp       feed-forward width           vocab    (padded) vocabulary
  None      a dimension no rule may shard
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from naohai.model.config import ModelConfig

LOGICAL_AXES = ("batch", "seq", "kv_seq", "embed", "heads", "kv_heads", "head_dim", "mlp", "vocab")

Axes = Tuple[Optional[str], ...]


@dataclass(frozen=True)
class OpSpec:
    """One shardable operation: ``name`` is relative to its owner until :func:`op_catalog` prefixes it."""

    name: str
    kind: str                       # MatMul | BatchMatMul | Softmax | Gather | Add | Mul | Activation | ...
    inputs: Tuple[Axes, ...]        # logical axes of each input
    shapes: Tuple[Tuple[int, ...], ...]  # size of each input dimension, for micro-batch b
    weight_inputs: Tuple[int, ...] = ()  # indices of inputs that are parameters (or fixed tables)
    params: Tuple[Optional[str], ...] = ()  # the parameter (relative name) at each weight input; None = constant

    def check(self) -> None:
        assert len(self.inputs) == len(self.shapes), self.name
        for axes, shape in zip(self.inputs, self.shapes):
            assert len(axes) == len(shape), (self.name, axes, shape)
        assert not self.params or len(self.params) == len(self.weight_inputs), self.name


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: Tuple[int, ...]
    axes: Tuple[Optional[str], ...]
    owner: str            # "embedding", "layers.<i>", "head" (final norm + head)
    no_decay: bool        # as in both references: only norm gains/shifts and biases skip weight decay
    init: str = "normal"  # normal (init_std) | scaled (init_std / sqrt(2 L)) | zeros | ones

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _prefixed(prefix: str, p: ParamSpec) -> ParamSpec:
    return ParamSpec(f"{prefix}.{p.name}", p.shape, p.axes, p.owner, p.no_decay, p.init)


# --------------------------------------------------------------------------- blocks
def norm_params(cfg: ModelConfig, owner: str) -> List[ParamSpec]:
    """Parameters of one norm, relative names (gamma, beta)."""
    h = cfg.hidden_size
    if cfg.norm == "nonparam_layernorm":
        return []
    out = [ParamSpec("gamma", (h,), ("embed",), owner, True, "ones")]
    if cfg.norm == "layernorm":
        out.append(ParamSpec("beta", (h,), ("embed",), owner, True, "zeros"))
    return out


def _norm_ops(cfg: ModelConfig, name: str, t: int, param_prefix: str) -> List[OpSpec]:
    """A LayerNorm primitive is shardable; RMSNorm is composed of elementwise ops left to propagation."""
    h = cfg.hidden_size
    if cfg.norm == "rmsnorm":
        return []
    params = (None, None) if cfg.norm == "nonparam_layernorm" else (f"{param_prefix}.gamma", f"{param_prefix}.beta")
    return [OpSpec(name, "LayerNorm", (("batch", "embed"), ("embed",), ("embed",)), ((t, h), (h,), (h,)), (1, 2),
                   params)]


def attention_params(cfg: ModelConfig, owner: str, query_layer: bool) -> List[ParamSpec]:
    """Parameters of one attention block in creation order, relative names."""
    h, nh, hd, nkv = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.kv_heads
    out = [ParamSpec("q_weight", (nh * hd, h), ("heads", "embed"), owner, False),
           ParamSpec("k_weight", (nkv * hd, h), ("kv_heads", "embed"), owner, False),
           ParamSpec("v_weight", (nkv * hd, h), ("kv_heads", "embed"), owner, False),
           ParamSpec("out_weight", (h, nh * hd), ("embed", "heads"), owner, False, "scaled")]
    if cfg.has_qkv_bias:
        out += [ParamSpec("q_bias", (nh * hd,), ("heads",), owner, True, "zeros"),
                ParamSpec("k_bias", (nkv * hd,), ("kv_heads",), owner, True, "zeros"),
                ParamSpec("v_bias", (nkv * hd,), ("kv_heads",), owner, True, "zeros")]
    if cfg.has_out_bias:
        out.append(ParamSpec("out_bias", (h,), ("embed",), owner, True, "zeros"))
    if query_layer:
        out.append(ParamSpec("query_embedding", (cfg.positions, h), (None, "embed"), owner, False))
    return out


def mlp_params(cfg: ModelConfig, owner: str) -> List[ParamSpec]:
    """Parameters of one feed-forward block in creation order, relative names."""
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    out = [ParamSpec("up_weight", (f, h), ("mlp", "embed"), owner, False)]
    if cfg.activation == "swiglu":
        out.append(ParamSpec("gate_weight", (f, h), ("mlp", "embed"), owner, False))
    out.append(ParamSpec("down_weight", (h, f), ("embed", "mlp"), owner, False, "scaled"))
    if cfg.has_mlp_bias:
        out.append(ParamSpec("up_bias", (f,), ("mlp",), owner, True, "zeros"))
        if cfg.activation == "swiglu":
            out.append(ParamSpec("gate_bias", (f,), ("mlp",), owner, True, "zeros"))
        out.append(ParamSpec("down_bias", (h,), ("embed",), owner, True, "zeros"))
    return out


def embedding_table_params(cfg: ModelConfig) -> List[ParamSpec]:
    """The embedding cell's own tables, relative names."""
    h = cfg.hidden_size
    out = [ParamSpec("word_embedding", (cfg.padded_vocab_size, h), ("vocab", "embed"), "embedding", False)]
    if cfg.position == "learned":
        out.append(ParamSpec("position_embedding", (cfg.positions, h), (None, "embed"), "embedding", False))
    return out


def head_weight_params(cfg: ModelConfig) -> List[ParamSpec]:
    if cfg.tie_embeddings:
        return []
    return [ParamSpec("weight", (cfg.padded_vocab_size, cfg.hidden_size), ("vocab", "embed"), "head", False)]


def _linear(name: str, x_axes: Axes, w_axes: Axes, t: int, out: int, inn: int, weight: str) -> OpSpec:
    return OpSpec(name, "MatMul", (x_axes, w_axes), ((t, inn), (out, inn)), (1,), (weight,))


def _bias_add(name: str, axis: str, t: int, n: int, bias: str) -> OpSpec:
    return OpSpec(name, "Add", (("batch", axis), (axis,)), ((t, n), (n,)), (1,), (bias,))


def layer_ops(cfg: ModelConfig, b: int, is_query_layer: bool = False) -> List[OpSpec]:
    """Ops of one decoder layer, names relative to ``layers.<i>``."""
    s, h, nh, hd = cfg.seq_length, cfg.hidden_size, cfg.num_heads, cfg.head_dim
    nkv, f = cfg.kv_heads, cfg.ffn_hidden_size
    t = b * s  # token rows of the flattened activations
    drop = cfg.dropout > 0
    ops: List[OpSpec] = []
    ops += _norm_ops(cfg, "input_norm", t, "input_norm")
    x = ("batch", "embed")
    a = "attention"
    ops.append(_linear(f"{a}.q", x, ("heads", "embed"), t, nh * hd, h, f"{a}.q_weight"))
    ops.append(_linear(f"{a}.k", x, ("kv_heads", "embed"), t, nkv * hd, h, f"{a}.k_weight"))
    ops.append(_linear(f"{a}.v", x, ("kv_heads", "embed"), t, nkv * hd, h, f"{a}.v_weight"))
    if cfg.has_qkv_bias:
        ops.append(_bias_add(f"{a}.q_bias", "heads", t, nh * hd, f"{a}.q_bias"))
        ops.append(_bias_add(f"{a}.k_bias", "kv_heads", t, nkv * hd, f"{a}.k_bias"))
        ops.append(_bias_add(f"{a}.v_bias", "kv_heads", t, nkv * hd, f"{a}.v_bias"))
    bhsd = ("batch", "heads", "seq", "head_dim")
    bhkd = ("batch", "heads", "kv_seq", "head_dim")
    bhss = ("batch", "heads", "seq", "kv_seq")
    ops.append(OpSpec(f"{a}.scores", "BatchMatMul", (bhsd, bhkd), ((b, nh, s, hd), (b, nh, s, hd))))
    ops.append(OpSpec(f"{a}.scale", "Mul", (bhss, ()), ((b, nh, s, s), ())))
    if cfg.eod_reset:   # the document-causal bias of each packed row (ALiBi distances added to it first)
        bias_axes, bias_shape = ("batch", "heads", "seq", "kv_seq"), (b, nh if cfg.position == "alibi" else 1, s, s)
        if cfg.position != "alibi":
            bias_axes = ("batch", None, "seq", "kv_seq")
        ops.append(OpSpec(f"{a}.mask", "Add", (bhss, bias_axes), ((b, nh, s, s), bias_shape)))
    elif cfg.position == "alibi":
        ops.append(OpSpec(f"{a}.mask", "Add", (bhss, ("heads", "seq", "kv_seq")), ((b, nh, s, s), (nh, s, s))))
    else:
        ops.append(OpSpec(f"{a}.mask", "Add", (bhss, (None, "seq", "kv_seq")), ((b, nh, s, s), (1, s, s))))
    ops.append(OpSpec(f"{a}.softmax", "Softmax", (bhss,), ((b, nh, s, s),)))
    if drop:
        ops.append(OpSpec(f"{a}.prob_dropout", "Dropout", (bhss,), ((b, nh, s, s),)))
    ops.append(OpSpec(f"{a}.context", "BatchMatMul", (bhss, bhkd), ((b, nh, s, s), (b, nh, s, hd))))
    ops.append(_linear(f"{a}.out", ("batch", "heads"), ("embed", "heads"), t, h, nh * hd, f"{a}.out_weight"))
    if cfg.has_out_bias:
        ops.append(_bias_add(f"{a}.out_bias", "embed", t, h, f"{a}.out_bias"))
    if drop:
        ops.append(OpSpec(f"{a}.dropout", "Dropout", (x,), ((t, h),)))
    ops.append(OpSpec(f"{a}.residual", "Add", (x, x), ((t, h), (t, h))))
    if not cfg.shared_block_norm:   # (in a parallel block it norms the layer input, not the residual)
        ops += _norm_ops(cfg, "post_attention_norm", t, "post_attention_norm")
    m = "mlp"
    ops.append(_linear(f"{m}.up", x, ("mlp", "embed"), t, f, h, f"{m}.up_weight"))
    if cfg.has_mlp_bias:
        ops.append(_bias_add(f"{m}.up_bias", "mlp", t, f, f"{m}.up_bias"))
    bm = ("batch", "mlp")
    if cfg.activation == "swiglu":
        ops.append(_linear(f"{m}.gate", x, ("mlp", "embed"), t, f, h, f"{m}.gate_weight"))
        if cfg.has_mlp_bias:
            ops.append(_bias_add(f"{m}.gate_bias", "mlp", t, f, f"{m}.gate_bias"))
        ops.append(OpSpec(f"{m}.act", "Activation", (bm,), ((t, f),)))
        ops.append(OpSpec(f"{m}.act_mul", "Mul", (bm, bm), ((t, f), (t, f))))
        ops.append(OpSpec(f"{m}.mul", "Mul", (bm, bm), ((t, f), (t, f))))
    else:
        ops.append(OpSpec(f"{m}.act", "Activation", (bm,), ((t, f),)))
        if cfg.activation in ("gelu", "gelu_tanh"):  # x * (1 + erf(x / sqrt 2)) / 2, or with tanh
            ops.append(OpSpec(f"{m}.act_mul", "Mul", (bm, bm), ((t, f), (t, f))))
    ops.append(_linear(f"{m}.down", bm, ("embed", "mlp"), t, h, f, f"{m}.down_weight"))
    if cfg.has_mlp_bias:
        ops.append(_bias_add(f"{m}.down_bias", "embed", t, h, f"{m}.down_bias"))
    if drop:
        ops.append(OpSpec(f"{m}.dropout", "Dropout", (x,), ((t, h),)))
    ops.append(OpSpec(f"{m}.residual", "Add", (x, x), ((t, h), (t, h))))
    if is_query_layer:
        ops.append(OpSpec(f"{a}.query_lookup", "Gather", ((None, "embed"),) + (_positions_input(cfg, b),),
                          ((cfg.positions, h), (b if cfg.eod_reset_positions else 1, s)), (0,),
                          (f"{a}.query_embedding",)))
    return ops


def _positions_input(cfg: ModelConfig, b: int) -> Axes:
    """Axes of the position ids fed to a position table: per row when they restart at EOD."""
    return ("batch", "seq") if cfg.eod_reset_positions else (None, "seq")


def layer_params(cfg: ModelConfig, i: int) -> List[ParamSpec]:
    """Parameters of layer ``i`` with full names, in the order the cells create them."""
    p = f"layers.{i}"
    is_q = bool(cfg.query_layer and i == cfg.num_layers - 1)
    out = [_prefixed(f"{p}.input_norm", x) for x in norm_params(cfg, p)]
    out += [_prefixed(f"{p}.attention", x) for x in attention_params(cfg, p, is_q)]
    if not cfg.shared_block_norm:
        out += [_prefixed(f"{p}.post_attention_norm", x) for x in norm_params(cfg, p)]
    out += [_prefixed(f"{p}.mlp", x) for x in mlp_params(cfg, p)]
    return out


def top_ops(cfg: ModelConfig, b: int) -> List[OpSpec]:
    """Ops outside the decoder layers (embedding, head, loss), with full names."""
    s, h, v = cfg.seq_length, cfg.hidden_size, cfg.padded_vocab_size
    t = b * s
    ops = [OpSpec("embedding.lookup", "Gather", (("vocab", "embed"), ("batch", "seq")), ((v, h), (b, s)), (0,),
                  ("embedding.word_embedding",))]
    if cfg.position == "learned":
        ops.append(OpSpec("embedding.position", "Gather", ((None, "embed"), _positions_input(cfg, b)),
                          ((cfg.positions, h), (b if cfg.eod_reset_positions else 1, s)), (0,),
                          ("embedding.position_embedding",)))
    if cfg.dropout > 0:
        ops.append(OpSpec("embedding.dropout", "Dropout", (("batch", "embed"),), ((t, h),)))
    ops += _norm_ops(cfg, "final_norm", t, "head.final_norm")
    head_weight = "embedding.word_embedding" if cfg.tie_embeddings else "head.weight"
    ops.append(_linear("head.logits", ("batch", "embed"), ("vocab", "embed"), t, v, h, head_weight))
    # The loss: nll = -log_softmax(logits)[label].  Its class axis is declared unshardable (None):
    # MindSpore 2.10's LogSoftmax and GatherD cannot split the axis they work along, so with a
    # vocab-parallel head the logits are gathered before the loss.  The pick's second input is the
    # label column [t, 1].
    ops.append(OpSpec("loss.log_softmax", "LogSoftmax", (("batch", None),), ((t, v),)))
    ops.append(OpSpec("loss.pick", "GatherD", (("batch", None), ("batch", None)), ((t, v), (t, 1))))
    return ops


def embedding_params(cfg: ModelConfig) -> List[ParamSpec]:
    out = [_prefixed("embedding", p) for p in embedding_table_params(cfg)]
    if cfg.embedding_norm:
        out += [_prefixed("embedding.norm", p) for p in norm_params(cfg, "embedding")]
    return out


def head_params(cfg: ModelConfig) -> List[ParamSpec]:
    out = [_prefixed("head.final_norm", p) for p in norm_params(cfg, "head")]
    out += [_prefixed("head", p) for p in head_weight_params(cfg)]
    return out


# --------------------------------------------------------------------------- the whole model
def op_catalog(cfg: ModelConfig, micro_batch: int = 1) -> Dict[str, OpSpec]:
    """Every shardable op of the model by full name, in model order; ``params`` hold full names."""
    out: Dict[str, OpSpec] = {}
    top = top_ops(cfg, micro_batch)
    for spec in top:
        if spec.name.startswith("embedding."):
            out[spec.name] = spec
    for i in range(cfg.num_layers):
        is_q = cfg.query_layer and i == cfg.num_layers - 1
        for spec in layer_ops(cfg, micro_batch, is_q):
            full = tuple(f"layers.{i}.{p}" if p else None for p in spec.params)
            out[f"layers.{i}.{spec.name}"] = OpSpec(f"layers.{i}.{spec.name}", spec.kind, spec.inputs, spec.shapes,
                                                    spec.weight_inputs, full)
    for spec in top:
        if not spec.name.startswith("embedding."):
            out[spec.name] = spec
    return out


def param_shapes(cfg: ModelConfig) -> List[ParamSpec]:
    out = embedding_params(cfg)
    for i in range(cfg.num_layers):
        out += layer_params(cfg, i)
    out += head_params(cfg)
    return out


def param_consumers(cfg: ModelConfig) -> Dict[str, Tuple[str, int]]:
    """Parameter full name -> (op full name, input index) of the op that shards it.

    A tied word embedding is consumed by the lookup and the head; the lookup (its
    first consumer) is the one given.
    """
    out: Dict[str, Tuple[str, int]] = {}
    for name, spec in op_catalog(cfg).items():
        for index, param in zip(spec.weight_inputs, spec.params):
            if param is not None and param not in out:
                out[param] = (name, index)
    return out


def init_std(cfg: ModelConfig, p: ParamSpec) -> float:
    """Standard deviation of a normal-initialised parameter (GPT-2's scaled output projections)."""
    if p.init == "scaled":
        return cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    return cfg.init_std
