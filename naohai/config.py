"""Recipes: the model, data and training settings of one job.

A recipe is a YAML file with three sections, ``model``, ``data`` and ``train``
(plus an optional ``name``).  ``model.preset`` names one of the published
configurations in :data:`MODEL_PRESETS`; other ``model`` keys override it.
Dotted ``key=value`` overrides from the command line are applied on top.

Every mistake (missing file, bad YAML, unknown key, wrong type, impossible value)
raises :class:`naohai.errors.UserError` naming the file and the key path.
"""
from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Union

import yaml

from naohai import validate
from naohai.errors import UserError, did_you_mean


# --------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    """One decoder-only family; presets select PanGu-alpha or PengCheng-Mind choices."""

    family: str = "naohai"            # pangu | naohai | custom (informational)
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
    activation: str = "swiglu"        # gelu | fast_gelu | swiglu
    norm: str = "layernorm"           # layernorm | rmsnorm | nonparam_layernorm
    norm_eps: float = 1e-5
    bias: bool = True                 # biases on linear layers
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
            "activation": ("gelu", "fast_gelu", "swiglu"),
            "norm": ("layernorm", "rmsnorm", "nonparam_layernorm"),
            "compute_dtype": ("float32", "float16", "bfloat16"),
            "final_norm": ("after", "before_query_layer"),
            "rope_style": ("rotate_half", "interleaved"),
        }
        for key, allowed in choices.items():
            value = getattr(self, key)
            if value not in allowed:
                bad(key, f"'{value}' is not one of {', '.join(allowed)}.{did_you_mean(value, allowed)}")
        for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_hidden_size",
                    "seq_length", "vocab_pad_multiple"):
            if getattr(self, key) <= 0:
                bad(key, f"must be a positive integer, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads:
            bad("num_heads", f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
                "hidden_size % num_heads == 0")
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            bad("num_kv_heads", f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.kv_heads}",
                "num_heads % num_kv_heads == 0")
        if self.position == "rope" and self.head_dim % 2:
            bad("hidden_size", f"RoPE needs an even head dimension, got {self.head_dim}")
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


# Published configurations.  Every value names its source in the reference code:
#   PG  = mindspore-ai/models official/nlp/Pangu_alpha (src/pangu_alpha_config.py, src/utils.py,
#         src/pangu_alpha.py, src/dataset.py) and arXiv 2104.12369 table 1;
#   PCM = PCLNLP-group/mPengC.mind (src/pengcheng_mind_config.py, src/pengcheng_mind*.py,
#         train_mPCmind7B.py, tools/conver_megatron_to_ms.py).
_PANGU = dict(
    family="pangu", vocab_size=40000, vocab_pad_multiple=1,       # PG utils.py --vocab_size 40000
    seq_length=1024, position="learned",                          # PG utils.py --seq_length 1024
    activation="fast_gelu", norm="layernorm", norm_eps=1e-5, bias=True,  # PG pangu_alpha_config hidden_act
    query_layer=True, tie_embeddings=True,                        # PG pangu_alpha.py QueryLayer, PanGuHead
    final_norm="before_query_layer",  # PG pangu_alpha.py PanguAlpha_Model.construct, non-pipeline branch
    eod_reset=True, eod_reset_positions=True, eod_id=6,           # PG pangu_alpha_config eod_reset/eod_token=6
    loss_pad_id=6,                                                # PG pangu_alpha_config pad_token=6
    dropout=0.1,                                                  # PG pangu_alpha_config dropout_rate=0.1
    softmax_fp32=False,                                           # PG pangu_alpha_config softmax float16
    compute_dtype="float16")
