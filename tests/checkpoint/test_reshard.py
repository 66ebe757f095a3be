"""Moving checkpoints between layouts, bit for bit, with the per-rank slices and strategy files
of MindSpore's own simulated compile of three shipped layouts:

A = tiny-dp2-mp2-pp2 (optimizer parallel, tied table), B = tiny-dp2-mp2, C = tiny-dp4-pp2
(another stage split, optimizer parallel).  References: the model's weights built on the
host without any parallelism (same seed), and MindSpore's compile-time slices.
"""
from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms

from naohai.checkpoint import store
from naohai.checkpoint.files import sha256_file, write_json
from naohai.checkpoint.reshard import merged_tensors, reshard_checkpoint
from naohai.config import load_recipe
from naohai.model.transformer import NaohaiLM
from naohai.strategy.run_plan import plan_run
from naohai.train.job import planned_checkpoint_layout

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {
    "A": ("tiny-dp2-mp2-pp2", "train.micro_batch_size=2"),
    "B": ("tiny-dp2-mp2", "train.micro_batch_size=8"),
    "C": ("tiny-dp4-pp2", "train.micro_batch_size=2"),
}


def _layout(key):
    name, override = LAYOUTS[key]
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), [override])
    run = plan_run(recipe, str(ROOT / "strategies" / f"{name}.yaml"))
    return run.recipe, planned_checkpoint_layout(run.strategy)


def _compiled(compiled_layout, key):
    name, override = LAYOUTS[key]
    rc, workdir, out = compiled_layout(["tiny", str(ROOT / "strategies" / f"{name}.yaml"), override])
    assert rc == 0, out[-3000:]
    return workdir


def _strategy_dir(workdir, tmp, world):
    d = tmp / f"strategy-{workdir.name}"
    d.mkdir(exist_ok=True)
    for r in range(world):
        shutil.copyfile(workdir / f"rank_{r}" / "strategy.ckpt", d / store.rank_file(r))
    return d


def _as_checkpoint(folder, rank_tensors, layout, recipe, strategy_dir=None):
    """A naohai checkpoint folder from per-rank tensor dicts (what a run of that layout saves)."""
    folder.mkdir(parents=True)
    files = {}
    for r, tensors in rank_tensors.items():
        path = folder / store.rank_file(r)
        ms.save_checkpoint([{"name": k, "data": v} for k, v in sorted(tensors.items())], str(path))
        files[store.rank_file(r)] = {"rank": r, "sha256": sha256_file(str(path)), "bytes": path.stat().st_size}
    if strategy_dir is not None:
        (folder / "strategy").mkdir()
        for f in sorted(Path(strategy_dir).glob("rank_*.ckpt")):
            shutil.copyfile(f, folder / "strategy" / f.name)
            files[f"strategy/{f.name}"] = {"sha256": sha256_file(str(f)), "bytes": f.stat().st_size}
    layout = dict(layout, ranks_with_files=sorted(rank_tensors))
    write_json(str(folder / store.MANIFEST), {"format": store.FORMAT, "step": 7, "recipe": recipe.to_dict(),
                                               "layout": layout, "files": files, "data": {"loader": {}}})
    assert store.verify(str(folder)).ok
    return str(folder)


def _load(ckpt, rank):
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(os.path.join(ckpt, store.rank_file(rank))).items()}


def _compile_slices(workdir, world):
    return {r: {k: v for k, v in ms.load_checkpoint(str(workdir / f"rank_{r}" / "slices.ckpt")).items()}
            for r in range(world)}


