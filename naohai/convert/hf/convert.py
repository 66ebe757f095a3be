"""Hugging Face folder <-> naohai model: the recipe from ``config.json``, the weights by name and shape.

:func:`read_hf` is what ``naohai ckpt import --from hf`` and ``train.init_from=HF_DIR`` read;
:func:`write_hf` what ``naohai ckpt export --to hf`` writes.  Every stored tensor must be one the
architecture names for this config (or a known non-weight buffer), every expected one must be there,
and every shape must be the one ``config.json`` implies: anything else is a UserError naming the
file and the tensor or key, never a silent mismatch.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from naohai.config import Recipe, recipe_from_dict
from naohai.data.hf_tokenizer import HFTokenizer
from naohai.model.config import ModelConfig
from naohai.convert.hf import folder
from naohai.convert.hf.arch import Architecture, HFConfig
from naohai.convert.hf.registry import for_family, for_model_type
from naohai.errors import UserError
from naohai.model.spec import param_shapes

#: the original config.json an imported model folder keeps, so that an export writes back the keys
#: naohai has no field for (token ids, generation defaults, max positions)
SOURCE_CONFIG = "hf_config.json"


def model_fields(src: str) -> Tuple[Architecture, Dict[str, Any]]:
    """(architecture, ModelConfig fields) of the folder's ``config.json``."""
    config = HFConfig(folder.read_config(src), os.path.join(src, folder.CONFIG))
    arch = for_model_type(config)
    return arch, dict(arch.read(config), family=arch.family)


def open_hf(src: str, overrides: Optional[Dict[str, Any]] = None
            ) -> Tuple[Recipe, Callable[[], Dict[str, np.ndarray]]]:
    """(recipe, reader) of a Hugging Face folder: the recipe's model from ``config.json`` (``overrides``:
    extra model fields, e.g. ``seq_length``), its ``data.tokenizer`` the folder's ``tokenizer.json`` if
    any; ``reader()`` reads and checks the weights (naohai names, float32)."""
    arch, fields = model_fields(src)
    fields.update(overrides or {})
    where = os.path.join(src, folder.CONFIG)
    cfg = recipe_from_dict({"name": os.path.basename(os.path.abspath(src)), "model": fields}, where=where).model
    tokenizer = os.path.join(os.path.abspath(src), "tokenizer.json")
    recipe = import_recipe(cfg, os.path.basename(os.path.abspath(src)),
                           tokenizer if os.path.isfile(tokenizer) else None)
    return recipe, lambda: to_naohai(folder.read_weights(src), cfg, arch, src)


def read_hf(src: str, overrides: Optional[Dict[str, Any]] = None) -> Tuple[ModelConfig, Dict[str, np.ndarray]]:
    """The ModelConfig and naohai-named float32 weights of a Hugging Face folder (see :func:`open_hf`)."""
    recipe, read = open_hf(src, overrides)
    return recipe.model, read()


def _stored_name(tensors: Dict[str, np.ndarray], name: str, arch: Architecture) -> Optional[str]:
    """The name under which ``name`` is stored: as is, or without the base model's prefix."""
    if name in tensors:
        return name
    if arch.prefix and name.startswith(arch.prefix) and name[len(arch.prefix):] in tensors:
        return name[len(arch.prefix):]
    return None


def to_naohai(tensors: Dict[str, np.ndarray], cfg: ModelConfig, arch: Architecture, src: str) -> Dict[str, np.ndarray]:
    expected = {p.name: p.shape for p in param_shapes(cfg)}
    out: Dict[str, np.ndarray] = {}
    used = set()
    where = _weights_file(src)
    for link in arch.links(cfg):
        stored = _stored_name(tensors, link.ref, arch)
        if stored is None:
            raise UserError(f"has no tensor '{link.ref}', which a {arch.model_type} model of this config.json "
                            f"({cfg.num_layers} layers) needs", where=where)
        used.add(stored)
        value = tensors[stored]
        try:
            parts = link.from_ref(value)
        except ValueError:
            parts = None
        if parts is not None:
            for name, part in zip(link.ours, parts):
                if tuple(part.shape) != tuple(expected[name]):
                    parts = None
                    break
        if parts is None:
            shapes = ", ".join(str(tuple(expected[n])) for n in link.ours)
            raise UserError(f"tensor '{stored}' has shape {tuple(value.shape)}, which does not match config.json "
                            f"(hidden_size, heads, kv heads, intermediate / vocab sizes give {shapes} for "
                            f"{', '.join(link.ours)})", where=where)
        out.update({name: np.asarray(part, np.float32) for name, part in zip(link.ours, parts)})
    if cfg.tie_embeddings:   # a tied head may still be stored (older save_pretrained); it must be the embedding
        for head in ("lm_head.weight", "embed_out.weight"):
            if head in tensors and head not in used:
                used.add(head)
                if not np.array_equal(tensors[head], out["embedding.word_embedding"]):
                    raise UserError(f"holds '{head}' different from the word embedding, but config.json says "
                                    f"tie_word_embeddings is true", where=where)
    extra = sorted(k for k in tensors if k not in used and not k.endswith(arch.ignored))
    if extra:
        raise UserError(f"holds {len(extra)} tensor(s) a {arch.model_type} model of this config.json does not have, "
                        f"e.g. {extra[:3]} (a config.json that does not describe these weights?)", where=where)
    missing = sorted(set(expected) - set(out))
    if missing:
        raise ValueError(f"the {arch.model_type} links leave naohai parameters unset: {missing[:4]}")
    return out


