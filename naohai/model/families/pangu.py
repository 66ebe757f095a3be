"""PanGu-alpha: the published configurations and the reference's architecture choices.

Every value names its source in the reference code:
  PG = mindspore-ai/models official/nlp/Pangu_alpha (src/pangu_alpha_config.py, src/utils.py,
       src/pangu_alpha.py, src/dataset.py) and arXiv 2104.12369 table 1.
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="pangu",
    summary="PanGu-alpha: learned positions, FastGeLU, top query layer, EOD resets (arXiv 2104.12369)",
    defaults=dict(
        vocab_size=40000, vocab_pad_multiple=1,                       # PG utils.py --vocab_size 40000
        seq_length=1024, position="learned",                          # PG utils.py --seq_length 1024
        activation="fast_gelu", norm="layernorm", norm_eps=1e-5, bias=True,  # PG pangu_alpha_config hidden_act
        query_layer=True, tie_embeddings=True,                        # PG pangu_alpha.py QueryLayer, PanGuHead
        final_norm="before_query_layer",  # PG pangu_alpha.py PanguAlpha_Model.construct, non-pipeline branch
        eod_reset=True, eod_reset_positions=True, eod_id=6,           # PG pangu_alpha_config eod_reset/eod_token=6
        loss_pad_id=6,                                                # PG pangu_alpha_config pad_token=6
        dropout=0.1,                                                  # PG pangu_alpha_config dropout_rate=0.1
        softmax_fp32=False,                                           # PG pangu_alpha_config softmax float16
        compute_dtype="float16"),
    presets={
        # arXiv 2104.12369 table 1; ffn 4h: PG train.py ffn_hidden_size=embedding_size * 4
        "pangu-alpha-2.6b": dict(hidden_size=2560, num_layers=32, num_heads=32, ffn_hidden_size=10240),
        "pangu-alpha-13b": dict(hidden_size=5120, num_layers=40, num_heads=40, ffn_hidden_size=20480),
        "pangu-alpha-200b": dict(hidden_size=16384, num_layers=64, num_heads=128, ffn_hidden_size=65536),
        # A small PanGu shape for CPU work (learned positions, top query layer), without the
        # reference's EOD resets, dropout and float16: the plain decoder's values for those.
        "tiny-pangu": dict(vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4, num_heads=4,
                           ffn_hidden_size=512, seq_length=128, position="learned", activation="gelu",
                           norm="layernorm", bias=True, query_layer=True, tie_embeddings=True,
                           final_norm="after", eod_reset=False, eod_reset_positions=False, eod_id=None,
                           loss_pad_id=None, dropout=0.0, softmax_fp32=True, compute_dtype="float32"),
    },
    checkpoint_formats=("pangu-alpha",),
)
