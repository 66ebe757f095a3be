"""Qwen2 (``model_type: qwen2``, ``Qwen2ForCausalLM``; Qwen1.5, Qwen2, Qwen2.5): LLaMA's layout with
biases on q, k and v (none on o or the MLP), RMSNorm, RoPE (rotate-half), SwiGLU, GQA.  Sliding-window
attention, where ``use_sliding_window`` (or a ``sliding_attention`` layer type) turns it on, becomes the
model's position limit (:func:`~naohai.convert.hf.arch.window_as_position_limit`).  Names:
transformers' modeling_qwen2.py."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import Architecture, HFConfig, register, window_as_position_limit
from naohai.convert.hf.llama import llama_config, llama_fields, llama_fits, llama_links


def read(c: HFConfig) -> Dict[str, Any]:
    fields = llama_fields(c)
    c.require("partial_rotary_factor", (1, 1.0), 1.0, "Qwen2 rotates whole heads")
    fields.update(bias=False, qkv_bias=True, out_bias=False, mlp_bias=False)
    layer_types = c.data.get("layer_types") or []
    sliding = c.get("use_sliding_window", False, bool) or (
        isinstance(layer_types, list) and "sliding_attention" in layer_types)
    window_as_position_limit(c, fields, c.data.get("sliding_window") if sliding else None)
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    return dict(llama_config(cfg), rms_norm_eps=cfg.norm_eps, use_sliding_window=False, sliding_window=None,
                max_window_layers=cfg.num_layers)


def fits(cfg: ModelConfig) -> List:
    return llama_fits(cfg) + [
        ("norm", cfg.norm == "rmsnorm", "it uses RMSNorm"),
        ("rotary_fraction", cfg.rotary_fraction == 1.0, "it rotates whole heads"),
        ("qkv_bias", cfg.has_qkv_bias, "its q, k and v projections have biases"),
        ("out_bias", not cfg.has_out_bias, "its attention output projection has no bias"),
        ("mlp_bias", not cfg.has_mlp_bias, "its MLP has no biases")]


ARCH = register(Architecture("qwen2", "qwen2", "Qwen2ForCausalLM", read, write, llama_links, fits,
                             ignored=("rotary_emb.inv_freq",)))
