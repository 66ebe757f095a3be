"""Names and layouts of the published PanGu-alpha and PengCheng-Mind checkpoints.

Both reference implementations build their networks from MindSpore's transformer
cells, so their checkpoints share one naming scheme (written here from the
reference code, see below) and differ in the feed-forward layout:

==============================================  ==========================================
reference name                                  naohai parameter (layout change)
==============================================  ==========================================
backbone.embedding.word_embedding.embedding_table    embedding.word_embedding (rows padded)
backbone.embedding.position_embedding.embedding_table embedding.position_embedding
backbone.blocks.<i>.layernorm1.gamma|beta       layers.<i>.input_norm.gamma|beta
backbone.blocks.<i>.attention.dense1|2|3.weight layers.<i>.attention.q|k|v_weight ([out, in], same)
backbone.blocks.<i>.attention.dense1|2|3.bias   layers.<i>.attention.q|k|v_bias
backbone.blocks.<i>.attention.projection.weight layers.<i>.attention.out_weight (stored [in, out]: T)
backbone.blocks.<i>.layernorm2.gamma|beta       layers.<i>.post_attention_norm.gamma|beta
backbone.blocks.<i>.output.mapping.weight       layers.<i>.mlp.up_weight ([in, out]: T); SwiGLU:
                                                [h, 2f] = [gate^T | up^T] (gate = first half)
backbone.blocks.<i>.output.mapping.bias         up_bias; SwiGLU: [gate_bias | up_bias]
backbone.blocks.<i>.output.projection.weight|bias layers.<i>.mlp.down_weight ([in, out]: T) | down_bias
backbone.top_query_embedding.embedding_table    layers.<L-1>.attention.query_embedding
backbone.top_query_layer.<as a block>           layers.<L-1>.<...> (the query layer)
backbone.layernorm.gamma|beta                   head.final_norm.gamma|beta
==============================================  ==========================================

Sources: mindspore-ai/models official/nlp/Pangu_alpha/src/pangu_alpha.py
(EmbeddingLayer, PanguAlpha_Model: blocks, top_query_embedding, top_query_layer,
layernorm) over MindFormers' TransformerEncoderLayer (layernorm1/2, attention.dense1-3
with [out, in] weights, attention.projection and output.mapping / output.projection
built with transpose_b=False, i.e. [in, out]); PCLNLP-group/mPengC.mind
src/pengcheng_mind_pipeline_layer_7B.py FeedForward (one mapping of width 2f, chunked
into silu(first half) * second half) and tools/conver_megatron_to_ms.py (the same
names, transposes of projection / mapping / output.projection).

The original PanGu-alpha release also stored the three tables under other names
(``backbone.word_embedding.embedding_table``, ``word_embedding_table``, ...) and as
``word_embedding.npy`` / ``position_embedding.npy`` / ``top_query_embedding.npy``;
they are accepted on import as aliases.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import numpy as np

from naohai.config import ModelConfig
from naohai.convert import FORMATS
from naohai.errors import UserError
from naohai.model.spec import param_shapes


#: names in a reference training checkpoint that are not model weights
NON_WEIGHT_PREFIXES = ("adam_m.", "adam_v.", "moment1.", "moment2.", "accu_grads.", "global_step", "loss_scale",
                       "scale_sense", "learning_rate", "current_iterator_step", "last_overflow_iterator_step",
                       "epoch_num", "step_num")

#: alternative names of the tables (first release of PanGu-alpha; load_embedding_from_ckpt)
ALIASES = {
    "backbone.embedding.word_embedding.embedding_table": ("backbone.word_embedding.embedding_table",
                                                          "word_embedding_table", "word_embedding.npy"),
    "backbone.embedding.position_embedding.embedding_table": ("backbone.position_embedding.embedding_table",
                                                              "position_embedding_table", "position_embedding.npy"),
    "backbone.top_query_embedding.embedding_table": ("query_embedding_table", "top_query_embedding.npy"),
}


@dataclass(frozen=True)
class Link:
    """One reference tensor and the naohai parameters it holds."""

    ref: str
    ours: Tuple[str, ...]
    to_ref: Callable[..., np.ndarray]            # ours... -> ref
    from_ref: Callable[[np.ndarray], Tuple[np.ndarray, ...]]  # ref -> ours...


def _same(x):
    return x


def _one(x):
    return (x,)


def _t(x):
    return np.ascontiguousarray(x.T)


def _t1(x):
    return (np.ascontiguousarray(x.T),)


def _fuse_weights(gate, up):
    """[f, h] gate and up -> the reference's [h, 2f] mapping (gate columns first)."""
    return np.ascontiguousarray(np.concatenate([gate.T, up.T], axis=1))


