"""GLM-4 (the ChatGLM line as transformers' GlmForCausalLM): RMSNorm, GQA, q/k/v biases only,
partial RoPE (half of each head) on interleaved pairs, SwiGLU, untied head.

Shapes from THUDM/glm-4-9b-hf's ``config.json`` (hidden 4096, 40 layers, 32 heads, 2 kv heads,
intermediate 13696, vocab 151552, rms eps 1.5625e-07, partial_rotary_factor 0.5); parameter count:
transformers' ``num_parameters()`` of that config.  Hugging Face folders: :mod:`naohai.convert.hf.glm`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="glm",
    summary="GLM-4: RMSNorm, GQA, q/k/v biases, partial interleaved RoPE, SwiGLU (transformers' GlmForCausalLM)",
    defaults=dict(position="rope", rope_style="interleaved", rotary_fraction=0.5, activation="swiglu",
                  norm="rmsnorm", norm_eps=1.5625e-07, bias=False, qkv_bias=True, tie_embeddings=False,
                  vocab_pad_multiple=1),
    presets={
        # 9,399,951,360 parameters
        "glm-4-9b": dict(vocab_size=151552, hidden_size=4096, num_layers=40, num_heads=32, num_kv_heads=2,
                         ffn_hidden_size=13696, seq_length=8192, compute_dtype="bfloat16"),
        "tiny-glm": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                         num_kv_heads=2, ffn_hidden_size=352, seq_length=128, norm_eps=1e-5),
    },
)
