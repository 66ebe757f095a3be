"""LoRA: low-rank adapters on the model's linear ops, the base weights frozen.

A targeted linear op ``y = x W^T`` (``W`` [out, in], a catalog ``MatMul`` of a decoder layer such as
``layers.3.attention.q``) becomes ``y = x W^T + (alpha / rank) * dropout(x) A^T B^T`` with
``A`` [rank, in] and ``B`` [out, rank], named ``<op>.lora_a`` / ``<op>.lora_b`` (Hu et al. 2021,
as Hugging Face PEFT's ``lora.Linear``).  ``B`` starts at zero, so the adapted model starts equal
to the base one; ``A`` is drawn uniform in ``[-1/sqrt(in), 1/sqrt(in)]`` from
``numpy.random.default_rng([seed, crc32(op name)])`` at its full shape: the same values whatever
the layout or the order the ops are visited in.

:func:`apply_lora` wraps the ops of a built :class:`~naohai.model.transformer.NaohaiLM` and marks
every other parameter ``requires_grad=False``, so the optimizer (built from the trainable
parameters) holds moments for the adapters only and no base gradient is computed.  The recipe
declares it::

    finetune: {method: lora, rank: 8, alpha: 16, dropout: 0.0, targets: 'attention\\.(q|v)$'}

``targets`` is a regular expression searched in the catalog names of the decoder layers' linear
ops (:func:`lora_ops` lists them).  Under a strategy file the factors follow their base op's
sharding: :mod:`naohai.strategy.lora` derives the strategies of the adapter's ops from the base's.

:class:`LoraMerged` folds trained adapters into base weights (``W + alpha / rank * B A``): what
``naohai ckpt merge-adapter`` writes and how generate / eval read a run of adapters.
"""
from __future__ import annotations

import re
import zlib
from typing import Any, Dict, List, Mapping, Tuple

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from naohai.ckpt_format import LazyTensors, shape_of
from naohai.model.config import ModelConfig
from naohai.model.spec import op_catalog
from naohai.errors import UserError


def lora_ops(cfg: ModelConfig) -> Dict[str, Tuple[int, int]]:
    """Catalog name -> (out, in) of every linear op LoRA may adapt (the decoder layers' MatMuls
    against a weight)."""
    out = {}
    for name, spec in op_catalog(cfg).items():
        if name.startswith("layers.") and spec.kind == "MatMul" and spec.weight_inputs == (1,) and spec.params \
                and spec.params[0] is not None:
            o, i = spec.shapes[1]
            out[name] = (int(o), int(i))
    return out


def select_targets(cfg: ModelConfig, ft, where: str = "recipe") -> Dict[str, Tuple[int, int]]:
    """The ops ``ft`` (a :class:`naohai.config.FinetuneConfig`) adapts, checked: exit 2 naming the key."""
    linear = lora_ops(cfg)
    try:
        pattern = re.compile(ft.targets)
    except re.error as exc:
        raise UserError(f"{ft.targets!r} is not a regular expression ({exc})", where=where,
                        key="finetune.targets") from None
    chosen = {n: shape for n, shape in linear.items() if pattern.search(n)}
    if not chosen:
        kinds = sorted({n.split(".", 2)[2] for n in linear})
        raise UserError(f"{ft.targets!r} matches no linear op of the model; the ops LoRA adapts are "
                        f"layers.<i>.{{{', '.join(kinds)}}}", where=where, key="finetune.targets")
    smallest = min(min(shape) for shape in chosen.values())
    if not 1 <= int(ft.rank) <= smallest:
        raise UserError(f"is {ft.rank}; it must be between 1 and {smallest}, the smallest dimension of the "
                        f"targeted ops' weights", where=where, key="finetune.rank",
                        rule="1 <= rank <= min(out, in) of every target")
    return chosen


def init_a(name: str, rank: int, fan_in: int, seed: int) -> np.ndarray:
    """``A`` of op ``name``: uniform in +-1/sqrt(fan_in), drawn from (seed, crc32(name)) at full shape."""
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=(rank, fan_in)).astype(np.float32)