def _split_weights(w):
    f = w.shape[1] // 2
    return np.ascontiguousarray(w[:, f:].T), np.ascontiguousarray(w[:, :f].T)   # up, gate


def _fuse_bias(gate, up):
    return np.concatenate([gate, up])


def _split_bias(b):
    f = b.shape[0] // 2
    return b[f:].copy(), b[:f].copy()                                             # up, gate


def check_fits(cfg: ModelConfig, fmt: str, where: str = "recipe") -> None:
    """The reference networks have LayerNorm, biases, a tied head and no GQA; say which key does not fit."""
    if fmt not in FORMATS:
        raise UserError(f"unknown checkpoint format '{fmt}'; formats: {', '.join(FORMATS)}", where="command line")
    rules = [("norm", cfg.norm == "layernorm", "the reference blocks use LayerNorm"),
             ("bias", cfg.bias, "the reference linear layers have biases"),
             ("tie_embeddings", cfg.tie_embeddings, "the reference head is the word embedding"),
             ("num_kv_heads", cfg.kv_heads == cfg.num_heads, "the reference attention has no grouped queries"),
             ("position", cfg.position in ("learned", "rope"), "the references use learned or RoPE positions"),
             ("embedding_norm", not cfg.embedding_norm, "the references have no embedding LayerNorm")]
    for key, ok, why in rules:
        if not ok:
            raise UserError(f"this model cannot be stored as a {fmt} checkpoint: {why}", where=where,
                            key=f"model.{key}")


def links(cfg: ModelConfig) -> List[Link]:
    """Every reference tensor of a model of this configuration, in model order."""
    out = [Link("backbone.embedding.word_embedding.embedding_table", ("embedding.word_embedding",), _same, _one)]
    if cfg.position == "learned":
        out.append(Link("backbone.embedding.position_embedding.embedding_table", ("embedding.position_embedding",),
                        _same, _one))
    last = cfg.num_layers - 1
    for i in range(cfg.num_layers):
        is_q = cfg.query_layer and i == last
        r = "backbone.top_query_layer" if is_q else f"backbone.blocks.{i}"
        o = f"layers.{i}"
        for ref_norm, our_norm in (("layernorm1", "input_norm"), ("layernorm2", "post_attention_norm")):
            for leaf in ("gamma", "beta"):
                out.append(Link(f"{r}.{ref_norm}.{leaf}", (f"{o}.{our_norm}.{leaf}",), _same, _one))
        for dense, ours in (("dense1", "q"), ("dense2", "k"), ("dense3", "v")):
            out.append(Link(f"{r}.attention.{dense}.weight", (f"{o}.attention.{ours}_weight",), _same, _one))
            out.append(Link(f"{r}.attention.{dense}.bias", (f"{o}.attention.{ours}_bias",), _same, _one))
        out.append(Link(f"{r}.attention.projection.weight", (f"{o}.attention.out_weight",), _t, _t1))
        out.append(Link(f"{r}.attention.projection.bias", (f"{o}.attention.out_bias",), _same, _one))
        if cfg.activation == "swiglu":
            out.append(Link(f"{r}.output.mapping.weight", (f"{o}.mlp.up_weight", f"{o}.mlp.gate_weight"),
                            lambda up, gate: _fuse_weights(gate, up), _split_weights))
            out.append(Link(f"{r}.output.mapping.bias", (f"{o}.mlp.up_bias", f"{o}.mlp.gate_bias"),
                            lambda up, gate: _fuse_bias(gate, up), _split_bias))
        else:
            out.append(Link(f"{r}.output.mapping.weight", (f"{o}.mlp.up_weight",), _t, _t1))
            out.append(Link(f"{r}.output.mapping.bias", (f"{o}.mlp.up_bias",), _same, _one))
        out.append(Link(f"{r}.output.projection.weight", (f"{o}.mlp.down_weight",), _t, _t1))
        out.append(Link(f"{r}.output.projection.bias", (f"{o}.mlp.down_bias",), _same, _one))
        if is_q:
            out.append(Link("backbone.top_query_embedding.embedding_table", (f"{o}.attention.query_embedding",),
                            _same, _one))
    for leaf in ("gamma", "beta"):
        out.append(Link(f"backbone.layernorm.{leaf}", (f"head.final_norm.{leaf}",), _same, _one))
    return out


