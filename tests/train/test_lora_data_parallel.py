"""LoRA under data parallel over msrun on CPU, for real: 2 workers == 1 process with the same global batch
(the adapters' gradients all-reduced, the frozen base untouched on both)."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from naohai.checkpoint.store import list_checkpoints
from naohai.model.lora import is_adapter_name
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.train.test_data_parallel import _launch, _metrics, _recipe_file, _strategy_file

FINETUNE = {"method": "lora", "rank": 4, "alpha": 8.0, "targets": r"attention\.(q|v)$|mlp\.down$"}


def _lora(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        raw = yaml.safe_load(fh)
    raw["finetune"] = dict(FINETUNE)
    with open(path, "w", encoding="utf-8") as fh:
        yaml.safe_dump(raw, fh)
    return path


@pytest.mark.slow
def test_lora_two_workers_match_one_process(tmp_path, micro_data):
    prepared, tok = micro_data
    dp_recipe = _lora(_recipe_file(tmp_path, "dp", prepared, tok))
    proc = _launch(dp_recipe, _strategy_file(tmp_path), tmp_path)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:]

    from naohai.config import load_recipe
    single = load_recipe(_lora(_recipe_file(tmp_path, "single", prepared, tok, micro_batch_size=8)))
    ref = start(plan_run(single), log=lambda *_: None, progress=False).run()
    got = _metrics(str(tmp_path / "dp"))
    train = {r["step"]: r["loss"] for r in got if r["split"] == "train"}
    assert sorted(train) == list(range(1, 7))
    assert len(set(train.values())) > 1          # the adapters learn: the loss moves
    for step, loss in train.items():
        assert abs(loss - ref.losses[step]) <= 1e-5, (step, loss, ref.losses[step])
    # the workers fine-tuned: rank 0's checkpoint is adapter-only and names its base
    last = list_checkpoints(str(tmp_path / "dp"))[-1]
    with open(os.path.join(last, "manifest.json"), encoding="utf-8") as fh:
        assert json.load(fh).get("finetune_base") is not None
    import mindspore as ms
    names = [n for n in ms.load_checkpoint(os.path.join(last, "rank_0.ckpt")) if n.startswith("layers.")]
    assert names and all(is_adapter_name(n) for n in names), names
