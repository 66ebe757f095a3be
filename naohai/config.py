"""Recipes: the model, data and training settings of one job.

A recipe is a YAML file with three sections, ``model``, ``data`` and ``train`` (plus an
optional ``finetune`` section and ``name``).  The ``model`` section becomes a
:class:`~naohai.model.config.ModelConfig`: ``model.preset`` names one of the published
configurations and ``model.family`` a model family (both from :mod:`naohai.model.families`,
:data:`MODEL_PRESETS` lists every preset); other ``model`` keys override them.
The ``train`` section is one flat mapping; it becomes a :class:`TrainConfig` made of small
configs, each checking its own keys (:data:`TRAIN_SECTIONS`: learning-rate schedule, optimizer,
step guard, checkpoints, logging, held-out evaluation).  Dotted ``key=value`` overrides from the
command line are applied on top.

Every mistake (missing file, bad YAML, unknown key, wrong type, impossible value)
raises :class:`naohai.errors.UserError` naming the file and the key path.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Union

import yaml

from naohai import validate
from naohai.errors import UserError, did_you_mean
from naohai.model.config import ModelConfig
from naohai.model.families import MODEL_PRESETS, model_fields  # noqa: F401  (MODEL_PRESETS: every preset)


# --------------------------------------------------------------------------- data
TOKENIZER_TYPES = ("sentencepiece", "byte_bpe")


DATA_FORMATS = ("text", "sft")
#: what leaving out a path key means (an empty path is refused rather than read so)
_LEFT_OUT = {"tokenizer": "a tokenizer trained into train.output_dir",
             "prepared_dir": "<train.output_dir>/data", "init_from": "fresh weights",
             "device_profile": "the detected device's peak"}


@dataclass
class DataConfig:
    # Corpus sources: 'builtin:pydoc' (English text CPython ships), 'builtin:fortunes-zh'
    # (Debian's fortunes-zh, Chinese), or paths/globs of .txt / .jsonl files.
    corpus: List[str] = field(default_factory=lambda: ["builtin:pydoc"])
    jsonl_key: str = "text"
    tokenizer: Optional[str] = None   # a sentencepiece .model or a Hugging Face tokenizer.json; None = train
    #                                   one into output_dir (kind: tokenizer_type)
    tokenizer_type: str = "sentencepiece"  # what a trained tokenizer is: sentencepiece | byte_bpe (tokenizer.json)
    jieba: bool = False               # PanGu-style Chinese pre-splitting before sentencepiece
    holdout_fraction: float = 0.05
    prepared_dir: Optional[str] = None  # packed shards; None = <output_dir>/data
    shuffle_seed: int = 1234
    format: str = "text"              # text: documents packed for pretraining | sft: .jsonl conversations
    #                                   with a loss mask (naohai/data/sft.py)
    truncation: str = "drop"          # sft: a conversation longer than a window is dropped | truncate
    packing: bool = True              # sft: conversations share windows | false: one conversation a window
    add_special_tokens: bool = False  # text with a Hugging Face tokenizer.json: each document as `tokenizer(text)`
    #                                   encodes it (the tokens its post-processor adds: Llama's
    #                                   BOS), then EOD; `ckpt import --from hf` sets it where those exist

    def validate(self, where: str = "recipe", prefix: str = "data") -> None:
        if not self.corpus:
            raise UserError("needs at least one corpus source", where=where, key=f"{prefix}.corpus")
        for i, source in enumerate(self.corpus):
            if not str(source).strip():
                raise UserError("is empty; give a file, folder, glob or builtin: source", where=where,
                                key=f"{prefix}.corpus[{i}]", rule="a non-empty source")
        for key in ("tokenizer", "prepared_dir"):      # "" read as left out: a new tokenizer, the default folder
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                raise UserError(f"is empty; give a path, or leave the key out for {_LEFT_OUT[key]}", where=where,
                                key=f"{prefix}.{key}", rule="a non-empty path or left out")
        if self.format not in DATA_FORMATS:
            raise UserError(f"'{self.format}' is not one of {', '.join(DATA_FORMATS)}."
                            f"{did_you_mean(self.format, DATA_FORMATS)}", where=where, key=f"{prefix}.format")
        if self.truncation not in ("drop", "truncate"):
            raise UserError(f"'{self.truncation}' is not one of drop, truncate", where=where,
                            key=f"{prefix}.truncation")
        if not self.packing and self.format != "sft":
            raise UserError("false applies only to data.format: sft (pretraining text is always packed)",
                            where=where, key=f"{prefix}.packing", rule="packing: false with format: sft")
        if self.add_special_tokens and self.format == "sft":
            raise UserError("applies to data.format: text; SFT conversations are rendered by the chat template, "
                            "which writes the model's special tokens itself", where=where,
                            key=f"{prefix}.add_special_tokens", rule="add_special_tokens with format: text")
        if self.tokenizer_type not in TOKENIZER_TYPES:
            raise UserError(f"'{self.tokenizer_type}' is not one of {', '.join(TOKENIZER_TYPES)}."
                            f"{did_you_mean(self.tokenizer_type, TOKENIZER_TYPES)}", where=where,
                            key=f"{prefix}.tokenizer_type")
        if self.jieba and (self.tokenizer_type == "byte_bpe" or str(self.tokenizer or "").endswith(".json")):
            raise UserError("jieba pre-splitting is for sentencepiece tokenizers; a byte-level BPE splits text "
                            "itself", where=where, key=f"{prefix}.jieba")
        if not 0.0 < self.holdout_fraction < 0.5:
            raise UserError(f"must be in (0, 0.5), got {self.holdout_fraction}", where=where,
                            key=f"{prefix}.holdout_fraction")
        if self.shuffle_seed < 0:
            raise UserError(f"must be an integer >= 0, got {self.shuffle_seed}", where=where,
                            key=f"{prefix}.shuffle_seed", rule="shuffle_seed >= 0")


# --------------------------------------------------------------------------- train
# The ``train`` section of a recipe is one flat mapping (``train.lr``, ``train.save_every``, ...).  In
# Python it is a TrainConfig made of small configs, each with its own validation: the learning-rate
# schedule, the optimizer, the step guard (loss scale, spike guard), checkpoints, logging and held-out
# evaluation.  TRAIN_SECTIONS says which flat keys each one holds.
DEVICES = ("auto", "CPU", "GPU", "Ascend")
LAYER_LOOP = ("auto", "always", "never")
CPU_REDUCTIONS = ("mindspore", "fused")
SCHEDULES = ("naohai", "pangu")
DECAYS = ("cosine", "linear", "constant")


def _complainer(where: str, prefix: str):
    def bad(key, msg, rule=None):
        raise UserError(msg, where=where, key=f"{prefix}.{key}", rule=rule)
    return bad


def _positive(cfg, keys, bad, least: int = 1) -> None:
    for key in keys:
        if getattr(cfg, key) < least:
            bad(key, f"must be a positive integer, got {getattr(cfg, key)}")


#: the largest peak learning rate and gradient clip a recipe may ask for, the smallest Adam epsilon
MAX_LR = 1.0
MAX_GRAD_CLIP = 1e6
MIN_ADAM_EPS = 1e-30
#: the largest spike factor (0 turns the guard off): a gradient norm a million times its running mean is past
#: any spike the guard is for, and above 3.4e38 the factor is inf in float32 (inf x a zero mean is NaN)
MAX_SPIKE_FACTOR = 1e6


@dataclass
class LRScheduleConfig:
    """The learning rate per optimizer step (naohai/train/schedule.py)."""
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    decay: str = "cosine"            # cosine | linear | constant
    decay_steps: Optional[int] = None  # None = train.steps
    schedule: str = "naohai"         # naohai | pangu (the references' LearningRate; see naohai/train/schedule.py)

    def validate(self, where: str, prefix: str) -> None:
        bad = _complainer(where, prefix)
        if self.decay not in DECAYS:
            bad("decay", f"'{self.decay}' is not one of {', '.join(DECAYS)}.{did_you_mean(self.decay, DECAYS)}")
        if self.schedule not in SCHEDULES:
            bad("schedule", f"'{self.schedule}' is not one of {', '.join(SCHEDULES)}.{did_you_mean(self.schedule, SCHEDULES)}")
        if self.schedule == "pangu" and self.decay == "constant":
            bad("decay", "the pangu schedule decays (cosine, or linear = PolynomialDecayLR of power 1); "
                         "'constant' has no reference counterpart", "schedule pangu -> decay cosine | linear")
        if self.decay_steps is not None and self.decay_steps <= 0:
            bad("decay_steps", f"must be a positive integer (or left out for train.steps), got {self.decay_steps}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            bad("min_lr", f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.lr > MAX_LR:
            bad("lr", f"{self.lr} is above {MAX_LR:g}: an AdamW step moves each weight by about lr, so the first "
                      "steps would overwrite the weights (and overflow float32)", f"0 < lr <= {MAX_LR:g}")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")


@dataclass
class OptimizerConfig:
    """AdamW (decoupled weight decay on the matrices) and the global-norm clip."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0           # global-norm clip; 0 disables

    def validate(self, where: str, prefix: str) -> None:
        bad = _complainer(where, prefix)
        if self.grad_clip < 0:
            bad("grad_clip", "must be >= 0 (0 disables clipping)")
        if self.grad_clip > MAX_GRAD_CLIP:
            # float32 turns a clip above 3.4e38 into inf, and inf / max(norm, inf) wrote NaN into every weight
            bad("grad_clip", f"{self.grad_clip} is above {MAX_GRAD_CLIP:g}, where the clip never acts; 0 turns "
                             "clipping off", f"grad_clip == 0 or 0 < grad_clip <= {MAX_GRAD_CLIP:g}")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0 < getattr(self, key) < 1:
                bad(key, f"must lie strictly between 0 and 1 (Adam's moment decay), got {getattr(self, key)}",
                    "0 < beta < 1")
        if not MIN_ADAM_EPS <= self.adam_eps <= 1:
            bad("adam_eps", f"must be between {MIN_ADAM_EPS:g} and 1, got {self.adam_eps} (smaller rounds to 0 in "
                            "float32, and a weight whose moments are 0 then divides 0 by 0)",
                f"{MIN_ADAM_EPS:g} <= adam_eps <= 1")
        if self.weight_decay < 0:
            bad("weight_decay", f"must be >= 0, got {self.weight_decay}")


