"""OLMo 1 (``model_type: olmo``, ``OlmoForCausalLM``): LLaMA's layout with non-parametric LayerNorm
(no weights, eps 1e-5), no biases, SwiGLU, RoPE.  Names: transformers' modeling_olmo.py."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import Architecture, HFConfig, register
from naohai.convert.hf.llama import llama_config, llama_fields, llama_fits, llama_links


def read(c: HFConfig) -> Dict[str, Any]:
    fields = llama_fields(c, norm_eps_key="")
    c.require("clip_qkv", (None,), None, "OLMo's optional clipping of q, k, v is not implemented")
    bias = c.get("attention_bias", False, bool)
    # OlmoLayerNorm: F.layer_norm(x, shape, None, None, eps=1e-5), a fixed eps
    fields.update(norm="nonparam_layernorm", norm_eps=1e-5, bias=False, qkv_bias=bias, out_bias=bias,
                  mlp_bias=False)
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    return dict(llama_config(cfg), attention_bias=cfg.has_qkv_bias, clip_qkv=None)


def fits(cfg: ModelConfig) -> List:
    return llama_fits(cfg) + [
        ("norm", cfg.norm == "nonparam_layernorm", "it uses non-parametric LayerNorm"),
        ("norm_eps", cfg.norm_eps == 1e-5, "its LayerNorm eps is fixed at 1e-5"),
        ("rotary_fraction", cfg.rotary_fraction == 1.0, "it rotates whole heads"),
        ("mlp_bias", not cfg.has_mlp_bias, "its MLP has no biases"),
        ("out_bias", cfg.has_out_bias == cfg.has_qkv_bias, "attention_bias sets q, k, v and o biases together")]


ARCH = register(Architecture("olmo", "olmo", "OlmoForCausalLM", read, write, llama_links, fits,
                             ignored=("rotary_emb.inv_freq",)))
