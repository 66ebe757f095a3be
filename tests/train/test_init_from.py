"""train.init_from: a run starts from another model's weights at step 0 (fresh optimizer, data from the
start), from a run folder, a checkpoint folder or an imported model folder.

References: the source model's own held-out loss (its run evaluated the same held-out batches), and
the loss of the source weights on the new run's first batch computed outside the trainer
(:func:`naohai.evaluate.evaluate` on the model :func:`naohai.checkpoint.weights.load_model` builds).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms

from naohai.checkpoint.store import list_checkpoints, read_manifest
from naohai.checkpoint.weights import find_weights, load_model
from naohai.convert.model_dir import write_model_dir
from naohai.data.loader import TokenWindowLoader
from naohai.errors import UserError
from naohai.evaluate import evaluate
from naohai.strategy.run_plan import plan_run
from naohai.train.job import train
from tests.conftest import micro_recipe


def _quiet(recipe, **kw):
    return train(plan_run(recipe), log=lambda *_: None, progress=False, **kw)


@pytest.fixture(scope="module")
def source(tmp_path_factory, micro_data):
    """A trained micro run (8 steps) and its result."""
    prepared, tok = micro_data
    run = tmp_path_factory.mktemp("init_source") / "run"
    return run, _quiet(micro_recipe(run, prepared, tok))


def _first_batch_loss(path, recipe):
    """The loss of ``path``'s weights on the first train batch of ``recipe`` (outside the trainer)."""
    batch = TokenWindowLoader(recipe.data.prepared_dir, "train", recipe.train.global_batch_size, 0, 1,
                              seed=recipe.data.shuffle_seed).next_batch()
    ms.set_context(mode=ms.PYNATIVE_MODE)
    found, model = load_model(str(path))
    model.set_train(False)
    try:
        return evaluate(model, found.recipe.model, np.asarray(batch)).loss
    finally:
        ms.set_context(mode=ms.GRAPH_MODE)


def test_starts_from_a_run_at_step_zero(tmp_path, micro_data, source):
    prepared, tok = micro_data
    src_run, src = source
    logs = []
    recipe = micro_recipe(tmp_path / "b", prepared, tok, steps=4, init_from=str(src_run))
    result = train(plan_run(recipe), log=logs.append, progress=False)
    # step 0 evaluates the source's final weights on the held-out batches the source evaluated at step 8
    assert result.evals[0] == pytest.approx(src.evals[8], rel=1e-6)
    # the first train loss is the source weights' loss on this run's first batch
    assert result.losses[1] == pytest.approx(_first_batch_loss(src_run, recipe), rel=1e-5)
    assert sorted(result.losses) == [1, 2, 3, 4]
    line = next(x for x in logs if x.startswith("initialised from"))
    assert "step_00000008" in line and "step 0" in line and "optimizer state fresh" in line
    man = read_manifest(list_checkpoints(str(tmp_path / "b"))[-1])
    assert man["step"] == 4 and man["data"]["loader"] == _loader_after(recipe, 4)
    # run again: the run resumes from its own checkpoint; init_from is not applied a second time
    logs.clear()
    again = micro_recipe(tmp_path / "b", prepared, tok, steps=6, init_from=str(src_run))
    resumed = train(plan_run(again), log=logs.append, progress=False)
    assert sorted(resumed.losses) == [5, 6]
    assert any("not used: this run resumed" in x for x in logs)


def _loader_after(recipe, steps):
    loader = TokenWindowLoader(recipe.data.prepared_dir, "train", recipe.train.global_batch_size, 0, 1,
                               seed=recipe.data.shuffle_seed)
    for _ in range(steps):
        loader.next_batch()
    return json.loads(json.dumps(loader.state_dict()))


def test_starts_from_a_checkpoint_folder_and_an_imported_model(tmp_path, micro_data, source):
    prepared, tok = micro_data
    src_run, src = source
    step4 = list_checkpoints(str(src_run))[0]
    assert read_manifest(step4)["step"] == 4
    from_ckpt = _quiet(micro_recipe(tmp_path / "c", prepared, tok, steps=2, eval_every=100, init_from=step4))
    assert from_ckpt.evals[0] == pytest.approx(src.evals[4], rel=1e-6)
    # an imported model folder holding the source's final weights, in the other layer form (the loop)
    found = find_weights(str(src_run))
    folder = write_model_dir(str(tmp_path / "model"), found.recipe, found.tensors())
    from_dir = _quiet(micro_recipe(tmp_path / "d", prepared, tok, steps=2, eval_every=100, layer_loop="always",
                                   init_from=folder))
    assert from_dir.evals[0] == pytest.approx(src.evals[8], rel=1e-6)
    [full] = (tmp_path / "d" / "init").glob("model-full-*")
    assert (full / "manifest.json").exists()
    # the source rewritten in place (other weights, same name): a new start writes a new full copy from it,
    # never the stale one
    other = {k: v + 0.25 for k, v in found.tensors().items()}
    os.remove(os.path.join(folder, "model.ckpt"))
    write_model_dir(str(tmp_path / "model2"), found.recipe, other)
    shutil.copyfile(tmp_path / "model2" / "model.ckpt", os.path.join(folder, "model.ckpt"))
    shutil.rmtree(tmp_path / "d" / "checkpoints")
    again = _quiet(micro_recipe(tmp_path / "d", prepared, tok, steps=2, eval_every=100, layer_loop="always",
                                init_from=folder))
    assert len(list((tmp_path / "d" / "init").glob("model-full-*"))) == 2
    assert again.evals[0] != pytest.approx(from_dir.evals[0], rel=1e-3)


def test_weights_that_do_not_fit_or_do_not_exist_are_user_errors(tmp_path, micro_data, source):
    prepared, tok = micro_data
    src_run, _ = source
    with pytest.raises(UserError, match="not found") as info:
        _quiet(micro_recipe(tmp_path / "e", prepared, tok, init_from=str(tmp_path / "nowhere")))
    assert info.value.key == "train.init_from"
    with pytest.raises(UserError, match="do not fit") as info:
        recipe = micro_recipe(tmp_path / "f", prepared, tok, init_from=str(src_run))
        recipe.model.hidden_size = 64
        recipe.model.ffn_hidden_size = 128
        _quiet(recipe)
    assert info.value.key == "train.init_from"
    with pytest.raises(UserError, match="holds no model weights"):
        find_weights(str(tmp_path))
    # weights trained with another tokenizer: the source's manifest records another tokenizer's SHA-256
    other = tmp_path / "other" / "step_00000008"
    shutil.copytree(list_checkpoints(str(src_run))[-1], other)
    man = json.loads((other / "manifest.json").read_text())
    man["identity"]["tokenizer_sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(UserError, match="another tokenizer") as info:
        _quiet(micro_recipe(tmp_path / "g", prepared, tok, init_from=str(other)))
    assert info.value.key == "train.init_from" and "data.tokenizer" in info.value.message
