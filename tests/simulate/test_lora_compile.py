"""LoRA on SFT data under a strategy file, compiled by MindSpore on 8 simulated devices (tiny, dp2 x mp2 x pp2).

The references are independent of naohai's rules: MindSpore's own compiled parameter layout (the
adapter factors' slices must follow the base weight's split, the rank axis whole), the compiled IR
(gradient reductions tagged with each parameter's name) and numpy slicing of the full-shape adapter
a one-device build creates (every rank's compile-time slice is the block of it that its layout
names: a dp1 run and a dp2-mp2-pp2 run start from the same adapter).  The data is SFT data (``data.format:
sft``), so the step is the masked loss's: the IR shows every rank's loss, and every last-stage rank's
gradient seed, scaled by the host-set token weight (1 / the global batch's learned tokens; the host side of
that wiring runs in tests/train/test_sft_loss.py)."""
import json
import re
from pathlib import Path

import numpy as np
import pytest

from naohai.strategy.lora import check_adapters, planned_adapters
from naohai.strategy.memory import adapter_placements
from naohai.strategy.rank_memory import compiled_state, planned_state
from naohai.strategy.run_plan import plan_run

ROOT = Path(__file__).resolve().parents[2]
ARGV = ["tiny", str(ROOT / "strategies/tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2", "finetune.method=lora",
        r"finetune.targets=attention\.(q|out)$|mlp\.down$", "finetune.rank=4", "data.format=sft"]
OPS = ("attention.q", "attention.out", "mlp.down")
RANK = 4


def _block(full: np.ndarray, layout: dict, local_rank: int) -> np.ndarray:
    """The slice of ``full`` a device holds, from MindSpore's dev matrix and tensor map (a tensor-map
    entry j names the dev-matrix axis j counted from the right; device coordinates are row-major)."""
    dev = layout["dev_matrix"]
    coords, rest = [], local_rank
    for size in reversed(dev):
        coords.append(rest % size)
        rest //= size                      # coords[j]: the coordinate on the j-th axis from the right
    index = []
    for axis, m in enumerate(layout["tensor_map"]):
        if m == -1:
            index.append(slice(None))
        else:
            n = dev[len(dev) - 1 - m]
            step = full.shape[axis] // n
            index.append(slice(coords[m] * step, (coords[m] + 1) * step))
    return full[tuple(index)]


def _one_device_adapters():
    """The full-shape adapters of the same recipe built on one device (no strategy file)."""
    import mindspore as ms
    from naohai.config import load_recipe
    from naohai.model.lora import adapter_params, apply_lora
    from naohai.model.transformer import NaohaiLM

    ms.set_device("CPU")
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ARGV[2:])
    model = NaohaiLM(recipe.model, seed=recipe.train.seed)
    apply_lora(model, recipe.finetune, recipe.train.seed)
    return {p.name: p.asnumpy() for p in adapter_params(model)}


@pytest.mark.slow
def test_lora_compiles_on_every_rank_with_factors_following_the_base_split(compiled_layout):
    rc, workdir, out = compiled_layout(ARGV)
    check_lora_compile(rc, workdir, out)


def check_lora_compile(rc, workdir, out):
    import mindspore as ms
    from naohai.simulate.ircheck import parse_comm_ops, reduced_gradients, weighted_nodes

    summary = json.loads((workdir / "summary.json").read_text())
    assert rc == 0 and summary["ok"], out[-4000:]
    per = summary["per_rank"]
    assert len(per) == 8 and all(r["ok"] for r in per)
    ir = summary["ir_checks"]
    assert ir["passed"] and ir["trainable"] == 4 * len(OPS) * 2, ir
    assert "IR checks, graph train: passed" in out and "all of them among the 24 trainable ones" in out
    assert ir["token_weight"] == "sft.token_weight" and "masked loss: every rank's loss" in out
    for r in range(8):
        weighted = weighted_nodes((workdir / f"rank_{r}" / "train.ir").read_text(errors="replace"), "sft.token_weight")
        assert "loss" in weighted and ("sens" in weighted or r < 4), (r, weighted)
        # the eval graph holds no weight: the host scales its summed NLL (builder.CompiledSteps.evaluate)
        assert not weighted_nodes((workdir / f"rank_{r}" / "eval.ir").read_text(errors="replace"), "sft.token_weight")
    full = _one_device_adapters()
    run = plan_run(str(ROOT / "recipes/tiny.yaml"), str(ROOT / "strategies/tiny-dp2-mp2-pp2.yaml"), ARGV[2:])
    planned = check_adapters(run.recipe, run.strategy)      # naohai's rules, as the planner reads them
    adapters = adapter_placements(run.strategy, planned_adapters(run.recipe, run.strategy))
    for r, entry in enumerate(per):
        stage, local = divmod(r, 4)
        params = entry["result"]["parameters"]
        mine = [i for i in range(4) if "slice_shape" in params.get(f"layers.{i}.attention.q_weight", {})]
        assert mine == ([0, 1] if stage == 0 else [2, 3])      # adapters live on their base layer's stage
        slices = ms.load_checkpoint(entry["result"]["slices_file"])
        # the planner's model states with the base frozen == MindSpore's (its accumulation buffers and
        # optimizer moments exist for the adapters only)
        got = compiled_state(params, run.strategy, run.recipe.model, stage)
        want = planned_state(run.strategy, run.recipe.model, stage, adapters)
        assert (got.params, got.weights, got.grads, got.optimizer) == \
            (want.params, want.weights, want.grads, want.optimizer), (r, got, want)
        ops = parse_comm_ops((workdir / f"rank_{r}" / "train.ir").read_text(errors="replace"))
        reduced = reduced_gradients(ops)
        for i in range(4):
            for op in OPS:
                a, b = f"layers.{i}.{op}.lora_a", f"layers.{i}.{op}.lora_b"
                if i not in mine:
                    assert "slice_shape" not in params.get(a, {}) and not reduced[a]
                    continue
                w = params[f"layers.{i}.{op}_weight"]["slice_shape"]          # [out, in] as MindSpore split it
                assert params[a]["full_shape"] == [RANK, full[a].shape[1]]
                assert params[a]["slice_shape"] == [RANK, w[1]]              # A: rank whole, input split as W's
                assert params[b]["slice_shape"] == [w[0], RANK]              # B: output split as W's, rank whole
                assert params[a]["local_shape"] == params[a]["slice_shape"]  # no optimizer shard of the rank axis
                for name in (a, b):
                    got = tuple(f // s for f, s in zip(params[name]["full_shape"], params[name]["slice_shape"]))
                    assert got == planned[name], (name, got, planned[name])
                for name in (a, b):
                    np.testing.assert_array_equal(slices[name].asnumpy(), _block(full[name], params[name], local))
                    assert reduced[name] >= 1, (r, name)                     # the adapters' gradients are reduced
                frozen = f"layers.{i}.{op}_weight"
                assert "slice_shape" in params[frozen] and reduced[frozen] == 0             # ... the frozen weight's are not
        assert not any(re.search(r"_weight$|\.(gamma|beta)$|_bias$", p) for p in reduced), (r, reduced)
    # the row-parallel ops really split A's input axis (mp2), the column-parallel one B's output axis
    p0 = per[0]["result"]["parameters"]
    assert p0["layers.0.attention.out.lora_a"]["slice_shape"] == [RANK, 64]
    assert p0["layers.0.mlp.down.lora_a"]["slice_shape"] == [RANK, 176]
    assert p0["layers.0.attention.q.lora_b"]["slice_shape"] == [64, RANK]
    assert np.any(full["layers.0.attention.out.lora_a"])
