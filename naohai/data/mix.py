"""Source mixing: several cleaned sources with weights and epoch caps -> one deterministic mixture.

A source is a `naohai data clean` output directory (its ``part-*.jsonl``), a
``.jsonl`` file or a glob of them.  ``weight`` is the share of the mixture's *bytes*
that comes from the source (weights are normalised); ``max_epochs`` caps how many
times its documents may be repeated.  The mixture is the largest one that meets
every cap: with shares ``p_i``, source bytes ``B_i`` and caps ``e_i`` its size is
``T = min_i e_i * B_i / p_i`` bytes, and source ``i`` contributes
``n_i = round(N_i * p_i * T / B_i)`` of its ``N_i`` documents, i.e. ``n_i / N_i``
epochs (as in The Pile's and Dolma's epoch-weighted mixes).

Order: ``numpy.random.SeedSequence(seed)`` spawns one generator per source and one
for the interleaving.  Source ``i`` contributes ``n_i // N_i`` full passes, each in
its own permutation, then the first ``n_i % N_i`` documents of one more
permutation; all picks are then shuffled together.  ``mixture.json`` records the
sources (files with size and mtime), counts, weights, epochs and seed, and
``<name>.order.npy`` the exact order as ``[source, document]`` rows, so the
sequence can be rebuilt from either.  `naohai data prepare` takes the
``mixture.json`` as a corpus source (:func:`iter_mixture`).
"""
from __future__ import annotations

import glob
import json
import math
import os
from fractions import Fraction
from dataclasses import dataclass
from typing import Dict, Iterator, List, Sequence, Tuple

import numpy as np

from naohai.errors import UserError
from naohai.runfiles import existing_ancestor

FORMAT = "naohai-mixture-v1"


@dataclass
class MixSource:
    path: str
    weight: float
    max_epochs: float = 1.0


def parse_source_spec(spec: str) -> MixSource:
    """``PATH:WEIGHT`` or ``PATH:WEIGHT:MAX_EPOCHS``."""
    parts = spec.rsplit(":", 2)
    try:
        if len(parts) == 3 and _is_number(parts[1]):
            path, weight, epochs = parts[0], float(parts[1]), float(parts[2])
        else:
            path, weight = spec.rsplit(":", 1)
            weight, epochs = float(weight), 1.0
    except ValueError:
        raise UserError(f"source '{spec}' is not PATH:WEIGHT or PATH:WEIGHT:MAX_EPOCHS", where="command line") \
            from None
    return MixSource(path, weight, epochs)


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def source_files(path: str) -> List[str]:
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(glob.escape(path), "part-*.jsonl")))
        if not files:
            raise UserError("holds no part-*.jsonl (is it a `naohai data clean` output?)", where=path)
        return files
    if any(ch in path for ch in "*?["):
        files = sorted(p for p in glob.glob(path) if p.endswith(".jsonl"))
        if not files:
            raise UserError("the pattern matches no .jsonl files", where=path)
        return files
    if not os.path.isfile(path):
        raise UserError("mixture source not found", where=path)
    return [path]


def _line_offsets(files: Sequence[str]) -> Tuple[np.ndarray, np.ndarray, int]:
    """(file index, byte offset) of every non-blank line, and the bytes in them."""
    fidx, offs, total = [], [], 0
    for i, path in enumerate(files):
        with open(path, "rb") as fh:
            pos = 0
            for line in fh:
                if line.strip():
                    fidx.append(i)
                    offs.append(pos)
                    total += len(line)
                pos += len(line)
    return np.asarray(fidx, np.int32), np.asarray(offs, np.int64), total


def _stat(files):
    return [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in files]


def _order_path(out: str) -> str:
    return out[: -len(".json")] + ".order.npy" if out.endswith(".json") else out + ".order.npy"


def check_out(out: str) -> None:
    """``out`` can take a mixture: a new file, or an earlier mixture file (replaced), in a folder that exists or
    can be made.  Checked before any work, so a mistake costs nothing and leaves nothing behind."""
    rule = "a new .json file, or an earlier mixture file"
    if not str(out).strip():
        raise UserError("must not be empty", where="command line", key="--out", rule=rule)
    path = os.path.abspath(out)
    for p in (path, _order_path(path)):
        if os.path.isdir(p):
            raise UserError("is a folder; give a file name, e.g. data/mixture.json", where=p, key="--out", rule=rule)
    if os.path.lexists(path):
        try:
            with open(path, "r", encoding="utf-8") as fh:
                old = json.load(fh)
        except (OSError, ValueError):
            old = None
        if not isinstance(old, dict) or old.get("format") != FORMAT:
            raise UserError(f"exists and is not a mixture file ({FORMAT}); it is never replaced, give a new "
                            f"file name", where=path, key="--out", rule=rule)
    parent = existing_ancestor(path)
    if not os.path.isdir(parent):
        raise UserError(f"{parent} is not a folder, so the file cannot be made", where=path, key="--out", rule=rule)
    if not os.access(parent, os.W_OK):
        raise UserError(f"the folder {parent} is not writable", where=path, key="--out", rule=rule)


def _takes(sources: Sequence[MixSource], counts: Sequence[int],
           sizes: Sequence[int]) -> Tuple[List[Fraction], List[int]]:
    """(shares, documents taken) in exact arithmetic: weights of any finite size (1e308 and 1e308, 1e300 and
    1e-300) neither overflow nor underflow into NaN or a division by zero."""
    weights = [Fraction(s.weight) for s in sources]
    total_weight = sum(weights)
    share = [w / total_weight for w in weights]
    total = min(Fraction(s.max_epochs) * b / p for s, b, p in zip(sources, sizes, share))
    take = [max(1, round(n * p * total / b)) for n, p, b in zip(counts, share, sizes)]
    return share, take


