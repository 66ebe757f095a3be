"""`naohai eval` on a trained run and on one of its checkpoint folders, against a numpy loss.

The weights come from the run's checkpoint file read with MindSpore's own
``load_checkpoint`` (not naohai's store), the loss from the numpy forward of
tests/model/model_reference.py (the references' input-pad mask when the model has one).
Imported model folders are covered in tests/convert/test_convert_cli.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np
import mindspore as ms

from naohai.checkpoint.store import list_checkpoints
from naohai.cli import main
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "model"))
import model_reference as ref  # noqa: E402


def _numpy_mean_loss(weights, cfg, windows):
    """Token-weighted mean over all windows of the masked next-token loss."""
    total, count = 0.0, 0
    for w in windows:
        ids, labels = w[None, :-1], w[None, 1:]
        n = int((ids != cfg.loss_pad_id).sum()) if cfg.loss_pad_id is not None else ids.size
        loss = ref.lm_loss(weights, cfg, ids, labels)
        if cfg.loss_pad_id is not None:
            loss = loss * (n + 1e-5) / max(n, 1)
        total, count = total + loss * n, count + n
    return total / count


def test_eval_of_a_trained_run_and_checkpoint_equals_numpy(tmp_path, micro_data, capsys):
    prepared, tok = micro_data
    run = tmp_path / "run"
    recipe = micro_recipe(run, prepared, tok, steps=4, save_every=2, eval_every=4)
    # PanGu's conventions (EOD blocks attention, the loss skips inputs equal to EOD = pad); the trainer
    # swaps in the tokenizer's EOD id (naohai.train.job.adopt_token_ids), read back from the manifest
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, eod_reset=True, eod_id=6,
                                                                   loss_pad_id=6))
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    ckpts = list_checkpoints(str(run))
    assert [os.path.basename(c) for c in ckpts][-1].endswith("4")
    with open(os.path.join(ckpts[-1], "manifest.json")) as fh:
        from naohai.config import recipe_from_dict
        cfg = recipe_from_dict(json.load(fh)["recipe"]).model
    rng = np.random.RandomState(0)
    s = cfg.seq_length + 1
    windows = rng.randint(0, cfg.vocab_size, (3, s)).astype(np.int64)
    assert cfg.eod_reset and cfg.eod_id is not None and cfg.loss_pad_id == cfg.eod_id
    windows[0, 5] = windows[0, 11] = cfg.eod_id
    windows[2, 20:] = cfg.loss_pad_id
    np.save(tmp_path / "ids.npy", windows)

    def eval_json(target):
        capsys.readouterr()
        assert main(["eval", target, "--ids", str(tmp_path / "ids.npy"), "--batch", "2", "--json",
                     "--device", "CPU"]) == 0
        return json.loads(capsys.readouterr().out)

    for ckpt, target in ((ckpts[-1], str(run)), (ckpts[0], ckpts[0])):
        weights = {k: v.asnumpy().astype(np.float64)
                   for k, v in ms.load_checkpoint(os.path.join(ckpt, "rank_0.ckpt")).items()}
        want = _numpy_mean_loss(weights, cfg, windows)
        got = eval_json(target)
        assert abs(got["loss"] - want) <= 1e-5 * max(1.0, want), (target, got, want)
        assert abs(got["perplexity"] - np.exp(want)) <= 1e-4 * np.exp(want)
        assert got["windows"] == 3
    # the two checkpoints hold different weights, so the two figures differ
    first = _numpy_mean_loss({k: v.asnumpy().astype(np.float64) for k, v in
                              ms.load_checkpoint(os.path.join(ckpts[0], "rank_0.ckpt")).items()}, cfg, windows)
    last = _numpy_mean_loss({k: v.asnumpy().astype(np.float64) for k, v in
                             ms.load_checkpoint(os.path.join(ckpts[-1], "rank_0.ckpt")).items()}, cfg, windows)
    assert abs(first - last) > 1e-4


def test_eval_text_of_a_run_uses_the_run_tokenizer(tmp_path, micro_data, capsys):
    prepared, tok = micro_data
    run = tmp_path / "run"
    start(plan_run(micro_recipe(run, prepared, tok, steps=2, save_every=2)), log=lambda *_: None,
          progress=False).run()
    text = tmp_path / "held.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", str(run), "--text", str(text), "--json", "--device", "CPU"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["windows"] >= 1 and np.isfinite(got["loss"])


def test_eval_of_a_folder_that_is_no_model(tmp_path, capsys):
    np.save(tmp_path / "ids.npy", np.arange(10))
    assert main(["eval", str(tmp_path), "--ids", str(tmp_path / "ids.npy")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "holds no model weights" in err and "imported model folder" in err and "Traceback" not in err


def test_short_or_empty_stream_names_its_length(tmp_path):
    """A stream shorter than one window says how many tokens it has and how many one window needs."""
    import pytest

    from naohai.errors import UserError
    from naohai.evaluate import windows_of

    cfg = micro_recipe(tmp_path).model                 # seq_length 32: a window is 33 ids
    for length in (0, 5, 32):
        with pytest.raises(UserError) as err:
            windows_of(np.arange(length, dtype=np.int64), cfg, "short.txt")
        assert f"the text has {length} tokens; 33 needed" in str(err.value) and "short.txt" in str(err.value)
    assert windows_of(np.arange(70, dtype=np.int64), cfg, "ok.txt").shape == (2, 33)


def test_held_out_text_of_a_prepared_folder(tmp_path, micro_data, capsys):
    """`naohai data info DIR --held-out-text F` writes the held-out split's documents, decoded, one after
    another with a blank line between them."""
    from naohai.data.prepare import load_prepared
    from naohai.data.tokenizer import Tokenizer

    prepared, tok = micro_data
    out = tmp_path / "held_out.txt"
    assert main(["data", "info", str(prepared), "--held-out-text", str(out)]) == 0
    prep = load_prepared(str(prepared))
    valid = np.asarray(prep.tokens("valid"))
    cuts = np.flatnonzero(valid == prep.eod_id)
    docs = [d[d != prep.eod_id] for d in np.split(valid, cuts)]
    docs = [d for d in docs if d.size]
    tokenizer = Tokenizer.load(tok)
    assert f"held-out split: {len(docs)} documents, {valid.size} tokens -> {out}" in capsys.readouterr().out
    text = out.read_text(encoding="utf-8")
    assert text == "\n\n".join(tokenizer.decode(d.tolist()) for d in docs) + "\n"
    assert len(docs) >= 2 and prep.meta["splits"]["valid"]["documents"] == len(docs)


def test_a_model_too_big_for_the_machine_is_refused_before_it_is_read(tmp_path, micro_data, capsys, monkeypatch):
    """eval, generate and score load a model's weights with `load_model`: a model whose float32 weights and the
    float32 tensors read into them (from a full-layout checkpoint, read a tensor at a time: its largest tensor)
    exceed MemTotal is refused, exit 2 naming the folder, before any tensor is read; a machine 1 byte larger
    loads it."""
    from naohai import devices
    from naohai.checkpoint import weights
    from naohai.model.params import count_params

    prepared, tok = micro_data
    run = tmp_path / "run"
    recipe = micro_recipe(run, prepared, tok, steps=1, save_every=1)
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    from naohai.model.params import param_shapes
    sizes = [int(np.prod(p.shape)) for p in param_shapes(recipe.model)]
    # float32 weights held by the model, and the largest tensor read at a time from the full-layout checkpoint
    need = 4 * count_params(recipe.model) + 4 * max(sizes)
    assert sum(sizes) == count_params(recipe.model)
    read = []
    monkeypatch.setattr(weights.Weights, "tensors", lambda self: read.append(1) or {})
    monkeypatch.setattr(devices, "machine_memory", lambda path=devices.MEMINFO: need - 1)
    text = tmp_path / "held.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    for argv in (["eval", str(run), "--text", str(text), "--json"], ["generate", str(run), "--prompt", "a"]):
        capsys.readouterr()
        assert main(argv + ["--device", "CPU"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "cannot be loaded in this machine's memory" in err and str(run) in err and "Traceback" not in err, err
    assert read == []
    monkeypatch.setattr(devices, "machine_memory", lambda path=devices.MEMINFO: need)
    found = weights.find_weights(str(run))
    weights.check_loads_in_memory(found)                   # fits exactly
