"""An imported model folder: ``model.ckpt`` (naohai parameter names) and ``recipe.yaml``.

``naohai ckpt import`` writes one; ``naohai eval``, ``naohai generate`` and
``naohai ckpt export`` read one.  Reading is behind :func:`load_model_dir` so
it can sit beside the trainer's own checkpoint store.
"""
from __future__ import annotations

import os
import shutil
from typing import Iterable, Mapping, Tuple, Union

import numpy as np
import yaml

from naohai import ckpt_format
from naohai.config import Recipe, recipe_from_dict, read_yaml
from naohai.errors import UserError
from naohai.validate import read_json_object

WEIGHTS = "model.ckpt"
RECIPE = "recipe.yaml"


def is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, WEIGHTS)) and os.path.isfile(os.path.join(path, RECIPE))


def write_model_dir(out: str, recipe: Recipe,
                    weights: Union[Mapping[str, np.ndarray], Iterable[Tuple[str, np.ndarray]]]) -> str:
    """Write ``model.ckpt`` (``weights``: a mapping or (name, array) pairs, written one at a time) and then
    ``recipe.yaml`` into ``out``, which must not hold an imported model yet."""
    from naohai.convert.files import write_ckpt

    if os.path.exists(os.path.join(out, WEIGHTS)):
        raise UserError("already holds an imported model; choose another --out", where=out)
    os.makedirs(out, exist_ok=True)
    write_ckpt(weights, os.path.join(out, WEIGHTS))
    with open(os.path.join(out, RECIPE), "w", encoding="utf-8") as fh:
        yaml.safe_dump(recipe.to_dict(), fh, sort_keys=False)
    return out


def write_hf_model_dir(out: str, cfg, weights: Union[Mapping[str, np.ndarray], Iterable[Tuple[str, np.ndarray]]],
                       src: str) -> str:
    """An imported model folder from a Hugging Face folder ``src``: the weights (a mapping, or pairs read one
    at a time, e.g. :func:`naohai.convert.hf.convert.stream_hf`'s), a recipe that fine-tunes them (its model;
    the tokenizer copied beside it and named by ``data.tokenizer``; ``train.init_from`` this folder at a
    fine-tuning rate), the tokenizer files and the original ``config.json`` (as ``hf_config.json``, which an
    export starts from).  ``out`` must be new or empty; when anything fails on the way (a tensor of the wrong
    shape found while streaming, a full disk) what was written there is removed again."""
    from naohai.convert.hf import folder
    from naohai.convert.hf.convert import SOURCE_CONFIG, import_recipe

    if os.path.exists(out) and os.listdir(out):
        raise UserError("already exists and is not empty; choose a new --out (nothing is overwritten)", where=out,
                        key="--out")
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        copied = folder.copy_tokenizer_files(src, out)
        tokenizer = os.path.abspath(os.path.join(out, "tokenizer.json")) if "tokenizer.json" in copied else None
        recipe = import_recipe(cfg, os.path.basename(os.path.abspath(src)), tokenizer,
                               fine_tune_from=os.path.abspath(out))
        folder.write_config_as(out, SOURCE_CONFIG, folder.read_config(src))
        return write_model_dir(out, recipe, weights)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        else:                       # it was empty: take out what this import put there
            for name in os.listdir(out):
                path = os.path.join(out, name)
                if os.path.isdir(path):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    os.remove(path)
        raise


def hf_export_sources(model_dir: str):
    """(recipe, weights, tokenizer folder, original config.json or None) of an imported model folder, for
    ``naohai ckpt export --to hf`` (a trained checkpoint comes through :mod:`naohai.checkpoint.weights`);
    the weights are :func:`load_model_dir`'s, read one at a time as the export asks."""
    from naohai.convert.hf.convert import SOURCE_CONFIG

    recipe, weights = load_model_dir(model_dir)
    src = os.path.join(model_dir, SOURCE_CONFIG)
    base = read_json_object(src) if os.path.isfile(src) else None
    return recipe, weights, model_dir, base


def load_model_dir(path: str) -> Tuple[Recipe, Mapping[str, np.ndarray]]:
    """(recipe, weights) of an imported model folder; the weights a mapping that reads each tensor of
    ``model.ckpt`` when asked (:class:`naohai.ckpt_format.Tensors`): opening reads the recipe and the
    file's table of contents only."""
    if not is_model_dir(path):
        raise UserError(f"is not an imported model folder (needs {WEIGHTS} and {RECIPE})", where=path)
    where = os.path.join(path, RECIPE)
    recipe = recipe_from_dict(read_yaml(where, "recipe"), where=where).validate()
    return recipe, ckpt_format.Tensors(os.path.join(path, WEIGHTS))
