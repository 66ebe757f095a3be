"""Benchmark `naohai data clean`: MB/s per step on this machine, and near-dedup time at 1x / 2x / 4x size.

Corpus: the pydoc topics and fortunes-zh entries, with each copy of the corpus lightly
edited (so deduplication has work that grows with size rather than dropping whole
copies), and in each copy one document in ten replaced by a near-duplicate (1% of its
characters changed) of an earlier document of that copy, so the near-dedup figures
include finding and dropping duplicates.  Per-step figures time each step's function
on one core over the same documents; the end-to-end figure is the whole `clean` with
all cores.  With ``--model RUN`` the perplexity step (`naohai data score`) is timed too.

    python run/bench_clean.py [--base-docs 2000] [--workers N] [--model RUN [--score-docs 200]]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from naohai.data import dedup, normalize, pii, quality  # noqa: E402
from naohai.data.clean import clean  # noqa: E402
from naohai.data.clean_config import CleanConfig  # noqa: E402
from naohai.data.corpus import fortunes_documents, pydoc_documents  # noqa: E402
from naohai.data.fasttext_models import LanguageIdentifier  # noqa: E402


def _edit(text: str, every: int, rng: random.Random) -> str:
    chars = list(text)
    for i in rng.sample(range(len(chars)), max(1, len(chars) // every)):
        chars[i] = rng.choice(string.ascii_letters)
    return "".join(chars)


def corpus(n: int, copy: int):
    rng = random.Random(copy)
    base = list(pydoc_documents()) + [d for d in fortunes_documents() if len(d) > 100]
    docs = list(itertools.islice(itertools.cycle(base), n))
    # edit ~5% of characters: distinct from every other copy at J well under 0.8
    out = [_edit(d, 20, rng) for d in docs]
    for i in rng.sample(range(1, n), n // 10):    # planted near-duplicates of earlier documents (J ~ 0.9)
        out[i] = _edit(out[rng.randrange(i)], 100, rng)
    return out


def mbps(nbytes, seconds):
    return nbytes / 1e6 / seconds


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-docs", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--model", default=None, help="a naohai run / checkpoint folder: time the perplexity step")
    ap.add_argument("--score-docs", type=int, default=200, help="documents the perplexity step is timed on")
    args = ap.parse_args()
    cfg = CleanConfig()
    docs = corpus(args.base_docs, 0)
    nbytes = sum(len(d.encode()) for d in docs)
    print(f"corpus: {len(docs)} documents, {nbytes / 1e6:.2f} MB; {os.cpu_count()} cores")
    lid = LanguageIdentifier()
    steps = {
        "normalize": lambda d: normalize.normalize(d, cfg.normalize),
        "language": lid.identify,
        "quality": lambda d: quality.quality_reason(d, cfg.quality, None),
        "pii": lambda d: pii.deidentify(d, cfg.pii),
        "exact_dedup (hash)": dedup.exact_key,
    }
    for name, fn in steps.items():
        t = time.perf_counter()
        for d in docs:
            fn(d)
        print(f"  {name:24s} {mbps(nbytes, time.perf_counter() - t):7.2f} MB/s (1 core)")
    t = time.perf_counter()
    sigs = dedup.signatures(docs, cfg.near_dedup)
    print(f"  {'near_dedup (MinHash)':24s} {mbps(nbytes, time.perf_counter() - t):7.2f} MB/s (1 core)")
    t = time.perf_counter()
    dedup.near_duplicates([(i,) for i in range(len(docs))], sigs, cfg.near_dedup)
    print(f"  {'near_dedup (LSH)':24s} {mbps(nbytes, time.perf_counter() - t):7.2f} MB/s (1 core)")

    if args.model:
        from naohai.commands.data import load_scorer
        from naohai.data.score import score_ids
        lm = load_scorer(args.model, device="CPU")
        few = docs[:args.score_docs]
        t = time.perf_counter()
        scores = score_ids(lm.encode_batch(few), lm, 8)
        sec = time.perf_counter() - t
        print(f"  {'perplexity (model)':24s} {mbps(sum(len(d.encode()) for d in few), sec):7.3f} MB/s "
              f"({len(few)} documents, {int(scores[:, 1].sum())} tokens, {scores[:, 1].sum() / sec:.0f} tokens/s, "
              f"seq_length {lm.seq_length}, {lm.describe['model']})")

    print("near dedup (signatures + LSH, 1 core) against corpus size:")
    for k in (1, 2, 4):
        big = [d for c in range(k) for d in corpus(args.base_docs, c)]
        t = time.perf_counter()
        dropped = len(dedup.near_duplicates([(i,) for i in range(len(big))], dedup.signatures(big, cfg.near_dedup),
                                            cfg.near_dedup))
        sec = time.perf_counter() - t
        print(f"  {k}x: {len(big)} documents, {sum(len(d.encode()) for d in big) / 1e6:.2f} MB, {sec:.2f} s "
              f"({sec / k:.2f} s per 1x), {dropped} dropped ({k * (args.base_docs // 10)} planted)")

    tmp = tempfile.mkdtemp()
    try:
        path = os.path.join(tmp, "in.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        t = time.perf_counter()
        clean([path], os.path.join(tmp, "out"), cfg, workers=args.workers, progress=False)
        sec = time.perf_counter() - t
        print(f"end to end, all steps, {args.workers} workers: {sec:.2f} s, {mbps(nbytes, sec):.2f} MB/s "
              f"(includes loading the models and forking)")
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
