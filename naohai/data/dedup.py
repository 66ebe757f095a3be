"""Deduplication: exact (normalised hash) and near-duplicate (MinHash-LSH, connected components).

Both keep one document of every group of duplicates, the one with the smallest
:func:`order_key` -- the hash of its text, then its place in the input (file, line),
so the choice depends neither on the order in which the documents are met nor on how
the work is split (the local engine and the Spark engine keep the same documents).

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
    only has to keep distinct shingles apart).  The signature is cut into ``bands``
    x ``rows`` (when not given, datasketch's optimum for ``threshold`` with false
    negatives weighted 0.95, false positives 0.05); documents whose rows of a band
    are equal share that band's bucket.  :func:`bucket_edges` links the members of a
    bucket (in order-key order) to the first earlier member they match, a match being an
    estimated Jaccard similarity of at least ``threshold`` less two standard deviations
    of that estimate (``2*sqrt(t(1-t)/num_perm)``, 0.07 at 0.8 and 128 permutations).
    The connected components of those links are the near-duplicate clusters; each keeps
    its smallest order key.  :func:`near_duplicates` does all of it in one process;
    the Spark engine runs the same :func:`band_keys` and :func:`bucket_edges` on its
    partitions and finds the components with a distributed algorithm.
"""
from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
import zlib
from typing import Any, Dict, List, Sequence, Tuple

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
    return _optimal_lsh(float(cfg.threshold), int(cfg.num_perm))


@functools.lru_cache(maxsize=None)
def _optimal_lsh(threshold: float, num_perm: int) -> Tuple[int, int]:
    """datasketch's optimum (it integrates numerically: about 0.28 s a call here, so once per process)."""
    from datasketch.lsh import _optimal_param
    # candidates are verified against their signatures, so a false positive costs one comparison and a
    # false negative a kept duplicate: weight them 0.05 : 0.95 (at 0.8 and 128 permutations this gives
    # 16 bands x 8 rows, P(candidate) 0.95 at J = 0.8, where the even weighting's 9 x 13 gives 0.40)
    bands, rows = _optimal_param(threshold, num_perm, 0.05, 0.95)
    return int(bands), int(rows)


def accept_agreement(cfg) -> float:
    """The fraction of equal signature values from which two documents count as near duplicates.

    The signature estimate of a Jaccard J has standard deviation sqrt(J(1-J)/num_perm); accepting
    from two deviations below the threshold keeps pairs right at it (half of which an estimate
    >= threshold would miss) while still refusing LSH's chance collisions."""
    t = cfg.threshold
    return t - 2.0 * (t * (1 - t) / cfg.num_perm) ** 0.5


def content_hash(text: str) -> str:
    """BLAKE2b-64 of the text as it is written out (hex; the string order is the number order)."""
    return hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def order_key(text: str, file_index: int, line: int) -> Tuple[str, int, int]:
    """What decides which duplicate is kept (the smallest): the text's hash, then its place in the input."""
    return (content_hash(text), file_index, line)


def exact_keepers(pairs) -> Dict[Any, Any]:
    """(exact key, order key) pairs -> each exact key's smallest order key: the document exact dedup keeps."""
    best: Dict[Any, Any] = {}
    for key, order in pairs:
        if key not in best or order < best[key]:
            best[key] = order
    return best


MATRIX_MEMBERS = 128     # buckets up to this size compare all pairs at once (128^2 x 128 bytes)


def band_keys(sigs: np.ndarray, bands: int, rows: int) -> List[List[bytes]]:
    """Per document, per band: the bytes of that band's rows (equal bytes = the same bucket)."""
    sigs = np.ascontiguousarray(sigs, dtype=np.uint32)
    return [[row[b * rows:(b + 1) * rows].tobytes() for b in range(bands)] for row in sigs]