@pytest.mark.slow
def test_layout_round_trips_bit_for_bit(compiled_layout, tmp_path):
    recipe, lay = {}, {}
    for key in LAYOUTS:
        recipe[key], lay[key] = _layout(key)
    work = {k: _compiled(compiled_layout, k) for k in LAYOUTS}
    sdir = {k: _strategy_dir(work[k], tmp_path, lay[k]["world"]) for k in LAYOUTS}

    # the host model, no parallelism, same seed: the reference full weights
    model = NaohaiLM(recipe["A"].model, seed=recipe["A"].train.seed)
    host = {p.name: p.asnumpy() for p in model.get_parameters()}

    for key in LAYOUTS:
        slices = _compile_slices(work[key], lay[key]["world"])
        ckpt = _as_checkpoint(tmp_path / f"compiled-{key}", slices, lay[key], recipe[key], sdir[key])
        # layout -> full equals the original weights (every model tensor, bit for bit)
        full = _load(reshard_checkpoint(ckpt, str(tmp_path / f"full-{key}")), 0)
        for name, value in host.items():
            assert name in full, (key, name)
            np.testing.assert_array_equal(full[name], value, err_msg=f"{key}: {name}")
        # read through merged_tensors (export, generate): the same model tensors, each read when asked, from a
        # temporary merge that is removed once the mapping is let go
        merged = merged_tensors(ckpt)
        for name, value in host.items():
            np.testing.assert_array_equal(merged[name], value, err_msg=f"{key} merged: {name}")
        temporary = os.path.dirname(os.path.dirname(merged.path))
        assert os.path.isdir(temporary) and temporary != os.path.dirname(ckpt)
        del merged
        gc.collect()
        assert not os.path.exists(temporary)
        # optimizer moments travel too (full shapes after merging)
        assert full["adam_m.layers.0.attention.q_weight"].shape == host["layers.0.attention.q_weight"].shape
        # full -> layout equals the compile-time slices on every rank
        back = reshard_checkpoint(str(tmp_path / f"full-{key}"), str(tmp_path / f"back-{key}"),
                                  str(sdir[key]), lay[key])
        for r in range(lay[key]["world"]):
            got = _load(back, r)
            for name, value in slices[r].items():
                if name in got:
                    np.testing.assert_array_equal(got[name], value.asnumpy(), err_msg=f"{key} rank {r}: {name}")
            assert {n for n in slices[r] if "layers." in n} <= set(got), (key, r)

    # non-trivial optimizer state: random full tensors R; R -> A -> full == R; A -> B -> A == A; A -> C -> A == A
    rng = np.random.default_rng(0)
    full_a = _load(str(tmp_path / "full-A"), 0)
    random = {k: rng.standard_normal(v.shape).astype(v.dtype) if v.size > 1 else v for k, v in full_a.items()}
    r_ckpt = _as_checkpoint(tmp_path / "random-full", {0: {k: ms.Tensor(v) for k, v in random.items()}},
                            {"mode": "standalone", "world": 1, "signature": "full", "stages": 1,
                             "describe": "full"}, recipe["A"])
    in_a = reshard_checkpoint(r_ckpt, str(tmp_path / "R-A"), str(sdir["A"]), lay["A"])
    again = _load(reshard_checkpoint(in_a, str(tmp_path / "R-A-full")), 0)
    for name, value in random.items():
        np.testing.assert_array_equal(again[name], value, err_msg=name)
    for other in ("B", "C"):
        via = reshard_checkpoint(in_a, str(tmp_path / f"A-{other}"), str(sdir[other]), lay[other])
        round_trip = reshard_checkpoint(via, str(tmp_path / f"A-{other}-A"), str(sdir["A"]), lay["A"])
        for r in range(8):
            a, b = _load(in_a, r), _load(round_trip, r)
            assert set(a) == set(b), (other, r, set(a) ^ set(b))
            for name in a:
                np.testing.assert_array_equal(a[name], b[name], err_msg=f"A->{other}->A rank {r}: {name}")


@pytest.mark.slow
def test_ckpt_reshard_command_moves_a_pipeline_checkpoint_to_another_layout(compiled_layout, tmp_path, capsys):
    """`naohai ckpt reshard A --to B [--compiled WORKDIR]`: B's rank files equal B's own compile-time slices."""
    from naohai.cli import main
    recipe_a, lay_a = _layout("A")
    work_a, work_b = _compiled(compiled_layout, "A"), _compiled(compiled_layout, "B")
    sdir_a = _strategy_dir(work_a, tmp_path, 8)
    ckpt = _as_checkpoint(tmp_path / "A", _compile_slices(work_a, 8), lay_a, recipe_a, sdir_a)
    name, override = LAYOUTS["B"]
    code = main(["ckpt", "reshard", ckpt, override, "--to", str(ROOT / "strategies" / f"{name}.yaml"),
                 "--compiled", str(work_b), "--out", str(tmp_path / "B")])
    assert code == 0, capsys.readouterr().err
    man = store.read_manifest(str(tmp_path / "B"))
    assert man["layout"]["world"] == 4 and man["resharded_from"]["path"] == ckpt and store.verify(str(tmp_path / "B")).ok
    expected = _compile_slices(work_b, 4)
    for r in range(4):
        got = _load(str(tmp_path / "B"), r)
        model_names = [n for n in expected[r] if not n.startswith(("adam_", "guard.", "beta", "global_step"))]
        assert model_names and set(model_names) <= set(got)
        for n in model_names:
            np.testing.assert_array_equal(got[n], expected[r][n].asnumpy(), err_msg=f"rank {r}: {n}")
    # without --compiled the command compiles B itself (same strategy files, so the same slices)
    code = main(["ckpt", "reshard", ckpt, override, "--to", str(ROOT / "strategies" / f"{name}.yaml"),
                 "--out", str(tmp_path / "B-self")])
    assert code == 0, capsys.readouterr().err
    for r in range(4):
        got, want = _load(str(tmp_path / "B-self"), r), _load(str(tmp_path / "B"), r)
        assert set(got) == set(want)
        for n in want:
            np.testing.assert_array_equal(got[n], want[n], err_msg=f"self-compiled rank {r}: {n}")
    # the CLI refuses to overwrite and names a compile workdir that does not fit
    assert main(["ckpt", "reshard", ckpt, override, "--to", str(ROOT / "strategies" / f"{name}.yaml"),
                 "--compiled", str(work_b), "--out", str(tmp_path / "B")]) == 2
    assert main(["ckpt", "reshard", ckpt, "train.micro_batch_size=2", "--to",
                 str(ROOT / "strategies" / "tiny-dp4-pp2.yaml"), "--compiled", str(work_b),
                 "--out", str(tmp_path / "C")]) == 2
    assert "rank_4/strategy.ckpt" in capsys.readouterr().err
