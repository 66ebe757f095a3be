"""The planner's per-rank parameter slices against MindSpore's own: `naohai check --compile` on tiny layouts.

MindSpore compiles naohai's real train step on simulated devices and reports, per rank, every
parameter's slice shape and optimizer shard (``parameter_layout_dict``).  The plan predicts the same
from the strategy alone; both must agree for every parameter on every rank, and a parameter must be
on exactly the ranks of the pipeline stages the plan puts it on.
"""
import json
import os

import pytest

from naohai.config import load_recipe
from naohai.strategy.memory import place_params
from naohai.strategy.resolve import check_strategy, load_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPTIMIZER_STATE = ("args", "accu_grads.", "accum.", "adam_m.", "adam_v.", "moments.", "learning_rate", "global_step",
                   "beta1_power", "beta2_power", "guard.")   # guard.*: the step's loss-scale / norm scalars

CASES = {   # strategy file, recipe override, ranks
    "tiny-dp2-mp2": ("tiny-dp2-mp2.yaml", "train.micro_batch_size=8", 4),
    "tiny-dp2-mp2-pp2": ("tiny-dp2-mp2-pp2.yaml", "train.micro_batch_size=2", 8),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_planned_slices_equal_mindspores(case, compiled_layout):
    strategy, override, ranks = CASES[case]
    recipe_path = os.path.join(ROOT, "recipes", "tiny.yaml")
    strategy_path = os.path.join(ROOT, "strategies", strategy)
    # the same compile as tests/simulate/test_check.py (shared per session)
    rc, workdir, out = compiled_layout(["tiny", str(strategy_path), override])
    summary = json.loads((workdir / "summary.json").read_text())
    assert rc == 0 and summary["ok"], out[-3000:]

    recipe = load_recipe(recipe_path, [override])
    resolved = check_strategy(load_strategy(strategy_path), recipe)
    planned = {pl.name: pl for pl in place_params(recipe.model, resolved)}
    per_stage = resolved.devices_per_stage
    compared, sharded = 0, 0
    for r in summary["per_rank"]:
        rank, params = r["rank"], r["result"]["parameters"]
        stage = rank // per_stage
        # the parameters the compiled step gave this rank (entries without a layout are other stages')
        names = {n for n, e in params.items() if "slice_shape" in e and not n.startswith(OPTIMIZER_STATE)}
        assert names == {n for n, pl in planned.items() if stage in pl.stages}, rank
        for name in names:
            pl, got = planned[name], params[name]
            want = [d // k for d, k in zip(pl.shape, pl.slices)]
            assert list(got["full_shape"]) == list(pl.shape), name
            assert list(got["slice_shape"]) == want, (rank, name, got["slice_shape"], want)
            if pl.opt_sharded:
                g = pl.opt_group
                assert got.get("opt_shard_size") == g and got["opt_local_shape"][0] == want[0] // g, (rank, name)
            else:
                assert not got.get("opt_shard_size"), (rank, name, got.get("opt_shard_group"))
            compared += 1
            sharded += pl.opt_sharded
    assert compared >= ranks * 20 and sharded > 0