def build_mixture(sources: Sequence[MixSource], out: str, seed: int = 0, text_key: str = "text") -> Dict:
    """Write ``out`` (mixture.json) and its order file; returns the mixture description."""
    if not sources:
        raise UserError("give at least one source", where="command line")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise UserError(f"must be an integer >= 0, got {seed!r}", where="command line", key="--seed",
                        rule="seed >= 0")
    check_out(out)
    for s in sources:
        if not (math.isfinite(s.weight) and s.weight > 0):
            raise UserError(f"weight must be a finite number > 0, got {s.weight}", where=s.path)
        if not (math.isfinite(s.max_epochs) and 0 < s.max_epochs <= 1000):
            raise UserError(f"max_epochs must be in (0, 1000], got {s.max_epochs}", where=s.path)
    files = [source_files(s.path) for s in sources]
    owner: Dict[str, int] = {}
    for i, fs in enumerate(files):
        for f in fs:
            j = owner.setdefault(os.path.realpath(f), i)
            if j != i:
                raise UserError(f"{f} is a file of two sources, '{sources[j].path}' (source {j + 1}) and "
                                f"'{sources[i].path}' (source {i + 1}): it would be mixed twice, past the epoch "
                                f"caps; give each file one source and one weight", where="command line")
    counts, sizes = [], []
    for s, fs in zip(sources, files):
        fidx, _, nbytes = _line_offsets(fs)
        if len(fidx) == 0:
            raise UserError("holds no documents", where=s.path)
        counts.append(len(fidx))
        sizes.append(nbytes)
    share, take = _takes(sources, counts, sizes)
    children = np.random.SeedSequence(int(seed)).spawn(len(sources) + 1)
    picks = []
    for i, (n, k) in enumerate(zip(counts, take)):
        rng = np.random.default_rng(children[i])
        idx = [rng.permutation(n) for _ in range(k // n)]
        if k % n:
            idx.append(rng.permutation(n)[: k % n])
        picks.append(np.stack([np.full(k, i, np.int64), np.concatenate(idx)], axis=1))
    order = np.concatenate(picks)
    order = order[np.random.default_rng(children[-1]).permutation(len(order))]
    out = os.path.abspath(out)
    order_path = _order_path(out)
    desc = {
        "format": FORMAT, "seed": int(seed), "text_key": text_key, "order": os.path.basename(order_path),
        "documents": int(len(order)),
        "sources": [{"path": s.path, "weight": s.weight, "share": float(p), "max_epochs": s.max_epochs,
                     "files": _stat(fs), "documents": n, "bytes": b, "taken": k, "epochs": k / n}
                    for s, fs, n, b, k, p in zip(sources, files, counts, sizes, take, share)],
    }
    # both files are written beside their names and renamed into place; a failure leaves no partial file
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
    except OSError as exc:
        raise UserError(f"its folder cannot be made: {exc.strerror or exc}", where=out, key="--out") from None
    order_tmp, tmp = order_path + ".tmp", out + ".tmp"
    try:
        with open(order_tmp, "wb") as fh:
            np.save(fh, order)
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(desc, fh, indent=1)
        os.replace(order_tmp, order_path)
        os.replace(tmp, out)
    except OSError as exc:
        raise UserError(f"cannot be written: {exc.strerror or exc}", where=out, key="--out") from None
    finally:
        for p in (order_tmp, tmp):
            if os.path.lexists(p) and not os.path.isdir(p):
                os.unlink(p)
    return desc


def load_mixture(path: str) -> Tuple[Dict, np.ndarray]:
    try:
        with open(path, "r", encoding="utf-8") as fh:
            desc = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot be read as a mixture: {exc}", where=path, key="data.corpus") from None
    if not isinstance(desc, dict) or desc.get("format") != FORMAT:
        raise UserError(f"is not a mixture file (format {FORMAT})", where=path, key="data.corpus")
    order_path = os.path.join(os.path.dirname(os.path.abspath(path)), desc["order"])
    if not os.path.exists(order_path):
        raise UserError(f"its order file {order_path} is missing; run `naohai data mix` again", where=path,
                        key="data.corpus")
    for src in desc["sources"]:
        for f, size, mtime in src["files"]:
            if not os.path.exists(f) or os.path.getsize(f) != size or os.stat(f).st_mtime_ns != mtime:
                raise UserError(f"source file {f} changed or vanished since the mixture was built; "
                                f"run `naohai data mix` again", where=path, key="data.corpus")
    return desc, np.load(order_path)


def iter_mixture(path: str) -> Iterator[str]:
    """The mixture's documents (texts) in its recorded order."""
    desc, order = load_mixture(path)
    key = desc.get("text_key", "text")
    index = []
    handles = []
    for src in desc["sources"]:
        files = [f for f, _, _ in src["files"]]
        fidx, offs, _ = _line_offsets(files)
        index.append((fidx, offs))
        handles.append([open(f, "rb") for f in files])
    try:
        for s, d in order:
            fidx, offs = index[s]
            fh = handles[s][fidx[d]]
            fh.seek(int(offs[d]))
            line = fh.readline()
            try:
                yield json.loads(line)[key]
            except (ValueError, KeyError, TypeError):
                raise UserError(f"source {desc['sources'][s]['path']} document {d} is not a JSON object with "
                                f"'{key}'", where=path, key="data.corpus") from None
    finally:
        for hs in handles:
            for h in hs:
                h.close()
