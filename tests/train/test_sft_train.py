"""`naohai train` on SFT data (data.format: sft) with LoRA: the run prepares the conversations, feeds
(tokens, mask) batches to the masked loss, learns, saves the adapters with the checkpoint and resumes."""
import json
import math
from pathlib import Path

import numpy as np

from naohai.config import recipe_from_dict
from naohai.data.sft import load_sft
from naohai.strategy.run_plan import plan_run
from naohai.train.job import adopt_token_ids, start, train
from tests.conftest import micro_recipe


def _recipe(tmp_path, tok, steps=8, **model):
    rows = [{"prompt": f"echo {i}", "response": f"{i}"} for i in range(200)]
    path = Path(tmp_path) / "chat.jsonl"
    if not path.exists():
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    raw = micro_recipe(Path(tmp_path) / "run", steps=steps, global_batch_size=4, micro_batch_size=2,
                       lr=2e-2).to_dict()
    raw["data"].update(format="sft", corpus=[str(path)], tokenizer=tok, holdout_fraction=0.1,
                       prepared_dir=str(Path(tmp_path) / "sft"))
    raw["model"].update(model)
    raw["finetune"] = {"method": "lora", "rank": 4, "alpha": 8.0, "targets": r"attention\.(q|v)$|mlp\.(up|down)$"}
    return recipe_from_dict(raw, where="test recipe")


def test_sft_lora_run_learns_saves_adapters_and_resumes(tmp_path, micro_data):
    _, tok = micro_data
    logs = []
    trainer = start(plan_run(_recipe(tmp_path, tok)), log=logs.append, progress=False)
    assert trainer.sft and trainer.steps.token_weight is not None
    result = trainer.run()
    assert sorted(result.losses) == list(range(1, 9))
    assert result.losses[8] < result.losses[1] < math.log(320) + 1
    meta = load_sft(str(Path(tmp_path) / "sft")).meta
    assert meta["report"]["malformed"] == 1 and any("1 malformed" in line for line in logs)
    # the micro model does not reset attention at EOD: packed conversations see each other, and it says so
    assert any("model.eod_reset is off" in line and f"model.eod_id={meta['tokenizer']['eod_id']}," in line
               for line in logs)
    quiet = []
    kept = adopt_token_ids(_recipe(tmp_path, tok, eod_reset=True, eod_id=0), str(Path(tmp_path) / "sft"), quiet.append)
    assert kept.model.eod_id == meta["tokenizer"]["eod_id"] and not any("eod_reset" in line for line in quiet)
    with open(Path(tmp_path) / "run" / "checkpoints" / "step_00000008" / "rank_0.json", encoding="utf-8") as fh:
        names = list(json.load(fh)["tensors"])
    assert "layers.0.attention.q.lora_a" in names and "adam_m.layers.1.attention.v.lora_b" in names
    assert "adam_m.layers.0.attention.q_weight" not in names            # no moments for the frozen base
    metrics = [json.loads(line) for line in open(Path(tmp_path) / "run" / "metrics.jsonl")]
    held = [m["loss"] for m in metrics if m.get("split") == "valid"]
    assert len(held) >= 2 and held[-1] < held[0] and np.isfinite(held).all()
    resumed = train(plan_run(_recipe(tmp_path, tok, steps=10)), log=lambda *_: None, progress=False)
    assert sorted(resumed.losses) == [9, 10]
