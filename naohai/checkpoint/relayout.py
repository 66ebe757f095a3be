"""A checkpoint's weights at a run's own layout: what resume and ``train.init_from`` load.

A run knows its layout record (the manifest's ``layout``: ``signature``, ``describe``, ``world``,
``stages``, ...).  :func:`load_at_layout` loads a checkpoint into the run's parameters: straight
from the checkpoint when the same layout wrote it, else from a copy resharded for this layout
(:func:`naohai.checkpoint.reshard.reshard_checkpoint` with the strategy files of the run's own
compile in ``<run>/strategy/``).  Rank 0 writes that copy once into ``<run>/<folder>/`` (kept: a
later resume of the same checkpoint reuses it); every rank then reads its own file of it.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Sequence

from naohai.checkpoint import store
from naohai.errors import UserError


def same_layout(manifest: Dict[str, Any], layout: Dict[str, Any]) -> bool:
    """Whether the checkpoint of ``manifest`` was written by ``layout``."""
    return (manifest.get("layout") or {}).get("signature") == layout["signature"]


def files_for_rank(manifest: Dict[str, Any], layout: Dict[str, Any], rank: int, sharded: bool) -> List[str]:
    """The files of a checkpoint that ``rank`` reads (and checks): its own parameter file when ``layout``
    wrote it (``sharded``: every rank has one, else rank 0's full tensors); for a checkpoint of another
    layout, which rank 0 reshards, rank 0 checks every file and the other ranks none."""
    if not same_layout(manifest, layout):
        return sorted(manifest.get("files") or {}) if rank == 0 else []
    return [store.rank_file(rank if sharded else 0)]


def path_at_layout(chosen: str, layout: Dict[str, Any], run_dir: str, *, rank: int,
                   all_ok: Callable[[bool], bool], log: Callable[[str], None], folder: str = "resharded") -> str:
    """``chosen`` itself when ``layout`` wrote it, else its copy for ``layout`` in
    ``<run_dir>/<folder>/<name>-<signature>`` (written by rank 0 unless it is there; every rank waits)."""
    manifest = store.read_manifest(chosen)
    if same_layout(manifest, layout):
        return chosen
    from naohai.checkpoint.reshard import reshard_checkpoint
    out = os.path.join(run_dir, folder, f"{os.path.basename(chosen)}-{layout['signature']}")
    error = None
    if rank == 0 and not os.path.exists(out):
        log(f"checkpoint {chosen} was written by another layout ({(manifest.get('layout') or {}).get('describe')}); "
            f"resharding it for {layout['describe']} -> {out}")
        try:
            strategy_dir = os.path.join(run_dir, "strategy") if layout["signature"] != "full" else None
            reshard_checkpoint(chosen, out, strategy_dir, layout if strategy_dir else None)
        except UserError as exc:
            error = exc
    if not all_ok(error is None):
        raise error or UserError("rank 0 could not reshard the checkpoint (see its log)", where=chosen)
    return out


def load_at_layout(chosen: str, layout: Dict[str, Any], run_dir: str, params: Sequence[Any], *, rank: int,
                   sharded: bool, all_ok: Callable[[bool], bool], log: Callable[[str], None],
                   optional: Callable[[str], bool] = lambda _: False, folder: str = "resharded") -> str:
    """Load ``chosen`` into ``params`` at ``layout`` (see the module docstring); returns the folder read."""
    source = path_at_layout(chosen, layout, run_dir, rank=rank, all_ok=all_ok, log=log, folder=folder)
    store.load_into(source, files_for_rank(store.read_manifest(source), layout, rank, sharded), params,
                    optional=optional)
    return source
