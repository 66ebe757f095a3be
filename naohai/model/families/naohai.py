"""The naohai family: the plain pre-LN decoder (ModelConfig's defaults) and its CPU-sized preset."""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="naohai",
    summary="pre-LN decoder: RoPE, SwiGLU, LayerNorm, biases, tied head (ModelConfig's defaults)",
    defaults={},
    presets={
        # A small model for CPU work (README command 1: 1.1M parameters, 4 layers).
        "tiny": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                     ffn_hidden_size=352, seq_length=128, position="rope", activation="swiglu",
                     norm="layernorm", bias=True, tie_embeddings=True, compute_dtype="float32"),
    },
)