class LoRAMatMul(nn.Cell):
    """``construct(x, w) = base(x, w) + (scale * (dropout(x) A^T)) B^T`` (``base`` a MatMul(transpose_b)).

    Every op is its own primitive (``drop.drop``, ``mm_a``, ``scale_mul``, ``mm_b``, ``add``) so the
    parallel package can give each a strategy derived from the base op's
    (:mod:`naohai.strategy.lora`); the cell itself holds no parallel logic.  The scale multiplies the
    [tokens, rank] product, the smallest tensor of the path."""

    def __init__(self, base, name: str, out: int, inn: int, rank: int, alpha: float, dropout: float, seed: int):
        super().__init__(auto_prefix=False)
        from naohai.model.layers import Dropout

        self.base = base
        self.lora_a = Parameter(Tensor(init_a(name, rank, inn, seed)), name=f"{name}.lora_a")
        self.lora_b = Parameter(Tensor(np.zeros((out, rank), np.float32)), name=f"{name}.lora_b")
        self.scale = float(alpha) / float(rank)
        self.scale_value = Tensor(self.scale, ms.float32)
        self.drop = Dropout(dropout)
        self.mm_a = ops.MatMul(transpose_b=True)
        self.scale_mul = ops.Mul()
        self.mm_b = ops.MatMul(transpose_b=True)
        self.add = ops.Add()
        self.cast = ops.Cast()

    def construct(self, x, w):
        low = self.mm_a(self.drop(x), self.cast(self.lora_a, x.dtype))
        low = self.scale_mul(low, self.cast(self.scale_value, x.dtype))
        return self.add(self.base(x, w), self.mm_b(low, self.cast(self.lora_b, x.dtype)))


def apply_lora(model, ft, seed: int, where: str = "recipe") -> List[str]:
    """Wrap the targeted ops of ``model`` (per-layer form) and freeze the rest; returns the op names."""
    if getattr(model, "layer_loop", False):
        raise UserError("LoRA needs one cell per layer; set train.layer_loop: never", where=where,
                        key="train.layer_loop")
    targets = select_targets(model.cfg, ft, where)
    for p in model.get_parameters():
        p.requires_grad = False
    for name, (out, inn) in targets.items():
        _, index, part, op = name.split(".")
        owner = getattr(model.layers[int(index)], part)
        cell = LoRAMatMul(getattr(owner, op), name, out, inn, int(ft.rank), float(ft.alpha), float(ft.dropout),
                          seed)
        setattr(owner, op, cell)
        cell.lora_a.name, cell.lora_b.name = f"{name}.lora_a", f"{name}.lora_b"   # full names, not prefixed
    return list(targets)


def adapter_params(model) -> List[Parameter]:
    """The LoRA parameters of ``model``, in model order."""
    return [p for p in model.get_parameters() if p.name.endswith((".lora_a", ".lora_b"))]



def is_adapter_name(name: str) -> bool:
    """Is ``name`` a LoRA factor (``layers.<i>.<part>.<op>.lora_a`` / ``.lora_b``, not an optimizer moment of one)?"""
    return name.startswith("layers.") and name.endswith((".lora_a", ".lora_b"))


class LoraMerged(LazyTensors):
    """The model's tensors with every adapter folded in: ``<op>_weight + alpha / rank * B A`` (float32), each
    computed when asked from ``base`` (itself maybe read when asked), so a model filled from it holds one base
    tensor beside its own weights; ``base`` is not changed.  An adapter whose op has no weight in ``base``, or
    whose factors do not fit its shape, is a ``ValueError`` when made."""

    def __init__(self, base: Mapping[str, Any], adapters: Mapping[str, Any], rank: int, alpha: float):
        self._base = self._keys = base
        self._scale = float(alpha) / float(rank)
        self._factors: Dict[str, Tuple[np.ndarray, np.ndarray]] = {}
        for name in sorted(n for n in adapters if n.endswith(".lora_a")):
            op = name[:-len(".lora_a")]
            a = np.asarray(adapters[name], np.float32)
            b = np.asarray(adapters[f"{op}.lora_b"], np.float32)
            shape = shape_of(base, f"{op}_weight") if f"{op}_weight" in base else None
            if shape is None or a.shape != (rank, shape[1]) or b.shape != (shape[0], rank):
                raise ValueError(f"adapter {op}: A {a.shape}, B {b.shape} do not fit rank {rank} and its base "
                                 f"weight {shape}")
            self._factors[f"{op}_weight"] = (a, b)

    def __getitem__(self, name: str) -> np.ndarray:
        w = self._base[name]
        if name not in self._factors:
            return w
        a, b = self._factors[name]
        return (np.asarray(w, np.float32) + self._scale * (b @ a)).astype(np.float32)

    def shape(self, name: str) -> Tuple[int, ...]:
        return shape_of(self._base, name)
