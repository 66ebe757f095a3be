"""Hugging Face folder <-> naohai model: the recipe from ``config.json``, the weights by name and shape.

:func:`stream_hf` is what ``naohai ckpt import --from hf`` reads, :class:`HFTensors` what a folder given
directly to ``generate``, ``eval`` or ``train.init_from=HF_DIR`` is read through (a tensor at a time);
:func:`write_hf` what ``naohai ckpt export --to hf`` writes.  Every stored tensor must be one the
architecture names for this config (or a known non-weight buffer), every expected one must be there,
and every shape must be the one ``config.json`` implies: anything else is a UserError naming the
file and the tensor or key, never a silent mismatch.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from naohai.ckpt_format import LazyTensors
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
            ) -> Tuple[Recipe, Callable[[], Mapping[str, np.ndarray]]]:
    """(recipe, reader) of a Hugging Face folder: the recipe's model from ``config.json`` (``overrides``:
    extra model fields, e.g. ``seq_length``), its ``data.tokenizer`` the folder's ``tokenizer.json`` if
    any; ``reader()`` checks the weights' names and gives them as an :class:`HFTensors` (naohai names, float32,
    each read and checked when asked)."""
    recipe, arch = _recipe_of(src, overrides)
    return recipe, lambda: HFTensors(src, recipe.model, arch)


def _recipe_of(src: str, overrides: Optional[Dict[str, Any]]) -> Tuple[Recipe, Architecture]:
    arch, fields = model_fields(src)
    fields.update(overrides or {})
    where = os.path.join(src, folder.CONFIG)
    name = os.path.basename(os.path.abspath(src))
    cfg = recipe_from_dict({"name": name, "model": fields}, where=where).model
    tokenizer = os.path.join(os.path.abspath(src), "tokenizer.json")
    return import_recipe(cfg, name, tokenizer if os.path.isfile(tokenizer) else None), arch


def stream_hf(src: str, overrides: Optional[Dict[str, Any]] = None
              ) -> Tuple[ModelConfig, Iterator[Tuple[str, np.ndarray]]]:
    """The ModelConfig of a Hugging Face folder and its weights one parameter at a time (naohai names,
    float32), for an import that holds one tensor at a time rather than the model; the tensors' names
    are checked here, before the first one is read (see :class:`HFTensors`)."""
    recipe, arch = _recipe_of(src, overrides)
    return recipe.model, iter(HFTensors(src, recipe.model, arch).items())


def read_hf(src: str, overrides: Optional[Dict[str, Any]] = None) -> Tuple[ModelConfig, Dict[str, np.ndarray]]:
    """The ModelConfig and naohai-named float32 weights of a Hugging Face folder (see :func:`open_hf`)."""
    cfg, tensors = stream_hf(src, overrides)
    return cfg, dict(tensors)


def _stored_name(tensors: Dict[str, Any], name: str, arch: Architecture) -> Optional[str]:
    """The name under which ``name`` is stored: as is, or without the base model's prefix."""
    if name in tensors:
        return name
    if arch.prefix and name.startswith(arch.prefix) and name[len(arch.prefix):] in tensors:
        return name[len(arch.prefix):]
    return None


