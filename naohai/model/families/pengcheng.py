"""PengCheng-Mind (鹏城·脑海): the published 7B and 200B configurations.

Every value names its source in the reference code:
  PCM = PCLNLP-group/mPengC.mind (src/pengcheng_mind_config.py, src/pengcheng_mind*.py,
        train_mPCmind7B.py, tools/conver_megatron_to_ms.py).
"""
from __future__ import annotations

from naohai.model.families import Family

FAMILY = Family(
    name="pengcheng",
    summary="PengCheng-Mind: RoPE, LayerNorm, biases, EOD 2 / pad 0, EOD attention reset",
    # EOD 2, pad 0, eod_reset, dropout 0.1: pengcheng_mind_config.py; RoPE tables are sliced by
    # position, not reset (RoPE.construct), so eod_reset_positions is off (its default).
    defaults=dict(position="rope", norm="layernorm", bias=True, tie_embeddings=True, eod_reset=True, eod_id=2,
                  loss_pad_id=0, dropout=0.1, compute_dtype="float16"),
    presets={
        # PengCheng-Mind 7B: PCM tools/conver_megatron_to_ms.py args_7B (hidden 4096, 32 layers, 32 heads,
        # ffn 10880 = int(2*4h/3/64)*64 as in train_mPCmind7B.py, seq 4096, padded vocab 125952, RoPE);
        # RoPE rotate-half: pengcheng_mind_pipeline_layer_7B.py RoPE (concatenated angle tables);
        # SwiGLU with fused gate|up mapping, biases, LayerNorm: the same file's FeedForward;
        # final LayerNorm after the last block: pengcheng_mind_7B.py PengChengMind_Model.construct.
        "pengcheng-mind-7b": dict(vocab_size=125952, vocab_pad_multiple=128, hidden_size=4096, num_layers=32,
                                  num_heads=32, ffn_hidden_size=10880, seq_length=4096, rope_style="rotate_half",
                                  activation="swiglu", query_layer=False),
        # PengCheng-Mind 200B is PanGu-shaped in the reference: PCM conver_megatron_to_ms.py args_200B
        # (hidden 12672, 96 heads, ffn 50688 = 4h, ms_fast_gelu, rotary, seq 2048, padded vocab 49984 =
        # make_vocab_size_divisible_by 64), 103 blocks there + the top query layer (pengcheng_mind.py
        # PengChengMind_Model: blocks = num_layers - 1, top_query_layer; pengcheng_mind_config.py
        # set_parse_200B num_layers=104); interleaved RoPE: pengcheng_mind_pipeline_layer.py RoPE
        # (np.repeat angle table, rotate_half on (.., -1, 2) pairs); final LayerNorm after the query
        # layer: pengcheng_mind.py construct (both branches); no position reset (RoPE.construct slices
        # tables by position).
        "pengcheng-mind-200b": dict(vocab_size=49984, vocab_pad_multiple=64, hidden_size=12672, num_layers=104,
                                    num_heads=96, ffn_hidden_size=50688, seq_length=2048, rope_style="interleaved",
                                    activation="fast_gelu", query_layer=True, final_norm="after"),
    },
    checkpoint_formats=("pengcheng-mind",),
)
