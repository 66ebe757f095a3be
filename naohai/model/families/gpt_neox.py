"""GPT-NeoX / Pythia: parallel residual with two LayerNorms, partial RoPE (a quarter of each head),
biases, exact GeLU, untied head (arXiv 2204.06745, 2304.01373).

Shapes from EleutherAI/pythia-6.9b's ``config.json`` (hidden 4096, 32 layers, 32 heads, intermediate
16384, vocab 50432, rotary_pct 0.25); parameter count: transformers' ``num_parameters()`` of that
config, 6,857,302,016 as Pythia's model card lists.  Hugging Face folders: :mod:`naohai.convert.hf.gpt_neox`.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="gpt_neox",
    summary="GPT-NeoX / Pythia: parallel residual, partial RoPE, biases, GeLU, untied head (GPTNeoXForCausalLM)",
    defaults=dict(position="rope", rope_style="rotate_half", rotary_fraction=0.25, activation="gelu",
                  norm="layernorm", bias=True, block="parallel", parallel_norms=2, tie_embeddings=False,
                  vocab_pad_multiple=1),
    presets={
        # 6,857,302,016 parameters
        "pythia-6.9b": dict(vocab_size=50432, hidden_size=4096, num_layers=32, num_heads=32, ffn_hidden_size=16384,
                            seq_length=2048, compute_dtype="float16"),
        "tiny-gpt-neox": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                              ffn_hidden_size=352, seq_length=128),
    },
)
