"""One Hugging Face architecture: its ``config.json`` <-> ModelConfig fields, its tensors <-> parameters.

An :class:`Architecture` is registered per ``model_type`` by the family modules of this
package (``llama.py``, ``bloom.py``, ...).  :class:`HFConfig` reads a ``config.json`` with
every mistake a :class:`~naohai.errors.UserError` naming the file and key; the layout
helpers here split the fused projections the architectures store (``query_key_value``
per head group, GPT-2's ``[in, out]`` Conv1D weights, GLM's ``gate_up_proj``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from naohai.model.config import ModelConfig
from naohai.convert.names import Link
from naohai.errors import UserError

#: longest window an imported recipe trains on by default (``model.seq_length`` overrides it)
DEFAULT_SEQ_LENGTH = 2048
#: rope scalings naohai computes (transformers' rope_type names; :func:`naohai.model.layers.rope_frequencies`)
SCALED_ROPE = ("linear", "llama3")
_MISSING = object()


class HFConfig:
    """A ``config.json`` mapping; ``where`` is its path for error messages."""

    def __init__(self, data: Dict[str, Any], where: str):
        self.data, self.where = data, where

    def __contains__(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def bad(self, key: str, message: str) -> UserError:
        return UserError(message, where=self.where, key=key)

    def get(self, key: str, default: Any = _MISSING, kind: type = int) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _MISSING:
                raise self.bad(key, f"is missing; this {self.data.get('model_type')} config needs it")
            return default
        ok = isinstance(value, bool) if kind is bool else (
            isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
            isinstance(value, kind) and not (kind is int and isinstance(value, bool)))
        if not ok:
            raise self.bad(key, f"must be {kind.__name__}, got {value!r}")
        return float(value) if kind is float else value

    def count(self, key: str) -> int:
        """A size that must be a positive integer (vocabulary, widths, layers, heads)."""
        value = self.get(key)
        if value <= 0:
            raise self.bad(key, f"must be a positive integer, got {value}")
        return value

    def first(self, keys: Sequence[str], default: Any = _MISSING, kind: type = int) -> Any:
        """The first of ``keys`` present (old and new names of one setting)."""
        for key in keys:
            if key in self:
                return self.get(key, kind=kind)
        if default is _MISSING:
            raise self.bad(keys[0], f"is missing; this {self.data.get('model_type')} config needs it")
        return default

    def require(self, key: str, allowed: Sequence[Any], default: Any, why: str) -> Any:
        """A setting naohai implements only for some values (else a UserError saying so)."""
        value = self.data.get(key, default)
        if value is None:
            value = default
        if value not in allowed:
            raise self.bad(key, f"is {value!r}; naohai implements only {', '.join(map(repr, allowed))} here ({why})")
        return value

    def rope(self, default_fraction: float = 1.0) -> Dict[str, Any]:
        """The ModelConfig fields of the RoPE: ``rope_base`` and ``rotary_fraction`` from ``rope_parameters``
        (transformers 5) or the older keys, and its scaling (``rope_scaling``: none, ``linear`` or Llama 3.1's
        ``llama3``, with their settings) from the older ``rope_scaling`` object where there is one, else from
        ``rope_parameters``; any other scaling is refused."""
        params = self.data.get("rope_parameters") or {}
        if not isinstance(params, dict):
            raise self.bad("rope_parameters", f"must be a JSON object, got {params!r}")
        scaling = self.data.get("rope_scaling")
        if isinstance(scaling, dict):
            kind, key, settings = scaling.get("rope_type", scaling.get("type")), "rope_scaling", scaling
        else:
            kind, key, settings = params.get("rope_type", params.get("type", "default")), "rope_parameters", params
        if kind not in (None, "default") + SCALED_ROPE:
            raise self.bad(f"{key}.rope_type", f"asks for rope scaling '{kind}', which naohai does not implement "
                                               f"(RoPE unscaled, 'linear' or 'llama3'); import a model without it "
                                               f"or remove the scaling from config.json knowingly")
        theta = params.get("rope_theta", self.first(("rope_theta", "rotary_emb_base"), 10000.0, float))
        fraction = params.get("partial_rotary_factor",
                              self.first(("partial_rotary_factor", "rotary_pct"), default_fraction, float))
        fields: Dict[str, Any] = {"rope_base": float(theta), "rotary_fraction": float(fraction)}
        if kind in (None, "default"):
            return dict(fields, rope_scaling="none")

        def number(name, whole=False):
            value = settings.get(name)
            if value is None:
                raise self.bad(f"{key}.{name}", f"is missing; rope_type '{kind}' needs it")
            ok = isinstance(value, int) if whole else isinstance(value, (int, float))
            if isinstance(value, bool) or not ok or not math.isfinite(value):
                raise self.bad(f"{key}.{name}", f"must be a finite {'integer' if whole else 'number'}, got {value!r}")
            return value if whole else float(value)

        fields.update(rope_scaling=kind, rope_factor=number("factor"))
        if kind == "llama3":
            fields.update(rope_low_freq_factor=number("low_freq_factor"),
                          rope_high_freq_factor=number("high_freq_factor"),
                          rope_original_positions=number("original_max_position_embeddings", whole=True))
        return fields


@dataclass(frozen=True)
class Architecture:
    """How one ``model_type`` maps onto naohai.

    ``read`` turns a config into ModelConfig fields (the family's choices and the shapes);
    ``write`` gives the config keys of a ModelConfig (after ``fits`` accepted it); ``links`` lists
    every stored tensor and the naohai parameters it holds; ``ignored`` are stored buffers that are
    not weights (causal masks, rotary frequencies of older checkpoints)."""

    model_type: str
    family: str
    class_name: str
    read: Callable[[HFConfig], Dict[str, Any]]
    write: Callable[[ModelConfig], Dict[str, Any]]
    links: Callable[[ModelConfig], List[Link]]
    fits: Callable[[ModelConfig], List[Tuple[str, bool, str]]]
    prefix: str = ""
    ignored: Tuple[str, ...] = ()


_ARCHS: Dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    _ARCHS[arch.model_type] = arch
    return arch


def registered() -> Dict[str, Architecture]:
    """The architectures registered so far (:mod:`.registry` imports every family module first)."""
    return dict(_ARCHS)


# --------------------------------------------------------------------------- common pieces
def common_fields(c: HFConfig, *, vocab: str, hidden: str, layers: str, heads: str, positions: Sequence[str],
                  tie_default: bool) -> Dict[str, Any]:
    """The shape fields every architecture has, and naohai's settings for an imported model: the
    vocabulary unpadded, float32 compute, no dropout, the plain mean loss."""
    max_pos = c.first(tuple(positions), DEFAULT_SEQ_LENGTH)
    return dict(vocab_size=c.count(vocab), vocab_pad_multiple=1, hidden_size=c.count(hidden),
                num_layers=c.count(layers), num_heads=c.count(heads), seq_length=min(max_pos, DEFAULT_SEQ_LENGTH),
                tie_embeddings=c.get("tie_word_embeddings", tie_default, bool), compute_dtype="float32",
                dropout=0.0, init_std=c.get("initializer_range", 0.02, float), eod_reset=False,
                eod_reset_positions=False, eod_id=None, loss_pad_id=None, query_layer=False)


def window_as_position_limit(c: HFConfig, fields: Dict[str, Any], window: Optional[int]) -> None:
    """Sliding-window attention (Mistral-7B-v0.1's 4,096 tokens, Qwen2's ``use_sliding_window``): naohai
    attends to every earlier position, which is the same computation as long as no sequence is longer than
    the window.  So a window shorter than ``max_position_embeddings`` becomes the model's position limit
    (``max_positions``; ``seq_length`` at most that): a longer ``model.seq_length`` is then refused, and
    generation stops at it."""
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise c.bad("sliding_window", f"must be a positive integer or null, got {window!r}")
    longest = c.first(("max_position_embeddings",), DEFAULT_SEQ_LENGTH)
    if window < longest:
        fields.update(max_positions=window, seq_length=min(fields["seq_length"], window))


def check_head_dim(c: HFConfig, fields: Dict[str, Any]) -> None:
    head_dim = c.get("head_dim", None)
    if fields["hidden_size"] % fields["num_heads"]:
        raise c.bad("num_attention_heads", f"{fields['num_heads']} does not divide hidden_size "
                                           f"{fields['hidden_size']}; naohai needs head_dim = hidden / heads")
    if head_dim is not None and head_dim != fields["hidden_size"] // fields["num_heads"]:
        raise c.bad("head_dim", f"is {head_dim}, but hidden_size / num_attention_heads is "
                                f"{fields['hidden_size'] // fields['num_heads']}; naohai supports only head_dim = "
                                f"hidden / heads")


def rope_keys(cfg: ModelConfig, fraction_key: Optional[str] = None) -> Dict[str, Any]:
    """RoPE settings in both the older keys (``rope_theta``, ``rope_scaling``) and transformers 5's
    ``rope_parameters``."""
    params: Dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_base}
    out: Dict[str, Any] = {"rope_theta": cfg.rope_base, "rope_scaling": None}
    if cfg.rope_scaling != "none":
        scaling: Dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_factor}
        if cfg.rope_scaling == "llama3":
            scaling.update(low_freq_factor=cfg.rope_low_freq_factor, high_freq_factor=cfg.rope_high_freq_factor,
                           original_max_position_embeddings=cfg.rope_original_positions)
        params.update(scaling)
        out["rope_scaling"] = dict(scaling)
    if fraction_key:
        params["partial_rotary_factor"] = cfg.rotary_fraction
        out[fraction_key] = cfg.rotary_fraction
    out["rope_parameters"] = params
    return out


def shape_keys(cfg: ModelConfig, **names: str) -> Dict[str, Any]:
    """Config keys of the shapes, under this architecture's ``names`` (e.g. hidden='n_embd')."""
    values = dict(vocab=cfg.padded_vocab_size, hidden=cfg.hidden_size, layers=cfg.num_layers, heads=cfg.num_heads,
                  positions=cfg.positions, ffn=cfg.ffn_hidden_size)
    return {names[k]: v for k, v in values.items() if k in names}


def common_fits(cfg: ModelConfig) -> List[Tuple[str, bool, str]]:
    return [("query_layer", not cfg.query_layer, "the architecture has no top query layer"),
            ("final_norm", cfg.final_norm == "after", "its final norm follows the last layer")]


def training_conventions(cfg: ModelConfig) -> List[str]:
    """What a model's recipe sets about how its windows were packed and its loss counted, which the exported
    network does not carry: the weights and the network are the same, and the outputs equal naohai's on an
    input with no EOD before its last token (a prompt, one conversation).  Said, not refused: an SFT run
    packs conversations with ``model.eod_reset``, and its adapter or merged model is meant for Hugging Face."""
    notes = []
    if cfg.eod_reset or cfg.eod_reset_positions:
        what = " and ".join(w for w, on in (("attention", cfg.eod_reset), ("positions", cfg.eod_reset_positions))
                            if on)
        notes.append(f"model.eod_reset{'_positions' if not cfg.eod_reset else ''}: naohai restarts {what} at each "
                     f"EOD (id {cfg.eod_id}) inside a window, a Hugging Face model does not; outputs are equal on "
                     f"inputs with no EOD before their last token (a prompt, one conversation)")
    if cfg.loss_pad_id is not None:
        notes.append(f"model.loss_pad_id {cfg.loss_pad_id}: naohai's loss and evaluation leave out targets equal to "
                     f"it; a Hugging Face loss counts every token")
    return notes


def same(x):
    return x


def one(x):
    return (x,)


def link(hf: str, ours: str) -> Link:
    return Link(hf, (ours,), same, one)


def transposed(hf: str, ours: str) -> Link:
    """GPT-2's Conv1D stores [in, out]; naohai [out, in]."""
    return Link(hf, (ours,), lambda w: np.ascontiguousarray(w.T), lambda w: (np.ascontiguousarray(w.T),))


def grouped_qkv(hf: str, prefix: str, kv_heads: int, group: int, head_dim: int, kind: str = "weight") -> Link:
    """A fused projection stored per key/value head as [q_1 .. q_group, k, v] blocks of ``head_dim`` rows
    (Falcon's new decoder and multi-query layouts; with group 1 the [q, k, v] per head of BLOOM, GPT-NeoX
    and Falcon's original layout); query head j * group + g is naohai's q head of that index."""
    ours = tuple(f"{prefix}{p}_{kind}" for p in ("q", "k", "v"))

    def split(w):
        tail = w.shape[1:]
        blocks = w.reshape((kv_heads, group + 2, head_dim) + tail)
        q = blocks[:, :group].reshape((kv_heads * group * head_dim,) + tail)
        return (np.ascontiguousarray(q), np.ascontiguousarray(blocks[:, group].reshape((-1,) + tail)),
                np.ascontiguousarray(blocks[:, group + 1].reshape((-1,) + tail)))

    def fuse(q, k, v):
        tail = q.shape[1:]
        q = q.reshape((kv_heads, group, head_dim) + tail)
        k = k.reshape((kv_heads, 1, head_dim) + tail)
        v = v.reshape((kv_heads, 1, head_dim) + tail)
        return np.ascontiguousarray(np.concatenate([q, k, v], axis=1).reshape((-1,) + tail))

    return Link(hf, ours, fuse, split)


def stacked(hf: str, ours: Sequence[str], axis: int = 0) -> Link:
    """Equal-sized naohai tensors concatenated along ``axis`` in one stored tensor."""
    n = len(ours)
    return Link(hf, tuple(ours), lambda *xs: np.ascontiguousarray(np.concatenate(xs, axis=axis)),
                lambda w: tuple(np.ascontiguousarray(x) for x in np.split(w, n, axis=axis)))


def head_links(cfg: ModelConfig, final_norm: str, head: str = "lm_head.weight") -> List[Link]:
    """The final LayerNorm (``<final_norm>.weight`` / ``.bias``) and, when untied, the output head."""
    out = [link(final_norm + ".weight", "head.final_norm.gamma"), link(final_norm + ".bias", "head.final_norm.beta")]
    return out if cfg.tie_embeddings else out + [link(head, "head.weight")]


def activation_of(c: HFConfig, key: str, default: str) -> str:
    """naohai's activation for a transformers ``hidden_act`` name (exact GeLU, tanh GeLU)."""
    names = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}
    value = c.get(key, default, str)
    if value not in names:
        raise c.bad(key, f"is '{value}'; naohai implements {', '.join(sorted(names))} for this architecture")
    return names[value]


def hf_activation(cfg: ModelConfig) -> str:
    return {"gelu": "gelu", "gelu_tanh": "gelu_new"}.get(cfg.activation, cfg.activation)
