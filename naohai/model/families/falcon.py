"""Falcon: the parallel attention + MLP block, multi-query (7B) or grouped (40B's new decoder
architecture) attention, RoPE, exact GeLU, LayerNorm, no biases, tied head.

Shapes from tiiuae/falcon-7b's ``config.json`` (hidden 4544, 32 layers, 71 heads, multi_query,
parallel_attn, one LayerNorm per block, vocab 65024, ffn 4 x hidden); parameter count: transformers'
``num_parameters()`` of that config.  Hugging Face folders: :mod:`naohai.convert.hf.falcon`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="falcon",
    summary="Falcon: parallel attention + MLP, multi-query / grouped attention, RoPE, GeLU (FalconForCausalLM)",
    defaults=dict(position="rope", rope_style="rotate_half", activation="gelu", norm="layernorm", bias=False,
                  block="parallel", parallel_norms=1, num_kv_heads=1, tie_embeddings=True, vocab_pad_multiple=1),
    presets={
        # 6,921,720,704 parameters
        "falcon-7b": dict(vocab_size=65024, hidden_size=4544, num_layers=32, num_heads=71, ffn_hidden_size=18176,
                          seq_length=2048, compute_dtype="bfloat16"),
        # small: the new decoder architecture's grouped attention (2 kv heads: model parallel 2 splits them)
        "tiny-falcon": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                            num_kv_heads=2, ffn_hidden_size=352, seq_length=128),
    },
)
