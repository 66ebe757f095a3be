"""Importing a sharded reference checkpoint: per-rank slices plus the strategy file of the run.

The slices are real: MindSpore's semi-auto compile on 2 simulated devices
(``tests/convert/sharded_target.py``) cuts the PanGu-alpha reference tensors, held under their
own names, the way the reference's model parallelism splits them, and writes the strategy file.
The import must give back every full tensor bit for bit, and `naohai eval` on the imported
model must equal the numpy reference loss on the unsharded tensors.
"""
import json
import shutil
from pathlib import Path

import numpy as np
import mindspore as ms
import pytest

from naohai.cli import main
from naohai.convert.files import read_reference
from naohai.errors import UserError
from naohai.simulate.harness import run_compile
from sharded_target import full_weights
from test_convert_cli import _recipe
from test_convert_reference import packed_ids, reference_loss, setup

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_sharded_reference_checkpoint_imports_bit_exact(tmp_path, capsys):
    cfg, fmt, w = setup("pangu", seed=4)
    assert all(np.array_equal(a, w[k]) for k, a in full_weights(4, cfg.padded_vocab_size).items())
    work = tmp_path / "compile"
    rep = run_compile("tests.convert.sharded_target:reference_slices", 2, work, timeout=600, sys_path=[ROOT],
                      kwargs={"seed": 4, "vocab": cfg.padded_vocab_size}, save_slices=True)
    assert rep.ok, rep.render()
    src = tmp_path / "pangu-sharded"
    for r in range(2):
        (src / f"rank_{r}").mkdir(parents=True)
        shutil.copyfile(work / f"rank_{r}" / "slices.ckpt", src / f"rank_{r}" / "pangu_alpha-1_1.ckpt")
    strategy = str(work / "rank_0" / "strategy.ckpt")

    # the slices are MindSpore's: halves of the split tensors, whole replicated ones
    s0 = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(src / "rank_0" / "pangu_alpha-1_1.ckpt")).items()}
    s1 = {k: v.asnumpy() for k, v in ms.load_checkpoint(str(src / "rank_1" / "pangu_alpha-1_1.ckpt")).items()}
    dense = "backbone.blocks.0.attention.dense1.weight"
    assert np.array_equal(s0[dense], w[dense][:8]) and np.array_equal(s1[dense], w[dense][8:])
    mapping = "backbone.top_query_layer.output.mapping.weight"
    assert np.array_equal(s1[mapping], w[mapping][:, 32:])
    assert np.array_equal(s0["backbone.layernorm.gamma"], w["backbone.layernorm.gamma"])

    merged = read_reference(str(src), strategy)
    assert set(merged) == set(w)
    for name, value in w.items():
        assert merged[name].dtype == value.dtype and np.array_equal(merged[name], value), name

    out = str(tmp_path / "imported")
    recipe = _recipe(tmp_path, "pangu")
    assert main(["ckpt", "import", str(src), "--from", fmt, "--recipe", recipe, "--out", out,
                 "--strategy", strategy]) == 0
    ids = packed_ids(cfg, seed=6)
    np.save(tmp_path / "ids.npy", ids)
    capsys.readouterr()
    assert main(["eval", out, "--ids", str(tmp_path / "ids.npy"), "--json", "--device", "CPU"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = reference_loss(cfg, "pangu", w, ids)
    assert abs(got["loss"] - want) <= 1e-5 * max(1.0, want), (got, want)

    # a slice folder without its strategy file, and a strategy file that is not one
    with pytest.raises(UserError, match="--strategy"):
        read_reference(str(src))
    bogus = tmp_path / "bogus.ckpt"
    bogus.write_bytes(b"not a strategy")
    with pytest.raises(UserError):
        read_reference(str(src), str(bogus))
