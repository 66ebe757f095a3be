"""Qwen2 (Qwen1.5, Qwen2, Qwen2.5): LLaMA's layout with biases on the q, k, v projections only,
RoPE base 1e6, RMSNorm eps 1e-6, GQA; small models tie the head.

Shapes from Qwen/Qwen2.5-0.5B's and Qwen/Qwen2.5-7B's ``config.json`` (model cards: 0.49B and
7.61B parameters); the counts in the comments are transformers' ``num_parameters()`` of those
configs, which ``tests/model/test_family_presets.py`` recomputes.  Hugging Face folders:
:mod:`naohai.convert.hf.qwen2`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="qwen2",
    summary="Qwen2 / Qwen2.5: RMSNorm, RoPE, SwiGLU, q/k/v biases, GQA (transformers' Qwen2ForCausalLM)",
    defaults=dict(position="rope", rope_style="rotate_half", rope_base=1000000.0, activation="swiglu",
                  norm="rmsnorm", norm_eps=1e-6, bias=False, qkv_bias=True, out_bias=False, mlp_bias=False,
                  tie_embeddings=False, vocab_pad_multiple=1),
    presets={
        # 494,032,768 parameters (tied head); hidden 896, 24 layers, 14 heads / 2 kv heads, vocab 151936
        "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                             ffn_hidden_size=4864, tie_embeddings=True, seq_length=4096,
                             compute_dtype="bfloat16"),
        # 7,615,616,512 parameters; hidden 3584, 28 layers, 28 heads / 4 kv heads, vocab 152064
        "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4,
                           ffn_hidden_size=18944, seq_length=4096, compute_dtype="bfloat16"),
        "tiny-qwen2": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                           num_kv_heads=2, ffn_hidden_size=352, seq_length=128, tie_embeddings=True),
    },
)
