"""GLM (``model_type: glm``, ``GlmForCausalLM``, the ChatGLM line as transformers implements GLM-4):
RMSNorm, GQA, q/k/v biases without an output bias, partial RoPE (``partial_rotary_factor``, default
0.5) on interleaved pairs, SwiGLU from one fused ``gate_up_proj`` ([gate | up] rows).  Names and
layout: transformers' modeling_glm.py (rotate_half on x[0::2] / x[1::2], cos/sin repeat_interleave)."""
from __future__ import annotations

from typing import Any, Dict, List

from naohai.model.config import ModelConfig
from naohai.convert.hf.arch import Architecture, HFConfig, register
from naohai.convert.hf.llama import llama_config, llama_fields, llama_fits, llama_links


def read(c: HFConfig) -> Dict[str, Any]:
    fields = llama_fields(c)
    fields.update(c.rope(default_fraction=0.5))
    fields.update(rope_style="interleaved", bias=False,
                  qkv_bias=c.get("attention_bias", True, bool), out_bias=False, mlp_bias=False)
    return fields


def write(cfg: ModelConfig) -> Dict[str, Any]:
    out = llama_config(cfg)
    out["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_fraction
    return dict(out, partial_rotary_factor=cfg.rotary_fraction, rms_norm_eps=cfg.norm_eps,
                attention_bias=cfg.has_qkv_bias)


def fits(cfg: ModelConfig) -> List:
    rules = [r for r in llama_fits(cfg) if r[0] != "rope_style"]
    return rules + [
        ("rope_style", cfg.rope_style == "interleaved", "its RoPE rotates interleaved pairs"),
        ("norm", cfg.norm == "rmsnorm", "it uses RMSNorm"),
        ("out_bias", not cfg.has_out_bias, "its output projection has no bias"),
        ("mlp_bias", not cfg.has_mlp_bias, "its MLP has no biases")]


def links(cfg: ModelConfig):
    return llama_links(cfg, gate_up=True)


ARCH = register(Architecture("glm", "glm", "GlmForCausalLM", read, write, links, fits,
                             ignored=("rotary_emb.inv_freq",)))
