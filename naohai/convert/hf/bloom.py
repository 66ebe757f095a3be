"""BLOOM (``model_type: bloom``, ``BloomForCausalLM``): ALiBi, LayerNorm right after the embedding,
tanh GeLU, biases everywhere, one ``query_key_value`` per head ([q, k, v] rows of each head), tied head.
Names: transformers' modeling_bloom.py (``transformer.`` prefix; checkpoints saved without it, as
bigscience's are, are read too).  ALiBi there adds slope * key position; naohai adds slope * (key -
query position), which differs by a per-row constant softmax removes."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import (Architecture, HFConfig, common_fields, common_fits, grouped_qkv, head_links, link,
                                    register, shape_keys)


def read(c: HFConfig) -> Dict[str, Any]:
    fields = common_fields(c, vocab="vocab_size", hidden="hidden_size", layers="n_layer", heads="n_head",
                           positions=("seq_length", "max_position_embeddings"), tie_default=True)
    c.require("apply_residual_connection_post_layernorm", (False,), False, "the residual is the block input")
    c.require("slow_but_exact", (False,), False, "tensor-parallel emulation is not needed for exact results")
    if fields["hidden_size"] % fields["num_heads"]:
        raise c.bad("n_head", f"{fields['num_heads']} does not divide hidden_size {fields['hidden_size']}")
    fields.update(ffn_hidden_size=4 * fields["hidden_size"], position="alibi", activation="gelu_tanh",
                  norm="layernorm", norm_eps=c.get("layer_norm_epsilon", 1e-5, float), bias=True,
                  qkv_bias=None, out_bias=None, mlp_bias=None, embedding_norm=True, block="sequential",
                  num_kv_heads=None)
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    return dict(shape_keys(cfg, vocab="vocab_size", hidden="hidden_size", layers="n_layer", heads="n_head"),
                layer_norm_epsilon=cfg.norm_eps, apply_residual_connection_post_layernorm=False,
                tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, seq_length=cfg.seq_length)


def fits(cfg: ModelConfig) -> List:
    bias = cfg.has_qkv_bias and cfg.has_out_bias and cfg.has_mlp_bias
    return common_fits(cfg) + [
        ("position", cfg.position == "alibi", "it uses ALiBi"),
        ("embedding_norm", cfg.embedding_norm, "it has a LayerNorm after the embedding"),
        ("norm", cfg.norm == "layernorm", "it uses LayerNorm"),
        ("activation", cfg.activation == "gelu_tanh", "its MLP is tanh GeLU"),
        ("ffn_hidden_size", cfg.ffn_hidden_size == 4 * cfg.hidden_size, "its MLP is 4 x hidden wide"),
        ("num_kv_heads", cfg.kv_heads == cfg.num_heads, "it has no grouped queries"),
        ("bias", bias, "every projection has a bias"),
        ("block", cfg.block == "sequential", "its block is sequential"),
]


def links(cfg: ModelConfig):
    t = "transformer."
    hd = cfg.head_dim
    out = [link(t + "word_embeddings.weight", "embedding.word_embedding"),
           link(t + "word_embeddings_layernorm.weight", "embedding.norm.gamma"),
           link(t + "word_embeddings_layernorm.bias", "embedding.norm.beta")]
    for i in range(cfg.num_layers):
        p, o = f"{t}h.{i}.", f"layers.{i}."
        out += [link(p + "input_layernorm.weight", o + "input_norm.gamma"),
                link(p + "input_layernorm.bias", o + "input_norm.beta"),
                grouped_qkv(p + "self_attention.query_key_value.weight", o + "attention.", cfg.num_heads, 1, hd),
                grouped_qkv(p + "self_attention.query_key_value.bias", o + "attention.", cfg.num_heads, 1, hd, "bias"),
                link(p + "self_attention.dense.weight", o + "attention.out_weight"),
                link(p + "self_attention.dense.bias", o + "attention.out_bias"),
                link(p + "post_attention_layernorm.weight", o + "post_attention_norm.gamma"),
                link(p + "post_attention_layernorm.bias", o + "post_attention_norm.beta"),
                link(p + "mlp.dense_h_to_4h.weight", o + "mlp.up_weight"),
                link(p + "mlp.dense_h_to_4h.bias", o + "mlp.up_bias"),
                link(p + "mlp.dense_4h_to_h.weight", o + "mlp.down_weight"),
                link(p + "mlp.dense_4h_to_h.bias", o + "mlp.down_bias")]
    return out + head_links(cfg, t + "ln_f")


ARCH = register(Architecture("bloom", "bloom", "BloomForCausalLM", read, write, links, fits, prefix="transformer."))
