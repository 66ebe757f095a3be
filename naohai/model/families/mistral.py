"""Mistral: LLaMA's layout (RMSNorm, RoPE, SwiGLU, no biases, untied head) with GQA (8 kv heads) and,
in Mistral-7B-v0.1, sliding-window attention over 4,096 tokens.

naohai attends to every earlier position; within the window that is the same computation, so the
v0.1 preset numbers at most 4,096 positions (``max_positions``), and an imported folder with a window
is held to it the same way (:mod:`naohai.convert.hf.mistral`).  Shapes from
mistralai/Mistral-7B-v0.1's ``config.json``; the parameter count is transformers'
``num_parameters()`` of that config (``tests/model/test_family_presets.py``).
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="mistral",
    summary="Mistral: RMSNorm, RoPE, SwiGLU, no biases, GQA; a sliding window as a position limit "
            "(transformers' MistralForCausalLM)",
    defaults=dict(position="rope", rope_style="rotate_half", activation="swiglu", norm="rmsnorm", norm_eps=1e-5,
                  bias=False, tie_embeddings=False, vocab_pad_multiple=1),
    presets={
        # 7,241,732,096 parameters; hidden 4096, 32 layers, 32 heads / 8 kv heads, intermediate 14336
        "mistral-7b": dict(vocab_size=32000, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                           ffn_hidden_size=14336, seq_length=4096, max_positions=4096, rope_base=10000.0,
                           compute_dtype="bfloat16"),
        "tiny-mistral": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                             num_kv_heads=2, ffn_hidden_size=352, seq_length=128),
    },
)
