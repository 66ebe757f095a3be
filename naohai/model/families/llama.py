"""LLaMA: RMSNorm, RoPE (rotate-half), SwiGLU, no biases, untied head; GQA from LLaMA 2 70B / 3 on.

Shapes from the published ``config.json`` files (huggyllama/llama-7b = the LLaMA paper's 7B,
arXiv 2302.13971 table 2); the parameter count in the comment is transformers'
``num_parameters()`` of that config, which ``tests/model/test_family_presets.py`` recomputes.
Hugging Face folders: :mod:`naohai.convert.hf.llama`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="llama",
    summary="LLaMA: RMSNorm, RoPE, SwiGLU, no biases, untied head, GQA (transformers' LlamaForCausalLM)",
    defaults=dict(position="rope", rope_style="rotate_half", activation="swiglu", norm="rmsnorm", norm_eps=1e-6,
                  bias=False, tie_embeddings=False, vocab_pad_multiple=1),
    presets={
        # 6,738,415,616 parameters; hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000
        "llama-7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=11008,
                         seq_length=2048, compute_dtype="bfloat16"),
        # a small LLaMA for CPU work and the compile checks (GQA 2 kv heads, so model parallel 2 splits them)
        "tiny-llama": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, ffn_hidden_size=352, seq_length=128),
    },
)
