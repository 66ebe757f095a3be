"""`naohai.data.dedup.near_duplicates` (both engines' near dedup on one machine): its sorted, grouped buckets give
the clusters of the plain rule, written here with a dictionary of band rows, the linking rule member by member
in plain Python and a union-find, on signatures with pairs, larger buckets (past `MATRIX_MEMBERS` too), copies
and chance collisions."""
from __future__ import annotations

import numpy as np
import pytest

from naohai.data import dedup
from naohai.data.clean_config import load_clean_config


def plain_links(members, keys, sigs, accept):
    """In order-key order, each member to the first earlier unlinked member agreeing on >= accept of the values."""
    heads, links = [], []
    for i in sorted(members, key=lambda i: keys[i]):
        for h in heads:
            if sum(int(a == b) for a, b in zip(sigs[h], sigs[i])) / len(sigs[i]) >= accept:
                links.append((keys[h], keys[i]))
                break
        else:
            heads.append(i)
    return links


def plain_rule(keys, sigs, cfg):
    """Documents sharing a band's rows share a bucket; clusters are the connected links (smallest key kept)."""
    bands, rows = dedup.lsh_params(cfg)
    accept = dedup.accept_agreement(cfg)
    buckets = {}
    for i, row in enumerate(sigs.tolist()):
        for b in range(bands):
            buckets.setdefault((b, tuple(row[b * rows:(b + 1) * rows])), []).append(i)
    rep = {}

    def root(x):
        while rep.get(x, x) != x:
            x = rep[x]
        return x
    lists = sigs.tolist()
    for members in buckets.values():
        for a, b in plain_links(members, keys, lists, accept):
            ra, rb = root(a), root(b)
            if ra != rb:
                rep[max(ra, rb)] = min(ra, rb)
    linked = set(rep) | set(rep.values())
    return {x: root(x) for x in linked if root(x) != x}


def signatures(n, seed, values):
    rng = np.random.default_rng(seed)
    sigs = rng.integers(0, values, size=(n, 128), dtype=np.uint32)
    for i in range(0, n, 7):                   # near duplicates of an earlier document, at several agreements
        j = max(0, i - int(rng.integers(1, 6)))
        same = rng.random(128) < rng.choice([0.5, 0.7, 0.8, 0.9, 1.0])
        sigs[i][same] = sigs[j][same]
    for i in range(3, n - 1, 40):             # clusters of three copies
        sigs[i + 1] = sigs[i - 1]
        sigs[i] = sigs[i - 1]
    if n > 1000:                              # a bucket larger than MATRIX_MEMBERS: copies and near copies
        sigs[200:200 + 2 * dedup.MATRIX_MEMBERS, :40] = sigs[199, :40]
    keys = [(f"{int(k):016x}", 0, i) for i, k in enumerate(rng.integers(0, 2 ** 62, n))]
    if n > 1000:   # a member agreeing with two heads that disagree (in a large bucket, and in small ones)
        for a in (210, 300, 600, 700):
            b, c = a + 1, a + 2
            sigs[b] = sigs[a]
            sigs[b, 70:] = rng.integers(0, values, 58)               # a, b: 70 of 128 equal (below accept)
            sigs[c] = sigs[a]                                        # c: 85 with a, 85 with b, no band
            sigs[c, 71:100:2] = sigs[b, 71:100:2]                    # shared with one of them alone
            sigs[c, 100:] = rng.integers(0, values, 28)
            keys[a], keys[b], keys[c] = sorted([keys[a], keys[b], keys[c]])
    return keys, sigs


@pytest.mark.parametrize("n,seed,values,threshold", [(3000, 0, 2 ** 32, 0.7), (2000, 1, 2 ** 32, 0.8),
                                                     (400, 2, 3, 0.7), (1, 3, 2 ** 32, 0.7), (0, 4, 2 ** 32, 0.7)])
def test_near_duplicates_equal_the_plain_rule(n, seed, values, threshold):
    cfg = load_clean_config(None).near_dedup
    cfg.threshold = threshold
    keys, sigs = signatures(n, seed, values)
    got = dedup.near_duplicates(keys, sigs, cfg)
    assert got == plain_rule(keys, sigs, cfg)
    assert n < 100 or len(got) > n // 20      # the planted duplicates are there to be found
