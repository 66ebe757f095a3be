"""A model family added from this file alone (no product file edited) is selected by a recipe and trains."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from naohai.config import load_recipe, recipe_from_dict
from naohai.errors import UserError
from naohai.model import families
from naohai.model.families import Family
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start

# A family none of the shipped ones is: ALiBi, exact GeLU, RMSNorm, no biases, an untied head.
TOY = Family(
    name="toy",
    summary="test family: ALiBi, GeLU, RMSNorm, no biases, untied head",
    defaults=dict(position="alibi", activation="gelu", norm="rmsnorm", bias=False, tie_embeddings=False),
    presets={"toy-micro": dict(vocab_size=320, vocab_pad_multiple=64, hidden_size=32, num_layers=2, num_heads=4,
                               ffn_hidden_size=64, seq_length=32)},
)
TRAIN = dict(steps=8, global_batch_size=4, micro_batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=2, log_every=2,
             eval_every=4, eval_batches=2, save_every=4)


@pytest.fixture
def toy():
    families.register(TOY)
    yield TOY
    families.unregister(TOY.name)


def _recipe(model, out, prepared=None, tok=None):
    data = {"corpus": ["builtin:pydoc"], "holdout_fraction": 0.05}
    if prepared:
        data.update(prepared_dir=str(prepared), tokenizer=str(tok))
    return recipe_from_dict({"name": "toy", "model": model, "data": data, "train": dict(TRAIN, output_dir=str(out))},
                            where="test recipe")


def test_family_and_preset_select_the_same_model(toy, tmp_path):
    by_preset = _recipe({"preset": "toy-micro"}, tmp_path).model
    by_family = _recipe(dict(TOY.presets["toy-micro"], family="toy"), tmp_path).model
    assert by_preset == by_family
    assert (by_preset.family, by_preset.position, by_preset.norm, by_preset.bias) == ("toy", "alibi", "rmsnorm", False)
    # a recipe key overrides the family's choice; the preset's family must agree with model.family
    assert _recipe({"preset": "toy-micro", "bias": True}, tmp_path).model.bias is True
    with pytest.raises(UserError, match="of family 'toy', not 'pangu'"):
        _recipe({"preset": "toy-micro", "family": "pangu"}, tmp_path)
    assert "toy-micro" in families.MODEL_PRESETS


def test_an_unregistered_family_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="unknown model family 'toy'") as info:
        _recipe({"family": "toy"}, tmp_path)
    assert info.value.key == "model.family"
    with pytest.raises(UserError, match="unknown preset 'toy-micro'"):
        _recipe({"preset": "toy-micro"}, tmp_path)


def test_the_new_family_trains(toy, tmp_path, micro_data):
    prepared, tok = micro_data
    recipe = _recipe({"preset": "toy-micro"}, tmp_path / "run", prepared, tok)
    trainer = start(plan_run(recipe), log=lambda *_: None, progress=False)
    result = trainer.run()
    assert sorted(result.losses) == list(range(1, 9))
    first, last = result.losses[1], result.losses[8]
    assert abs(first - math.log(320)) < 0.5          # a fresh model predicts about uniformly over the vocabulary
    assert last < first - 0.3
    # the family's choices reached the cells: RMSNorm (gamma, no beta), no biases, an untied head
    with open(Path(tmp_path) / "run" / "checkpoints" / "step_00000008" / "rank_0.json", encoding="utf-8") as fh:
        names = [n for n in json.load(fh)["tensors"] if not n.startswith(("adam_", "global_step"))]
    assert "head.weight" in names and "layers.1.input_norm.gamma" in names
    assert not [n for n in names if n.endswith(("beta", "bias", "position_embedding"))]
    # the run folder's recipe names the family and reads back to the same model
    assert load_recipe(str(Path(tmp_path) / "run" / "recipe.resolved.yaml")).model == recipe.model