MODEL_PRESETS: Dict[str, Dict[str, Any]] = {
    # PanGu-alpha (arXiv 2104.12369 table 1; ffn 4h: PG train.py ffn_hidden_size=embedding_size * 4)
    "pangu-alpha-2.6b": dict(_PANGU, hidden_size=2560, num_layers=32, num_heads=32, ffn_hidden_size=10240),
    "pangu-alpha-13b": dict(_PANGU, hidden_size=5120, num_layers=40, num_heads=40, ffn_hidden_size=20480),
    "pangu-alpha-200b": dict(_PANGU, hidden_size=16384, num_layers=64, num_heads=128, ffn_hidden_size=65536),
    # PengCheng-Mind 7B: PCM tools/conver_megatron_to_ms.py args_7B (hidden 4096, 32 layers, 32 heads,
    # ffn 10880 = int(2*4h/3/64)*64 as in train_mPCmind7B.py, seq 4096, padded vocab 125952, RoPE);
    # RoPE rotate-half: pengcheng_mind_pipeline_layer_7B.py RoPE (concatenated angle tables);
    # SwiGLU with fused gate|up mapping, biases, LayerNorm: the same file's FeedForward;
    # final LayerNorm after the last block: pengcheng_mind_7B.py PengChengMind_Model.construct;
    # EOD 2, pad 0, eod_reset, dropout 0.1: pengcheng_mind_config.py; RoPE tables are sliced by
    # position, not reset (RoPE.construct), so eod_reset_positions is off.
    "pengcheng-mind-7b": dict(family="pengcheng", vocab_size=125952, vocab_pad_multiple=128, hidden_size=4096,
                              num_layers=32, num_heads=32, ffn_hidden_size=10880, seq_length=4096,
                              position="rope", rope_style="rotate_half", activation="swiglu", norm="layernorm",
                              bias=True, query_layer=False, tie_embeddings=True, eod_reset=True, eod_id=2,
                              loss_pad_id=0, dropout=0.1, compute_dtype="float16"),
    # PengCheng-Mind 200B is PanGu-shaped in the reference: PCM conver_megatron_to_ms.py args_200B
    # (hidden 12672, 96 heads, ffn 50688 = 4h, ms_fast_gelu, rotary, seq 2048, padded vocab 49984 =
    # make_vocab_size_divisible_by 64), 103 blocks there + the top query layer (pengcheng_mind.py
    # PengChengMind_Model: blocks = num_layers - 1, top_query_layer; pengcheng_mind_config.py
    # set_parse_200B num_layers=104); interleaved RoPE: pengcheng_mind_pipeline_layer.py RoPE
    # (np.repeat angle table, rotate_half on (.., -1, 2) pairs); final LayerNorm after the query
    # layer: pengcheng_mind.py construct (both branches); EOD 2 / pad 0 / dropout 0.1:
    # pengcheng_mind_config.py; no position reset (RoPE.construct slices tables by position).
    "pengcheng-mind-200b": dict(family="pengcheng", vocab_size=49984, vocab_pad_multiple=64,
                                hidden_size=12672, num_layers=104, num_heads=96, ffn_hidden_size=50688,
                                seq_length=2048, position="rope", rope_style="interleaved",
                                activation="fast_gelu", norm="layernorm", bias=True, query_layer=True,
                                final_norm="after", tie_embeddings=True, eod_reset=True, eod_id=2,
                                loss_pad_id=0, dropout=0.1, compute_dtype="float16"),
    # Small models for CPU work.
    "tiny": dict(family="naohai", vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4,
                 num_heads=4, ffn_hidden_size=352, seq_length=128, position="rope", activation="swiglu",
                 norm="layernorm", bias=True, tie_embeddings=True, compute_dtype="float32"),
    "tiny-pangu": dict(family="pangu", vocab_size=2048, vocab_pad_multiple=128, hidden_size=128, num_layers=4,
                       num_heads=4, ffn_hidden_size=512, seq_length=128, position="learned",
                       activation="gelu", norm="layernorm", bias=True, query_layer=True,
                       tie_embeddings=True, compute_dtype="float32"),
}