@dataclass
class LossScaleConfig:
    dynamic: bool = False      # off unless set (float16 compute usually wants it on)
    init: float = 2.0 ** 16
    window: int = 1000         # steps without overflow before the scale grows
    factor: float = 2.0
    min_scale: float = 1.0


@dataclass
class GuardConfig:
    """The step guard (naohai/train/step.py StepGuard): loss scale and the gradient-norm spike guard, and
    how many skipped steps in a row stop the run."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    spike_factor: float = 0.0        # skip a step whose gradient norm exceeds this x its running mean; 0 = off
    spike_warmup: int = 50           # applied steps before the spike guard starts judging
    spike_window: int = 100          # steps in the running mean of the gradient norm
    max_skipped_steps: int = 25      # consecutive skipped steps (non-finite or spike) that stop the run

    def validate(self, where: str, prefix: str) -> None:
        bad = _complainer(where, prefix)
        if self.spike_factor != 0 and self.spike_factor <= 1:
            bad("spike_factor", f"must be 0 (off) or > 1, got {self.spike_factor}")
        if self.spike_factor > MAX_SPIKE_FACTOR:
            bad("spike_factor", f"{self.spike_factor} is above {MAX_SPIKE_FACTOR:g}, where the guard never acts "
                                f"(above 3.4e38 it is inf in float32); 0 turns the guard off",
                f"spike_factor == 0 or 1 < spike_factor <= {MAX_SPIKE_FACTOR:g}")
        _positive(self, ("spike_warmup", "spike_window", "max_skipped_steps"), bad)
        ls = self.loss_scale
        if (ls.window < 1 or not 1 < ls.factor <= 2 ** 16 or not 2 ** -64 <= ls.min_scale
                or not ls.min_scale <= ls.init <= 2 ** 64):
            # a larger scale or factor is inf in float32: every step non-finite, skipped until the run stops; a
            # min_scale of 1e-300 is 0 in float32, and a scale of 0 unscales the gradients by 1 / 0
            bad("loss_scale", f"need window >= 1, 1 < factor <= 2^16 and 2^-64 <= min_scale <= init <= 2^64, "
                              f"got window={ls.window} factor={ls.factor} min_scale={ls.min_scale} init={ls.init}")


@dataclass
class CheckpointConfig:
    """When checkpoints are written and which are kept (naohai/checkpoint/store.py)."""
    save_every: int = 100
    keep_checkpoints: int = 3        # keep the last K checkpoints (0 = keep every checkpoint) ...
    keep_every: int = 0              # ... and every checkpoint whose step is a multiple of this (0 = none)
    async_save: bool = False         # write checkpoint files in the background while training goes on

    def validate(self, where: str, prefix: str) -> None:
        bad = _complainer(where, prefix)
        _positive(self, ("save_every",), bad)
        meaning = {"keep_checkpoints": "0 keeps every checkpoint",
                   "keep_every": "0 keeps none besides the last keep_checkpoints"}
        for key, zero in meaning.items():
            if getattr(self, key) < 0:      # read as 0 by the retention, silently
                bad(key, f"must be an integer >= 0 ({zero}), got {getattr(self, key)}", f"{key} >= 0")


@dataclass
class LoggingConfig:
    """The console / metrics line of every ``log_every``-th step, and the peak its MFU is measured against."""
    log_every: int = 10
    device_profile: Optional[str] = None  # planner profile for the MFU peak; None = detect on Ascend
    device_peak_tflops: Optional[float] = None  # MFU denominator per device; None = profile / measured on CPU

    def validate(self, where: str, prefix: str) -> None:
        bad = _complainer(where, prefix)
        _positive(self, ("log_every",), bad)
        if self.device_peak_tflops is not None and not 0 < self.device_peak_tflops < 1e6:
            bad("device_peak_tflops", f"must be a positive number of TFLOP/s, got {self.device_peak_tflops}")
        if self.device_profile is not None and not str(self.device_profile).strip():
            # which profiles exist is the planner's to say (naohai/strategy/profiles.py recipe_profile)
            bad("device_profile", f"is empty; give a profile, or leave the key out for {_LEFT_OUT['device_profile']}",
                "a non-empty name or left out")


@dataclass
class HeldOutConfig:
    """The held-out loss: every ``eval_every`` steps, over ``eval_batches`` batches of the valid split."""
    eval_every: int = 100
    eval_batches: int = 8

    def validate(self, where: str, prefix: str) -> None:
        _positive(self, ("eval_every", "eval_batches"), _complainer(where, prefix))


@dataclass
class DownstreamEvalConfig:
    """``train.eval``: lm-eval tasks scored on the live weights during training (naohai/train/downstream.py)."""
    tasks: List[str] = field(default_factory=list)   # task names (shipped: naohai_pydoc_cont, ...); empty = off
    every: int = 500                 # evaluate every this many steps (and before step 1 and at the end)
    num_fewshot: Optional[int] = None  # None = each task's own default
    limit: Optional[int] = None      # at most this many examples per task
    include_path: List[str] = field(default_factory=list)   # folders of task YAML files of your own
    batch: int = 16                  # rows of the one compiled scoring graph

    def validate(self, where: str, prefix: str) -> None:
        bad = _complainer(where, prefix)
        _positive(self, ("every", "batch"), bad)
        if self.num_fewshot is not None and self.num_fewshot < 0:
            bad("num_fewshot", f"must be >= 0, got {self.num_fewshot}")
        if self.limit is not None and self.limit <= 0:
            bad("limit", f"must be a positive number of examples, got {self.limit}")
        names = [str(t).strip() for t in self.tasks]
        if any(not n for n in names) or len(set(names)) != len(names):
            bad("tasks", f"needs distinct, non-empty task names, got {self.tasks}")


#: the small configs of TrainConfig, by attribute: their fields are written flat in ``train``
TRAIN_SECTIONS = {"lr_schedule": LRScheduleConfig, "optimizer": OptimizerConfig, "guard": GuardConfig,
                  "checkpoints": CheckpointConfig, "logging": LoggingConfig, "held_out": HeldOutConfig}


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch_size: int = 16      # sequences per optimizer step, across all data-parallel ranks
    micro_batch_size: int = 16       # sequences per device per forward; accumulation fills the rest
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    seed: int = 42
    mode: str = "graph"              # graph | pynative
    reuse_layer_graphs: bool = True  # compile equal decoder layers once (lazy_inline; CPU and Ascend)
    layer_loop: str = "auto"         # auto | always | never: equal layers as one loop over stacked weights
    #                                  (naohai.model.stack); auto = on CPU, one device or data parallel,
    #                                  from 12 looped layers (naohai.train.builder.AUTO_LOOP_MIN_LAYERS)
    cpu_reductions: str = "mindspore"  # mindspore | fused: on CPU, the norms, the attention's softmax,
    #                                  SwiGLU's sigmoid, the cross entropy, the global gradient norm and the
    #                                  AdamW update by MindSpore's ops in their order (bit for bit the composed
    #                                  graph) or by naohai's compiled kernels in theirs (faster; float32 results
    #                                  differ in the last bits; naohai.model.cpu_kernels)
    cpu_affinity: bool = True        # on CPU, MindSpore's thread binding on this process's cores
    #                                  (naohai.train.job.bind_cpu_threads); off: MindSpore's default
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    held_out: HeldOutConfig = field(default_factory=HeldOutConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    output_dir: str = "runs/default"
    init_from: Optional[str] = None  # start from these model weights (a run, a checkpoint, a model folder or a
    #                                  Hugging Face folder):
    #                                  fresh optimizer, step 0, data from the start; a run that has its own
    #                                  checkpoints resumes from them instead
    device: str = "auto"             # auto | CPU | GPU | Ascend (auto: Ascend, else GPU, else CPU)
    eval: DownstreamEvalConfig = field(default_factory=DownstreamEvalConfig)  # downstream tasks in the loop
    exact_match: bool = False        # sft: held-out answers reproduced exactly (naohai/train/exact_match.py),
    #                                  before step 1, every eval_every steps and at the end

    @classmethod
    def from_keys(cls, **keys: Any) -> "TrainConfig":
        """A TrainConfig from the flat keys of a recipe's ``train`` section (``lr=...``, ``save_every=...``),
        each given to the small config that holds it."""
        parts: Dict[str, Dict[str, Any]] = {name: {} for name in TRAIN_SECTIONS}
        for key, value in list(keys.items()):
            section = train_key_section(key)
            if section is not None:
                parts[section][key] = keys.pop(key)
        return cls(**keys, **{name: TRAIN_SECTIONS[name](**given) for name, given in parts.items()})

    def flat(self) -> Dict[str, Any]:
        """The recipe's ``train`` mapping of this config (the inverse of :meth:`from_keys`)."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out.update(dataclasses.asdict(value) if f.name in TRAIN_SECTIONS else {f.name: _plain(value)})
        return out

    def validate(self, where: str = "recipe", prefix: str = "train") -> None:
        bad = _complainer(where, prefix)
        if self.mode not in ("graph", "pynative"):
            bad("mode", f"'{self.mode}' is not one of graph, pynative")
        if self.layer_loop not in LAYER_LOOP:
            bad("layer_loop", f"'{self.layer_loop}' is not one of {', '.join(LAYER_LOOP)}."
                              f"{did_you_mean(str(self.layer_loop), LAYER_LOOP)}")
        if self.cpu_reductions not in CPU_REDUCTIONS:
            bad("cpu_reductions", f"'{self.cpu_reductions}' is not one of {', '.join(CPU_REDUCTIONS)}."
                                  f"{did_you_mean(str(self.cpu_reductions), CPU_REDUCTIONS)}")
        _positive(self, ("steps", "global_batch_size", "micro_batch_size"), bad)
        if self.seed < 0:
            bad("seed", f"must be an integer >= 0, got {self.seed}", "seed >= 0")
        if not str(self.output_dir or "").strip():
            bad("output_dir", "is empty; give the run's folder", "a non-empty path")
        if self.init_from is not None and not str(self.init_from).strip():
            bad("init_from", f"is empty; give a run, checkpoint or model folder, or leave the key out for "
                             f"{_LEFT_OUT['init_from']}", "a non-empty path or left out")
        if self.global_batch_size % self.micro_batch_size:
            bad("global_batch_size", f"{self.global_batch_size} is not a multiple of micro_batch_size "
                                     f"{self.micro_batch_size}", "global_batch_size % micro_batch_size == 0")
        if self.device not in DEVICES:
            bad("device", f"'{self.device}' is not one of {', '.join(DEVICES)}.{did_you_mean(self.device, DEVICES)}")
        for name in TRAIN_SECTIONS:
            getattr(self, name).validate(where, prefix)
        if self.lr_schedule.lr * self.optimizer.weight_decay >= 1:
            bad("weight_decay", f"lr x weight_decay = {self.lr_schedule.lr} x {self.optimizer.weight_decay} must be "
                                "below 1: AdamW multiplies each decayed weight by 1 - lr x weight_decay every step",
                "lr * weight_decay < 1")
        self.eval.validate(where, f"{prefix}.eval")


