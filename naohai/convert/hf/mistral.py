"""Mistral (``model_type: mistral``, ``MistralForCausalLM``): LLaMA's layout without biases (RMSNorm,
RoPE rotate-half, SwiGLU, GQA); ``sliding_window`` (4,096 in Mistral-7B-v0.1, null from v0.2) becomes
the model's position limit (:func:`~naohai.convert.hf.arch.window_as_position_limit`).  Names:
transformers' modeling_mistral.py."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import Architecture, HFConfig, register, window_as_position_limit
from naohai.convert.hf.llama import llama_config, llama_fields, llama_fits, llama_links


def read(c: HFConfig) -> Dict[str, Any]:
    fields = llama_fields(c)
    fields.update(bias=False, qkv_bias=False, out_bias=False, mlp_bias=False)
    window_as_position_limit(c, fields, c.data.get("sliding_window"))
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    # naohai attends to every position up to max_position_embeddings (its position limit): no window
    return dict(llama_config(cfg), rms_norm_eps=cfg.norm_eps, sliding_window=None)


def fits(cfg: ModelConfig) -> List:
    return llama_fits(cfg) + [
        ("norm", cfg.norm == "rmsnorm", "it uses RMSNorm"),
        ("rotary_fraction", cfg.rotary_fraction == 1.0, "it rotates whole heads"),
        ("qkv_bias", not cfg.has_qkv_bias, "its attention has no biases"),
        ("out_bias", not cfg.has_out_bias, "its attention has no biases"),
        ("mlp_bias", not cfg.has_mlp_bias, "its MLP has no biases")]


ARCH = register(Architecture("mistral", "mistral", "MistralForCausalLM", read, write, llama_links, fits,
                             ignored=("rotary_emb.inv_freq",)))