# --------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    # Corpus sources: 'builtin:pydoc' (English text CPython ships), 'builtin:fortunes-zh'
    # (Debian's fortunes-zh, Chinese), or paths/globs of .txt / .jsonl files.
    corpus: List[str] = field(default_factory=lambda: ["builtin:pydoc"])
    jsonl_key: str = "text"
    tokenizer: Optional[str] = None   # a sentencepiece .model; None = train one into output_dir
    jieba: bool = False               # PanGu-style Chinese pre-splitting before sentencepiece
    holdout_fraction: float = 0.05
    prepared_dir: Optional[str] = None  # packed shards; None = <output_dir>/data
    shuffle_seed: int = 1234

    def validate(self, where: str = "recipe", prefix: str = "data") -> None:
        if not self.corpus:
            raise UserError("needs at least one corpus source", where=where, key=f"{prefix}.corpus")
        if not 0.0 < self.holdout_fraction < 0.5:
            raise UserError(f"must be in (0, 0.5), got {self.holdout_fraction}", where=where,
                            key=f"{prefix}.holdout_fraction")


# --------------------------------------------------------------------------- train
DEVICES = ("auto", "CPU", "GPU", "Ascend")
LAYER_LOOP = ("auto", "always", "never")


@dataclass
class LossScaleConfig:
    dynamic: bool = False      # on by default only for float16 compute (see Recipe.validate)
    init: float = 2.0 ** 16
    window: int = 1000         # steps without overflow before the scale grows
    factor: float = 2.0
    min_scale: float = 1.0


