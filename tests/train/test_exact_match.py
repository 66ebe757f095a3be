"""Held-out exact match (train.exact_match): the count against a hand count, its equivalence with greedy
decoding on a live model, and a short SFT run that logs `exact_match` rows (before step 1 and after)."""
import json
from pathlib import Path

import numpy as np
import pytest

from naohai.config import recipe_from_dict
from naohai.errors import UserError
from naohai.train.exact_match import answer_spans, count_exact
from naohai.strategy.run_plan import plan_run
from naohai.train.job import train
from tests.conftest import micro_recipe


@pytest.fixture(autouse=True)
def _cpu():
    """The device is named before MindSpore's runtime starts (a later run's set_device must agree)."""
    import mindspore as ms
    ms.set_device("CPU")


def test_count_against_a_hand_count():
    tokens = np.array([[9, 5, 6, 7, 1, 9, 8, 1, 0],
                       [9, 4, 4, 1, 9, 3, 1, 0, 0]])
    mask = np.array([[0, 0, 1, 1, 1, 0, 1, 1, 0],          # answers at 2..4 and 6..7
                     [0, 0, 1, 1, 0, 0, 1, 0, 0]])         # answers at 2..3 and 6
    assert answer_spans(mask[0]) == [(2, 5), (6, 8)]
    predicted = np.array([[0, 6, 7, 1, 0, 8, 2, 0],        # answer 1 right (6 7 1), answer 2 wrong at 7 (2 != 1)
                          [0, 4, 1, 0, 0, 1, 0, 0]])       # answer 1 right (4 1), answer 2 right (1)
    # by hand: 3 of the 4 answers are reproduced exactly
    assert count_exact(tokens, mask, predicted) == (3, 4)
    predicted[1, 5] = 3                                   # row 1's second answer now wrong
    assert count_exact(tokens, mask, predicted) == (2, 4)
    assert count_exact(tokens, np.zeros_like(mask), predicted) == (0, 0)


def test_teacher_forced_match_is_greedy_decoding(micro_data):
    """A model's own greedy continuation (key/value-cache decoding, naohai.generate) is matched; changing
    any one of its tokens makes it a miss."""
    import mindspore as ms
    from naohai.generate import CachedDecoder, SamplingConfig
    from naohai.model.transformer import NaohaiLM
    from naohai.train.exact_match import _logits_net, predictions

    cfg = micro_recipe("unused").model
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        model = NaohaiLM(cfg, seed=5)
        model.set_train(False)
        prompt = [7, 20, 31, 44, 52]
        new = CachedDecoder(model, cfg).generate_ids([prompt], SamplingConfig(temperature=0.0, max_new_tokens=6),
                                                     vocab=cfg.vocab_size)[0]
        window = np.zeros((1, cfg.seq_length + 1), np.int64)
        window[0, :11] = prompt + new
        mask = np.zeros_like(window)
        mask[0, 5:11] = 1
        predicted = predictions(_logits_net(model), window, 1, cfg.vocab_size)
        assert count_exact(window, mask, predicted) == (1, 1)
        for j in range(5, 11):
            other = window.copy()
            other[0, j] = (other[0, j] + 1) % cfg.vocab_size
            assert count_exact(other, mask, predictions(_logits_net(model), other, 1, cfg.vocab_size))[0] == 0
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def _recipe(tmp_path, tok, steps):
    rows = [{"prompt": f"Repeat: {w}", "response": w} for w in
            ["for", "while", "class", "return", "import", "yield", "with", "lambda", "global", "try"] * 8]
    rows = [dict(r, prompt=f"{r['prompt']} {i}") for i, r in enumerate(rows)]
    path = Path(tmp_path) / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    raw = micro_recipe(Path(tmp_path) / "run", steps=steps, global_batch_size=4, micro_batch_size=2, lr=2e-2,
                       eval_every=3).to_dict()
    raw["data"].update(format="sft", corpus=[str(path)], tokenizer=tok, holdout_fraction=0.2,
                       prepared_dir=str(Path(tmp_path) / "sft"))
    raw["train"]["exact_match"] = True
    raw["finetune"] = {"method": "lora", "rank": 4, "alpha": 8.0, "targets": r"attention\.(q|v)$"}
    return recipe_from_dict(raw, where="test recipe")


def test_a_short_run_logs_exact_match_rows(tmp_path, micro_data):
    logs = []
    train(plan_run(_recipe(tmp_path, micro_data[1], steps=4)), log=logs.append, progress=False)
    rows = [json.loads(line) for line in open(Path(tmp_path) / "run" / "metrics.jsonl")]
    em = [r for r in rows if "exact_match" in r]
    assert [r["step"] for r in em] == [0, 3, 4]
    from naohai.data.sft import load_sft
    held_out = load_sft(str(Path(tmp_path) / "sft")).meta["splits"]["valid"]["conversations"]
    for r in em:                                          # one answer per held-out conversation
        assert r["task"] == "sft_heldout" and r["n"] == held_out >= 1 and 0.0 <= r["exact_match"] <= 1.0
        assert r["exact_match"] == pytest.approx(r["matched"] / r["n"])
    assert any("held-out exact match (sft_heldout)" in line for line in logs)
    assert (Path(tmp_path) / "run" / "downstream.png").exists()


def test_exact_match_needs_sft_data(tmp_path):
    raw = micro_recipe(tmp_path).to_dict()
    raw["train"]["exact_match"] = True
    with pytest.raises(UserError, match="key 'train.exact_match'"):
        recipe_from_dict(raw, where="test recipe").validate()


def test_exact_match_refuses_a_layout_that_shards_the_model(tmp_path, micro_data):
    """The scorer needs the whole model on each rank: a semi-auto layout stops before anything is prepared."""
    recipe = _recipe(tmp_path, micro_data[1], steps=4)
    strategy = Path(tmp_path) / "dp2-mp2.yaml"
    strategy.write_text("name: micro-dp2-mp2\nmesh: {data: 2, model: 2, pipeline: 1}\nmicro_batches: 1\n"
                        "optimizer_parallel: {enabled: false}\n", encoding="utf-8")
    with pytest.raises(UserError, match="key 'train.exact_match'.*shards the model"):
        train(plan_run(recipe, str(strategy)), log=lambda *_: None, progress=False)
    assert not (Path(tmp_path) / "sft").exists() and not (Path(tmp_path) / "run").exists()
