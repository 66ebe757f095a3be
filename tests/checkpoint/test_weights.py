"""Reading a checkpoint's model: only the model's tensors of a full-layout rank file are read (its Adam
moments, two thirds of the file, stay on disk), equal to what MindSpore's own load_checkpoint reads; an export
that cannot happen says so before anything is read."""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from naohai import ckpt_format
from naohai.checkpoint import store
from naohai.cli import main


def test_a_full_checkpoint_reads_its_model_tensors_only(ckpt, monkeypatch):
    import mindspore as ms
    from naohai.checkpoint.weights import find_weights
    from naohai.model.params import param_shapes
    read, real = [], ckpt_format.read

    def recording(path, entry):
        read.append(entry.name)
        return real(path, entry)
    monkeypatch.setattr(ckpt_format, "read", recording)
    found = find_weights(str(ckpt))
    assert read == []                                  # opening reads the manifest and table only
    tensors = found.tensors()
    assert read == []                                  # read when asked, one at a time
    model = {p.name for p in param_shapes(found.recipe.model)}
    assert sorted(tensors) == sorted(model)
    tensors = dict(tensors)
    assert sorted(read) == sorted(model)               # each once; the moments never
    whole = ms.load_checkpoint(os.path.join(str(ckpt), store.rank_file(0)))
    assert len(whole) > 2 * len(model)                 # the moments and step state are in the file, unread
    for name, value in tensors.items():
        want = whole[name].asnumpy()
        assert value.dtype == np.float32 and value.shape == want.shape and np.array_equal(value, want), name


def test_export_to_hf_of_a_family_without_architecture_reads_nothing(ckpt, tmp_path, capsys, monkeypatch):
    from naohai.checkpoint import reshard

    def refuse(*_a, **_k):
        raise AssertionError("read the checkpoint's tensors before refusing")
    monkeypatch.setattr(reshard, "merged_tensors", refuse)
    capsys.readouterr()
    assert main(["ckpt", "export", str(ckpt), "--to", "hf", "--out", str(tmp_path / "hf")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.family" in err and "Traceback" not in err and not os.path.exists(tmp_path / "hf")


def test_a_model_folder_without_its_tokenizer_fails_before_any_tensor_is_read(ckpt, tmp_path, capsys, monkeypatch):
    """generate, eval --text and data score of an imported folder with no tokenizer and none in its recipe say so
    (naming the folder and data.tokenizer) before the weights are read; a 536M model was read for 28 s and
    5 GB first, then pointed at the run's default tokenizer path."""
    from naohai.checkpoint.weights import find_weights
    from naohai.convert.model_dir import write_model_dir
    found = find_weights(str(ckpt))
    recipe = dataclasses.replace(found.recipe, data=dataclasses.replace(found.recipe.data, tokenizer=None))
    folder = str(tmp_path / "imported")
    write_model_dir(folder, recipe, found.tensors())
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50, encoding="utf-8")

    def refuse(*_a, **_k):
        raise AssertionError("read a tensor before saying the tokenizer is missing")
    monkeypatch.setattr(ckpt_format, "read", refuse)
    for argv in (["generate", folder, "--prompt", "a", "--device", "CPU"],
                 ["eval", folder, "--text", str(text), "--device", "CPU"],
                 ["data", "score", str(text), "--model", folder, "--out", str(tmp_path / "scored")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = " ".join(capsys.readouterr().err.split())
        assert folder in err and "has no tokenizer" in err and "data.tokenizer" in err and "Traceback" not in err, err
