"""Model families: each one's architecture choices, published presets and checkpoint formats.

A family is one :class:`Family` value in one file of this package (``pangu.py``,
``pengcheng.py``, ``naohai.py``, and the Hugging Face architectures ``llama.py``, ``qwen2.py``,
``mistral.py``, ``olmo.py``, ``glm.py``, ``falcon.py``, ``gpt_neox.py``, ``bloom.py``, ``gpt2.py``, whose folders
:mod:`naohai.convert.hf` reads and writes).  ``defaults`` are the :class:`~naohai.model.config.ModelConfig`
fields every model of the family shares (its spec builder choices: positions, activation,
norm, query layer, EOD handling, ...); ``presets`` are its published configurations,
each one the fields it adds to the defaults; ``checkpoint_formats`` name the reference
checkpoint layouts ``naohai ckpt import --from`` reads for it.

A recipe selects a family by ``model.family`` (the defaults, then the recipe's own model
keys) or by ``model.preset`` (the preset names its family).  Adding a family is one file
here registered below, or :func:`register` from anywhere (a test, a plug-in) before the
recipe is read; cells and the model description (:mod:`naohai.model.spec`) only change
when the family needs a piece no flag describes yet.

Pure data, no MindSpore and no other naohai import: the recipe loader reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, Mapping, Tuple

from naohai.errors import UserError, did_you_mean


@dataclass(frozen=True)
class Family:
    """One decoder-only family: its shared field values, its presets, its reference checkpoints."""

    name: str
    summary: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    presets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    checkpoint_formats: Tuple[str, ...] = ()

    def preset_fields(self, preset: str) -> Dict[str, Any]:
        """The ModelConfig fields of one preset: the family's defaults, the preset's own, the family."""
        return dict(self.defaults, **self.presets[preset], family=self.name)

    def fields(self) -> Dict[str, Any]:
        """The ModelConfig fields a recipe naming only this family starts from."""
        return dict(self.defaults, family=self.name)


_FAMILIES: Dict[str, Family] = {}


def register(family: Family) -> Family:
    """Make ``family`` (and its presets) known to recipes; names must not clash with known ones."""
    if family.name in _FAMILIES and _FAMILIES[family.name] is not family:
        raise ValueError(f"model family '{family.name}' is already registered")
    for preset in family.presets:
        owner = _preset_owner(preset)
        if owner is not None and owner is not family:
            raise ValueError(f"preset '{preset}' of family '{family.name}' is already a preset of '{owner.name}'")
    _FAMILIES[family.name] = family
    return family


def unregister(name: str) -> None:
    """Forget a family registered by :func:`register` (tests that add one take it away again)."""
    _FAMILIES.pop(name, None)


def names() -> Tuple[str, ...]:
    return tuple(_FAMILIES)


def get(name: str, where: str = "recipe", key: str = "model.family") -> Family:
    """The family called ``name``; an unknown name is a UserError naming the known ones."""
    if name not in _FAMILIES:
        raise UserError(f"unknown model family '{name}'.{did_you_mean(str(name), _FAMILIES)} "
                        f"Families: {', '.join(_FAMILIES)}.", where=where, key=key)
    return _FAMILIES[name]


def _preset_owner(preset: str):
    for family in _FAMILIES.values():
        if preset in family.presets:
            return family
    return None


def preset_family(preset: str, where: str = "recipe", key: str = "model.preset") -> Family:
    """The family owning ``preset``; an unknown preset is a UserError naming the known ones."""
    owner = _preset_owner(preset)
    if owner is None:
        raise UserError(f"unknown preset '{preset}'.{did_you_mean(str(preset), MODEL_PRESETS)} "
                        f"Presets: {', '.join(MODEL_PRESETS)}.", where=where, key=key)
    return owner


class _Presets(Mapping):
    """Every registered preset by name -> its ModelConfig fields (a live view of the registry)."""

    def __getitem__(self, preset: str) -> Dict[str, Any]:
        owner = _preset_owner(preset)
        if owner is None:
            raise KeyError(preset)
        return owner.preset_fields(preset)

    def __iter__(self) -> Iterator[str]:
        for family in list(_FAMILIES.values()):
            yield from family.presets

    def __len__(self) -> int:
        return sum(len(f.presets) for f in _FAMILIES.values())


#: preset name -> ModelConfig fields, over all registered families
MODEL_PRESETS: Mapping[str, Dict[str, Any]] = _Presets()


def model_fields(raw: Mapping[str, Any], where: str = "recipe") -> Dict[str, Any]:
    """A recipe's ``model`` section with ``preset`` / ``family`` expanded into ModelConfig fields.

    ``preset`` gives its family's defaults and its own values; ``family`` alone gives the
    family's defaults; neither gives the naohai family.  The section's other keys override
    them.  A ``family`` that contradicts the preset's is refused.
    """
    raw = dict(raw)
    preset = raw.pop("preset", None)
    if raw.get("family") is None:
        raw.pop("family", None)
    for key, value in (("preset", preset), ("family", raw.get("family"))):
        if value is not None and not isinstance(value, str):   # a list or mapping was a TypeError (unhashable)
            raise UserError(f"must be a {key} name, got {value!r}", where=where, key=f"model.{key}",
                            rule=f"model.{key} is a string")
    if preset is not None:
        family = preset_family(preset, where)
        if raw.get("family") is not None and raw["family"] != family.name:
            raise UserError(f"preset '{preset}' is of family '{family.name}', not '{raw['family']}'",
                            where=where, key="model.family", rule="model.family == the preset's family")
        base = family.preset_fields(preset)
    else:
        base = get(raw.get("family") or "naohai", where).fields()
    base.update(raw)
    return base


from naohai.model.families import (bloom as _bloom, falcon as _falcon, glm as _glm, gpt2 as _gpt2,  # noqa: E402
                                   gpt_neox as _gpt_neox, llama as _llama, mistral as _mistral,
                                   naohai as _naohai, olmo as _olmo, pangu as _pangu, pengcheng as _pengcheng,
                                   qwen2 as _qwen2)

for _module in (_pangu, _pengcheng, _naohai, _llama, _qwen2, _mistral, _olmo, _glm, _falcon, _gpt_neox, _bloom,
                _gpt2):
    register(_module.FAMILY)
