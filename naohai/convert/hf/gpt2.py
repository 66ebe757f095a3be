"""GPT-2 (``model_type: gpt2``, ``GPT2LMHeadModel``): learned positions, LayerNorm, tanh GeLU
(``gelu_new``), biases, tied head, Conv1D weights stored [in, out] with ``c_attn`` = [q | k | v]
columns.  Names: transformers' modeling_gpt2.py."""
from __future__ import annotations

from typing import Any, Dict, List

import numpy as np

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import (Architecture, HFConfig, activation_of, common_fields, common_fits, head_links,
                                    hf_activation, link, register, shape_keys, transposed)
from naohai.convert.names import Link


def read(c: HFConfig) -> Dict[str, Any]:
    fields = common_fields(c, vocab="vocab_size", hidden="n_embd", layers="n_layer", heads="n_head",
                           positions=("n_positions",), tie_default=True)
    if fields["hidden_size"] % fields["num_heads"]:
        raise c.bad("n_head", f"{fields['num_heads']} does not divide n_embd {fields['hidden_size']}")
    c.require("scale_attn_weights", (True,), True, "scores are scaled by 1/sqrt(head_dim)")
    c.require("scale_attn_by_inverse_layer_idx", (False,), False, "no per-layer score scaling")
    c.require("add_cross_attention", (False,), False, "decoder-only")
    fields.update(ffn_hidden_size=c.get("n_inner", 4 * fields["hidden_size"]), position="learned",
                  max_positions=c.get("n_positions", 1024),
                  activation=activation_of(c, "activation_function", "gelu_new"),
                  norm="layernorm", norm_eps=c.get("layer_norm_epsilon", 1e-5, float), bias=True, qkv_bias=None,
                  out_bias=None, mlp_bias=None, embedding_norm=False, num_kv_heads=None, block="sequential")
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    out = shape_keys(cfg, vocab="vocab_size", hidden="n_embd", layers="n_layer", heads="n_head",
                     positions="n_positions", ffn="n_inner")
    out.update(activation_function=hf_activation(cfg), layer_norm_epsilon=cfg.norm_eps, scale_attn_weights=True,
               tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, n_ctx=cfg.positions)
    return out


def fits(cfg: ModelConfig) -> List:
    return common_fits(cfg) + [
        ("position", cfg.position == "learned", "it uses learned positions"),
        ("norm", cfg.norm == "layernorm", "it uses LayerNorm"),
        ("activation", cfg.activation in ("gelu", "gelu_tanh"), "its MLP is GeLU"),
        ("num_kv_heads", cfg.kv_heads == cfg.num_heads, "it has no grouped queries"),
        ("bias", cfg.has_qkv_bias and cfg.has_out_bias and cfg.has_mlp_bias, "every projection has a bias"),
        ("block", cfg.block == "sequential", "its block is sequential"),
        ("embedding_norm", not cfg.embedding_norm, "it has no embedding norm")]


def _qkv(hf: str, prefix: str, kind: str) -> Link:
    """c_attn: [h, 3h] weight ([in, out], columns q | k | v) or [3h] bias."""
    ours = tuple(f"{prefix}{p}_{kind}" for p in ("q", "k", "v"))
    if kind == "bias":
        return Link(hf, ours, lambda q, k, v: np.concatenate([q, k, v]),
                    lambda b: tuple(np.ascontiguousarray(x) for x in np.split(b, 3)))
    return Link(hf, ours, lambda q, k, v: np.ascontiguousarray(np.concatenate([q, k, v]).T),
                lambda w: tuple(np.ascontiguousarray(x) for x in np.split(np.ascontiguousarray(w.T), 3)))


def links(cfg: ModelConfig):
    t = "transformer."
    out = [link(t + "wte.weight", "embedding.word_embedding"), link(t + "wpe.weight", "embedding.position_embedding")]
    for i in range(cfg.num_layers):
        p, o = f"{t}h.{i}.", f"layers.{i}."
        out += [link(p + "ln_1.weight", o + "input_norm.gamma"), link(p + "ln_1.bias", o + "input_norm.beta"),
                _qkv(p + "attn.c_attn.weight", o + "attention.", "weight"),
                _qkv(p + "attn.c_attn.bias", o + "attention.", "bias"),
                transposed(p + "attn.c_proj.weight", o + "attention.out_weight"),
                link(p + "attn.c_proj.bias", o + "attention.out_bias"),
                link(p + "ln_2.weight", o + "post_attention_norm.gamma"),
                link(p + "ln_2.bias", o + "post_attention_norm.beta"),
                transposed(p + "mlp.c_fc.weight", o + "mlp.up_weight"), link(p + "mlp.c_fc.bias", o + "mlp.up_bias"),
                transposed(p + "mlp.c_proj.weight", o + "mlp.down_weight"),
                link(p + "mlp.c_proj.bias", o + "mlp.down_bias")]
    return out + head_links(cfg, t + "ln_f")


ARCH = register(Architecture("gpt2", "gpt2", "GPT2LMHeadModel", read, write, links, fits, prefix="transformer.",
                             ignored=("attn.bias", "attn.masked_bias")))
