"""GPT-NeoX (``model_type: gpt_neox``, ``GPTNeoXForCausalLM``; Pythia): parallel residual
(``use_parallel_residual``, two LayerNorms), partial RoPE (``rotary_pct``, default 0.25) on half-split
pairs, one ``query_key_value`` per head ([q, k, v] rows of each head), biases, exact GeLU, untied
``embed_out``.  Names: transformers' modeling_gpt_neox.py."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import (Architecture, HFConfig, activation_of, common_fields, common_fits, grouped_qkv,
                                    head_links, hf_activation, link, register, rope_keys, shape_keys)


def read(c: HFConfig) -> Dict[str, Any]:
    fields = common_fields(c, vocab="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                           heads="num_attention_heads", positions=("max_position_embeddings",), tie_default=False)
    if fields["hidden_size"] % fields["num_heads"]:
        raise c.bad("num_attention_heads", f"{fields['num_heads']} does not divide hidden_size {fields['hidden_size']}")
    fields.update(c.rope(default_fraction=0.25))
    bias = c.get("attention_bias", True, bool)
    fields.update(ffn_hidden_size=c.get("intermediate_size"), position="rope", rope_style="rotate_half",
                  activation=activation_of(c, "hidden_act", "gelu"),
                  norm="layernorm", norm_eps=c.get("layer_norm_eps", 1e-5, float), bias=True, qkv_bias=bias,
                  out_bias=bias, mlp_bias=True, embedding_norm=False, num_kv_heads=None,
                  block="parallel" if c.get("use_parallel_residual", True, bool) else "sequential", parallel_norms=2)
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    out = shape_keys(cfg, vocab="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                     heads="num_attention_heads", positions="max_position_embeddings", ffn="intermediate_size")
    out.update(hidden_act=hf_activation(cfg), layer_norm_eps=cfg.norm_eps, attention_bias=cfg.has_qkv_bias,
               use_parallel_residual=cfg.block == "parallel", tie_word_embeddings=cfg.tie_embeddings,
               initializer_range=cfg.init_std, **rope_keys(cfg, "rotary_pct"))
    out["rotary_emb_base"] = cfg.rope_base
    return out


def fits(cfg: ModelConfig) -> List:
    return common_fits(cfg) + [
        ("position", cfg.position == "rope", "it uses RoPE"),
        ("rope_style", cfg.rope_style == "rotate_half", "its RoPE rotates half-split pairs"),
        ("norm", cfg.norm == "layernorm", "it uses LayerNorm"),
        ("activation", cfg.activation in ("gelu", "gelu_tanh"), "its MLP is GeLU"),
        ("num_kv_heads", cfg.kv_heads == cfg.num_heads, "it has no grouped queries"),
        ("out_bias", cfg.has_out_bias == cfg.has_qkv_bias, "attention_bias sets q, k, v and dense biases together"),
        ("mlp_bias", cfg.has_mlp_bias, "its MLP has biases"),
        ("parallel_norms", cfg.parallel_norms == 2, "its parallel block has two LayerNorms"),
        ("embedding_norm", not cfg.embedding_norm, "it has no embedding norm")]


def links(cfg: ModelConfig):
    t, hd = "gpt_neox.", cfg.head_dim
    out = [link(t + "embed_in.weight", "embedding.word_embedding")]
    for i in range(cfg.num_layers):
        p, o = f"{t}layers.{i}.", f"layers.{i}."
        out += [link(p + "input_layernorm.weight", o + "input_norm.gamma"),
                link(p + "input_layernorm.bias", o + "input_norm.beta"),
                link(p + "post_attention_layernorm.weight", o + "post_attention_norm.gamma"),
                link(p + "post_attention_layernorm.bias", o + "post_attention_norm.beta"),
                grouped_qkv(p + "attention.query_key_value.weight", o + "attention.", cfg.num_heads, 1, hd),
                link(p + "attention.dense.weight", o + "attention.out_weight"),
                link(p + "mlp.dense_h_to_4h.weight", o + "mlp.up_weight"),
                link(p + "mlp.dense_h_to_4h.bias", o + "mlp.up_bias"),
                link(p + "mlp.dense_4h_to_h.weight", o + "mlp.down_weight"),
                link(p + "mlp.dense_4h_to_h.bias", o + "mlp.down_bias")]
        if cfg.has_qkv_bias:
            out += [grouped_qkv(p + "attention.query_key_value.bias", o + "attention.", cfg.num_heads, 1, hd, "bias"),
                    link(p + "attention.dense.bias", o + "attention.out_bias")]
    return out + head_links(cfg, t + "final_layer_norm", "embed_out.weight")


ARCH = register(Architecture("gpt_neox", "gpt_neox", "GPTNeoXForCausalLM", read, write, links, fits,
                             prefix="gpt_neox.", ignored=("attention.bias", "attention.masked_bias",
                                                          "rotary_emb.inv_freq")))