def train_key_section(key: str) -> Optional[str]:
    """The small config of TrainConfig that holds the flat ``train`` key ``key`` (None: TrainConfig itself)."""
    for name, cls in TRAIN_SECTIONS.items():
        if any(f.name == key for f in dataclasses.fields(cls)):
            return name
    return None


def train_keys() -> List[str]:
    """Every key of a recipe's ``train`` section, in the order a written recipe has them."""
    return list(TrainConfig().flat())


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


# --------------------------------------------------------------------------- finetune
FINETUNE_METHODS = ("lora", "prefix", "prompt", "adapter", "llama_adapter")
#: the largest LoRA scale alpha / rank: float16's largest finite value (the scale is cast to the compute dtype)
MAX_LORA_SCALE = 65504.0
#: the keys each method reads (``method`` aside); a stated key of another method is refused
FINETUNE_KEYS = {"lora": ("rank", "alpha", "dropout", "targets"), "prefix": ("num_virtual_tokens",),
                 "prompt": ("num_virtual_tokens",), "adapter": ("bottleneck",),
                 "llama_adapter": ("num_virtual_tokens", "adapter_layers")}


@dataclass
class FinetuneConfig:
    """The recipe's ``finetune`` section: a parameter-efficient method on a frozen base.

    ``lora`` (:mod:`naohai.model.lora`): ``rank``, ``alpha``, ``dropout``, ``targets`` (a regular
    expression searched in the catalog names of the decoder layers' linear ops, e.g.
    ``attention\\.(q|v)$``).  ``prefix`` / ``prompt``: ``num_virtual_tokens``; ``llama_adapter``:
    ``num_virtual_tokens`` (the adaption prompt's length) and ``adapter_layers`` (the top layers that
    get one); ``adapter`` (Houlsby): ``bottleneck`` (:mod:`naohai.model.finetune`)."""
    method: str = "lora"
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = r"attention\.(q|k|v|out)$"
    num_virtual_tokens: int = 8
    adapter_layers: int = 1
    bottleneck: int = 16

    def validate(self, where: str = "recipe", stated=frozenset()) -> None:
        if self.method not in FINETUNE_METHODS:
            raise UserError(f"'{self.method}' is not one of {', '.join(FINETUNE_METHODS)}."
                            f"{did_you_mean(self.method, FINETUNE_METHODS)}", where=where, key="finetune.method")
        mine = FINETUNE_KEYS[self.method]
        for key in sorted(stated):
            name = key.split(".", 1)[1] if key.startswith("finetune.") else None
            if name and name != "method" and name not in mine:
                raise UserError(f"is not a key of method {self.method} (its keys: {', '.join(mine)})",
                                where=where, key=key)
        positive = {"rank": self.rank, "num_virtual_tokens": self.num_virtual_tokens,
                    "adapter_layers": self.adapter_layers, "bottleneck": self.bottleneck}
        for name in mine:
            if name in positive and (isinstance(positive[name], bool) or int(positive[name]) < 1):
                raise UserError(f"must be a positive integer, got {positive[name]}", where=where,
                                key=f"finetune.{name}")
        if self.method == "lora":
            if not self.alpha > 0:
                raise UserError(f"must be positive, got {self.alpha}", where=where, key="finetune.alpha")
            if not str(self.targets).strip():       # an empty pattern is found in every op name
                raise UserError("is empty; give a regular expression searched in the linear ops' names ('.' adapts "
                                "every one)", where=where, key="finetune.targets", rule="a non-empty pattern")
            if self.alpha / self.rank > MAX_LORA_SCALE:
                # the scale is a tensor of the compute dtype: inf times the zero-initialised B is NaN at once
                raise UserError(f"alpha / rank = {self.alpha} / {self.rank} = {self.alpha / self.rank:g} scales the "
                                f"adapter's output; above {MAX_LORA_SCALE:g}, float16's largest value, it is inf in "
                                f"float16 (and at 3.4e38 in float32), and inf times the zero-initialised B is NaN "
                                f"at the first step", where=where, key="finetune.alpha",
                                rule=f"0 < alpha / rank <= {MAX_LORA_SCALE:g}")
            if not 0.0 <= self.dropout < 1.0:
                raise UserError(f"must be in [0, 1), got {self.dropout}", where=where, key="finetune.dropout")

    def fits(self, cfg: ModelConfig, where: str = "recipe") -> None:
        """The rules of this section that depend on the model ``cfg`` (exit 2 naming the key)."""
        method = self.method
        if method == "adapter" and int(self.bottleneck) > cfg.hidden_size:
            raise UserError(f"is {self.bottleneck}, wider than the model's hidden_size {cfg.hidden_size}: the "
                            f"adapter's down projection [hidden -> bottleneck] has rank at most hidden_size, so a "
                            f"wider one adds parameters (2 x layers x hidden x bottleneck) but no capacity",
                            where=where, key="finetune.bottleneck", rule="1 <= bottleneck <= model.hidden_size")
        if method in ("prefix", "prompt"):
            n = int(self.num_virtual_tokens)
            if n + cfg.seq_length > cfg.positions:
                raise UserError(f"is {n}: the virtual tokens come before the model's {cfg.seq_length} tokens, and "
                                f"{n} + {cfg.seq_length} exceeds the {cfg.positions} positions the model numbers "
                                f"(model.max_positions); lower num_virtual_tokens or model.seq_length",
                                where=where, key="finetune.num_virtual_tokens",
                                rule="num_virtual_tokens + model.seq_length <= model.max_positions")
            if cfg.position == "alibi":
                raise UserError(f"{method} tuning is not built for ALiBi positions (model.position: alibi)",
                                where=where, key="finetune.method")
        if method == "prompt" and (cfg.eod_reset or cfg.eod_reset_positions):
            raise UserError("prompt tuning with EOD resets (model.eod_reset / eod_reset_positions) is not built: the "
                            "virtual tokens would belong to the first document of a packed window only; use "
                            "method: prefix, or turn the resets off", where=where, key="finetune.method")
        if method == "llama_adapter":
            if int(self.num_virtual_tokens) > cfg.positions:
                raise UserError(f"is {self.num_virtual_tokens}: the adaption prompt's keys join every window's "
                                f"keys in the adapted layers, and a prompt longer than the {cfg.positions} positions "
                                f"the model numbers (model.max_positions) is not an adapter but a second context",
                                where=where, key="finetune.num_virtual_tokens",
                                rule="num_virtual_tokens <= model.max_positions")
            if not 1 <= int(self.adapter_layers) <= cfg.num_layers:
                raise UserError(f"is {self.adapter_layers}; it must be between 1 and the model's {cfg.num_layers} layers",
                                where=where, key="finetune.adapter_layers", rule="1 <= adapter_layers <= num_layers")
            if cfg.query_layer:
                raise UserError("llama_adapter is not built for PanGu's query layer (model.query_layer: true)",
                                where=where, key="finetune.method")