def _weights_file(src: str) -> str:
    index = os.path.join(src, folder.INDEX)
    return index if os.path.isfile(index) else os.path.join(src, folder.SINGLE)


def hf_config(cfg: ModelConfig, arch: Architecture, base: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """``config.json`` of a model: ``base`` (the imported original, if any) with every key naohai
    knows set from ``cfg``."""
    out = dict(base or {})
    for stale in ("rope_scaling", "torch_dtype", "_name_or_path"):
        out.pop(stale, None)
    out.update(arch.write(cfg))
    out.update(model_type=arch.model_type, architectures=[arch.class_name], dtype="float32",
               use_cache=True)
    return out


def from_naohai(weights: Dict[str, np.ndarray], cfg: ModelConfig, arch: Architecture) -> Dict[str, np.ndarray]:
    return {link.ref: np.asarray(link.to_ref(*[np.asarray(weights[n], np.float32) for n in link.ours]), np.float32)
            for link in arch.links(cfg)}


def write_hf(out: str, cfg: ModelConfig, weights: Dict[str, np.ndarray], *, where: str,
             tokenizer_dir: Optional[str] = None, base_config: Optional[Dict[str, Any]] = None,
             shard_bytes: int = folder.DEFAULT_SHARD_BYTES) -> List[str]:
    """Write a Hugging Face folder (new, never over an existing path); returns the files written."""
    arch = for_family(cfg, where)
    if os.path.exists(out):
        raise UserError("already exists; exporting never overwrites (choose a new folder)", where=out, key="--out")
    tensors = from_naohai(weights, cfg, arch)
    os.makedirs(out)
    files = folder.write_weights(out, tensors, shard_bytes)
    folder.write_config(out, hf_config(cfg, arch, base_config))
    files.append(folder.CONFIG)
    files += folder.copy_tokenizer_files(tokenizer_dir, out)
    return files


#: what an imported model's recipe trains with: Llama 2's fine-tuning rate (cosine from 2e-5, weight decay 0.1;
#: Touvron et al. 2023, section 3.1), where naohai's from-scratch 3e-3 would wreck pretrained weights
FINE_TUNE_TRAIN = {"lr": 2.0e-5, "min_lr": 2.0e-6, "warmup_steps": 10, "weight_decay": 0.1}


def import_recipe(cfg: ModelConfig, name: str, tokenizer: Optional[str], fine_tune_from: Optional[str] = None
                  ) -> Recipe:
    """A recipe for an imported model: its model fields, the folder's tokenizer (``data.add_special_tokens``
    where its post-processor adds tokens to a text), naohai's train defaults; with ``fine_tune_from`` (the
    imported folder) a recipe that fine-tunes those weights: ``train.init_from`` that folder, the rates of
    :data:`FINE_TUNE_TRAIN` and ``train.output_dir`` ``runs/<name>-ft``."""
    model = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    data: Dict[str, Any] = {"tokenizer": tokenizer} if tokenizer else {}
    if tokenizer:       # documents encoded as the model's own tokenizer(text) encodes them (Llama's BOS)
        data["add_special_tokens"] = HFTokenizer.load(tokenizer).adds_special_tokens
    train: Dict[str, Any] = {}
    if fine_tune_from:
        train = dict(FINE_TUNE_TRAIN, init_from=fine_tune_from, output_dir=f"runs/{name}-ft")
    return recipe_from_dict({"name": name, "model": model, "data": data, "train": train},
                            where=f"import of {name}")
