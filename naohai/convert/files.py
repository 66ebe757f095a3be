"""Reading and writing reference checkpoint files (MindSpore ``.ckpt`` and ``.npy`` tables).

A source is one of:

* a ``.ckpt`` file holding the whole model;
* a folder with one ``.ckpt`` file and, optionally, the embedding tables the
  PanGu-alpha release ships beside it (``word_embedding.npy``,
  ``position_embedding.npy``, ``top_query_embedding.npy``);
* a folder of per-rank slices (``rank_<n>/*.ckpt``) together with the strategy
  file the training run wrote: MindSpore's ``transform_checkpoints`` merges the
  slices into one whole checkpoint first.
"""
from __future__ import annotations

import glob
import os
import stat
import tempfile
from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

import numpy as np

from naohai.errors import UserError

NPY_TABLES = ("word_embedding.npy", "position_embedding.npy", "top_query_embedding.npy")


def _load_ckpt(path: str) -> Dict[str, np.ndarray]:
    import mindspore as ms
    try:
        params = ms.load_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - MindSpore raises ValueError/RuntimeError for bad files
        raise UserError(f"is not a readable MindSpore checkpoint ({str(exc).splitlines()[0][:200]})",
                        where=path) from None
    return {name: p.asnumpy() for name, p in params.items()}


def _merge_slices(folder: str, strategy: str) -> Dict[str, np.ndarray]:
    """Merge rank_<n>/*.ckpt slices into whole tensors with MindSpore's ``transform_checkpoints``."""
    import mindspore as ms
    if not os.path.isfile(strategy):
        raise UserError("strategy file not found", where=strategy)
    ranks = sorted(glob.glob(os.path.join(folder, "rank_*")))
    if not ranks:
        raise UserError("has no rank_<n> folders of checkpoint slices", where=folder,
                        rule="sharded sources are <folder>/rank_<n>/<name>.ckpt plus --strategy FILE")
    names = {os.path.basename(p) for r in ranks for p in glob.glob(os.path.join(r, "*.ckpt"))}
    if len(names) != 1:
        raise UserError(f"rank folders must hold one checkpoint name each, found {sorted(names)[:4]}", where=folder)
    prefix = os.path.splitext(names.pop())[0]
    with tempfile.TemporaryDirectory(prefix="naohai-merge-") as out:
        try:
            ms.transform_checkpoints(folder, out, prefix, strategy, None)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise UserError(f"MindSpore could not merge these slices with strategy file {strategy} "
                            f"({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__})",
                            where=folder) from None
        merged = glob.glob(os.path.join(out, "rank_0", "*.ckpt"))
        if not merged:
            raise UserError("MindSpore produced no merged checkpoint from these slices", where=folder)
        return _load_ckpt(merged[0])


def read_reference(src: str, strategy: Optional[str] = None) -> Dict[str, np.ndarray]:
    """All tensors of a reference checkpoint source, by name (``.npy`` tables by file name)."""
    if not os.path.exists(src):
        raise UserError("checkpoint source not found", where=src)
    if strategy is not None:
        return _merge_slices(src, strategy)
    if os.path.isfile(src):
        return _load_ckpt(src)
    ckpts = sorted(glob.glob(os.path.join(src, "*.ckpt")))
    if len(ckpts) > 1:
        raise UserError(f"holds {len(ckpts)} .ckpt files; name the one to import", where=src)
    if not ckpts and glob.glob(os.path.join(src, "rank_*")):
        raise UserError("holds per-rank slices; pass the strategy file of the run with --strategy", where=src)
    tensors: Dict[str, np.ndarray] = _load_ckpt(ckpts[0]) if ckpts else {}
    for table in NPY_TABLES:
        path = os.path.join(src, table)
        if os.path.exists(path):
            try:
                tensors[table] = np.load(path)
            except (ValueError, OSError) as exc:
                raise UserError(f"is not a readable .npy array ({exc})", where=path) from None
    if not tensors:
        raise UserError("holds no .ckpt file or embedding .npy table", where=src)
    return tensors


def write_ckpt(tensors: Union[Mapping[str, np.ndarray], Iterable[Tuple[str, np.ndarray]]], path: str) -> str:
    """Write tensors as one MindSpore checkpoint, float32, in the order given (parent folders created).
    ``tensors`` is a mapping or (name, array) pairs, e.g. a generator that reads each when its turn comes:
    one tensor is held at a time (:func:`naohai.ckpt_format.write`).  The file appears whole or not at all
    (written beside it, then renamed) and read-only, as ``mindspore.save_checkpoint`` leaves it."""
    from naohai import ckpt_format

    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    part = f"{path}.partial"
    try:
        ckpt_format.write(part, ((name, np.ascontiguousarray(value, np.float32)) for name, value in pairs))
        os.chmod(part, stat.S_IRUSR)
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)
    return path
