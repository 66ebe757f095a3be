"""Deterministic, rank-aware, resumable batches of token windows from a prepared dir.

The loader walks a global sample position ``sample`` (windows consumed so far by
all ranks together).  Sample ``s`` lies in epoch ``e = s // N`` (N windows) and is
window ``perm_e[s % N]``, where ``perm_e`` is the permutation drawn from
``numpy.random.default_rng([seed, e])`` (or the identity when not shuffling).  A
global batch is the next ``global_batch_size`` samples (it may straddle an epoch
boundary); data-parallel rank ``r`` of ``W`` gets rows ``[r*B/W, (r+1)*B/W)``.

``state_dict()`` holds the global position, so ``load_state_dict()`` continues at
exactly the next sample, and the batches after a resume equal those of an
uninterrupted run.  Every window is visited exactly once per epoch.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import numpy as np

from naohai.data.prepare import Prepared, load_prepared
from naohai.errors import UserError


class TokenWindowLoader:
    """Batches ``[local_batch, seq_length + 1]`` int32 of one split for one rank."""

    def __init__(self, prepared_dir, split: str = "train", global_batch_size: int = 1, rank: int = 0,
                 world_size: int = 1, seed: int = 0, start_sample: int = 0, shuffle: Optional[bool] = None,
                 verify: bool = False):
        self.prepared = prepared_dir if isinstance(prepared_dir, Prepared) else load_prepared(prepared_dir,
                                                                                              verify=verify)
        self.split = split
        self.global_batch_size = int(global_batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        if self.global_batch_size <= 0:
            raise UserError(f"must be a positive integer, got {global_batch_size}", key="train.global_batch_size")
        if self.world_size <= 0 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if self.global_batch_size % self.world_size:
            raise UserError(f"{self.global_batch_size} is not divisible by the {self.world_size} data-parallel "
                            f"ranks", key="train.global_batch_size", rule="global_batch_size % data_parallel == 0")
        self.local_batch_size = self.global_batch_size // self.world_size
        self.seed = int(seed)
        self.shuffle = (split == "train") if shuffle is None else bool(shuffle)
        self.seq_length = self.prepared.seq_length
        self.num_windows = self.prepared.num_windows(split)
        if self.num_windows <= 0:
            raise UserError(f"the {split} split holds no complete window", where=self.prepared.path,
                            key="data.corpus")
        self._tokens = self.prepared.tokens(split)
        self._perm_epoch = -1
        self._perm: Optional[np.ndarray] = None
        self.sample = int(start_sample)

    # ---- order
    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            else:
                self._perm = np.arange(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def window_indices(self, start: int, count: int) -> np.ndarray:
        """Window ids of global samples ``[start, start + count)``."""
        out = np.empty(count, dtype=np.int64)
        pos = 0
        while pos < count:
            s = start + pos
            epoch, offset = divmod(s, self.num_windows)
            take = min(count - pos, self.num_windows - offset)
            out[pos:pos + take] = self._permutation(epoch)[offset:offset + take]
            pos += take
        return out

    # ---- batches
    def next_batch(self) -> np.ndarray:
        lo = self.sample + self.rank * self.local_batch_size
        idx = self.window_indices(lo, self.local_batch_size)
        s = self.seq_length
        batch = np.empty((self.local_batch_size, s + 1), dtype=np.int32)
        for row, w in enumerate(idx):
            batch[row] = self._tokens[w * s: w * s + s + 1]
        self.sample += self.global_batch_size
        return batch

    def __iter__(self) -> Iterator[np.ndarray]:
        while True:
            yield self.next_batch()

    @property
    def epoch(self) -> int:
        """Epoch of the next sample."""
        return self.sample // self.num_windows

    @property
    def epoch_progress(self) -> float:
        """Epochs completed, as a fraction (e.g. 1.25)."""
        return self.sample / self.num_windows

    # ---- resume
    def state_dict(self) -> Dict[str, Any]:
        return {"sample": int(self.sample), "seed": self.seed, "split": self.split,
                "num_windows": self.num_windows, "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in ("seed", "num_windows", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(f"the checkpoint's data loader has {key}={state[key]!r} but this run has "
                                f"{getattr(self, key)!r}; the data order cannot be resumed (prepare the same "
                                f"data or start a new run)", where=self.prepared.path, key="data")
        self.sample = int(state["sample"])


def eval_batches(prepared_dir, global_batch_size: int, num_batches: int, rank: int = 0, world_size: int = 1,
                 split: str = "valid") -> Iterator[np.ndarray]:
    """The fixed first ``num_batches`` batches of a split, in order (wrapping if the split is short)."""
    loader = TokenWindowLoader(prepared_dir, split, global_batch_size, rank, world_size, seed=0, shuffle=False)
    for _ in range(int(num_batches)):
        yield loader.next_batch()
