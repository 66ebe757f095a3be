"""How fast naohai's data loader delivers training batches, without any training.

``loader_tokens_per_s(prepared_dir, batch)`` times :meth:`TokenWindowLoader.next_batch`
(shuffled windows out of the memory-mapped shard, as the trainer reads them) for at
least ``min_seconds`` and returns tokens (batch x seq) per second.  The trainer calls
the loader synchronously, so loader / training tokens per second >= 10 means the loader
takes at most a tenth of a step.
"""
from __future__ import annotations

import time

from naohai.data.loader import TokenWindowLoader


def loader_tokens_per_s(prepared_dir: str, batch: int, min_seconds: float = 1.0, min_batches: int = 50) -> float:
    loader = TokenWindowLoader(prepared_dir, "train", batch, seed=7)
    tokens = batch * loader.seq_length
    loader.next_batch()                              # first permutation and page-in outside the timing
    count, t0 = 0, time.perf_counter()
    while count < min_batches or time.perf_counter() - t0 < min_seconds:
        loader.next_batch()
        count += 1
    return count * tokens / (time.perf_counter() - t0)
