"""Per-token generation time with the key/value cache and with full-window recompute.

    PYTHONPATH=$PWD python run/bench_generate.py [--new 64 512] [--hidden 256 --layers 4]

Prints, for a random-weight model of the given size with seq_length = prompt + the largest
--new, the first decode step (it compiles the fixed-cache step graph) and the mean step time
over the next 32 and the last 32 new tokens; with --recompute the same for the loop that
re-runs the whole window every step.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--seq", type=int, default=0, help="seq_length (default prompt + largest --new + 1)")
    ap.add_argument("--recompute", action="store_true", help="also time the no-cache loop (slow)")
    args = ap.parse_args()

    import mindspore as ms
    from mindspore import Tensor

    from naohai.config import MODEL_PRESETS, ModelConfig
    from naohai.generate import SamplingConfig, CachedDecoder
    from naohai.model.transformer import NaohaiLM

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    seq = args.seq or args.prompt + max(args.new) + 1
    cfg = ModelConfig(**dict(MODEL_PRESETS["tiny"], hidden_size=args.hidden, num_layers=args.layers,
                             num_heads=args.hidden // 32, ffn_hidden_size=args.hidden * 8 // 3 // 32 * 32,
                             seq_length=seq))
    model = NaohaiLM(cfg)
    prompt = list(np.random.RandomState(0).randint(3, cfg.vocab_size, args.prompt))
    for n in args.new:
        stamps = []
        dec = CachedDecoder(model, cfg, pad_id=0)
        dec.generate_ids([prompt], SamplingConfig(max_new_tokens=n, temperature=0), cfg.vocab_size,
                         on_token=lambda r, t: stamps.append(time.perf_counter()))
        steps = np.diff(stamps)[1:] * 1e3         # the first decode step compiles the graph
        print(f"cache     new={n:4d}  compile + first step {1e3 * (stamps[1] - stamps[0]):7.1f} ms  "
              f"steps 2-33 {steps[:32].mean():7.2f} ms/token  last 32 steps {steps[-32:].mean():7.2f} ms/token")
        if args.recompute:
            ids = list(prompt)
            times = []
            for _ in range(n):
                arr = np.zeros((1, seq), np.int32)
                arr[0, :len(ids)] = ids
                t0 = time.perf_counter()
                logits = model.logits(Tensor(arr)).asnumpy()[0, len(ids) - 1]
                times.append(time.perf_counter() - t0)
                ids.append(int(np.argmax(logits[:cfg.vocab_size])))
            times = np.array(times) * 1e3
            print(f"recompute new={n:4d}  first 32 steps {times[:32].mean():7.2f} ms/token  "
                  f"last 32 steps {times[-32:].mean():7.2f} ms/token")


if __name__ == "__main__":
    main()
