"""The model's description: one dataclass of every architecture choice and size.

A recipe's ``model`` section becomes a :class:`ModelConfig` (:mod:`naohai.config` reads it,
with the family's defaults and presets from :mod:`naohai.model.families`); everything in
:mod:`naohai.model` and the planner builds from it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from naohai.errors import UserError, did_you_mean
from naohai.model import families

#: most decoder layers: ten times the deepest transformer published (DeepNet, 1,000 layers); the model and the
#: planner hold a cell and ~27 named ops per layer (10,000 layers took 26 s and 260 MB to plan; 2^31 was a
#: MemoryError in the strategy check, and a million would take ~26 GB)
MAX_LAYERS = 10_000
#: most rows of the (padded) embedding: token ids are int32 (the loader's batches, the embedding lookup)
MAX_TOKEN_ROWS = 2 ** 31
#: smallest norm epsilon: float32 holds nothing positive below ~1e-38 (1e-45 subnormal), so a smaller one is 0
MIN_NORM_EPS = 1e-30
#: largest init_std: the standard deviation of the drawn weights, against the unit scale of the normed activations
MAX_INIT_STD = 1.0


@dataclass
class ModelConfig:
    """One decoder-only model: its family and every architecture choice and size."""

    family: str = "naohai"            # a registered family (naohai.model.families): naohai, pangu, llama, ...
    vocab_size: int = 32000           # tokenizer vocabulary (before padding)
    vocab_pad_multiple: int = 128     # the embedding/head rows are padded to this multiple
    hidden_size: int = 256
    num_layers: int = 4               # all decoder layers, including the PanGu query layer
    num_heads: int = 4
    num_kv_heads: Optional[int] = None  # grouped-query attention; None = num_heads
    ffn_hidden_size: int = 1024
    seq_length: int = 128
    max_positions: Optional[int] = None  # size of learned position tables; None = seq_length
    position: str = "rope"            # learned | rope | alibi | none
    rope_base: float = 10000.0
    rope_scaling: str = "none"        # none | linear (frequencies / rope_factor) | llama3 (Llama 3.1's bands)
    rope_factor: float = 1.0          # linear / llama3: how much longer a context than pretraining's
    rope_low_freq_factor: float = 1.0   # llama3: wavelengths past original / low are divided by rope_factor
    rope_high_freq_factor: float = 4.0  # llama3: wavelengths below original / high are kept; between: blended
    rope_original_positions: int = 8192  # llama3: the context the model was pretrained on
    activation: str = "swiglu"        # gelu | gelu_tanh | fast_gelu | swiglu
    norm: str = "layernorm"           # layernorm | rmsnorm | nonparam_layernorm
    norm_eps: float = 1e-5
    bias: bool = True                 # biases on linear layers (the three below default to it)
    qkv_bias: Optional[bool] = None   # biases of the q, k, v projections (GLM: true with bias false)
    out_bias: Optional[bool] = None   # bias of the attention output projection
    mlp_bias: Optional[bool] = None   # biases of the feed-forward projections
    block: str = "sequential"         # sequential: x += attn(n1(x)); x += mlp(n2(x)) |
    #                                   parallel (GPT-J / GPT-NeoX / Falcon): x += attn(n1(x)) + mlp(n2(x))
    parallel_norms: int = 2           # parallel block: n1 and n2 apart (2), or one norm feeding both (1, Falcon-7B)
    rotary_fraction: float = 1.0      # share of each head's dimensions RoPE rotates (GPT-NeoX rotary_pct, GLM 0.5)
    query_layer: bool = False         # PanGu-alpha top query layer as the last layer
    tie_embeddings: bool = True       # output head shares the word embedding
    embedding_norm: bool = False      # BLOOM: LayerNorm right after the embedding
    compute_dtype: str = "float32"    # float32 | float16 | bfloat16 (master weights stay fp32)
    softmax_fp32: bool = True
    norm_fp32: bool = True
    dropout: float = 0.0              # on the embedding, attention probabilities and both block outputs
    init_std: float = 0.02
    # ---- reference-fidelity options (PanGu-alpha / PengCheng-Mind); defaults keep the plain pre-LN decoder
    final_norm: str = "after"         # after | before_query_layer (PanGu's non-pipeline / inference order)
    rope_style: str = "rotate_half"   # rotate_half: pairs (i, i + d/2) | interleaved: pairs (2i, 2i + 1)
    eod_reset: bool = False           # no attention across an EOD inside a packed window
    eod_reset_positions: bool = False  # position ids restart after each EOD (learned / query tables, RoPE)
    eod_id: Optional[int] = None      # the EOD id eod_reset looks for
    loss_pad_id: Optional[int] = None  # predictions made FROM this input id leave the loss; None = mean of all
    query_softmax_fp32: Optional[bool] = None  # softmax dtype of the top query layer; None = softmax_fp32

    # ---- derived
    @property
    def padded_vocab_size(self) -> int:
        m = max(1, int(self.vocab_pad_multiple))
        return int(math.ceil(self.vocab_size / m) * m)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else bool(self.qkv_bias)

    @property
    def has_out_bias(self) -> bool:
        return self.bias if self.out_bias is None else bool(self.out_bias)

    @property
    def has_mlp_bias(self) -> bool:
        return self.bias if self.mlp_bias is None else bool(self.mlp_bias)

    @property
    def shared_block_norm(self) -> bool:
        """One norm feeds both attention and MLP (a parallel block with ``parallel_norms: 1``)."""
        return self.block == "parallel" and self.parallel_norms == 1

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.rotary_fraction)

    @property
    def positions(self) -> int:
        return self.max_positions or self.seq_length

    def with_token_ids(self, eod_id: int, pad_id: int) -> "ModelConfig":
        """This model for a tokenizer whose EOD and pad ids are these.

        Presets carry the reference tokenizers' ids (PanGu-alpha eod = pad = 6, PengCheng-Mind eod 2 /
        pad 0); what the ids mean carries over: ``eod_id`` becomes the tokenizer's EOD, and
        ``loss_pad_id`` its EOD where the preset's pad was its EOD (PanGu), else its pad id.
        """
        eod = None if self.eod_id is None else int(eod_id)
        pad = None
        if self.loss_pad_id is not None:
            pad = int(eod_id) if self.loss_pad_id == self.eod_id else int(pad_id)
        return dataclasses.replace(self, eod_id=eod, loss_pad_id=pad)

    def validate(self, where: str = "recipe", prefix: str = "model") -> None:
        def bad(key, msg, rule=None):
            raise UserError(msg, where=where, key=f"{prefix}.{key}", rule=rule)

        choices = {
            "position": ("learned", "rope", "alibi", "none"),
            "activation": ("gelu", "gelu_tanh", "fast_gelu", "swiglu"),
            "block": ("sequential", "parallel"),
            "norm": ("layernorm", "rmsnorm", "nonparam_layernorm"),
            "compute_dtype": ("float32", "float16", "bfloat16"),
            "final_norm": ("after", "before_query_layer"),
            "rope_style": ("rotate_half", "interleaved"),
            "rope_scaling": ("none", "linear", "llama3"),
        }
        if self.family not in families.names():
            bad("family", f"unknown model family '{self.family}'.{did_you_mean(str(self.family), families.names())} "
                          f"Families: {', '.join(families.names())}.")
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value not in allowed:
                bad(key, f"'{value}' is not one of {', '.join(allowed)}.{did_you_mean(value, allowed)}")
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                    "seq_length", "vocab_pad_multiple"):
            if getattr(self, key) <= 0:
                bad(key, f"must be a positive integer, got {getattr(self, key)}")
        for key, instead in (("num_kv_heads", "num_heads"), ("max_positions", "seq_length")):
            value = getattr(self, key)
            if value is not None and value < 1:     # 0 read as 'left out' (the `or` of kv_heads / positions)
                bad(key, f"must be a positive integer, or left out for {instead}, got {value}",
                    f"{key} >= 1 or left out")
        if self.num_layers > MAX_LAYERS:
            bad("num_layers", f"{self.num_layers:,} layers is more than {MAX_LAYERS:,}, ten times the deepest "
                              f"transformer published (DeepNet, 1,000 layers): the model and the planner hold a "
                              f"cell and its ops per layer (10,000 take ~30 s and 260 MB to plan)",
                f"1 <= num_layers <= {MAX_LAYERS}")
        if self.padded_vocab_size > MAX_TOKEN_ROWS:
            key = "vocab_pad_multiple" if self.vocab_pad_multiple > self.vocab_size else "vocab_size"
            bad(key, f"vocab_size {self.vocab_size} padded to a multiple of {self.vocab_pad_multiple} is "
                     f"{self.padded_vocab_size:,} rows, more than 2^31: token ids are int32 (the loader's batches "
                     f"and the embedding lookup)", "padded vocab_size <= 2^31")
        if self.hidden_size % self.num_heads:
            bad("num_heads", f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
                "hidden_size % num_heads == 0")
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            bad("num_kv_heads", f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}",
                "num_heads % num_kv_heads == 0")
        if not 0.0 < self.rotary_fraction <= 1.0:
            bad("rotary_fraction", f"must be in (0, 1], got {self.rotary_fraction}")
        if not self.rope_base > 1:
            bad("rope_base", f"must be above 1, got {self.rope_base}: RoPE turns pair i of each head by "
                             f"rope_base^(-2i/d) radians per token, a real number only for a positive base (0 or "
                             f"below made the loss NaN) and slower for each later pair only above 1 (published: "
                             f"10,000 and up)", "rope_base > 1")
        if self.rope_scaling != "none":
            if self.position != "rope":
                bad("rope_scaling", f"scales RoPE's frequencies, but position is '{self.position}'",
                    "rope_scaling: none unless position: rope")
            if not (math.isfinite(self.rope_factor) and 1 <= self.rope_factor <= 1e6):
                bad("rope_factor", f"must be between 1 and 1e6, got {self.rope_factor}: the context is that many "
                                   f"times pretraining's", "1 <= rope_factor <= 1e6")
        if self.rope_scaling == "llama3":
            if not (math.isfinite(self.rope_high_freq_factor) and 0 < self.rope_low_freq_factor
                    < self.rope_high_freq_factor <= 1e6):
                bad("rope_high_freq_factor", f"must be above rope_low_freq_factor, both above 0, got "
                                             f"{self.rope_low_freq_factor} and {self.rope_high_freq_factor}: they split "
                                             f"the wavelengths into kept, blended and scaled bands",
                    "0 < rope_low_freq_factor < rope_high_freq_factor")
            if self.rope_original_positions < 1:
                bad("rope_original_positions", f"must be a positive integer, got {self.rope_original_positions}",
                    "rope_original_positions >= 1")
        if not MIN_NORM_EPS <= self.norm_eps <= 1:
            bad("norm_eps", f"must be between {MIN_NORM_EPS:g} and 1, got {self.norm_eps}: it is added to the "
                            f"variance the norm divides by, so it must stay positive in float32 (below 0 the loss "
                            f"was NaN; at 0 a constant row divides 0 by 0) and below the unit variance the norm "
                            f"makes (above it the norm stops normalising; at 1e300, inf in float32, nothing before "
                            f"a norm got a gradient)", f"{MIN_NORM_EPS:g} <= norm_eps <= 1")
        if not 0 < self.init_std <= MAX_INIT_STD:
            bad("init_std", f"must be above 0 and at most {MAX_INIT_STD:g}, got {self.init_std}: the weights are "
                            f"drawn from N(0, init_std) (published models: 0.02 or less); at 0 every gradient is "
                            f"0, and above {MAX_INIT_STD:g} the weights outgrow the unit-scale activations the "
                            f"norms make (at 1e30 the first gradient was NaN)",
                f"0 < init_std <= {MAX_INIT_STD:g}")
        if self.position == "rope" and (self.rotary_dim % 2 or self.rotary_dim == 0):
            bad("rotary_fraction" if self.rotary_fraction < 1 else "hidden_size",
                f"RoPE needs an even, non-zero number of rotated dimensions, got {self.rotary_dim} "
                f"(head dimension {self.head_dim} x rotary_fraction {self.rotary_fraction})")
        if self.parallel_norms not in (1, 2):
            bad("parallel_norms", f"must be 1 or 2, got {self.parallel_norms}")
        if self.parallel_norms != 2 and self.block != "parallel":
            bad("parallel_norms", "only a parallel block can share its norm", "parallel_norms: 1 needs block: parallel")
        if self.seq_length > self.positions:
            bad("seq_length", f"seq_length {self.seq_length} is larger than max_positions {self.positions}",
                "seq_length <= max_positions")
        if self.query_layer and self.num_layers < 1:
            bad("num_layers", "a query layer needs at least one layer")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.final_norm == "before_query_layer" and not self.query_layer:
            bad("final_norm", "'before_query_layer' needs query_layer: true", "final_norm needs a query layer")
        if (self.eod_reset or self.eod_reset_positions) and self.eod_id is None:
            bad("eod_id", "eod_reset / eod_reset_positions need the EOD id", "eod_id set when resetting at EOD")
        for key in ("eod_id", "loss_pad_id"):
            value = getattr(self, key)
            if value is not None and not 0 <= value < self.vocab_size:
                bad(key, f"{value} is not a token id of a {self.vocab_size}-piece vocabulary",
                    "0 <= id < vocab_size")
