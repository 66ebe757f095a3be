"""Packed token shards: documents -> one flat token stream per split, plus ``meta.json``.

Layout of a prepared directory::

    meta.json     format, tokenizer (path, sha256, vocab size, eod id), seq_length,
                  dtype, per split: file, documents, tokens, windows; source fingerprint
    train.npy     1-D token stream (uint16 if vocab < 65536 else uint32)
    valid.npy     the held-out documents, same layout

Each document is encoded and followed by the EOD id; the documents of a split are
concatenated in corpus order.  Window ``i`` of a split is
``stream[i*seq_length : i*seq_length + seq_length + 1]`` (inputs are the first
``seq_length`` tokens, labels the last ``seq_length``), so consecutive windows
share one token and there are ``(tokens - 1) // seq_length`` windows.

The held-out split is chosen by document: documents are taken in the order of a
permutation drawn from ``numpy.random.default_rng(seed)`` until they hold at least
``holdout_fraction`` of the tokens (see :func:`holdout_mask`).

Writing is atomic: everything goes to ``<out_dir>.tmp-<pid>`` and is renamed into
place when complete.  An existing prepared directory made with a different
tokenizer or seq_length is only replaced with ``overwrite=True``; a folder that is
not prepared data (no ``meta.json``, or files naohai does not write there) is
never replaced (:func:`check_replaceable`).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

import numpy as np

from naohai.data.tokenizer import Tokenizer
from naohai.errors import UserError

FORMAT = "naohai-packed-v1"
SPLITS = ("train", "valid")
META = "meta.json"
_BATCH_DOCS = 256
_CHUNK = 1 << 22


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size < 65536 else np.dtype(np.uint32)


def num_windows(tokens: int, seq_length: int) -> int:
    return max(0, (int(tokens) - 1) // int(seq_length))


def holdout_mask(doc_tokens: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out documents.

    Documents are taken in the order of ``default_rng(seed).permutation(N)`` until
    they hold at least ``fraction`` of all tokens; at least one document is held
    out and at least one is kept for training.
    """
    n = len(doc_tokens)
    perm = np.random.default_rng(int(seed)).permutation(n)
    cum = np.cumsum(np.asarray(doc_tokens, dtype=np.int64)[perm])
    k = int(np.searchsorted(cum, float(fraction) * cum[-1])) + 1
    k = min(n - 1, max(1, k))
    mask = np.zeros(n, dtype=bool)
    mask[perm[:k]] = True
    return mask


def read_meta(out_dir: str) -> Optional[Dict[str, Any]]:
    """meta.json of a prepared dir, or None if there is none (or it is unreadable)."""
    path = os.path.join(out_dir, META)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _progress(iterable, enabled: bool, desc: str):
    if not enabled or not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, desc=desc, unit="doc", file=sys.stderr)


def _batches(documents: Iterable[str], size: int):
    batch = []
    for doc in documents:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


#: what a prepared folder holds (token windows; SFT data adds the masks): all that --overwrite may replace
PREPARED_FILES = frozenset({META, "train.npy", "valid.npy", "train.mask.npy", "valid.mask.npy"})


def check_replaceable(out_dir: str) -> None:
    """Refuse to replace ``out_dir`` unless it is missing, empty or a prepared data folder: a ``meta.json`` and
    only the files naohai writes there.  ``--overwrite`` replaces the whole folder, so without this a run folder
    or a user's own folder given as the output would be deleted."""
    if not os.path.isdir(out_dir):
        if os.path.exists(out_dir):
            raise UserError("exists and is not a directory", where=out_dir, key="data.prepared_dir")
        return
    entries = set(os.listdir(out_dir))
    if not entries:
        return
    foreign = sorted(entries - PREPARED_FILES)
    if META not in entries or foreign:
        what = f"it holds {', '.join(foreign[:5])}{' ...' if len(foreign) > 5 else ''}" if foreign else \
            "it has no meta.json"
        raise UserError(f"is not a prepared data folder ({what}); --overwrite replaces only a folder naohai "
                        f"prepared, so nothing was changed. Choose another folder (a new or empty one)",
                        where=out_dir, key="data.prepared_dir", rule="overwrite only prepared data")


def _check_target(out_dir: str, tokenizer: Tokenizer, seq_length: int, overwrite: bool) -> None:
    if not os.path.exists(out_dir):
        return
    if not os.path.isdir(out_dir):
        raise UserError("exists and is not a directory", where=out_dir, key="data.prepared_dir")
    if not os.listdir(out_dir):
        return
    if overwrite:
        check_replaceable(out_dir)
        return
    meta = read_meta(out_dir)
    if meta is None:
        raise UserError("exists, is not empty and is not a prepared data directory; refusing to replace "
                        "it (choose another directory or pass --overwrite)", where=out_dir,
                        key="data.prepared_dir")
    old_sha = meta.get("tokenizer", {}).get("sha256")
    if old_sha != tokenizer.sha256 or meta.get("seq_length") != seq_length:
        raise UserError(f"was prepared with another tokenizer or seq_length (seq_length "
                        f"{meta.get('seq_length')}, tokenizer {meta.get('tokenizer', {}).get('path')}); "
                        f"refusing to replace it. Pass --overwrite (overwrite=True) or choose another "
                        f"data.prepared_dir", where=out_dir, key="data.prepared_dir")


