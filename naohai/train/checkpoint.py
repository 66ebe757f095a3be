"""Checkpoints with exact resume.

A checkpoint is a folder ``<output_dir>/checkpoints/step_<N>/`` holding
``model.ckpt`` (weights and optimizer state as MindSpore saves them) and
``state.json`` (step, data position, loss scale, RNG seeds, recipe).  It is
written under a temporary name and renamed when complete, so a crash never
leaves a half checkpoint that resume would pick; older ones beyond
``keep_checkpoints`` are removed only after the new one is in place.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Dict, List, Optional, Sequence

import mindspore as ms

from naohai.errors import UserError

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def list_checkpoints(output_dir: str) -> List[str]:
    root = checkpoint_root(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, "state.json")):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [path for _, path in sorted(found)]


def latest_checkpoint(output_dir: str) -> Optional[str]:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def _state_params(params: Sequence[ms.Parameter]) -> List[Dict[str, Any]]:
    return [{"name": p.name, "data": p} for p in params]


def save_checkpoint(output_dir: str, step: int, params: Sequence[ms.Parameter], state: Dict[str, Any],
                    keep: int = 3) -> str:
    root = checkpoint_root(output_dir)
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step_{step:08d}")
    tmp = final + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    ms.save_checkpoint(_state_params(params), os.path.join(tmp, "model.ckpt"))
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as fh:
        json.dump(state, fh, indent=1, sort_keys=True)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(tmp, final)
    if keep > 0:
        for old in list_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: str) -> Dict[str, Any]:
    state_file = os.path.join(path, "state.json")
    try:
        with open(state_file, "r", encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read checkpoint state: {exc}", where=state_file) from None


def resolve_checkpoint(path: str) -> str:
    """Accept a checkpoint folder, a run's output folder, or a model.ckpt file."""
    if os.path.isfile(path) and path.endswith(".ckpt"):
        path = os.path.dirname(path)
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "state.json")):
        return path
    if os.path.isdir(path):
        latest = latest_checkpoint(path)
        if latest:
            return latest
    raise UserError("is not a checkpoint folder, a model.ckpt, or a run folder with checkpoints/", where=path)


def load_params(path: str, targets: Sequence[ms.Parameter], strict: bool = True) -> None:
    """Copy saved values into ``targets`` (matched by name)."""
    ckpt_file = os.path.join(path, "model.ckpt")
    try:
        saved = ms.load_checkpoint(ckpt_file)
    except (RuntimeError, ValueError, OSError) as exc:
        raise UserError(f"cannot load checkpoint: {str(exc).splitlines()[0]}", where=ckpt_file) from None
    missing = []
    for p in targets:
        value = saved.get(p.name)
        if value is None:
            missing.append(p.name)
            continue
        if tuple(value.shape) != tuple(p.shape):
            raise UserError(f"parameter '{p.name}' has shape {tuple(value.shape)} in the checkpoint but "
                            f"{tuple(p.shape)} in the model (a different recipe?)", where=ckpt_file)
        p.set_data(value.astype(p.dtype) if value.dtype != p.dtype else value)
    if strict and missing:
        raise UserError(f"checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]} (a different recipe?)",
                        where=ckpt_file)