SCHEDULES = ("naohai", "pangu")


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch_size: int = 16      # sequences per optimizer step, across all data-parallel ranks
    micro_batch_size: int = 16       # sequences per device per forward; accumulation fills the rest
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    decay: str = "cosine"            # cosine | linear | constant
    decay_steps: Optional[int] = None  # None = steps
    schedule: str = "naohai"         # naohai | pangu (the references' LearningRate; see naohai/train/schedule.py)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0           # global-norm clip; 0 disables
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    spike_factor: float = 0.0        # skip a step whose gradient norm exceeds this x its running mean; 0 = off
    spike_warmup: int = 50           # applied steps before the spike guard starts judging
    spike_window: int = 100          # steps in the running mean of the gradient norm
    max_skipped_steps: int = 25      # consecutive skipped steps (non-finite or spike) that stop the run
    seed: int = 42
    mode: str = "graph"              # graph | pynative
    reuse_layer_graphs: bool = True  # compile equal decoder layers once (lazy_inline; CPU and Ascend)
    layer_loop: str = "auto"         # auto | always | never: equal layers as one loop over stacked weights
    #                                  (naohai.model.stack); auto = on CPU, one device or data parallel,
    #                                  from 12 looped layers (naohai.train.builder.AUTO_LOOP_MIN_LAYERS)
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    save_every: int = 100
    keep_checkpoints: int = 3        # keep the last K checkpoints ...
    keep_every: int = 0              # ... and every checkpoint whose step is a multiple of this (0 = none)
    async_save: bool = False         # write checkpoint files in the background while training goes on
    output_dir: str = "runs/default"
    device: str = "auto"             # auto | CPU | GPU | Ascend (auto: Ascend, else GPU, else CPU)
    device_profile: Optional[str] = None  # planner profile for the MFU peak; None = detect on Ascend
    device_peak_tflops: Optional[float] = None  # MFU denominator per device; None = profile / measured on CPU

    def validate(self, where: str = "recipe", prefix: str = "train") -> None:
        def bad(key, msg, rule=None):
            raise UserError(msg, where=where, key=f"{prefix}.{key}", rule=rule)

        if self.decay not in ("cosine", "linear", "constant"):
            bad("decay", f"'{self.decay}' is not one of cosine, linear, constant."
                         f"{did_you_mean(self.decay, ('cosine', 'linear', 'constant'))}")
        if self.schedule not in SCHEDULES:
            bad("schedule", f"'{self.schedule}' is not one of {', '.join(SCHEDULES)}.{did_you_mean(self.schedule, SCHEDULES)}")
        if self.schedule == "pangu" and self.decay == "constant":
            bad("decay", "the pangu schedule decays (cosine, or linear = PolynomialDecayLR of power 1); "
                         "'constant' has no reference counterpart", "schedule pangu -> decay cosine | linear")
        if self.decay_steps is not None and self.decay_steps <= 0:
            bad("decay_steps", f"must be a positive integer (or left out for train.steps), got {self.decay_steps}")
        if self.mode not in ("graph", "pynative"):
            bad("mode", f"'{self.mode}' is not one of graph, pynative")
        if self.layer_loop not in LAYER_LOOP:
            bad("layer_loop", f"'{self.layer_loop}' is not one of {', '.join(LAYER_LOOP)}."
                              f"{did_you_mean(str(self.layer_loop), LAYER_LOOP)}")
        for key in ("steps", "global_batch_size", "micro_batch_size"):
            if getattr(self, key) <= 0:
                bad(key, f"must be a positive integer, got {getattr(self, key)}")
        if self.global_batch_size % self.micro_batch_size:
            bad("global_batch_size", f"{self.global_batch_size} is not a multiple of micro_batch_size "
                                     f"{self.micro_batch_size}", "global_batch_size % micro_batch_size == 0")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            bad("min_lr", f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")
        for key in ("log_every", "eval_every", "save_every", "eval_batches"):
            if getattr(self, key) <= 0:
                bad(key, f"must be a positive integer, got {getattr(self, key)}")
        if self.grad_clip < 0:
            bad("grad_clip", "must be >= 0 (0 disables clipping)")
        if self.device not in DEVICES:
            bad("device", f"'{self.device}' is not one of {', '.join(DEVICES)}.{did_you_mean(self.device, DEVICES)}")
        if self.spike_factor != 0 and self.spike_factor <= 1:
            bad("spike_factor", f"must be 0 (off) or > 1, got {self.spike_factor}")
        for key in ("spike_warmup", "spike_window", "max_skipped_steps"):
            if getattr(self, key) < 1:
                bad(key, f"must be a positive integer, got {getattr(self, key)}")
        if self.device_peak_tflops is not None and not 0 < self.device_peak_tflops < 1e6:
            bad("device_peak_tflops", f"must be a positive number of TFLOP/s, got {self.device_peak_tflops}")
        ls = self.loss_scale
        if ls.window < 1 or ls.factor <= 1 or ls.min_scale <= 0 or ls.init < ls.min_scale:
            bad("loss_scale", f"need window >= 1, factor > 1, min_scale > 0 and init >= min_scale, got "
                              f"window={ls.window} factor={ls.factor} min_scale={ls.min_scale} init={ls.init}")


# --------------------------------------------------------------------------- recipe
@dataclass
class Recipe:
    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    source: Optional[str] = None      # file it was read from (not a YAML key)
    # dotted keys the recipe file or its overrides wrote (e.g. "train.global_batch_size"); the rest are
    # defaults.  naohai.strategy.batch adopts a strategy file's batch only where the recipe is silent.
    stated: FrozenSet[str] = frozenset()

    def validate(self) -> "Recipe":
        where = self.source or "recipe"
        self.model.validate(where)
        self.data.validate(where)
        self.train.validate(where)
        return self

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source", None)
        d.pop("stated", None)
        return d


def write_recipe(recipe: "Recipe", path: str) -> str:
    """Write ``recipe`` (name included) as a YAML file ``load_recipe`` reads back to the same recipe."""
    raw = recipe.to_dict()
    raw["name"] = recipe.name
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh, sort_keys=False, default_flow_style=None)
    return path


