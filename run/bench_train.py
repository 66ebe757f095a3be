#!/usr/bin/env python
"""Benchmark: naohai's train step against MindSpore's stock TrainOneStepCell, same run.

Both train the same NaohaiLM (tiny preset unless --preset) on the same random batches
with AdamWeightDecay; the peer has no clipping, loss scale or finite check.  Prints
tokens/s for each and the ratio naohai / peer (1.0 = no overhead).  Not a test.

    python run/bench_train.py [--preset tiny] [--steps 30] [--batch 16]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn

from naohai.config import MODEL_PRESETS, ModelConfig
from naohai.model.transformer import NaohaiLM
from naohai.train.step import TrainStep


def _time(step, batches, warmup=3):
    for ids, labels in batches[:warmup]:
        step(ids, labels)
    start = time.perf_counter()
    for ids, labels in batches[warmup:]:
        out = step(ids, labels)
    (out[0] if isinstance(out, tuple) else out).asnumpy()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_device("CPU")
    cfg = ModelConfig(**MODEL_PRESETS[args.preset])
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(args.steps + 3):
        tok = rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_length + 1)).astype(np.int32)
        batches.append((Tensor(tok[:, :-1]), Tensor(tok[:, 1:])))
    tokens = args.steps * args.batch * cfg.seq_length

    ours_model = NaohaiLM(cfg, seed=0)
    ours_opt = nn.AdamWeightDecay(ours_model.trainable_params(), learning_rate=1e-3)
    ours = TrainStep(ours_model, ours_opt, grad_clip=1.0)
    scale = Tensor(1.0, ms.float32)
    peer_model = NaohaiLM(cfg, seed=0)
    peer = nn.TrainOneStepCell(peer_model, nn.AdamWeightDecay(peer_model.trainable_params(), learning_rate=1e-3))
    # alternate rounds so that load from other processes hits both alike; keep the best round
    t_ours, t_peer = float("inf"), float("inf")
    for _ in range(args.rounds):
        t_ours = min(t_ours, _time(lambda i, l: ours(i, l, scale), batches))
        t_peer = min(t_peer, _time(peer, batches))

    print(f"preset {args.preset}, batch {args.batch} x {cfg.seq_length}, {args.steps} timed steps")
    print(f"naohai TrainStep (clip + finite check + scale): {tokens / t_ours:,.0f} tokens/s")
    print(f"MindSpore TrainOneStepCell (peer)             : {tokens / t_peer:,.0f} tokens/s")
    print(f"ratio naohai / peer: {t_peer / t_ours:.3f}")


if __name__ == "__main__":
    main()
