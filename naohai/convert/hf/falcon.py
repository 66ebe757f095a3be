"""Falcon (``model_type: falcon``, ``FalconForCausalLM``): the parallel attention + MLP block (one
shared LayerNorm, or ``ln_attn`` / ``ln_mlp`` in the new decoder architecture), multi-query or grouped
(``num_kv_heads``) attention from one ``query_key_value`` stored per key/value head as [q_1..q_g, k, v],
RoPE, exact GeLU, optional biases, tied head.  Names and layouts: transformers' modeling_falcon.py
(FalconAttention._split_heads, FalconDecoderLayer).  Falcon's ALiBi variant scales the ALiBi bias by
1/sqrt(head_dim) with the scores, which naohai's ALiBi does not: it is refused."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import (Architecture, HFConfig, common_fields, common_fits, grouped_qkv, head_links, link,
                                    register, rope_keys, shape_keys)


def read(c: HFConfig) -> Dict[str, Any]:
    fields = common_fields(c, vocab="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                           heads="num_attention_heads", positions=("max_position_embeddings",), tie_default=True)
    c.require("alibi", (False,), False, "Falcon's ALiBi is scaled with the scores; only its RoPE models are read")
    new = c.get("new_decoder_architecture", False, bool)
    parallel = c.get("parallel_attn", True, bool)
    if new and not parallel:
        raise c.bad("parallel_attn", "is false with new_decoder_architecture; transformers' Falcon then never "
                                     "adds the attention output to the residual, which naohai does not copy")
    multi_query = c.get("multi_query", True, bool)
    heads = fields["num_heads"]
    kv = c.get("num_kv_heads", heads) if (new or not multi_query) else 1
    norms = c.get("num_ln_in_parallel_attn", 2 if new else 1) if parallel else 2
    if fields["hidden_size"] % heads:
        raise c.bad("num_attention_heads", f"{heads} does not divide hidden_size {fields['hidden_size']}")
    fields.update(c.rope())         # Falcon rotates whole heads: rotary_fraction 1.0 below
    act = c.require("activation", ("gelu",), "gelu", "its MLP is exact GeLU")
    bias = c.get("bias", False, bool)
    fields.update(num_kv_heads=kv, ffn_hidden_size=c.get("ffn_hidden_size", 4 * fields["hidden_size"]),
                  position="rope", rotary_fraction=1.0, rope_style="rotate_half", activation=act,
                  norm="layernorm", norm_eps=c.get("layer_norm_epsilon", 1e-5, float), bias=bias, qkv_bias=None,
                  out_bias=None, mlp_bias=None, embedding_norm=False,
                  block="parallel" if parallel else "sequential", parallel_norms=norms if parallel else 2)
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    parallel = cfg.block == "parallel"
    new = parallel and (cfg.parallel_norms == 2 or cfg.kv_heads not in (1, cfg.num_heads))
    out = shape_keys(cfg, vocab="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                     heads="num_attention_heads", positions="max_position_embeddings", ffn="ffn_hidden_size")
    out.update(num_kv_heads=cfg.kv_heads, new_decoder_architecture=new, multi_query=cfg.kv_heads == 1,
               parallel_attn=parallel, num_ln_in_parallel_attn=cfg.parallel_norms if parallel else None,
               alibi=False, bias=cfg.bias, activation="gelu", layer_norm_epsilon=cfg.norm_eps,
               tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, **rope_keys(cfg))
    return out


def fits(cfg: ModelConfig) -> List:
    parallel = cfg.block == "parallel"
    return common_fits(cfg) + [
        ("position", cfg.position == "rope", "it uses RoPE"),
        ("rope_style", cfg.rope_style == "rotate_half", "its RoPE rotates half-split pairs"),
        ("rotary_fraction", cfg.rotary_fraction == 1.0, "it rotates whole heads"),
        ("norm", cfg.norm == "layernorm", "it uses LayerNorm"),
        ("activation", cfg.activation == "gelu", "its MLP is exact GeLU"),
        ("bias", cfg.has_qkv_bias == cfg.has_out_bias == cfg.has_mlp_bias == cfg.bias, "one 'bias' key sets all"),
        ("num_kv_heads", parallel or cfg.kv_heads in (1, cfg.num_heads),
         "grouped queries come with the new decoder architecture, whose block is parallel"),
        ("embedding_norm", not cfg.embedding_norm, "it has no embedding norm")]


def links(cfg: ModelConfig):
    t = "transformer."
    kv, group, hd = cfg.kv_heads, cfg.num_heads // cfg.kv_heads, cfg.head_dim
    new = cfg.block == "parallel" and cfg.parallel_norms == 2
    out = [link(t + "word_embeddings.weight", "embedding.word_embedding")]
    for i in range(cfg.num_layers):
        p, o = f"{t}h.{i}.", f"layers.{i}."
        leaves = (("weight", "gamma"), ("bias", "beta"))
        if new:
            norms = (("ln_attn", "input_norm"), ("ln_mlp", "post_attention_norm"))
        elif cfg.block == "parallel":
            norms = (("input_layernorm", "input_norm"),)
        else:
            norms = (("input_layernorm", "input_norm"), ("post_attention_layernorm", "post_attention_norm"))
        out += [link(f"{p}{hf}.{a}", f"{o}{ours}.{b}") for hf, ours in norms for a, b in leaves]
        out.append(grouped_qkv(p + "self_attention.query_key_value.weight", o + "attention.", kv, group, hd))
        out.append(link(p + "self_attention.dense.weight", o + "attention.out_weight"))
        out += [link(p + "mlp.dense_h_to_4h.weight", o + "mlp.up_weight"),
                link(p + "mlp.dense_4h_to_h.weight", o + "mlp.down_weight")]
        if cfg.bias:
            out += [grouped_qkv(p + "self_attention.query_key_value.bias", o + "attention.", kv, group, hd, "bias"),
                    link(p + "self_attention.dense.bias", o + "attention.out_bias"),
                    link(p + "mlp.dense_h_to_4h.bias", o + "mlp.up_bias"),
                    link(p + "mlp.dense_4h_to_h.bias", o + "mlp.down_bias")]
    return out + head_links(cfg, t + "ln_f")


ARCH = register(Architecture("falcon", "falcon", "FalconForCausalLM", read, write, links, fits, prefix="transformer.",
                             ignored=("rotary_emb.inv_freq",)))
