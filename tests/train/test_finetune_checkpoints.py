"""A prefix-tuning / Houlsby-adapter run's checkpoints hold the method's tensors and their moments only,
name their base, verify; eval reads the run over its base (logits = the base model with the method's
trained tensors); generate runs both (the prefix run with its virtual keys/values in the cache)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.checkpoint.adapters import BASE_KEY
from naohai.checkpoint.store import list_checkpoints, read_manifest
from naohai.checkpoint.weights import find_weights, load_model
from naohai.cli import main
from naohai.config import recipe_from_dict
from naohai.convert.weights import assign_weights
from naohai.model.finetune import apply_finetune, is_method_name
from naohai.model.params import param_shapes
from naohai.model.transformer import NaohaiLM
from naohai.strategy.run_plan import plan_run
from naohai.train.job import train
from tests.conftest import micro_recipe

METHODS = {"prefix": {"num_virtual_tokens": 4}, "adapter": {"bottleneck": 4}}


def _quiet(recipe):
    return train(plan_run(recipe), log=lambda *_: None, progress=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory, micro_data):
    prepared, tok = micro_data
    root = tmp_path_factory.mktemp("ft_ckpt")
    _quiet(micro_recipe(root / "base", prepared, tok, steps=4))
    return root / "base"


@pytest.mark.parametrize("method", sorted(METHODS))
def test_run_checkpoints_hold_the_method_only_and_serve(base, micro_data, tmp_path, capsys, method):
    prepared, tok = micro_data
    raw = micro_recipe(tmp_path / "ft", prepared, tok, steps=4, lr=2e-2, save_every=4).to_dict()
    raw["model"]["max_positions"] = 40
    raw["train"]["init_from"] = str(base)
    raw["finetune"] = {"method": method, **METHODS[method]}
    _quiet(recipe_from_dict(raw, where="test recipe"))
    run = str(tmp_path / "ft")
    ckpt = list_checkpoints(run)[-1]
    man = read_manifest(ckpt)
    assert man[BASE_KEY]["path"] == os.path.abspath(list_checkpoints(str(base))[-1])
    names = list(json.load(open(os.path.join(ckpt, "rank_0.json")))["tensors"])
    assert not {p.name for p in param_shapes(recipe_from_dict(man["recipe"]).model)} & set(names)   # no base
    trained = sorted(n for n in names if is_method_name(n))
    assert trained and sorted(n for n in names if n.startswith(("adam_m.", "adam_v."))) == sorted(
        f"adam_{m}.{n}" for n in trained for m in "mv")
    assert main(["ckpt", "verify", run]) == 0
    # the run reads as the base model with the method's trained tensors
    found = find_weights(run)
    values = found.adapters()
    _, plain = load_model(str(base))
    model = NaohaiLM(found.recipe.model, seed=5)
    apply_finetune(model, found.recipe.finetune, seed=5)
    assign_weights(model, {**{p.name: p.asnumpy() for p in plain.get_parameters()}, **values})
    ids = np.random.default_rng(0).integers(3, 320, size=(2, 32)).astype(np.int32)
    model.set_train(False)
    _, served = load_model(run)
    served.set_train(False)
    np.testing.assert_array_equal(served.logits(Tensor(ids)).asnumpy(), model.logits(Tensor(ids)).asnumpy())
    plain.set_train(False)
    assert np.abs(model.logits(Tensor(ids)).asnumpy() - plain.logits(Tensor(ids)).asnumpy()).max() > 1e-4
    np.save(tmp_path / "ids.npy", np.random.default_rng(1).integers(3, 320, size=(4, 33)))
    capsys.readouterr()
    assert main(["eval", run, "--ids", str(tmp_path / "ids.npy"), "--json"]) == 0
    assert np.isfinite(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"])
    code = main(["generate", run, "--prompt", "def f", "--max-new-tokens", "3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err
    ms.set_context(mode=ms.GRAPH_MODE)


def test_a_prefix_run_as_init_from_is_refused(base, micro_data, tmp_path, capsys):
    """A run of a method that does not fold is no model to start from (its adapter would be dropped)."""
    prepared, tok = micro_data
    raw = micro_recipe(tmp_path / "ft", prepared, tok, steps=2, save_every=2).to_dict()
    raw["model"]["max_positions"] = 40
    raw["train"]["init_from"] = str(base)
    raw["finetune"] = {"method": "prefix", "num_virtual_tokens": 2}
    _quiet(recipe_from_dict(raw, where="test recipe"))
    again = micro_recipe(tmp_path / "again", prepared, tok, steps=2).to_dict()
    again["train"]["init_from"] = str(tmp_path / "ft")
    from naohai.errors import UserError
    with pytest.raises(UserError, match=r"key 'train.init_from'.*prefix adapter, which does not fold"):
        _quiet(recipe_from_dict(again, where="test recipe"))
    assert not list_checkpoints(str(tmp_path / "again"))
