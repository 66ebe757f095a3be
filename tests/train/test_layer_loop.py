"""Training with the layer loop (train.layer_loop, naohai.model.stack): the same run as one cell per
layer, the same checkpoint files, resume across the two forms, and where the loop is refused."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.config import load_recipe
from naohai.errors import UserError
from naohai.strategy.resolve import RecomputeSpec, check_strategy, default_strategy
from naohai.strategy.run_plan import Run, plan_run
from naohai.strategy.runtime import Runtime
from naohai.strategy.schema import parse_strategy
from naohai.train.builder import AUTO_LOOP_MIN_LAYERS, build, layer_loop
from naohai.train.job import start
from tests.conftest import micro_recipe

ROOT = Path(__file__).resolve().parents[2]


def _run(recipe, steps=None, resume=False):
    trainer = start(plan_run(recipe), log=lambda *_: None, progress=False, max_steps=steps)
    assert trainer.built.model.layer_loop == (recipe.train.layer_loop == "always")
    if resume:
        trainer.resume()
    return trainer.run()


def _tensors(run_dir, step):
    with open(Path(run_dir) / "checkpoints" / f"step_{step:08d}" / "rank_0.json", encoding="utf-8") as fh:
        return json.load(fh)["tensors"]


@pytest.mark.parametrize("variant", [{}, {"micro_batch_size": 2}])
def test_loop_trains_and_checkpoints_like_one_cell_per_layer(tmp_path, micro_data, variant):
    """MindSpore's own outputs of the per-layer model are the reference: 8 steps, two evals, the files."""
    prepared, tok = micro_data
    flat = _run(micro_recipe(tmp_path / "flat", prepared, tok, layer_loop="never", **variant))
    loop = _run(micro_recipe(tmp_path / "loop", prepared, tok, layer_loop="always", **variant))
    assert sorted(loop.losses) == list(range(1, 9))
    for step, value in flat.losses.items():
        assert loop.losses[step] == pytest.approx(value, rel=1e-6, abs=1e-6), step
    assert loop.evals == pytest.approx(flat.evals, rel=1e-6)
    assert loop.losses[8] < loop.losses[1]
    # the same tensors by the same per-layer names in both forms' files (optimizer moments included)
    names = _tensors(tmp_path / "loop", 8)
    assert names == _tensors(tmp_path / "flat", 8)
    assert "layers.1.attention.q_weight" in names and "adam_m.layers.0.mlp.up_weight" in names
    assert not [n for n in names if "stack." in n]


@pytest.mark.parametrize("first, second", [("always", "never"), ("never", "always")])
def test_resume_across_the_two_forms_is_exact(tmp_path, micro_data, first, second):
    prepared, tok = micro_data
    full = _run(micro_recipe(tmp_path / "full", prepared, tok, layer_loop=second))
    _run(micro_recipe(tmp_path / "part", prepared, tok, layer_loop=first), steps=4)
    resumed = _run(micro_recipe(tmp_path / "part", prepared, tok, layer_loop=second), steps=4, resume=True)
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for step in resumed.losses:
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-6, abs=1e-6), step
    assert resumed.evals[8] == pytest.approx(full.evals[8], rel=1e-6)


def _tiny(*over):
    return load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=8", *over])


def _plain(recipe):
    return default_strategy(recipe.model, recipe.train.micro_batch_size)


def _loop(*over_and_runtime):
    *over, runtime = over_and_runtime
    recipe = _tiny(*over)
    return layer_loop(recipe, _plain(recipe), runtime)


def _strategy(recipe, layers):
    raw = {"name": "t", "mesh": {"data": 1, "model": 1, "pipeline": 1}, "layers": layers}
    return check_strategy(parse_strategy(raw, "inline"), recipe)


def test_where_the_loop_runs_and_where_it_is_refused():
    ms.set_device("CPU")
    one = Runtime("standalone", 0, 1, 0, 1)
    semi = Runtime("semi_auto", 0, 8, 0, 2, stages=2)
    deep = f"model.num_layers={AUTO_LOOP_MIN_LAYERS}"
    # auto: one cell per layer for shallow models, the loop from AUTO_LOOP_MIN_LAYERS looped layers
    assert _loop(one) == (False, None)
    assert _loop(f"model.num_layers={AUTO_LOOP_MIN_LAYERS - 1}", one) == (False, None)
    assert _loop(deep, one) == (True, None)
    assert _loop(deep, Runtime("data_parallel", 0, 2, 0, 2)) == (True, None)
    assert _loop("train.layer_loop=always", one) == (True, None)
    assert _loop(deep, "train.layer_loop=never", one) == (False, None)
    loop, note = _loop(deep, semi)
    assert not loop and "one graph per layer" in note
    with pytest.raises(UserError) as err:
        _loop("train.layer_loop=always", semi)
    assert err.value.key == "train.layer_loop"
    # MindSpore does not recompute inside a loop: a strategy with recompute keeps one cell per layer
    recipe = _tiny("train.layer_loop=always", "model.num_layers=4")
    for some in ([RecomputeSpec("full")] * 4, [RecomputeSpec()] * 3 + [RecomputeSpec("select", ("mlp.up",))]):
        with pytest.raises(UserError, match="does not recompute inside a loop"):
            layer_loop(recipe, SimpleNamespace(recompute=some), one)
        loop, note = layer_loop(_tiny(deep), SimpleNamespace(recompute=some * 4), one)
        assert not loop and "does not recompute inside a loop" in note
    assert layer_loop(recipe, SimpleNamespace(recompute=[RecomputeSpec()] * 4), one) == (True, None)



