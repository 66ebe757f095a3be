"""Which architecture reads or writes a model: the registry of the family modules of this package.

:mod:`.arch` defines :class:`~.arch.Architecture` and ``register``; each family module
(``bloom.py``, ``falcon.py``, ...) registers its architecture when imported.  This module imports
them all, so asking it (:func:`for_model_type` on import, :func:`for_family` on export) sees every
architecture, while the family modules depend on :mod:`.arch` only (no import circle).
"""
from __future__ import annotations

from typing import Dict

from naohai.convert.hf import (bloom, falcon, glm, gpt2, gpt_neox, llama, mistral, olmo,  # noqa: F401
                              qwen2)  # (they register)
from naohai.convert.hf.arch import Architecture, HFConfig, registered
from naohai.errors import UserError, did_you_mean
from naohai.model.config import ModelConfig


def architectures() -> Dict[str, Architecture]:
    """model_type -> architecture, for every family module of this package."""
    return registered()


def for_model_type(config: HFConfig) -> Architecture:
    archs = architectures()
    kind = config.data.get("model_type")
    if kind not in archs:
        raise config.bad("model_type", f"'{kind}' is not an architecture naohai reads.{did_you_mean(str(kind), archs)} "
                                       f"Known: {', '.join(sorted(archs))}.")
    return archs[kind]


def for_family(cfg: ModelConfig, where: str) -> Architecture:
    archs = [a for a in architectures().values() if a.family == cfg.family]
    if not archs:
        known = sorted({a.family for a in architectures().values()})
        raise UserError(f"model family '{cfg.family}' has no Hugging Face architecture here (families that export: "
                        f"{', '.join(known)}; see the README's Hugging Face section for PanGu-alpha and "
                        f"PengCheng-Mind)", where=where, key="model.family")
    arch = archs[0]
    for key, ok, why in arch.fits(cfg):
        if not ok:
            raise UserError(f"this model cannot be written as a Hugging Face '{arch.model_type}' model: {why}",
                            where=where, key=f"model.{key}")
    return arch
