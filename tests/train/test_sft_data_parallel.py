"""The masked fine-tuning loss under data parallel over msrun on CPU, for real: 2 workers, each accumulating
2 micro-batches of 2 rows, == 1 process accumulating 2 micro-batches of 4 rows (the same global batch of 8;
the same held-out batches of 4 rows).  The conversations' learned tokens are spread unevenly over rows,
micro-batches and ranks, so a per-rank or per-micro-batch normalisation would differ (checked below)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from naohai.checkpoint.store import list_checkpoints
from naohai.config import load_recipe
from naohai.data.sft import SFTLoader, masked_labels
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.train.test_data_parallel import _launch, _metrics, _recipe_file, _strategy_file


def _conversations(path) -> str:
    rng = np.random.default_rng(7)
    lines = []
    for i in range(120):
        turns = [{"role": "user", "content": f"{i}"},
                 {"role": "assistant", "content": "a" * int(rng.integers(1, 12))}]
        if i % 4 == 0:
            turns += [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c" * int(rng.integers(1, 6))}]
        lines.append(json.dumps({"messages": turns}))
    path.write_text("\n".join(lines), encoding="utf-8")
    return str(path)


def _sft(recipe_path: str, corpus: str, sft_dir: str) -> str:
    with open(recipe_path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["data"].update(format="sft", corpus=[corpus], prepared_dir=sft_dir, holdout_fraction=0.1, truncation="truncate")
    raw["train"]["grad_clip"] = 0.0
    with open(recipe_path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return recipe_path


@pytest.mark.slow
def test_sft_two_workers_match_one_process(tmp_path, micro_data):
    _, tok = micro_data
    corpus, sft_dir = _conversations(tmp_path / "chat.jsonl"), str(tmp_path / "sft")
    # one process, 2 micro-batches of 4 rows (it also prepares the SFT shards)
    single = load_recipe(_sft(_recipe_file(tmp_path, "single", sft_dir, tok, micro_batch_size=4), corpus, sft_dir))
    ref = start(plan_run(single), log=lambda *_: None, progress=False).run()
    # the batches are uneven: rank halves and micro-batches of 2 rows hold different learned-token counts
    loader = SFTLoader(sft_dir, "train", 8, seed=single.data.shuffle_seed)
    counts = [(masked_labels(loader.next_batch())[1] >= 0).sum(axis=1) for _ in range(6)]
    assert all(len({int(c[i:i + 2].sum()) for i in range(0, 8, 2)}) > 1 for c in counts)

    # 2 workers x (2 micro-batches of 2 rows, accumulated on the host)
    dp = _sft(_recipe_file(tmp_path, "dp", sft_dir, tok, micro_batch_size=2), corpus, sft_dir)
    proc = _launch(dp, _strategy_file(tmp_path), tmp_path)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    got = _metrics(str(tmp_path / "dp"))
    train = {r["step"]: r["loss"] for r in got if r["split"] == "train"}
    valid = {r["step"]: r["loss"] for r in got if r["split"] == "valid"}
    assert sorted(train) == list(range(1, 7)) and sorted(valid) == [0, 3, 6]
    assert len(set(train.values())) > 1
    for step, loss in train.items():
        assert abs(loss - ref.losses[step]) <= 1e-6 * abs(ref.losses[step]), (step, loss, ref.losses[step])
    for step, loss in valid.items():
        assert abs(loss - ref.evals[step]) <= 1e-6 * abs(ref.evals[step]), (step, loss, ref.evals[step])
    # the final weights agree
    import mindspore as ms
    mine = ms.load_checkpoint(os.path.join(list_checkpoints(str(tmp_path / "dp"))[-1], "rank_0.ckpt"))
    theirs = ms.load_checkpoint(os.path.join(list_checkpoints(str(tmp_path / "single"))[-1], "rank_0.ckpt"))
    weights = [n for n in theirs if n.startswith(("layers.", "embedding."))]
    assert weights and set(weights) <= set(mine)
    for name in weights:
        a, b = mine[name].asnumpy(), theirs[name].asnumpy()
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(b).max()), name