def publish(tmp: str, out_dir: str, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Write ``meta`` as ``tmp``/meta.json and swap the finished ``tmp`` folder into ``out_dir`` (the old
    one, if any, is moved aside first and removed after); returns ``meta``."""
    check_replaceable(out_dir)         # checked first by the callers; again here, the one place that replaces
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, ensure_ascii=False)
    old = None
    if os.path.exists(out_dir):
        old = f"{out_dir}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return meta


def prepare(documents: Iterable[str], tokenizer: Tokenizer, out_dir: str, seq_length: int,
            holdout_fraction: float = 0.05, seed: int = 1234, *, overwrite: bool = False,
            progress: bool = True, source: Optional[Dict[str, Any]] = None,
            min_train_windows: int = 1, min_valid_windows: int = 1,
            add_special_tokens: bool = False) -> Dict[str, Any]:
    """Tokenize ``documents`` into packed train/valid shards in ``out_dir``; returns the meta dict.  Each
    document is its tokens and EOD; with ``add_special_tokens`` its tokens are those ``tokenizer(text)``
    gives in transformers (:meth:`~naohai.data.hf_tokenizer.HFTokenizer.encode_documents`), and EOD is not
    added again where the tokenizer's post-processor already ends the document with it."""
    seq_length = int(seq_length)
    if seq_length <= 0:
        raise UserError(f"must be a positive integer, got {seq_length}", key="model.seq_length")
    out_dir = os.path.abspath(out_dir)
    _check_target(out_dir, tokenizer, seq_length, overwrite)
    dtype = token_dtype(tokenizer.vocab_size)
    eod = tokenizer.eod_id
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # pass 1: every document's tokens + EOD into one flat scratch file
        scratch = os.path.join(tmp, "all.tokens")
        lengths = []
        max_id = -1
        with open(scratch, "wb") as fh:
            encode = tokenizer.encode_documents if add_special_tokens else tokenizer.encode_batch
            for batch in _batches(_progress(documents, progress, "tokenizing"), _BATCH_DOCS):
                for ids in encode(batch):
                    ended = add_special_tokens and len(ids) > 0 and ids[-1] == eod
                    arr = np.empty(len(ids) + (not ended), dtype=np.int64)
                    arr[:len(ids)] = ids
                    arr[-1] = eod
                    max_id = max(max_id, int(arr.max()))
                    arr.astype(dtype).tofile(fh)
                    lengths.append(len(arr))
        n_docs = len(lengths)
        if n_docs < 2:
            raise UserError(f"needs at least 2 documents to hold one out for validation, got {n_docs}",
                            key="data.corpus")
        if max_id >= tokenizer.vocab_size:
            raise RuntimeError(f"tokenizer produced id {max_id} >= vocab size {tokenizer.vocab_size}")
        # pass 2: split by document
        lengths_arr = np.asarray(lengths, dtype=np.int64)
        is_valid = holdout_mask(lengths_arr, holdout_fraction, seed)
        starts = np.concatenate([[0], np.cumsum(lengths_arr)[:-1]])
        stream = np.memmap(scratch, dtype=dtype, mode="r") if lengths_arr.sum() else np.zeros(0, dtype)
        splits: Dict[str, Dict[str, Any]] = {}
        for split, mask in (("train", ~is_valid), ("valid", is_valid)):
            total = int(lengths_arr[mask].sum())
            fname = f"{split}.npy"
            out = np.lib.format.open_memmap(os.path.join(tmp, fname), mode="w+", dtype=dtype, shape=(total,))
            pos = 0
            for s, n in zip(starts[mask], lengths_arr[mask]):
                for off in range(0, int(n), _CHUNK):
                    m = min(_CHUNK, int(n) - off)
                    out[pos:pos + m] = stream[int(s) + off:int(s) + off + m]
                    pos += m
            out.flush()
            del out
            splits[split] = {"file": fname, "documents": int(mask.sum()), "tokens": total,
                             "windows": num_windows(total, seq_length)}
        del stream
        os.remove(scratch)
        need = {"train": min_train_windows, "valid": min_valid_windows}
        for split in SPLITS:
            if splits[split]["windows"] < need[split]:
                raise UserError(
                    f"the corpus is too small: the {split} split has {splits[split]['tokens']} tokens, "
                    f"{splits[split]['windows']} windows of seq_length {seq_length}, but at least "
                    f"{need[split]} are needed; add text, lower model.seq_length or change "
                    f"data.holdout_fraction", key="data.corpus")
        meta = {
            "format": FORMAT,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "tokenizer": {"path": tokenizer.path, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
                          "eod_id": eod, "pad_id": tokenizer.pad_id, "scheme": tokenizer.scheme},
            "seq_length": seq_length,
            "window": {"length": seq_length + 1, "stride": seq_length},
            "dtype": dtype.name,
            "max_token_id": max_id,
            "holdout_fraction": float(holdout_fraction),
            "seed": int(seed),
            "splits": splits,
            "source": source or {},
        }
        if add_special_tokens:
            meta["add_special_tokens"] = True
        return publish(tmp, out_dir, meta)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# --------------------------------------------------------------------------- reading
@dataclass
class Prepared:
    """A validated prepared directory; ``tokens(split)`` is a read-only memmap."""

    path: str
    meta: Dict[str, Any]

    @property
    def seq_length(self) -> int:
        return int(self.meta["seq_length"])

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eod_id(self) -> int:
        return int(self.meta["tokenizer"]["eod_id"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def num_windows(self, split: str) -> int:
        return int(self._split(split)["windows"])

    def tokens(self, split: str) -> np.ndarray:
        return np.load(os.path.join(self.path, self._split(split)["file"]), mmap_mode="r")

    def window(self, split: str, index: int) -> np.ndarray:
        s = self.seq_length
        return np.asarray(self.tokens(split)[index * s: index * s + s + 1])

    def _split(self, split: str) -> Dict[str, Any]:
        if split not in self.meta["splits"]:
            raise UserError(f"unknown split '{split}'; splits: {', '.join(self.meta['splits'])}",
                            where=self.path)
        return self.meta["splits"][split]


def load_prepared(path: str, *, verify: bool = True) -> Prepared:
    """Open a prepared dir, checking meta.json, shard sizes/dtypes and (``verify``) every id < vocab."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UserError("prepared data directory not found (run 'naohai data prepare RECIPE')", where=path,
                        key="data.prepared_dir")
    meta = read_meta(path)
    if meta is None:
        raise UserError(f"has no valid {META}; it is not a prepared data directory (run 'naohai data "
                        f"prepare RECIPE')", where=path, key="data.prepared_dir")
    prep = Prepared(path, meta)
    vocab = prep.vocab_size
    for split in SPLITS:
        info = prep._split(split)
        fpath = os.path.join(path, info["file"])
        try:
            arr = np.load(fpath, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise UserError(f"shard cannot be read: {exc}", where=fpath) from None
        if arr.ndim != 1 or arr.dtype != prep.dtype or arr.shape[0] != int(info["tokens"]):
            raise UserError(f"shard does not match {META} (dtype {arr.dtype}, shape {arr.shape}; expected "
                            f"{prep.dtype}, ({info['tokens']},)); prepare the data again", where=fpath)
        if verify:
            for off in range(0, arr.shape[0], _CHUNK):
                top = int(arr[off:off + _CHUNK].max())
                if top >= vocab:
                    raise UserError(f"holds token id {top} >= the tokenizer's vocabulary size {vocab}; the "
                                    f"shard is corrupt or from another tokenizer, prepare the data again",
                                    where=fpath)
    return prep


def vocab_fits(pieces: int, vocab_size: int, exact: bool = True) -> bool:
    """Whether a tokenizer of ``pieces`` fits a model of ``vocab_size`` rows: as many, or, not ``exact``, at
    most as many (a published model's embedding padded past its tokenizer)."""
    return int(pieces) == int(vocab_size) or (not exact and int(pieces) < int(vocab_size))


def check_compatible(meta: Any, vocab_size: int, seq_length: int, where: Optional[str] = None,
                     exact_vocab: bool = True) -> None:
    """Raise UserError if prepared data (meta dict or Prepared) does not fit the model settings; with
    ``exact_vocab`` false the tokenizer may have fewer pieces than the model has rows (a published model's
    padded embedding)."""
    if isinstance(meta, Prepared):
        meta = meta.meta
    tok_vocab = int(meta["tokenizer"]["vocab_size"])
    if not vocab_fits(tok_vocab, vocab_size, exact_vocab):
        raise UserError(f"is {vocab_size}, but the prepared data was tokenized with a vocabulary of "
                        f"{tok_vocab} ({meta['tokenizer'].get('path')}); set model.vocab_size={tok_vocab} or "
                        f"use a tokenizer with {vocab_size} pieces", where=where, key="model.vocab_size",
                        rule="model.vocab_size == tokenizer vocab size")
    top = int(meta.get("max_token_id", -1))
    if top >= int(vocab_size):
        raise UserError(f"is {vocab_size}, but the prepared data holds token id {top}", where=where,
                        key="model.vocab_size", rule="token ids < model.vocab_size")
    if int(meta["seq_length"]) != int(seq_length):
        raise UserError(f"is {seq_length}, but the prepared data has windows for seq_length "
                        f"{meta['seq_length']}; prepare it again (naohai data prepare RECIPE --overwrite)",
                        where=where, key="model.seq_length", rule="model.seq_length == prepared seq_length")
