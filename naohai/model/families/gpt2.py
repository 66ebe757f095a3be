"""GPT-2: learned positions, LayerNorm, tanh GeLU, biases, tied head.

Shapes from openai-community/gpt2's ``config.json`` (n_embd 768, 12 layers, 12 heads, n_positions
1024, vocab 50257); parameter count: transformers' ``num_parameters()`` of that config, the "124M"
model.  Hugging Face folders: :mod:`naohai.convert.hf.gpt2`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="gpt2",
    summary="GPT-2: learned positions, LayerNorm, tanh GeLU, biases, tied head (GPT2LMHeadModel)",
    defaults=dict(position="learned", activation="gelu_tanh", norm="layernorm", bias=True, tie_embeddings=True,
                  vocab_pad_multiple=1),
    presets={
        # 124,439,808 parameters
        "gpt2": dict(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, ffn_hidden_size=3072,
                     seq_length=1024),
        "tiny-gpt2": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                          ffn_hidden_size=512, seq_length=128),
    },
)