def test_bad_layer_loop_value_is_a_recipe_error():
    with pytest.raises(UserError) as err:
        _tiny("train.layer_loop=sometimes")
    assert err.value.key == "train.layer_loop" and "auto, always, never" in err.value.message


def test_a_strategy_with_recompute_builds_one_recomputed_cell_per_layer():
    ms.set_context(mode=ms.GRAPH_MODE)
    recipe = _tiny(f"model.num_layers={AUTO_LOOP_MIN_LAYERS}")
    built = build(Run(recipe, _strategy(recipe, {f"0-{AUTO_LOOP_MIN_LAYERS - 1}": {"recompute": "full"}})))
    assert not built.model.layer_loop
    assert all(cell._has_config_recompute for cell in built.model.layer_cells())
    assert any("does not recompute inside a loop" in note for note in built.steps.notes)


class _Body(ms.nn.Cell):
    def __init__(self):
        super().__init__()
        self.tanh = ms.ops.Tanh()

    def construct(self, x, w, i):
        return ms.ops.exp(self.tanh(ms.ops.matmul(x, ms.ops.gather(w, i, 0))))


class _Loop(ms.nn.Cell):
    def __init__(self, recompute: bool):
        super().__init__()
        self.body = _Body()
        if recompute:
            self.body.recompute()
        self.w = ms.Parameter(Tensor(np.full((3, 8, 8), 0.1, np.float32)), name="w")
        self.count = Tensor(3, ms.int32)

    def construct(self, x):
        i = Tensor(0, ms.int32)
        while i < self.count:
            x = self.body(x, self.w, i)
            i = i + 1
        return x.sum()


def test_mindspore_compiles_a_recomputed_loop_body_like_a_plain_one(tmp_path):
    """Why a strategy's recompute keeps one cell per layer: the executed graph of a loop whose body is
    marked for recompute has exactly the ops of the unmarked one (one Tanh, no recomputed copy)."""
    import glob
    import re
    ops_of = {}
    mode = ms.get_context("mode")
    try:
        for recompute in (False, True):
            folder = tmp_path / f"ir-{recompute}"
            ms.set_context(mode=ms.GRAPH_MODE, save_graphs=2, save_graphs_path=str(folder))
            net = _Loop(recompute)
            ms.value_and_grad(net, None, net.trainable_params())(Tensor(np.ones((4, 8), np.float32)))
            texts = []
            for ir in glob.glob(str(folder / "[0-9]*_execute_[0-9]*.ir")):      # the executed graphs
                with open(ir, encoding="utf-8") as fh:
                    texts.append(fh.read())
            [grad_graph] = [t for t in texts if "PrimFunc_TanhGrad" in t]     # the value-and-grad graph
            ops_of[recompute] = sorted(re.findall(r"= (PrimFunc_\w+)\(", grad_graph))
    finally:
        ms.set_context(mode=mode, save_graphs=0)
    assert ops_of[False].count("PrimFunc_Tanh") == 1 and "PrimFunc_TanhGrad" in ops_of[False]
    assert ops_of[True] == ops_of[False]


def test_state_written_after_steps_have_run_reaches_the_compiled_loop():
    """The checkpoint view writes a stack in place: a loop model that has already trained, given the
    state of a per-layer model, then takes the same step as that model (MindSpore 2.10 would keep
    the stack's old memory after a plain set_data)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    over = ["model.num_layers=3", "train.global_batch_size=2", "train.micro_batch_size=2", "model.seq_length=32",
            "train.warmup_steps=0"]
    tokens = np.random.RandomState(0).randint(0, 2048, (3, 2, 33)).astype(np.int32)
    batch = [(Tensor(t[:, :-1]), Tensor(t[:, 1:])) for t in tokens]
    flat = build(plan_run(_tiny(*over, "train.layer_loop=never")))
    loop = build(plan_run(_tiny(*over, "train.seed=7", "train.layer_loop=always")))
    assert loop.model.layer_loop
    flat.steps.train_step(*batch[0])
    for ids, labels in batch[1:]:
        loop.steps.train_step(ids, labels)           # the loop's step has run: its memory is bound
    source = {e.name: e.asnumpy() for e in flat.saved_params()}
    targets = loop.saved_params()
    assert {e.name for e in targets} == set(source)
    for entry in targets:
        entry.set_data(Tensor(np.array(source[entry.name])))
    want = float(flat.steps.train_step(*batch[2])[0].asnumpy())
    got = float(loop.steps.train_step(*batch[2])[0].asnumpy())
    assert got == pytest.approx(want, rel=1e-6)
    after = {e.name: e.asnumpy() for e in flat.saved_params()}
    for entry in loop.saved_params():
        np.testing.assert_allclose(entry.asnumpy(), after[entry.name], rtol=1e-5, atol=1e-7, err_msg=entry.name)