def bucket_edges(members: Sequence[Tuple[Any, np.ndarray]], accept: float) -> List[Tuple[Any, Any]]:
    """Links within one LSH bucket: ``members`` are (order key, signature); each member, taken in
    order-key order, is linked to the first earlier member whose signature agrees with its own on at
    least ``accept`` of the values (one comparison per member when the bucket holds copies of one text).
    Members matching none start a group of their own.  Up to MATRIX_MEMBERS members, every pair's
    agreement is computed at once."""
    members = sorted(members, key=lambda m: m[0])
    if len(members) <= MATRIX_MEMBERS:
        sigs = np.stack([np.asarray(sig) for _, sig in members])
        agrees = (np.mean(sigs[:, None, :] == sigs[None, :, :], axis=2) >= accept).tolist()
        heads: List[int] = []
        edges = []
        for i, row in enumerate(agrees):
            hit = next((h for h in heads if row[h]), None)
            if hit is None:
                heads.append(i)
            else:
                edges.append((members[hit][0], members[i][0]))
        return edges
    keys: List[Any] = []
    head_sigs: List[np.ndarray] = []
    edges = []
    for key, sig in members:
        if head_sigs:
            agree = np.mean(np.stack(head_sigs) == np.asarray(sig), axis=1)
            hit = np.flatnonzero(agree >= accept)
            if len(hit):
                edges.append((keys[int(hit[0])], key))
                continue
        keys.append(key)
        head_sigs.append(np.asarray(sig))
    return edges


def components(edges: Sequence[Tuple[Any, Any]]) -> Dict[Any, Any]:
    """Union-find: node -> the smallest node of its connected component (nodes of some edge only)."""
    parent: Dict[Any, Any] = {}

    def find(x):
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    for a, b in edges:
        parent.setdefault(a, a)
        parent.setdefault(b, b)
        ra, rb = find(a), find(b)
        if ra != rb:
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            parent[hi] = lo
    return {x: find(x) for x in parent}


def near_duplicates(keys: Sequence[Any], sigs: np.ndarray, cfg) -> Dict[Any, Any]:
    """The near duplicates among documents with distinct order ``keys`` and MinHash ``sigs``: a map from
    each document to drop to the kept representative of its cluster (the smallest key of its component).

    The LSH buckets are found per band by sorting the band's rows (``np.unique``), and a bucket with the
    same members as another (a duplicate pair shares many bands) is linked once: the links, and so the
    clusters, are those of :func:`bucket_edges` on every bucket of :func:`band_keys`.  Two-member buckets,
    most of them, are checked together."""
    bands, rows = lsh_params(cfg)
    accept = accept_agreement(cfg)
    sigs = np.ascontiguousarray(sigs, dtype=np.uint32)
    groups = set()
    for b in range(bands):
        band = np.ascontiguousarray(sigs[:, b * rows:(b + 1) * rows]).view(np.dtype((np.void, 4 * rows))).ravel()
        _, bucket, counts = np.unique(band, return_inverse=True, return_counts=True)
        bucket = bucket.ravel()
        shared = np.flatnonzero(counts[bucket] > 1)
        if len(shared):
            shared = shared[np.argsort(bucket[shared], kind="stable")]
            for members in np.split(shared, np.flatnonzero(np.diff(bucket[shared])) + 1):
                groups.add(tuple(members.tolist()))
    edges = []
    pairs = np.array([g for g in groups if len(g) == 2], dtype=np.int64).reshape(-1, 2)
    agree = np.mean(sigs[pairs[:, 0]] == sigs[pairs[:, 1]], axis=1)
    for (i, j), ok in zip(pairs.tolist(), (agree >= accept).tolist()):
        if ok:
            edges.append((keys[i], keys[j]) if keys[i] < keys[j] else (keys[j], keys[i]))
    for g in groups:
        if len(g) > 2:
            edges.extend(bucket_edges([(keys[i], sigs[i]) for i in g], accept))
    return cluster_drops(edges)


def cluster_drops(edges: Sequence[Tuple[Any, Any]]) -> Dict[Any, Any]:
    """Each linked node that is not the smallest of its component -> that smallest node (its cluster's keeper)."""
    return {x: rep for x, rep in components(edges).items() if x != rep}
