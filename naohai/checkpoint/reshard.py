"""Moving checkpoints between layouts: merge to full tensors, split to a strategy, reshard.

A naohai checkpoint of a sharded run holds ``rank_<r>.ckpt`` (each rank's slices) and
``strategy/rank_<r>.ckpt`` (the parameter strategy file MindSpore wrote when that
rank's step was compiled).  This module:

* :func:`merged_strategy` turns a folder of per-rank strategy files into the one file
  MindSpore's transform needs: under pipeline parallelism one file per stage merged
  with ``mindspore.parallel.merge_pipeline_strategys`` (a rank's stage is
  ``rank // (world // stages)``; the ``current_stage`` field of 2.10's files is not
  reliable), otherwise rank 0's file;
* :func:`transform` runs ``mindspore.parallel.transform_checkpoints`` from one layout
  (a strategy file, or None for full tensors) to another, returning the per-rank files;
* :func:`reshard_checkpoint` writes a complete naohai checkpoint (manifest, SHA-256,
  strategy files) for the destination layout, so ``naohai train`` resumes from it and
  ``naohai generate`` reads a merged one like any other.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import weakref
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

import mindspore as ms
import numpy as np

from naohai import ckpt_format
from naohai.checkpoint import store
from naohai.checkpoint.files import sha256_file, write_json
from naohai.errors import UserError
from naohai.runfiles import check_writable, temp_dir_beside


def merged_strategy(strategy_dir: str, world: int, stages: int, out_file: str) -> str:
    """One strategy file for a layout from its per-rank files ``strategy_dir/rank_<r>.ckpt``."""
    per_stage = world // max(1, stages)
    firsts = [os.path.join(strategy_dir, store.rank_file(s * per_stage)) for s in range(max(1, stages))]
    missing = [f for f in firsts if not os.path.exists(f)]
    if missing:
        raise UserError(f"strategy files missing: {', '.join(os.path.basename(m) for m in missing)} (one per "
                        f"pipeline stage is needed to move this checkpoint to another layout)", where=strategy_dir)
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    if stages <= 1:
        shutil.copyfile(firsts[0], out_file)
        return out_file
    with tempfile.TemporaryDirectory(prefix="naohai-stages-") as tmp:
        for s, f in enumerate(firsts):
            shutil.copyfile(f, os.path.join(tmp, f"stage_{s}.ckpt"))
        ms.parallel.merge_pipeline_strategys(tmp, out_file)
    return out_file


def checkpoint_strategy(ckpt: str, out_file: str) -> Optional[str]:
    """The merged strategy file of a naohai checkpoint, or None for a full (unsharded) one."""
    man = store.read_manifest(ckpt)
    layout = man.get("layout") or {}
    if layout.get("signature", "full") == "full":
        return None
    return merged_strategy(os.path.join(ckpt, "strategy"), int(layout["world"]), int(layout.get("stages", 1)),
                           out_file)


def transform(src_files: Dict[int, str], src_strategy: Optional[str], dst_strategy: Optional[str],
              work: str) -> Dict[int, str]:
    """Per-rank files of the destination layout (rank 0 only when ``dst_strategy`` is None)."""
    src_dir, dst_dir = os.path.join(work, "src"), os.path.join(work, "dst")
    for rank, path in src_files.items():
        os.makedirs(os.path.join(src_dir, f"rank_{rank}"), exist_ok=True)
        os.symlink(os.path.abspath(path), os.path.join(src_dir, f"rank_{rank}", f"part{rank}.ckpt"))
    try:
        ms.parallel.transform_checkpoints(src_dir, dst_dir, "part", src_strategy, dst_strategy)
    except (ValueError, TypeError, RuntimeError, KeyError) as exc:
        raise UserError(f"MindSpore could not transform the checkpoint: {str(exc).splitlines()[0]}",
                        where=work) from None
    out = {}
    for folder in sorted(glob.glob(os.path.join(dst_dir, "rank_*"))):
        rank = int(os.path.basename(folder).split("_")[1])
        files = glob.glob(os.path.join(folder, "*.ckpt"))
        if files:
            out[rank] = files[0]
    return out


def _rank_files(ckpt: str) -> Dict[int, str]:
    man = store.read_manifest(ckpt)
    ranks = (man.get("layout") or {}).get("ranks_with_files") or [0]
    return {int(r): os.path.join(ckpt, store.rank_file(int(r))) for r in ranks}


def reshard_checkpoint(src: str, out: str, dst_strategy_dir: Optional[str] = None,
                       dst_layout: Optional[Dict[str, Any]] = None, hash_files: bool = True) -> str:
    """Write checkpoint ``src`` for another layout as a new naohai checkpoint folder ``out``.

    ``dst_strategy_dir`` holds the destination's per-rank strategy files (from its own
    compile, e.g. ``naohai check --compile``'s ``rank_<r>/strategy.ckpt`` gathered as
    ``rank_<r>.ckpt``) and ``dst_layout`` its manifest layout record; both None = merge to
    full tensors (one ``rank_0.ckpt``, usable by one device, data parallel and ``generate``).
    ``src`` is verified first (sizes and SHA-256; ``hash_files=False`` checks sizes only); the new
    folder is written in a uniquely named temporary folder beside ``out`` and renamed into place.
    """
    man = store.verified(src, hash_files=hash_files)
    if os.path.lexists(out):
        raise UserError("already exists; choose a new folder (nothing is overwritten)", where=out)
    check_writable(os.path.dirname(os.path.abspath(out)), key="--out")
    tmp = temp_dir_beside(out)          # a new, unique name: never a folder of the user's
    try:
        with tempfile.TemporaryDirectory(prefix=".naohai-reshard-", dir=os.path.dirname(os.path.abspath(out))) as work:
            src_strategy = checkpoint_strategy(src, os.path.join(work, "src_strategy.ckpt"))
            dst_strategy = None
            if dst_strategy_dir is not None:
                if not dst_layout:
                    raise ValueError("dst_layout is needed with dst_strategy_dir")
                dst_strategy = merged_strategy(dst_strategy_dir, int(dst_layout["world"]),
                                               int(dst_layout.get("stages", 1)),
                                               os.path.join(work, "dst_strategy.ckpt"))
            if src_strategy is None and dst_strategy is None:   # full tensors already: a verified copy
                files = {0: os.path.join(src, store.rank_file(0))}
            else:
                files = transform(_rank_files(src), src_strategy, dst_strategy, work)
            entries: Dict[str, Any] = {}
            for rank, path in sorted(files.items()):
                name = store.rank_file(rank)
                shutil.copyfile(path, os.path.join(tmp, name))
                entries[name] = {"rank": rank, "sha256": sha256_file(os.path.join(tmp, name)),
                                 "bytes": os.path.getsize(os.path.join(tmp, name))}
            if dst_strategy_dir is not None:
                os.makedirs(os.path.join(tmp, "strategy"))
                for f in sorted(glob.glob(os.path.join(dst_strategy_dir, "rank_*.ckpt"))):
                    dst = os.path.join(tmp, "strategy", os.path.basename(f))
                    shutil.copyfile(f, dst)
                    entries[f"strategy/{os.path.basename(f)}"] = {"sha256": sha256_file(dst),
                                                                   "bytes": os.path.getsize(dst)}
        layout = dict(dst_layout) if dst_layout else {
            "mode": "standalone", "world": 1, "signature": "full", "ranks_with_files": [0],
            "mesh": {"data": 1, "model": 1, "pipeline": 1}, "stages": 1, "describe": "full tensors (merged)"}
        layout["ranks_with_files"] = sorted(files)
        new = dict(man, layout=layout, files=entries,
                   resharded_from={"path": os.path.abspath(src), "layout": man.get("layout")})
        write_json(os.path.join(tmp, store.MANIFEST), new)
        if os.path.lexists(out):
            raise UserError("appeared while it was being written; nothing is overwritten", where=out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def merged_tensors(ckpt: str, hash_files: bool = True) -> ckpt_format.Tensors:
    """Full tensors of any naohai checkpoint, verified first, each read when asked
    (:class:`naohai.ckpt_format.Tensors`: taking the model's leaves its Adam moments, two thirds of the file,
    unread).  A sharded checkpoint is merged first into a temporary folder, which is removed once the returned
    mapping is let go."""
    man = store.verified(ckpt, hash_files=hash_files)
    if (man.get("layout") or {}).get("signature", "full") == "full":
        return ckpt_format.Tensors(os.path.join(ckpt, store.rank_file(0)))
    work = tempfile.mkdtemp(prefix="naohai-merge-")
    try:
        out = reshard_checkpoint(ckpt, os.path.join(work, "merged"), hash_files=hash_files)
        tensors = ckpt_format.Tensors(os.path.join(out, store.rank_file(0)))
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    weakref.finalize(tensors, shutil.rmtree, work, True)
    return tensors


def model_weights(ckpt: str, hash_files: bool = True) -> Tuple[Any, Mapping[str, np.ndarray]]:
    """(recipe, {naohai parameter name: full float32 array}) of a checkpoint's model (no optimizer state),
    after verifying the checkpoint; the arrays are read when asked (:func:`merged_tensors`)."""
    from naohai.config import recipe_from_dict
    from naohai.model.params import param_shapes
    man = store.read_manifest(ckpt)
    if not isinstance(man.get("recipe"), dict):
        raise UserError("integrity error: the manifest records no recipe", where=ckpt, key="recipe")
    recipe = recipe_from_dict(man["recipe"], where=os.path.join(ckpt, store.MANIFEST))
    if man.get("finetune_base") is not None:
        raise UserError("holds LoRA adapters only (a fine-tuning run's checkpoint), not the model: "
                        "`naohai ckpt merge-adapter` makes the full model, `ckpt export --to hf` or `--to peft` "
                        "write it out", where=ckpt, key="finetune")
    return recipe, ModelTensors(merged_tensors(ckpt, hash_files=hash_files),
                                {p.name for p in param_shapes(recipe.model)})


class ModelTensors(ckpt_format.LazyTensors):
    """The model's parameters among a checkpoint's tensors, each read (as float32) when asked."""

    def __init__(self, tensors: Mapping[str, Any], names: Set[str]):
        self._tensors = tensors
        self._keys = dict.fromkeys(k for k in tensors if k in names)     # the file's order, O(1) lookups

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._keys:
            raise KeyError(name)
        return as_float32(self._tensors[name])

    def shape(self, name: str) -> Tuple[int, ...]:
        """A parameter's shape, without reading it when the checkpoint's table gives it."""
        if name not in self._keys:
            raise KeyError(name)
        return ckpt_format.shape_of(self._tensors, name)


def as_float32(value: Any) -> np.ndarray:
    """A MindSpore tensor or a numpy array as a float32 array (no copy when it is one already)."""
    return np.asarray(value.asnumpy() if hasattr(value, "asnumpy") else value, np.float32)


def export_safetensors(ckpt: str, out_file: str, hash_files: bool = True) -> List[str]:
    """The full model of a verified checkpoint as one safetensors file, tensors by name, each read and written
    in turn (:func:`naohai.convert.hf.folder.write_safetensors`; written in a unique temporary folder beside
    ``out_file``, then renamed; an existing file is never overwritten); returns the tensor names written."""
    from naohai.convert.hf.folder import write_safetensors
    from naohai.model.params import param_shapes
    recipe, tensors = model_weights(ckpt, hash_files=hash_files)
    if os.path.lexists(out_file):
        raise UserError("already exists (nothing is overwritten)", where=out_file)
    sizes = {p.name: 4 * int(np.prod(p.shape, dtype=np.int64)) for p in param_shapes(recipe.model)}
    names = sorted(tensors)
    work = temp_dir_beside(out_file)
    try:
        write_safetensors(os.path.join(work, "model.safetensors"),
                          [(k, sizes[k], lambda k=k: tensors[k]) for k in names], {"format": "ms"})
        if os.path.lexists(out_file):
            raise UserError("appeared while it was being written; nothing is overwritten", where=out_file)
        os.rename(os.path.join(work, "model.safetensors"), out_file)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return names