# --------------------------------------------------------------------------- recipe
@dataclass
class Recipe:
    name: str = "recipe"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    finetune: Optional[FinetuneConfig] = None   # None = every parameter trains
    source: Optional[str] = None      # file it was read from (not a YAML key)
    # dotted keys the recipe file or its overrides wrote (e.g. "train.global_batch_size"); the rest are
    # defaults.  naohai.strategy.batch adopts a strategy file's batch only where the recipe is silent.
    stated: FrozenSet[str] = frozenset()

    def validate(self) -> "Recipe":
        where = self.source or "recipe"
        self.model.validate(where)
        self.data.validate(where)
        self.train.validate(where)
        if self.finetune is not None:
            self.finetune.validate(where, self.stated)
            if self.finetune.method != "lora":
                self.finetune.fits(self.model, where)
        if self.train.exact_match and self.data.format != "sft":
            raise UserError("scores the held-out answers of fine-tuning data; it needs data.format: sft",
                            where=where, key="train.exact_match")
        return self

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train"] = self.train.flat()
        d.pop("source", None)
        d.pop("stated", None)
        if d.get("finetune") is None:
            d.pop("finetune", None)
        else:                                  # the method's own keys only (others are refused on reading)
            keep = ("method",) + FINETUNE_KEYS[d["finetune"]["method"]]
            d["finetune"] = {k: v for k, v in d["finetune"].items() if k in keep}
        return d


