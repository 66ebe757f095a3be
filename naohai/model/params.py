"""Parameter inventory of a model configuration, computed without allocating weights.

:func:`param_shapes` lists every parameter the cells in ``naohai.model`` create,
by the same names MindSpore gives them, with shapes and the logical axes of each
dimension.  The strategy planner uses it for per-device memory; a test checks it
against the real cells of a small model, so the two agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from naohai.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    name: str
    shape: Tuple[int, ...]
    axes: Tuple[Optional[str], ...]
    owner: str            # "embedding", "layers.<i>", "head" (final norm + head)
    no_decay: bool        # norms, biases and embeddings are excluded from weight decay

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _norm_params(cfg: ModelConfig, prefix: str, owner: str) -> List[ParamSpec]:
    h = cfg.hidden_size
    if cfg.norm == "nonparam_layernorm":
        return []
    out = [ParamSpec(f"{prefix}.gamma", (h,), ("embed",), owner, True)]
    if cfg.norm == "layernorm":
        out.append(ParamSpec(f"{prefix}.beta", (h,), ("embed",), owner, True))
    return out


def layer_params(cfg: ModelConfig, i: int) -> List[ParamSpec]:
    h, nh, hd, nkv, f = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.kv_heads, cfg.ffn_hidden_size
    p = f"layers.{i}"
    out = _norm_params(cfg, f"{p}.input_norm", p)
    a = f"{p}.attention"
    out += [ParamSpec(f"{a}.q_weight", (nh * hd, h), ("heads", "embed"), p, False),
            ParamSpec(f"{a}.k_weight", (nkv * hd, h), ("kv_heads", "embed"), p, False),
            ParamSpec(f"{a}.v_weight", (nkv * hd, h), ("kv_heads", "embed"), p, False)]
    if cfg.bias:
        out += [ParamSpec(f"{a}.q_bias", (nh * hd,), ("heads",), p, True),
                ParamSpec(f"{a}.k_bias", (nkv * hd,), ("kv_heads",), p, True),
                ParamSpec(f"{a}.v_bias", (nkv * hd,), ("kv_heads",), p, True)]
    out.append(ParamSpec(f"{a}.out_weight", (h, nh * hd), ("embed", "heads"), p, False))
    if cfg.bias:
        out.append(ParamSpec(f"{a}.out_bias", (h,), ("embed",), p, True))
    if cfg.query_layer and i == cfg.num_layers - 1:
        out.append(ParamSpec(f"{a}.query_embedding", (cfg.positions, h), (None, "embed"), p, True))
    out += _norm_params(cfg, f"{p}.post_attention_norm", p)
    m = f"{p}.mlp"
    out.append(ParamSpec(f"{m}.up_weight", (f, h), ("mlp", "embed"), p, False))
    if cfg.bias:
        out.append(ParamSpec(f"{m}.up_bias", (f,), ("mlp",), p, True))
    if cfg.activation == "swiglu":
        out.append(ParamSpec(f"{m}.gate_weight", (f, h), ("mlp", "embed"), p, False))
        if cfg.bias:
            out.append(ParamSpec(f"{m}.gate_bias", (f,), ("mlp",), p, True))
    out.append(ParamSpec(f"{m}.down_weight", (h, f), ("embed", "mlp"), p, False))
    if cfg.bias:
        out.append(ParamSpec(f"{m}.down_bias", (h,), ("embed",), p, True))
    return out


def embedding_params(cfg: ModelConfig) -> List[ParamSpec]:
    h = cfg.hidden_size
    out = [ParamSpec("embedding.word_embedding", (cfg.padded_vocab_size, h), ("vocab", "embed"), "embedding", True)]
    if cfg.position == "learned":
        out.append(ParamSpec("embedding.position_embedding", (cfg.positions, h), (None, "embed"), "embedding", True))
    if cfg.embedding_norm:
        out += _norm_params(cfg, "embedding.norm", "embedding")
    return out


def head_params(cfg: ModelConfig) -> List[ParamSpec]:
    out = _norm_params(cfg, "head.final_norm", "head")
    if not cfg.tie_embeddings:
        out.append(ParamSpec("head.weight", (cfg.padded_vocab_size, cfg.hidden_size), ("vocab", "embed"), "head", False))
    return out


def param_shapes(cfg: ModelConfig) -> List[ParamSpec]:
    out = embedding_params(cfg)
    for i in range(cfg.num_layers):
        out += layer_params(cfg, i)
    out += head_params(cfg)
    return out


def count_params(cfg: ModelConfig) -> int:
    return sum(p.size for p in param_shapes(cfg))


def count_by_owner(cfg: ModelConfig) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for p in param_shapes(cfg):
        out[p.owner] = out.get(p.owner, 0) + p.size
    return out
