"""Open a prepared data directory of either kind: token windows (:mod:`naohai.data.prepare`) or SFT
conversations with their loss mask (:mod:`naohai.data.sft`).

Both keep a ``meta.json`` with the tokenizer that made them; the trainer, ``naohai data info`` and the
in-loop evaluator read it through :func:`open_prepared` and need not know which kind a run has.
"""
from __future__ import annotations

from naohai.data.prepare import Prepared, load_prepared
from naohai.data.sft import is_sft_dir, load_sft


def open_prepared(path: str, *, verify: bool = True) -> Prepared:
    """The prepared directory at ``path``: an SFT directory when its meta.json says so, else token
    windows (:func:`naohai.data.prepare.load_prepared`, whose errors name a directory that is neither)."""
    if is_sft_dir(path):
        return load_sft(path)
    return load_prepared(path, verify=verify)