def write_recipe(recipe: "Recipe", path: str) -> str:
    """Write ``recipe`` (name included) as a YAML file ``load_recipe`` reads back to the same recipe."""
    raw = recipe.to_dict()
    raw["name"] = recipe.name
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh, sort_keys=False, default_flow_style=None)
    return path


# --------------------------------------------------------------------------- loading
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
        return build_section(tp, value, where, key)
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


def _key_types(cls) -> Dict[str, Any]:
    """The YAML keys of section ``cls`` and their types (TrainConfig: its flat keys, TRAIN_SECTIONS)."""
    hints = typing.get_type_hints(cls)
    types = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "source"}
    if cls is TrainConfig:
        for name, section in TRAIN_SECTIONS.items():
            del types[name]
            types.update(_key_types(section))
    return types


def build_section(cls, data: Dict[str, Any], where: str, prefix: str):
    """The dataclass ``cls`` from a YAML mapping: unknown keys and wrong types are UserErrors naming
    ``where`` and the dotted key under ``prefix``."""
    hints = _key_types(cls)
    names = list(hints)
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise UserError(f"unknown key '{key}'.{did_you_mean(key, names)} Known keys: {', '.join(names)}.",
                            where=where, key=path)
        kwargs[key] = _coerce(value, hints[key], where, path)
    return cls.from_keys(**kwargs) if cls is TrainConfig else cls(**kwargs)


