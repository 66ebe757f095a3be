"""Adapters without their base: where the base weights are, and how the two are put back together.

A fine-tuning run (a recipe with ``finetune``, :mod:`naohai.model.lora`) checkpoints only what it
trains: the adapters, their Adam moments and the step state -- a few hundred kilobytes for the
tiny model instead of its 13 MB.  Its manifest records the base under :data:`BASE_KEY`::

    finetune_base: {path: <the weights train.init_from resolved to, absolute> | null,
                    seed: <train.seed: the base when there was no init_from>,
                    fingerprint: <see below>, describe: <one line for messages>}

The *fingerprint* names the base's content cheaply: for a naohai checkpoint the SHA-256 of its
files' recorded hashes (checked when the checkpoint is verified), for an imported model folder the
SHA-256 of ``model.ckpt``, for a base drawn from the seed ``seed:<n>``.  Resuming the run, reading
it (generate, eval, score, export) or merging it loads the base from ``path`` and refuses a base
whose fingerprint differs (exit 2: the adapters were trained on other weights).

An *adapter folder* (``naohai ckpt import --from peft``) is the same thing outside a run:
``adapter.ckpt`` (the factors under naohai's names), ``recipe.yaml`` (the base's recipe with the
``finetune`` section of the adapter) and ``adapter.json`` (the base record above and where the
adapter came from).  :mod:`naohai.checkpoint.weights` reads both kinds as the merged model.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
from typing import Any, Dict, Mapping, Optional

import numpy as np

from naohai.checkpoint.files import sha256_file, write_json
from naohai.errors import UserError

BASE_KEY = "finetune_base"
ADAPTER_WEIGHTS = "adapter.ckpt"
ADAPTER_INFO = "adapter.json"
RECIPE = "recipe.yaml"


def fingerprint_of(found) -> str:
    """The content fingerprint of ``found`` (a :class:`naohai.checkpoint.weights.Weights`)."""
    if found.fingerprint:
        return found.fingerprint
    h = hashlib.sha256()
    tensors = found.tensors()
    for name in sorted(tensors):                   # one tensor read at a time from a lazy source
        h.update(name.encode("utf-8"))
        h.update(np.ascontiguousarray(tensors[name], np.float32).tobytes())
    return h.hexdigest()


def checkpoint_fingerprint(manifest: Dict[str, Any]) -> str:
    """A checkpoint's fingerprint: the SHA-256 of its files' names and recorded SHA-256s."""
    files = manifest.get("files") or {}
    text = json.dumps(sorted((name, entry.get("sha256")) for name, entry in files.items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def file_fingerprint(path: str) -> str:
    return sha256_file(path)


def base_record(found, seed: int) -> Dict[str, Any]:
    """The :data:`BASE_KEY` record of a base: ``found`` (weights) or None (the model drawn from ``seed``)."""
    if found is None:
        return {"path": None, "seed": int(seed), "fingerprint": f"seed:{int(seed)}",
                "describe": f"the model drawn from train.seed {int(seed)}"}
    return {"path": os.path.abspath(found.path), "seed": int(seed), "fingerprint": fingerprint_of(found),
            "describe": found.describe()}


def seed_tensors(recipe, seed: int) -> Dict[str, np.ndarray]:
    """The model's initial weights drawn from ``seed`` (the base of a run without ``train.init_from``)."""
    from naohai.model.transformer import NaohaiLM
    model = NaohaiLM(recipe.model, seed=seed)
    return {p.name: p.asnumpy().astype(np.float32) for p in model.get_parameters()}


def merged(base: Mapping[str, Any], adapters: Dict[str, np.ndarray], recipe, where: str) -> Mapping[str, np.ndarray]:
    """``base`` with ``adapters`` folded in by the recipe's ``finetune`` (LoRA: rank, alpha); the tensors of
    the other methods (:mod:`naohai.model.finetune`) cannot be folded and come beside the base's
    (:func:`naohai.checkpoint.weights.load_model` builds the model with the method).  Each tensor is made when
    asked, from a base that may itself be read when asked: the whole base is never held."""
    from naohai.model.lora import LoraMerged
    ft = recipe.finetune
    if ft.method != "lora":
        clash = sorted(n for n in adapters if n in base)
        if clash:
            raise UserError(f"base mismatch: the adapter's {clash[0]} is a base tensor", where=where, key="finetune")
        return collections.ChainMap({k: np.asarray(v, np.float32) for k, v in adapters.items()}, base)
    try:
        return LoraMerged(base, adapters, int(ft.rank), float(ft.alpha))
    except ValueError as exc:
        raise UserError(f"base mismatch: {exc}", where=where, key="finetune") from None


# --------------------------------------------------------------------------- adapter folders
def is_adapter_dir(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, name)) for name in (ADAPTER_WEIGHTS, ADAPTER_INFO, RECIPE))


def write_adapter_dir(out: str, recipe, adapters: Dict[str, np.ndarray], base: Dict[str, Any],
                      origin: Dict[str, Any]) -> str:
    """An adapter folder ``out`` (a new path): the factors, the recipe (with ``finetune``), the base record."""
    import yaml
    from naohai.convert.files import write_ckpt
    from naohai.runfiles import temp_dir_beside

    if os.path.lexists(out):
        raise UserError("already exists; choose a new folder (nothing is overwritten)", where=out, key="--out")
    work = temp_dir_beside(out)
    try:
        write_ckpt({k: np.asarray(v, np.float32) for k, v in adapters.items()}, os.path.join(work, ADAPTER_WEIGHTS))
        with open(os.path.join(work, RECIPE), "w", encoding="utf-8") as fh:
            yaml.safe_dump(recipe.to_dict(), fh, sort_keys=False)
        write_json(os.path.join(work, ADAPTER_INFO), {BASE_KEY: base, "origin": origin})
        os.rename(work, out)
    except BaseException:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
        raise
    return out


def read_adapter_dir(path: str):
    """(recipe, adapters, base record, adapter.json) of an adapter folder."""
    from naohai.config import read_yaml, recipe_from_dict
    from naohai.convert.files import read_reference
    where = os.path.join(path, RECIPE)
    recipe = recipe_from_dict(read_yaml(where, "recipe"), where=where).validate()
    if recipe.finetune is None:
        raise UserError("has no finetune section: not the recipe of an adapter folder", where=where, key="finetune")
    info_path = os.path.join(path, ADAPTER_INFO)
    try:
        with open(info_path, encoding="utf-8") as fh:
            info = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot be read ({exc})", where=info_path) from None
    if not isinstance(info, dict) or not isinstance(info.get(BASE_KEY), dict):
        raise UserError(f"has no '{BASE_KEY}' record: not an adapter folder's", where=info_path, key=BASE_KEY)
    return recipe, read_reference(os.path.join(path, ADAPTER_WEIGHTS)), info[BASE_KEY], info


def plain_recipe(recipe, tokenizer: Optional[str] = None):
    """``recipe`` without its ``finetune`` section (a merged model is a plain one)."""
    from naohai.config import recipe_from_dict
    raw = recipe.to_dict()
    raw.pop("finetune", None)
    if tokenizer:
        raw.setdefault("data", {})["tokenizer"] = tokenizer
    return recipe_from_dict(raw, where=recipe.source or "recipe")
