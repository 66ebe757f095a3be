"""OLMo 1: non-parametric LayerNorm, no biases, SwiGLU, RoPE (arXiv 2402.00838).

Shapes from allenai/OLMo-7B-hf's ``config.json`` (hidden 4096, 32 layers, 32 heads, intermediate
11008, vocab 50304, untied); parameter count: transformers' ``num_parameters()`` of that config.
Hugging Face folders: :mod:`naohai.convert.hf.olmo`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="olmo",
    summary="OLMo 1: non-parametric LayerNorm, no biases, SwiGLU, RoPE (transformers' OlmoForCausalLM)",
    defaults=dict(position="rope", rope_style="rotate_half", activation="swiglu", norm="nonparam_layernorm",
                  norm_eps=1e-5, bias=False, tie_embeddings=False, vocab_pad_multiple=1),
    presets={
        # 6,888,095,744 parameters
        "olmo-7b": dict(vocab_size=50304, hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=11008,
                        seq_length=2048, compute_dtype="bfloat16"),
        "tiny-olmo": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                          ffn_hidden_size=352, seq_length=128),
    },
)
