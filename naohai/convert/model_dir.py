"""An imported model folder: ``model.ckpt`` (naohai parameter names) and ``recipe.yaml``.

``naohai ckpt import`` writes one; ``naohai eval``, ``naohai generate`` and
``naohai ckpt export`` read one.  Reading is behind :func:`load_model_dir` so
it can sit beside the trainer's own checkpoint store.
"""
from __future__ import annotations

import os
from typing import Dict, Tuple

import numpy as np
import yaml

from naohai.config import Recipe, recipe_from_dict, read_yaml
from naohai.errors import UserError

WEIGHTS = "model.ckpt"
RECIPE = "recipe.yaml"


def is_model_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, WEIGHTS)) and os.path.isfile(os.path.join(path, RECIPE))


def write_model_dir(out: str, recipe: Recipe, weights: Dict[str, np.ndarray]) -> str:
    from naohai.convert.files import write_ckpt

    if os.path.exists(os.path.join(out, WEIGHTS)):
        raise UserError("already holds an imported model; choose another --out", where=out)
    os.makedirs(out, exist_ok=True)
    write_ckpt(weights, os.path.join(out, WEIGHTS))
    with open(os.path.join(out, RECIPE), "w", encoding="utf-8") as fh:
        yaml.safe_dump(recipe.to_dict(), fh, sort_keys=False)
    return out


def load_model_dir(path: str) -> Tuple[Recipe, Dict[str, np.ndarray]]:
    from naohai.convert.files import read_reference

    if not is_model_dir(path):
        raise UserError(f"is not an imported model folder (needs {WEIGHTS} and {RECIPE})", where=path)
    where = os.path.join(path, RECIPE)
    recipe = recipe_from_dict(read_yaml(where, "recipe"), where=where).validate()
    return recipe, read_reference(os.path.join(path, WEIGHTS))