def _set_dotted(tree: Dict[str, Any], dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise UserError(f"cannot set '{dotted}': '{p}' is not a section", where=where, key=dotted)
        node = nxt
    node[parts[-1]] = value


def is_override(item: str) -> bool:
    """Whether a command-line word has the form of a dotted override (``key=value``, the key not empty)."""
    return "=" in item and not item.startswith("=")


def parse_overrides(items: Sequence[str], where: str = "command line") -> Dict[str, Any]:
    """Turn ['train.lr=1e-3', 'model.preset=tiny'] into a nested dict (values parsed as YAML)."""
    tree: Dict[str, Any] = {}
    for item in items:
        if not is_override(item):
            raise UserError(f"override '{item}' is not of the form section.key=value", where=where)
        key, raw = item.split("=", 1)
        try:
            value = validate.load_yaml(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        _set_dotted(tree, key.strip(), value, where)
    return tree


def merge_trees(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with ``extra`` laid over it, nested mappings merged key by key (overrides on a recipe)."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge_trees(out[k], v)
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
    top = ("name", "model", "data", "train", "finetune")
    for key in raw:
        if key not in top:
            raise UserError(f"unknown section '{key}'.{did_you_mean(key, top)} Sections: {', '.join(top)}.",
                            where=where, key=str(key))
    model_raw = raw.get("model") or {}
    if not isinstance(model_raw, dict):
        raise UserError("must be a mapping", where=where, key="model")
    model_raw = dict(model_raw)
    model_raw = model_fields(model_raw, where)
    for section in ("data", "train", "finetune"):
        if raw.get(section) is not None and not isinstance(raw[section], dict):
            raise UserError("must be a mapping", where=where, key=section)
    recipe = Recipe(
        name=validate.text(raw.get("name"), where, "name", default="recipe"),
        model=build_section(ModelConfig, model_raw, where, "model"),
        data=build_section(DataConfig, raw.get("data") or {}, where, "data"),
        train=build_section(TrainConfig, raw.get("train") or {}, where, "train"),
        finetune=None if raw.get("finetune") is None else build_section(FinetuneConfig, raw["finetune"], where, "finetune"),
        source=where,
        stated=frozenset(f"{section}.{key}" for section in ("data", "train", "finetune") for key in (raw.get(section) or {})),
    )
    return recipe.validate()


def recipe_names() -> List[str]:
    """The recipes shipped in the repository's recipes/ folder (names without .yaml)."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
    try:
        return sorted(name[:-5] for name in os.listdir(folder) if name.endswith(".yaml"))
    except OSError:
        return []


def load_recipe(path: str, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe file (or a name in recipes/) and apply dotted overrides.  A mistake in an
    override is reported against the command line, not the recipe file."""
    given = path
    path = resolve_recipe_path(path)
    if not os.path.exists(path):
        names = recipe_names()
        if given in MODEL_PRESETS:   # commands that need only a model (check, plan) accept the preset itself
            raise UserError(f"'{given}' is a model preset, not a recipe: this command needs a recipe (data and train "
                            f"settings too). Write one whose model.preset is {given} (recipes/tiny.yaml is an "
                            f"example). Recipes: {', '.join(names)}", where=given)
        raise UserError(f"no such recipe file, and no recipe of that name in recipes/."
                        f"{did_you_mean(given, names)} Recipes: {', '.join(names)}", where=given)
    raw = read_yaml(path, "recipe")
    if overrides:
        raw = merge_trees(raw, parse_overrides(overrides))
    try:
        return recipe_from_dict(raw, where=path)
    except UserError as err:
        hit = [item for item in overrides if err.key and item.split("=", 1)[0].strip() == err.key]
        if not hit:
            raise
        raise UserError(err.message, where=f"command line override '{hit[-1]}' (recipe {path})", key=err.key,
                        rule=err.rule) from None


def load_recipe_or_preset(name: str, overrides: Sequence[str] = ()) -> Recipe:
    """For commands that need only a model and a batch (``check``, ``plan``): a recipe resolved exactly as
    ``train`` resolves it (a path, then a name in recipes/), else a model preset of that name.  So a
    name means the same recipe in every command: ``tiny`` is recipes/tiny.yaml (whose model is the
    preset ``tiny``), and a preset with no recipe of its name (``llama-7b``) is the preset alone."""
    path = resolve_recipe_path(name)
    if os.path.exists(path):
        return load_recipe(path, overrides)
    if name in MODEL_PRESETS:
        return preset_recipe(name, overrides, where=f"preset {name} (no recipe of that name in recipes/)")
    names = recipe_names()
    raise UserError(f"'{name}' is no recipe file, no recipe in recipes/ and no model preset."
                    f"{did_you_mean(name, sorted(set(names) | set(MODEL_PRESETS)))} Recipes: {', '.join(names)}; presets: "
                    f"{', '.join(sorted(MODEL_PRESETS))}", where="command line", key="RECIPE",
                    rule="recipe file, recipes/ name or preset")


def preset_recipe(preset: str, overrides: Sequence[str] = (), where: str = "") -> Recipe:
    """A recipe holding only a model preset (for `naohai plan pangu-alpha-200b ...`), with dotted overrides."""
    raw = merge_trees({"name": preset, "model": {"preset": preset}}, parse_overrides(overrides))
    return recipe_from_dict(raw, where=where or f"preset {preset}")