def to_reference(weights: Dict[str, np.ndarray], cfg: ModelConfig, fmt: str) -> Dict[str, np.ndarray]:
    """naohai parameters -> reference tensors (float32, reference names and layouts)."""
    check_fits(cfg, fmt)
    out = {}
    for link in links(cfg):
        out[link.ref] = np.asarray(link.to_ref(*[np.asarray(weights[n], np.float32) for n in link.ours]), np.float32)
    return out


def _is_weight(name: str) -> bool:
    return not name.startswith(NON_WEIGHT_PREFIXES)


def from_reference(tensors: Dict[str, np.ndarray], cfg: ModelConfig, fmt: str,
                   where: str = "checkpoint") -> Dict[str, np.ndarray]:
    """Reference tensors -> naohai parameters, checking every name and shape against the recipe.

    The word table may have the unpadded vocabulary's rows (zero rows are added up
    to the padded size) or the padded size; any other mismatch is a UserError.
    """
    check_fits(cfg, fmt)
    tensors = {k: v for k, v in tensors.items() if _is_weight(k)}
    for canonical, aliases in ALIASES.items():
        if canonical not in tensors:
            for alias in aliases:
                if alias in tensors:
                    tensors[canonical] = tensors.pop(alias)
                    break
    expected = {p.name: p.shape for p in param_shapes(cfg)}
    out: Dict[str, np.ndarray] = {}
    used = set()
    for link in links(cfg):
        if link.ref not in tensors:
            raise UserError(f"has no tensor '{link.ref}', which a {fmt} model of this recipe "
                            f"({cfg.num_layers} layers, query layer: {cfg.query_layer}) needs", where=where)
        value = np.asarray(tensors[link.ref], np.float32)
        used.add(link.ref)
        if link.ref.endswith("word_embedding.embedding_table"):
            value = _pad_rows(value, cfg, where, link.ref)
        try:
            parts = link.from_ref(value)
        except Exception:  # noqa: BLE001 - a malformed tensor (wrong rank) is a user error here
            parts = None
        shapes = [expected[n] for n in link.ours]
        if parts is None or [tuple(p.shape) for p in parts] != [tuple(s) for s in shapes]:
            want = tuple(link.to_ref(*[np.zeros(s, np.float32) for s in shapes]).shape)
            raise UserError(f"tensor '{link.ref}' has shape {tuple(value.shape)}, the recipe needs {want}",
                            where=where, rule="hidden_size, num_heads, ffn_hidden_size, vocab and seq_length "
                                              "of the recipe must match the checkpoint")
        for name, part in zip(link.ours, parts):
            out[name] = np.ascontiguousarray(part, np.float32)
    extra = sorted(set(tensors) - used)
    if extra:
        raise UserError(f"has {len(extra)} tensor(s) this recipe has no place for, e.g. '{extra[0]}'", where=where,
                        rule="num_layers, query_layer and position of the recipe must match the checkpoint")
    return out


def _pad_rows(table: np.ndarray, cfg: ModelConfig, where: str, name: str) -> np.ndarray:
    rows = cfg.padded_vocab_size
    if table.ndim == 2 and table.shape[0] in (cfg.vocab_size, rows) and table.shape[0] < rows:
        pad = np.zeros((rows - table.shape[0], table.shape[1]), np.float32)
        return np.concatenate([table, pad], axis=0)
    return table

