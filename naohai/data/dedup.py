"""Deduplication: exact (normalised hash) and near-duplicate (MinHash-LSH with datasketch).

Both keep the first document in corpus order and drop later copies.

Exact
    A document's key is the BLAKE2b-64 hash of its text after NFKC, case folding
    and removal of everything but letters and digits, so copies that differ only
    in case, spacing or punctuation count as the same.
Near
    Shingles are character n-grams of that same normalised text (``shingle:
    chars``; no word splitting, so it works for Chinese) or word n-grams of the
    lower-cased text (``shingle: words``).  Their MinHash signatures
    (``datasketch.MinHash.bulk``, ``num_perm`` permutations) are computed per work
    unit, in parallel.  Shingles are hashed to 32 bits with CRC-32 (C speed; the
    randomness MinHash needs comes from its seeded permutations, the shingle hash
    only has to keep distinct shingles apart).  :class:`NearDuplicateIndex` then goes through the corpus
    once: a document is looked up in a ``datasketch.MinHashLSH`` with ``bands`` x
    ``rows`` (when not given, datasketch's optimum for ``threshold`` with false
    negatives weighted 0.95, false positives 0.05); a candidate
    counts only when the signatures' estimated Jaccard similarity reaches
    ``threshold`` less two standard deviations of that estimate
    (``2*sqrt(t(1-t)/num_perm)``, 0.07 at 0.8 and 128 permutations); a document with none is inserted.  Each document costs one
    query and at most one insert, so the time grows linearly with the corpus.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
import zlib
from typing import List, Optional, Sequence, Tuple

import numpy as np

_NOT_WORD = re.compile(r"[\W_]+")


def dedup_text(text: str) -> str:
    """NFKC, case-folded, letters and digits only."""
    return _NOT_WORD.sub("", unicodedata.normalize("NFKC", text).casefold())


def exact_key(text: str) -> str:
    return hashlib.blake2b(dedup_text(text).encode("utf-8"), digest_size=8).hexdigest()


def shingles(text: str, kind: str = "chars", n: int = 5) -> List[bytes]:
    """The set of n-gram shingles (as UTF-8 bytes); a text shorter than n is one shingle."""
    if kind == "chars":
        s = dedup_text(text)
        grams = {s[i:i + n] for i in range(len(s) - n + 1)} or {s}
    else:
        ws = [w for w in _NOT_WORD.split(unicodedata.normalize("NFKC", text).casefold()) if w]
        grams = {" ".join(ws[i:i + n]) for i in range(len(ws) - n + 1)} or {" ".join(ws)}
    return [g.encode("utf-8") for g in sorted(grams)]


def jaccard(a: Sequence[bytes], b: Sequence[bytes]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / len(sa | sb) if sa or sb else 1.0


def signatures(texts: Sequence[str], cfg) -> np.ndarray:
    """[len(texts), num_perm] uint32 MinHash signatures for a :class:`NearDedupConfig`."""
    from datasketch import MinHash
    if not texts:
        return np.zeros((0, cfg.num_perm), np.uint32)
    sets = [shingles(t, cfg.shingle, cfg.ngram) for t in texts]
    hashes = MinHash.bulk(sets, num_perm=cfg.num_perm, seed=cfg.seed, hashfunc=zlib.crc32)
    return np.stack([np.asarray(m.hashvalues, np.uint32) for m in hashes])


def lsh_params(cfg) -> Tuple[int, int]:
    """(bands, rows): the configured ones, or datasketch's optimum for the threshold."""
    if cfg.bands is not None:
        return int(cfg.bands), int(cfg.rows)
    from datasketch.lsh import _optimal_param
    # candidates are verified against their signatures, so a false positive costs one comparison and a
    # false negative a kept duplicate: weight them 0.05 : 0.95 (at 0.8 and 128 permutations this gives
    # 16 bands x 8 rows, P(candidate) 0.95 at J = 0.8, where the even weighting's 9 x 13 gives 0.40)
    return tuple(int(x) for x in _optimal_param(cfg.threshold, cfg.num_perm, 0.05, 0.95))


class NearDuplicateIndex:
    """Streaming near-duplicate detection: :meth:`check` says whether a signature repeats an earlier kept one."""

    def __init__(self, cfg):
        from datasketch import MinHashLSH
        self.cfg = cfg
        self.bands, self.rows = lsh_params(cfg)
        # the signature estimate of a Jaccard J has standard deviation sqrt(J(1-J)/num_perm); accepting
        # candidates from two deviations below the threshold keeps pairs right at it (half of which an
        # estimate >= threshold would miss) while still refusing LSH's chance collisions
        t = cfg.threshold
        self.accept = t - 2.0 * (t * (1 - t) / cfg.num_perm) ** 0.5
        self.lsh = MinHashLSH(num_perm=cfg.num_perm, params=(self.bands, self.rows))
        self._kept: List[np.ndarray] = []

    def _lean(self, sig: np.ndarray):
        from datasketch import LeanMinHash
        return LeanMinHash(seed=self.cfg.seed, hashvalues=sig, scheme="affine32")

    def check(self, sig: np.ndarray) -> Optional[int]:
        """The index of an earlier kept document this one nearly duplicates (then it is not kept), or None."""
        m = self._lean(sig)
        for cand in sorted(self.lsh.query(m)):
            if float(np.mean(self._kept[cand] == sig)) >= self.accept:
                return cand
        key = len(self._kept)
        self._kept.append(sig)
        self.lsh.insert(key, m, check_duplication=False)
        return None
