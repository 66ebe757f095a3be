"""BLOOM: ALiBi, a LayerNorm right after the embedding, tanh GeLU, biases, tied head
(arXiv 2211.05100 table 3).

Shapes from bigscience/bloom-560m and bloom-7b1's ``config.json`` (hidden 1024 / 4096, 24 / 30
layers, 16 / 32 heads, vocab 250880, MLP 4 x hidden); parameter counts: transformers'
``num_parameters()`` of those configs.  Hugging Face folders: :mod:`naohai.convert.hf.bloom`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="bloom",
    summary="BLOOM: ALiBi, embedding LayerNorm, tanh GeLU, biases, tied head (BloomForCausalLM)",
    defaults=dict(position="alibi", activation="gelu_tanh", norm="layernorm", bias=True, embedding_norm=True,
                  tie_embeddings=True, vocab_pad_multiple=1),
    presets={
        # 559,214,592 parameters
        "bloom-560m": dict(vocab_size=250880, hidden_size=1024, num_layers=24, num_heads=16, ffn_hidden_size=4096,
                           seq_length=2048, compute_dtype="bfloat16"),
        # 7,069,016,064 parameters
        "bloom-7b1": dict(vocab_size=250880, hidden_size=4096, num_layers=30, num_heads=32, ffn_hidden_size=16384,
                          seq_length=2048, compute_dtype="bfloat16"),
        "tiny-bloom": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                           ffn_hidden_size=512, seq_length=128),
    },
)