class HFTensors(LazyTensors):
    """A Hugging Face folder's weights by naohai parameter name, each read (float32) when asked.

    Checked when made, before anything is read: every tensor the architecture names for this config is stored
    and nothing else is (a missing or extra tensor exits 2 naming the weights file).  Checked as each stored
    tensor is read: that its values are finite floats and its shape (and a stored tied head: equal to the
    embedding).  A stored tensor that holds several parameters (a fused query/key/value) is read once for
    them and kept until a parameter of another is asked for, so a reader that takes the parameters in order
    (the model's, or this mapping's) reads each stored tensor once and holds one at a time."""

    def __init__(self, src: str, cfg: ModelConfig, arch: Architecture):
        self._stored = folder.stored_weights(src)
        self._where = _weights_file(src)
        links = arch.links(cfg)
        names = []
        for link in links:
            name = _stored_name(self._stored, link.ref, arch)
            if name is None:
                raise UserError(f"has no tensor '{link.ref}', which a {arch.model_type} model of this config.json "
                                f"({cfg.num_layers} layers) needs", where=self._where)
            names.append(name)
        self._heads = [h for h in ("lm_head.weight", "embed_out.weight")       # older save_pretrained kept a tied head
                       if cfg.tie_embeddings and h in self._stored and h not in names]
        extra = sorted(k for k in self._stored
                       if k not in names and k not in self._heads and not k.endswith(arch.ignored))
        if extra:
            raise UserError(f"holds {len(extra)} tensor(s) a {arch.model_type} model of this config.json does not "
                            f"have, e.g. {extra[:3]} (a config.json that does not describe these weights?)",
                            where=self._where)
        self._expected = {p.name: p.shape for p in param_shapes(cfg)}
        missing = sorted(set(self._expected) - {n for link in links for n in link.ours})
        if missing:
            raise ValueError(f"the {arch.model_type} links leave naohai parameters unset: {missing[:4]}")
        self._links = list(zip(links, names))
        self._of = {ours: i for i, (link, _) in enumerate(self._links) for ours in link.ours}
        self._keys = self._of
        self._held: Tuple[int, Dict[str, np.ndarray]] = (-1, {})

    def __getitem__(self, ours: str) -> np.ndarray:
        i = self._of[ours]                      # KeyError for a name that is not a parameter
        if self._held[0] != i:
            self._held = (-1, {})               # let the last link's parts go before reading the next
            self._held = (i, self._read(*self._links[i]))
        return self._held[1][ours]

    def shape(self, ours: str) -> Tuple[int, ...]:
        """A parameter's shape as ``config.json`` gives it (a stored tensor of another shape is refused when read)."""
        self._of[ours]                          # KeyError for a name that is not a parameter
        return tuple(self._expected[ours])

    def _read(self, link, name: str) -> Dict[str, np.ndarray]:
        where, expected = self._where, self._expected
        value = self._stored[name].read()
        bad = value.size - int(np.count_nonzero(np.isfinite(value))) if value.dtype.kind == "f" else -1
        if bad:
            raise UserError(f"holds '{name}' " + (f"as {value.dtype}; a weight is floating point" if bad < 0 else
                            f"with {bad} of its {value.size} values NaN or infinite (in float32, naohai's type); "
                            f"the model's outputs would be NaN"), where=where, rule="finite floating-point weights")
        try:
            parts = link.from_ref(value)
        except ValueError:
            parts = None
        if parts is not None and any(tuple(part.shape) != tuple(expected[n]) for n, part in zip(link.ours, parts)):
            parts = None
        if parts is None:
            shapes = ", ".join(str(tuple(expected[n])) for n in link.ours)
            raise UserError(f"tensor '{name}' has shape {tuple(value.shape)}, which does not match config.json "
                            f"(hidden_size, heads, kv heads, intermediate / vocab sizes give {shapes} for "
                            f"{', '.join(link.ours)})", where=where)
        del value
        out = {ours: np.asarray(part, np.float32) for ours, part in zip(link.ours, parts)}
        embedding = out.get("embedding.word_embedding")
        for head in self._heads if embedding is not None else ():
            if not np.array_equal(self._stored[head].read(), embedding):
                raise UserError(f"holds '{head}' different from the word embedding, but config.json says "
                                f"tie_word_embeddings is true", where=where)
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


def from_naohai(weights: Mapping[str, np.ndarray], cfg: ModelConfig, arch: Architecture, where: str
                ) -> List[folder.Planned]:
    """The architecture's tensors of naohai ``weights``, planned to be made one at a time: (name, float32 bytes,
    maker).  ``weights`` may be a mapping that reads each parameter when asked (an imported folder's
    ``model.ckpt``), so an export holds the tensors of one link at a time; a parameter whose shape is not the
    one ``cfg`` gives exits 2 naming ``where``."""
    shapes = {p.name: tuple(p.shape) for p in param_shapes(cfg)}

    def param(name):
        value = np.asarray(weights[name], np.float32)
        if tuple(value.shape) != shapes[name]:
            raise UserError(f"holds '{name}' of shape {tuple(value.shape)}, where its recipe's model gives "
                            f"{shapes[name]}", where=where)
        return value

    def maker(link):
        return lambda: link.to_ref(*[param(n) for n in link.ours])
    return [(link.ref, sum(int(np.prod(shapes[n], dtype=np.int64)) * 4 for n in link.ours), maker(link))
            for link in arch.links(cfg)]


def write_hf(out: str, cfg: ModelConfig, weights: Mapping[str, np.ndarray], *, where: str,
             tokenizer_dir: Optional[str] = None, base_config: Optional[Dict[str, Any]] = None,
             shard_bytes: int = folder.DEFAULT_SHARD_BYTES) -> List[str]:
    """Write a Hugging Face folder (new, never over an existing path); returns the files written.  The weights
    are converted and written one link at a time; if anything fails on the way, ``out`` is removed again."""
    arch = for_family(cfg, where)
    if os.path.exists(out):
        raise UserError("already exists; exporting never overwrites (choose a new folder)", where=out, key="--out")
    tensors = from_naohai(weights, cfg, arch, where)
    os.makedirs(out)
    try:
        files = folder.write_weights(out, tensors, shard_bytes)
        folder.write_config(out, hf_config(cfg, arch, base_config))
        files.append(folder.CONFIG)
        files += folder.copy_tokenizer_files(tokenizer_dir, out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
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
