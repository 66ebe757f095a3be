import os

import pytest
import yaml

from naohai.cli import main
from naohai.config import load_recipe
from naohai.data.pipeline import ensure_prepared
from naohai.data.prepare import load_prepared
from naohai.errors import UserError


def _recipe_file(tmp_path, **data):
    raw = {"name": "t", "model": {"preset": "tiny", "vocab_size": 512, "seq_length": 64},
           "data": {"corpus": ["builtin:pydoc"], **data},
           "train": {"output_dir": str(tmp_path / "run"), "global_batch_size": 4, "micro_batch_size": 4}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_ensure_prepared_trains_prepares_and_reuses(tmp_path):
    path = _recipe_file(tmp_path)
    recipe = load_recipe(path)
    out, tok = ensure_prepared(recipe, progress=False)
    assert out == str(tmp_path / "run" / "data")
    assert tok.path == str(tmp_path / "run" / "tokenizer.model") and tok.vocab_size == 512
    prep = load_prepared(out)
    assert prep.seq_length == 64 and prep.meta["tokenizer"]["sha256"] == tok.sha256
    stamp = os.stat(os.path.join(out, "meta.json")).st_mtime_ns
    out2, tok2 = ensure_prepared(load_recipe(path), progress=False)
    assert out2 == out and tok2.sha256 == tok.sha256
    assert os.stat(os.path.join(out, "meta.json")).st_mtime_ns == stamp  # reused, not rebuilt
    # a corpus setting changed: rebuilt with the same tokenizer
    ensure_prepared(load_recipe(path, ["data.holdout_fraction=0.2"]), progress=False)
    assert load_prepared(out).meta["holdout_fraction"] == 0.2
    # the tokenizer in output_dir has 512 pieces: another vocab size is an error naming the key
    with pytest.raises(UserError) as err:
        ensure_prepared(load_recipe(path, ["model.vocab_size=1024"]), progress=False)
    assert err.value.key == "model.vocab_size"
    # other seq_length: the existing shards are not replaced silently
    with pytest.raises(UserError) as err:
        ensure_prepared(load_recipe(path, ["model.seq_length=32"]), progress=False)
    assert err.value.key == "data.prepared_dir"
    out3, _ = ensure_prepared(load_recipe(path, ["model.seq_length=32"]), progress=False, overwrite=True)
    assert load_prepared(out3).seq_length == 32


def test_jieba_flag_must_match_tokenizer(tmp_path):
    path = _recipe_file(tmp_path)
    ensure_prepared(load_recipe(path), progress=False)
    with pytest.raises(UserError) as err:
        ensure_prepared(load_recipe(path, ["data.jieba=true"]), progress=False)
    assert err.value.key == "data.jieba"


def test_cli_prepare_and_errors(tmp_path, capsys):
    path = _recipe_file(tmp_path)
    assert main(["data", "prepare", path, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "valid:" in out
    assert main(["data", "info", str(tmp_path / "run" / "data")]) == 0
    assert main(["data", "prepare", path, "train.global_batch_size=100000", "train.micro_batch_size=100000"]) == 2
    assert "too small" in capsys.readouterr().err
    assert main(["data", "tokenizer", "--corpus", str(tmp_path / "missing.txt"), "--vocab-size", "512",
                 "--out", str(tmp_path / "tk")]) == 2
    err = capsys.readouterr().err
    assert "not found" in err and "Traceback" not in err
    assert main(["data", "tokenizer", "--corpus", "builtin:pydoc", "--vocab-size", "600",
                 "--out", str(tmp_path / "tk")]) == 0
    assert os.path.exists(tmp_path / "tk.model")
    assert main(["data", "tokenizer", "--corpus", "builtin:pydoc", "--vocab-size", "600",
                 "--out", str(tmp_path / "tk")]) == 2  # refuses to replace without --force


def _tree(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_overwrite_never_replaces_a_folder_that_is_not_prepared_data(tmp_path, capsys):
    """`data prepare --out F --overwrite` replaced F whole: a user's folder, or a run folder given by mistake,
    was deleted (found by a probe: its checkpoints, metrics and tokenizer were gone)."""
    path = _recipe_file(tmp_path)
    assert main(["data", "prepare", path, "--no-progress"]) == 0
    run = tmp_path / "run"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "checkpoints" / "step_2" / "manifest.json").write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "a.jsonl").write_text('{"text": "my own"}\n')
    stray = tmp_path / "stray"                    # prepared data plus a file naohai never writes there
    assert main(["data", "prepare", path, "--out", str(stray), "--no-progress"]) == 0
    (stray / "NOTES.md").write_text("keep")
    capsys.readouterr()
    for folder in (run, mine, stray):
        before = _tree(folder)
        assert main(["data", "prepare", path, "--out", str(folder), "--overwrite", "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert "not a prepared data folder" in err and str(folder) in err and "Traceback" not in err
        assert _tree(folder) == before
    (stray / "NOTES.md").unlink()                 # prepared data alone: --overwrite rebuilds it
    assert main(["data", "prepare", path, "model.seq_length=32", "--out", str(stray), "--overwrite",
                 "--no-progress"]) == 0
    assert load_prepared(str(stray)).seq_length == 32


def test_sft_overwrite_never_replaces_a_folder_that_is_not_prepared_data(tok, tmp_path):
    from naohai.data.sft import prepare_sft
    convs = tmp_path / "c.jsonl"
    convs.write_text("".join('{"prompt": "say %d", "response": "%d"}\n' % (i, i) for i in range(40)))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not a prepared data folder"):
        prepare_sft([str(convs)], tok, str(mine), 32, overwrite=True)
    assert (mine / "keep.txt").read_text() == "mine" and sorted(os.listdir(mine)) == ["keep.txt"]


def test_a_given_tokenizer_may_have_fewer_pieces_than_the_model_has_rows(tmp_path, micro_data):
    """Published models pad their embedding past their tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens;
    BLOOM, OLMo, GLM-4, Pythia too), and fine-tuning one was refused ('set model.vocab_size=...', which the
    checkpoint's shapes forbid).  Starting from train.init_from, a given data.tokenizer may now have fewer
    pieces than model.vocab_size; more pieces (ids past the embedding), fewer for a model trained from scratch,
    or a tokenizer naohai trained into the run folder for another size (a stale one), is still exit 2."""
    import dataclasses
    from tests.conftest import micro_recipe
    recipe = micro_recipe(tmp_path / "run", tokenizer=micro_data[1])          # a 320-piece tokenizer
    padded = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, vocab_size=384))
    with pytest.raises(UserError, match="has 320 pieces") as info:           # from scratch: sized to it
        ensure_prepared(padded, progress=False)
    assert info.value.rule == "model.vocab_size == tokenizer vocab size"
    padded = dataclasses.replace(padded, train=dataclasses.replace(padded.train, init_from=str(tmp_path / "src")))
    out, tok = ensure_prepared(padded, progress=False)
    assert tok.vocab_size == 320 and load_prepared(out).meta["tokenizer"]["vocab_size"] == 320
    small = dataclasses.replace(padded, model=dataclasses.replace(recipe.model, vocab_size=256),
                                train=dataclasses.replace(padded.train, output_dir=str(tmp_path / "small")))
    with pytest.raises(UserError, match="has 320 pieces") as info:
        ensure_prepared(small, progress=False)
    assert info.value.key == "model.vocab_size" and ">=" in info.value.rule
    trained = micro_recipe(tmp_path / "own")                                  # naohai trains 320 pieces here
    ensure_prepared(trained, progress=False)
    stale = dataclasses.replace(trained, model=dataclasses.replace(trained.model, vocab_size=384))
    with pytest.raises(UserError, match="delete that file to train a new tokenizer"):
        ensure_prepared(stale, progress=False)
