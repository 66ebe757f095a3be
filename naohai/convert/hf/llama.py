"""LLaMA (``model_type: llama``, ``LlamaForCausalLM``): RMSNorm, RoPE (rotate-half), SwiGLU, GQA,
optional attention / MLP biases, head tied or not.  Names: transformers' modeling_llama.py."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import (Architecture, HFConfig, check_head_dim, common_fields, common_fits, link,
                                    register, rope_keys, shape_keys)
from naohai.convert.names import Link


def llama_fields(c: HFConfig, norm_eps_key: str = "rms_norm_eps") -> Dict[str, Any]:
    """The LLaMA-shaped fields LLaMA, OLMo and GLM share."""
    fields = common_fields(c, vocab="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                           heads="num_attention_heads", positions=("max_position_embeddings",), tie_default=False)
    check_head_dim(c, fields)
    c.require("hidden_act", ("silu",), "silu", "the gated MLP is SwiGLU")
    fields.update(num_kv_heads=c.get("num_key_value_heads", fields["num_heads"]),
                  ffn_hidden_size=c.get("intermediate_size"), position="rope", rope_style="rotate_half",
                  activation="swiglu", norm="rmsnorm", block="sequential", embedding_norm=False, **c.rope())
    if norm_eps_key:
        fields["norm_eps"] = c.get(norm_eps_key, 1e-6, float)
    return fields


def read(c: HFConfig) -> Dict[str, Any]:
    fields = llama_fields(c)
    c.require("partial_rotary_factor", (1, 1.0), 1.0, "LLaMA rotates whole heads")
    bias = c.get("attention_bias", False, bool)
    fields.update(bias=False, qkv_bias=bias, out_bias=bias, mlp_bias=c.get("mlp_bias", False, bool))
    return fields


def llama_config(cfg: ModelConfig) -> Dict[str, Any]:
    out = shape_keys(cfg, vocab="vocab_size", hidden="hidden_size", layers="num_hidden_layers",
                     heads="num_attention_heads", positions="max_position_embeddings", ffn="intermediate_size")
    out.update(num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim, hidden_act="silu",
               tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, **rope_keys(cfg))
    return out


def write(cfg: ModelConfig) -> Dict[str, Any]:
    return dict(llama_config(cfg), rms_norm_eps=cfg.norm_eps, attention_bias=cfg.has_qkv_bias,
                mlp_bias=cfg.has_mlp_bias)


def llama_fits(cfg: ModelConfig) -> List:
    return common_fits(cfg) + [
        ("position", cfg.position == "rope", "it uses RoPE"),
        ("rope_style", cfg.rope_style == "rotate_half", "its RoPE rotates half-split pairs"),
        ("activation", cfg.activation == "swiglu", "its MLP is SwiGLU"),
        ("block", cfg.block == "sequential", "its block is sequential"),
        ("embedding_norm", not cfg.embedding_norm, "it has no embedding norm")]


def fits(cfg: ModelConfig) -> List:
    return llama_fits(cfg) + [
        ("norm", cfg.norm == "rmsnorm", "it uses RMSNorm"),
        ("rotary_fraction", cfg.rotary_fraction == 1.0, "it rotates whole heads"),
        ("out_bias", cfg.has_out_bias == cfg.has_qkv_bias, "attention_bias sets q, k, v and o biases together")]


def llama_links(cfg: ModelConfig, gate_up: bool = False) -> List[Link]:
    """``model.*`` tensors of LLaMA-shaped models; ``gate_up``: GLM's fused [gate | up] projection."""
    norms = cfg.norm != "nonparam_layernorm"
    out = [link("model.embed_tokens.weight", "embedding.word_embedding")]
    for i in range(cfg.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        if norms:
            out.append(link(p + "input_layernorm.weight", o + "input_norm.gamma"))
        for hf, ours in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v"), ("o_proj", "out")):
            out.append(link(f"{p}self_attn.{hf}.weight", f"{o}attention.{ours}_weight"))
            if cfg.has_qkv_bias if ours != "out" else cfg.has_out_bias:
                out.append(link(f"{p}self_attn.{hf}.bias", f"{o}attention.{ours}_bias"))
        if norms:
            out.append(link(p + "post_attention_layernorm.weight", o + "post_attention_norm.gamma"))
        if gate_up:
            from naohai.convert.hf.arch import stacked
            out.append(stacked(p + "mlp.gate_up_proj.weight", (o + "mlp.gate_weight", o + "mlp.up_weight")))
        else:
            out.append(link(p + "mlp.gate_proj.weight", o + "mlp.gate_weight"))
            out.append(link(p + "mlp.up_proj.weight", o + "mlp.up_weight"))
        out.append(link(p + "mlp.down_proj.weight", o + "mlp.down_weight"))
        if cfg.has_mlp_bias:
            out += [link(p + "mlp.gate_proj.bias", o + "mlp.gate_bias"),
                    link(p + "mlp.up_proj.bias", o + "mlp.up_bias"),
                    link(p + "mlp.down_proj.bias", o + "mlp.down_bias")]
    if norms:
        out.append(link("model.norm.weight", "head.final_norm.gamma"))
    if not cfg.tie_embeddings:
        out.append(link("lm_head.weight", "head.weight"))
    return out


ARCH = register(Architecture("llama", "llama", "LlamaForCausalLM", read, write, llama_links, fits,
                             ignored=("rotary_emb.inv_freq",)))
