"""`naohai.data.dedup.near_duplicates` (both engines' near dedup on one machine): its sorted, grouped buckets give
the clusters of the plain rule, written here with a dictionary of band bytes and every bucket linked by
`bucket_edges`, on signatures with pairs, larger buckets, copies and chance collisions."""
from __future__ import annotations

import numpy as np
import pytest

from naohai.data import dedup
from naohai.data.clean_config import load_clean_config


def plain_rule(keys, sigs, cfg):
    bands, rows = dedup.lsh_params(cfg)
    accept = dedup.accept_agreement(cfg)
    buckets = {}
    for i, row in enumerate(sigs):
        for b in range(bands):
            buckets.setdefault((b, row[b * rows:(b + 1) * rows].tobytes()), []).append(i)
    edges = []
    for members in buckets.values():
        if len(members) > 1:
            edges += dedup.bucket_edges([(keys[i], sigs[i]) for i in members], accept)
    return dedup.cluster_drops(edges)


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
    keys = [(f"{int(k):016x}", 0, i) for i, k in enumerate(rng.integers(0, 2 ** 62, n))]
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
