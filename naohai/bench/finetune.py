"""Full fine-tuning against LoRA: the same model trained on the same SFT windows, each variant in a worker.

:func:`write_random_sft` writes a bench-sized prepared SFT folder (:mod:`naohai.data.sft`'s format) of
random conversations: a prompt of 8-31 random tokens, then a response of 8-31 learned ones, an EOD
after each, packed into windows as ``naohai data prepare`` packs them (no tokenizer needed; the
bench model is random-initialised, the data random: throughput and memory do not depend on either).

:func:`bench_finetune` trains that data with the masked SFT loss through naohai's trainer
(:class:`naohai.bench.naohai_row.NaohaiRun`) twice, each variant in a worker process of its own
(``python -m naohai.bench.worker sft-full|sft-lora MODEL_JSON ...``), so each peak RSS (``ru_maxrss``) is
the variant's own; rounds alternate the two variants and each keeps its best round.

- ``full``: every parameter trained (``finetune: null``);
- ``lora``: :data:`LORA`, the sft-tiny recipe's adapter (rank 32, alpha 64, every linear op), base frozen.

Per variant: tokens/s over all tokens of the batches (``batch x seq`` per step) and over the learned
tokens (all tokens/s x the train split's learned fraction: loss-mask ones over ``windows x seq`` labels;
both variants read the same windows in the same order); the trained parameter count; the optimizer state as AdamWeightDecay holds it (the
bytes of its ``moments1`` and ``moments2`` tensors, as built); the worker's peak RSS.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, List

import numpy as np

from naohai.bench import arith
from naohai.bench.models import BenchModel

#: the sft-tiny recipe's LoRA (recipes/sft-tiny.yaml)
LORA = {"method": "lora", "rank": 32, "alpha": 64.0, "dropout": 0.0,
        "targets": r"attention\.(q|k|v|out)$|mlp\.(gate|up|down)$"}
VARIANTS = {"full": None, "lora": LORA}


def bench_model_json(bm: BenchModel) -> str:
    """``bm`` as the JSON a worker reads back with :func:`bench_model_from_json`."""
    return json.dumps({"name": bm.name, "batch": bm.batch, "model": dataclasses.asdict(bm.model)})


def bench_model_from_json(text: str) -> BenchModel:
    from naohai.config import ModelConfig
    d = json.loads(text)
    return BenchModel(d["name"], ModelConfig(**d["model"]), int(d["batch"]))


def _conversations(rng, vocab: int, eod: int):
    """Endless (ids, learned) conversations: prompt 8-31 tokens, response 8-31 learned, then EOD (learned)."""
    while True:
        p, r = int(rng.integers(8, 32)), int(rng.integers(8, 32))
        ids = [int(x) for x in rng.integers(2, vocab, p + r)] + [eod]
        yield ids, [0] * p + [1] * (r + 1)


def write_random_sft(path: str, vocab_size: int, seq_length: int, train_windows: int, valid_windows: int = 4,
                     seed: int = 0) -> str:
    """A prepared SFT folder of random conversations (see the module docstring); returns ``path``."""
    from naohai.data.prepare import META, token_dtype
    from naohai.data.sft import FORMAT, pack

    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = token_dtype(vocab_size)
    eod, pad = 1, 0
    splits: Dict[str, Any] = {}
    convs = _conversations(rng, vocab_size, eod)
    for split, windows in (("train", train_windows), ("valid", valid_windows)):
        taken: List = []
        # about 4 tokens of conversation per 3 of window: take plenty, keep the first ``windows`` windows
        for _ in range(int(windows) * (seq_length + 1) // 20 + 8):
            taken.append(next(convs))
        ids, mask, stats = pack(iter(taken), seq_length, pad, "drop")
        while len(ids) < windows:
            taken += [next(convs) for _ in range(8)]
            ids, mask, stats = pack(iter(taken), seq_length, pad, "drop")
        ids, mask = ids[:windows], mask[:windows]
        np.save(os.path.join(path, f"{split}.npy"), ids.astype(dtype))
        np.save(os.path.join(path, f"{split}.mask.npy"), mask)
        splits[split] = {"file": f"{split}.npy", "mask": f"{split}.mask.npy", "windows": int(len(ids)),
                         "tokens": int(ids.size), "conversations": int(stats["conversations"]),
                         "learned_tokens": int(mask.sum()), "dropped_truncated": 0, "truncated": 0}
    meta = {"format": FORMAT, "tokenizer": {"path": None, "sha256": "random-tokens", "vocab_size": int(vocab_size),
                                            "eod_id": eod, "pad_id": pad, "scheme": "random", "template": "none"},
            "seq_length": int(seq_length), "window": {"length": seq_length + 1, "stride": seq_length + 1},
            "dtype": dtype.name, "max_token_id": int(vocab_size) - 1, "holdout_fraction": 0.0, "seed": int(seed),
            "truncation": "drop", "splits": splits,
            "report": {"lines_read": 0, "conversations": sum(s["conversations"] for s in splits.values()),
                       "dropped_truncated": 0, "truncated": 0, "malformed": 0, "malformed_lines": []},
            "source": {"random": True}}
    with open(os.path.join(path, META), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=1)
    return path


def bench_finetune(bm: BenchModel, rounds: int, steps: int, workdir: str, peak: float,
                   log: Callable[[str], None] = print) -> Dict[str, Any]:
    """Both variants on ``bm`` (see the module docstring): ``{"model", "rows": {variant: row}, "ratios", ...}``."""
    from naohai.bench.process import Worker
    from naohai.model.params import count_params

    prepared = write_random_sft(os.path.join(workdir, f"sft-{bm.name}"), bm.model.vocab_size, bm.seq,
                                train_windows=max(64, 8 * bm.batch))
    with open(os.path.join(prepared, "meta.json"), encoding="utf-8") as fh:
        train = json.load(fh)["splits"]["train"]
    # learned labels over all labels (seq per window): the same windows feed both variants
    fraction = train["learned_tokens"] / float(train["windows"] * bm.seq)
    spec = bench_model_json(bm)
    workers: Dict[str, Any] = {}
    per_round: Dict[str, List[float]] = {k: [] for k in VARIANTS}
    answers: Dict[str, Dict[str, Any]] = {}
    try:
        for key in VARIANTS:
            workers[key] = Worker(f"sft-{key}", spec, prepared, workdir, peak, label=bm.name)
        for r in range(int(rounds)):
            for key in VARIANTS:
                ans = workers[key].request(cmd="round", steps=steps + 1)
                per_round[key].append(arith.tokens_per_second(bm.tokens_per_step, ans["times"]))
                answers[key] = ans
                log(f"{bm.name} fine-tuning round {r + 1}/{rounds}: {key} {per_round[key][-1]:,.0f} tokens/s")
        state = {key: workers[key].request(cmd="allocated") for key in VARIANTS}
    finally:
        for w in workers.values():
            w.close()
    rows = {}
    for key in VARIANTS:
        tps = arith.best(per_round[key])
        a = state[key]
        rows[key] = {"tokens_per_s": tps, "learned_tokens_per_s": tps * fraction if tps else None,
                     "rounds_tokens_per_s": per_round[key], "first_step_s": answers[key]["first_step_s"],
                     "trainable_params": a["parameters_count"], "optimizer_state_bytes": a["optimizer_state"],
                     "optimizer_state_tensors": a["optimizer_state_tensors"],
                     "optimizer_state_shapes": a["optimizer_state_shapes"],
                     "peak_rss": answers[key].get("peak_rss")}
    full, lora = rows["full"], rows["lora"]
    return {"model": bm.name, "params": count_params(bm.model), "batch": bm.batch, "seq": bm.seq, "steps_per_round": int(steps),
            "rounds": int(rounds), "learned_fraction": fraction, "lora": dict(LORA),
            "rows": rows,
            "ratios": {"lora_over_full_tokens_per_s": arith.ratio(lora["tokens_per_s"], full["tokens_per_s"]),
                       "lora_over_full_optimizer_state": arith.ratio(lora["optimizer_state_bytes"],
                                                                     full["optimizer_state_bytes"]),
                       "lora_over_full_peak_rss": arith.ratio(lora["peak_rss"], full["peak_rss"])}}
