"""`naohai ckpt import` -> `naohai eval` -> `naohai ckpt export` -> import again, on reference-format files."""
import json
import os

import numpy as np
import pytest
import yaml

from naohai.cli import main
from naohai.convert.files import read_reference, write_ckpt
from test_convert_reference import FAMILIES, packed_ids, reference_loss, setup


def _recipe(tmp_path, family):
    raw, _ = FAMILIES[family]
    path = tmp_path / f"{family}.yaml"
    path.write_text(yaml.safe_dump({"name": family, "model": dict(raw)}))
    return str(path)


def test_import_eval_export_import_round_trip(tmp_path, capsys):
    for family in ("pangu", "pcm7b"):
        cfg, fmt, w = setup(family, seed=3)
        src = write_ckpt(w, str(tmp_path / f"{family}-ref.ckpt"))
        recipe = _recipe(tmp_path, family)
        out = str(tmp_path / f"{family}-imported")
        assert main(["ckpt", "import", src, "--from", fmt, "--recipe", recipe, "--out", out]) == 0
        ids = packed_ids(cfg, seed=5)
        np.save(tmp_path / "ids.npy", ids)
        capsys.readouterr()
        assert main(["eval", out, "--ids", str(tmp_path / "ids.npy"), "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        want = reference_loss(cfg, family, w, ids)
        assert abs(got["loss"] - want) <= 1e-5 * max(1.0, want), (family, got, want)
        assert abs(got["perplexity"] - np.exp(want)) <= 1e-4 * np.exp(want)
        exported = str(tmp_path / f"{family}-export.ckpt")
        assert main(["ckpt", "export", out, "--to", fmt, "--out", exported]) == 0
        back = read_reference(exported)
        assert set(back) == set(w) and all(np.array_equal(back[k], w[k]) for k in w)
        again = str(tmp_path / f"{family}-again")
        assert main(["ckpt", "import", exported, "--from", fmt, "--recipe", recipe, "--out", again]) == 0
        a, b = read_reference(f"{out}/model.ckpt"), read_reference(f"{again}/model.ckpt")
        assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_cli_errors_exit_2_with_one_paragraph(tmp_path, capsys):
    cfg, fmt, w = setup("pangu")
    src = write_ckpt(w, str(tmp_path / "ref.ckpt"))
    wrong = _recipe(tmp_path, "pcm7b")                  # a PengCheng-Mind recipe for a PanGu checkpoint
    assert main(["ckpt", "import", src, "--from", fmt, "--recipe", wrong, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "naohai: error:" in err and "Traceback" not in err
    out = str(tmp_path / "ok")
    assert main(["ckpt", "import", src, "--from", fmt, "--recipe", _recipe(tmp_path, "pangu"), "--out", out]) == 0
    np.save(tmp_path / "short.npy", np.arange(3))
    assert main(["eval", out, "--ids", str(tmp_path / "short.npy")]) == 2
    short = " ".join(capsys.readouterr().err.split())     # the message is wrapped to the terminal
    assert "has 3 tokens; 9 needed" in short and "seq_length 8 + 1" in short
    assert main(["ckpt", "export", out, "--format", fmt, "--out", src]) == 2   # never overwrites
    assert "nothing is overwritten" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["empty", "folder", "file", "under_a_file"])
def test_every_ckpt_action_writes_a_new_out_only(tmp_path, capsys, where):
    """`ckpt import --from pangu-alpha --out DIR` wrote into an existing folder, replacing a recipe.yaml the user
    had there; an empty --out crashed merge / reshard / export / import with a traceback (found by a probe)."""
    cfg, fmt, w = setup("pangu")
    src = write_ckpt(w, str(tmp_path / "ref.ckpt"))
    model = str(tmp_path / "model")
    assert main(["ckpt", "import", src, "--from", fmt, "--recipe", _recipe(tmp_path, "pangu"), "--out", model]) == 0
    target = {"empty": "", "folder": str(tmp_path / "proj"), "file": str(tmp_path / "notes.txt"),
              "under_a_file": str(tmp_path / "notes.txt" / "sub")}[where]
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "recipe.yaml").write_text("mine: 1\n")
    (tmp_path / "notes.txt").write_text("mine")
    capsys.readouterr()
    for argv in (["ckpt", "import", src, "--from", fmt, "--recipe", _recipe(tmp_path, "pangu")],
                 ["ckpt", "export", model, "--format", fmt],
                 ["ckpt", "export", model, "--to", "hf"],
                 ["ckpt", "merge", model]):
        assert main([*argv, "--out", target]) == 2, argv
        err = capsys.readouterr().err
        assert "key '--out'" in err and "Traceback" not in err, (argv, err)
    assert (tmp_path / "proj" / "recipe.yaml").read_text() == "mine: 1\n"
    assert sorted(os.listdir(tmp_path / "proj")) == ["recipe.yaml"]
    assert (tmp_path / "notes.txt").read_text() == "mine"



@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "0", "-1", "5XB", "", "1e300GB"])
def test_a_shard_size_that_is_not_a_size_is_named(text):
    """inf and 1e400 raised OverflowError (a traceback) before."""
    from naohai.commands.ckpt import _shard_bytes
    from naohai.errors import UserError
    with pytest.raises(UserError) as err:
        _shard_bytes(text)
    assert err.value.key == "--shard-size"


def test_shard_sizes_read_as_the_units_say():
    from naohai.commands.ckpt import _shard_bytes
    assert (_shard_bytes("5GB"), _shard_bytes("200MB"), _shard_bytes("1.5MiB"), _shard_bytes("1000000")) == \
        (5 * 10 ** 9, 200 * 10 ** 6, 3 * 2 ** 19, 10 ** 6)


def test_a_flag_of_another_format_exits_2(tmp_path, capsys):
    """`ckpt export --format pangu-alpha --shard-size nan` and `ckpt import --from pangu-alpha --base RUN` ignored
    the flag (found by a probe)."""
    cfg, fmt, w = setup("pangu")
    src = write_ckpt(w, str(tmp_path / "ref.ckpt"))
    model = str(tmp_path / "model")
    assert main(["ckpt", "import", src, "--from", fmt, "--recipe", _recipe(tmp_path, "pangu"), "--out", model]) == 0
    capsys.readouterr()
    assert main(["ckpt", "export", model, "--format", fmt, "--shard-size", "1GB", "--out", str(tmp_path / "e")]) == 2
    assert "key '--shard-size'" in capsys.readouterr().err
    assert main(["ckpt", "import", src, "--from", fmt, "--recipe", _recipe(tmp_path, "pangu"), "--base", model,
                 "--out", str(tmp_path / "i")]) == 2
    assert "key '--base'" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() and not (tmp_path / "i").exists()


def test_an_empty_checkpoint_or_model_path_is_named(capsys):
    for argv in (["ckpt", "inspect", ""], ["generate", ""]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "path is empty" in err and "Traceback" not in err
