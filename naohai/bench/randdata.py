"""A prepared data folder of uniformly random tokens, in the packed layout the loader reads.

The benchmark feeds naohai's real loader (:class:`naohai.data.loader.TokenWindowLoader`)
without training a tokenizer: ``write_random_prepared(path, vocab, seq, windows)`` writes
``train.npy`` / ``valid.npy`` and a ``meta.json`` in :mod:`naohai.data.prepare`'s format
whose tokenizer entry says the ids are random (EOD id 0, pad id 0; the benchmarked models
use neither).
"""
from __future__ import annotations

import json
import os

import numpy as np

from naohai.data.prepare import FORMAT, META, num_windows, token_dtype


def write_random_prepared(path: str, vocab_size: int, seq_length: int, train_windows: int,
                          valid_windows: int = 4, seed: int = 0) -> str:
    os.makedirs(path, exist_ok=True)
    dtype = token_dtype(vocab_size)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, windows in (("train", train_windows), ("valid", valid_windows)):
        tokens = int(windows) * seq_length + 1
        np.save(os.path.join(path, f"{split}.npy"), rng.integers(0, vocab_size, tokens).astype(dtype))
        splits[split] = {"file": f"{split}.npy", "documents": 1, "tokens": tokens,
                         "windows": num_windows(tokens, seq_length)}
    meta = {"format": FORMAT, "tokenizer": {"path": None, "sha256": "random-tokens", "vocab_size": int(vocab_size),
                                            "eod_id": 0, "pad_id": 0, "scheme": "random"},
            "seq_length": int(seq_length), "window": {"length": seq_length + 1, "stride": seq_length},
            "dtype": dtype.name, "max_token_id": int(vocab_size) - 1, "holdout_fraction": 0.0, "seed": int(seed),
            "splits": splits, "source": {"random": True}}
    with open(os.path.join(path, META), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    return path
