"""`naohai ckpt import` -> `naohai eval` -> `naohai ckpt export` -> import again, on reference-format files."""
import json

import numpy as np
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
    assert "never overwrites" in capsys.readouterr().err
