"""train.init_from=HF_DIR: a run starts from a Hugging Face folder's weights (a tiny random llama
built locally with transformers, its byte-level BPE tokenizer.json beside it).

Reference: transformers' own mean token NLL of that model on the run's first batch (the batch
naohai's loader hands the trainer, read again outside the trainer).
"""
from __future__ import annotations

import dataclasses

import pytest

from naohai.config import recipe_from_dict
from naohai.convert.hf.convert import open_hf
from naohai.data.loader import TokenWindowLoader
from naohai.data.pipeline import default_prepared_dir
from naohai.errors import UserError
from naohai.strategy.run_plan import plan_run
from naohai.train.job import train
from tests.conftest import micro_recipe
from tests.convert import hf_models

pytest.importorskip("transformers")

#: a corpus the byte BPE of hf_models encodes (any text does: it is byte level)
LINES = [f"{hf_models.TEXT} line {i}: the loop runs {i % 7} times; 模型 {i * 3}" for i in range(400)]


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """(transformers model, its saved folder, a corpus file)."""
    root = tmp_path_factory.mktemp("hf_init")
    folder = str(root / "llama")
    model = hf_models.build("llama", folder)
    corpus = root / "corpus.txt"
    corpus.write_text("\n\n\n".join(LINES), encoding="utf-8")
    return model, folder, str(corpus)


def _recipe(out, folder, corpus, **train_kw):
    """A recipe whose model is the folder's (from its config.json), trained on ``corpus`` with its tokenizer."""
    cfg = open_hf(folder, {"seq_length": 32})[0].model
    model = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    train_cfg = dict(steps=20, global_batch_size=4, micro_batch_size=4, lr=1e-3, min_lr=1e-4, warmup_steps=2,
                     log_every=5, eval_every=100, eval_batches=1, save_every=20, output_dir=str(out),
                     init_from=folder)
    train_cfg.update(train_kw)
    return recipe_from_dict({"name": "from-hf", "model": model,
                             "data": {"corpus": [corpus], "tokenizer": f"{folder}/tokenizer.json",
                                      "holdout_fraction": 0.05},
                             "train": train_cfg}, where="test recipe")


def test_twenty_steps_from_a_hugging_face_folder(tmp_path, hf_llama):
    model, folder, corpus = hf_llama
    recipe = _recipe(tmp_path / "run", folder, corpus)
    logs = []
    result = train(plan_run(recipe), log=logs.append, progress=False)
    assert sorted(result.losses) == list(range(1, 21))
    line = next(x for x in logs if x.startswith("initialised from"))
    assert "hugging face folder" in line and "step 0" in line
    batch = TokenWindowLoader(default_prepared_dir(recipe), "train", 4, 0, 1, seed=recipe.data.shuffle_seed).next_batch()
    want = hf_models.hf_mean_nll(model, batch)
    assert result.losses[1] == pytest.approx(want, rel=1e-5), (result.losses[1], want)
    assert result.losses[20] < result.losses[1]


def test_a_published_models_padded_embedding_trains_from_its_folder(tmp_path, hf_llama):
    """Qwen2.5 has 151,936 embedding rows for a 151,665-token tokenizer (BLOOM, OLMo, GLM-4 and Pythia pad
    too): training from such a folder was refused ('set model.vocab_size=...', which its shapes forbid).  A
    qwen2 folder with 320 rows over the 300-token tokenizer: the first loss is transformers' NLL of the
    batch, over all 320 rows."""
    _, _, corpus = hf_llama
    folder = str(tmp_path / "qwen2-padded")
    model = hf_models.build("qwen2", folder, vocab_size=320)
    recipe = _recipe(tmp_path / "run", folder, corpus, steps=2)
    assert recipe.model.vocab_size == 320
    result = train(plan_run(recipe), log=lambda *_: None, progress=False)
    batch = TokenWindowLoader(default_prepared_dir(recipe), "train", 4, 0, 1, seed=recipe.data.shuffle_seed).next_batch()
    assert batch.max() < 300
    assert result.losses[1] == pytest.approx(hf_models.hf_mean_nll(model, batch), rel=1e-5)


def test_a_hugging_face_folder_with_another_tokenizer_or_shape_is_refused(tmp_path, hf_llama, micro_data):
    _, folder, corpus = hf_llama
    prepared, tok = micro_data
    # the micro model's sentencepiece data: other token ids than the folder's tokenizer.json
    recipe = micro_recipe(tmp_path / "a", prepared, tok, init_from=folder)
    with pytest.raises(UserError) as info:
        train(plan_run(recipe), log=lambda *_: None, progress=False)
    assert info.value.key == "train.init_from"
    assert "do not fit" in info.value.message or "another tokenizer" in info.value.message
    # the folder's own tokenizer, but a model of another width
    recipe = _recipe(tmp_path / "b", folder, corpus, steps=2)
    recipe.model.ffn_hidden_size = 256
    with pytest.raises(UserError, match="do not fit") as info:
        train(plan_run(recipe), log=lambda *_: None, progress=False)
    assert info.value.key == "train.init_from"