# --------------------------------------------------------------------------- loading
def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp)).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str, key: str) -> Any:
    """Check/convert a YAML value to a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin is Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where, key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"must be a mapping, got {type(value).__name__}", where=where, key=key)
        return _build(tp, value, where, key)
    if origin in (list, List, Sequence):
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise UserError(f"must be a list, got {type(value).__name__}", where=where, key=key)
        return [_coerce(v, item_tp, where, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        return validate.boolean(value, where, key)
    if tp is int:
        return validate.integer(value, where, key)
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        return validate.number(value, where, key)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise UserError(f"must be a string, got {value!r}", where=where, key=key)
        return str(value)
    return value


def _build(cls, data: Dict[str, Any], where: str, prefix: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.name != "source"]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise UserError(f"unknown key '{key}'.{did_you_mean(key, names)} Known keys: {', '.join(names)}.",
                            where=where, key=path)
        kwargs[key] = _coerce(value, hints[key], where, path)
    return cls(**kwargs)


def _set_dotted(tree: Dict[str, Any], dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise UserError(f"cannot set '{dotted}': '{p}' is not a section", where=where, key=dotted)
        node = nxt
    node[parts[-1]] = value


def parse_overrides(items: Sequence[str], where: str = "command line") -> Dict[str, Any]:
    """Turn ['train.lr=1e-3', 'model.preset=tiny'] into a nested dict (values parsed as YAML)."""
    tree: Dict[str, Any] = {}
    for item in items:
        if "=" not in item or item.startswith("="):
            raise UserError(f"override '{item}' is not of the form section.key=value", where=where)
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value, where)
    return tree


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml(path: str, what: str = "file") -> Dict[str, Any]:
    """Read a YAML mapping, turning every failure into a UserError naming the file."""
    if not os.path.exists(path):
        raise UserError(f"{what} not found", where=path)
    if os.path.isdir(path):
        raise UserError(f"{what} is a directory, expected a YAML file", where=path)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            data = validate.load_yaml(fh)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UserError(f"is not valid YAML{at}: {problem}", where=path) from None
    except UnicodeDecodeError:
        raise UserError("is not UTF-8 text", where=path) from None
    if data is None:
        raise UserError(f"{what} is empty", where=path)
    if not isinstance(data, dict):
        raise UserError(f"{what} must be a YAML mapping at the top level, got {type(data).__name__}", where=path)
    return data


def resolve_recipe_path(name_or_path: str) -> str:
    """Accept a path, or a bare name of a file in the repository's recipes/ folder."""
    if os.path.exists(name_or_path):
        return name_or_path
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for cand in (os.path.join(here, "recipes", name_or_path), os.path.join(here, "recipes", name_or_path + ".yaml")):
        if os.path.exists(cand):
            return cand
    return name_or_path


def recipe_from_dict(raw: Dict[str, Any], where: str = "recipe") -> Recipe:
    raw = dict(raw)
    top = ("name", "model", "data", "train")
    for key in raw:
        if key not in top:
            raise UserError(f"unknown section '{key}'.{did_you_mean(key, top)} Sections: {', '.join(top)}.",
                            where=where, key=str(key))
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict):
        raise UserError("must be a mapping", where=where, key="model")
    model_raw = dict(model_raw)
    preset = model_raw.pop("preset", None)
    if preset is not None:
        if preset not in MODEL_PRESETS:
            raise UserError(f"unknown preset '{preset}'.{did_you_mean(preset, MODEL_PRESETS)} "
                            f"Presets: {', '.join(MODEL_PRESETS)}.", where=where, key="model.preset")
        model_raw = _merge(MODEL_PRESETS[preset], model_raw)
    for section in ("data", "train"):
        if raw.get(section) is not None and not isinstance(raw[section], dict):
            raise UserError("must be a mapping", where=where, key=section)
    recipe = Recipe(
        name=str(raw.get("name", "recipe")),
        model=_build(ModelConfig, model_raw, where, "model"),
        data=_build(DataConfig, raw.get("data") or {}, where, "data"),
        train=_build(TrainConfig, raw.get("train") or {}, where, "train"),
        source=where,
        stated=frozenset(f"{section}.{key}" for section in ("data", "train") for key in (raw.get(section) or {})),
    )
    return recipe.validate()


def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe file (or a name in recipes/) and apply dotted overrides."""
    path = resolve_recipe_path(path)
    raw = read_yaml(path, "recipe")
    if overrides:
        raw = _merge(raw, parse_overrides(overrides))
    return recipe_from_dict(raw, where=path)


def preset_recipe(preset: str) -> Recipe:
    """A recipe holding only a model preset (for `naohai plan pangu-alpha-200b ...`)."""
    return recipe_from_dict({"name": preset, "model": {"preset": preset}}, where=f"preset {preset}")
