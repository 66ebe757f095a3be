"""LoRA's sharding rules (naohai.strategy.lora) and the checks of a fine-tuning run under a strategy file.

What MindSpore makes of the rules is tested in tests/simulate/test_lora_compile.py (slow); here the
derivation against the base op's tuple, the layout the planner reads, and the bad inputs (exit 2)."""
import re
from pathlib import Path

import pytest
import yaml

from naohai.cli import main
from naohai.config import read_yaml
from naohai.strategy.lora import adapter_layout, adapter_op_refusal, adapter_strategies, check_adapters
from naohai.strategy.run_plan import plan_run

ROOT = Path(__file__).resolve().parents[2]
S = ROOT / "strategies"
LORA = ["finetune.method=lora", r"finetune.targets=attention\.(q|out)$"]


def _tiny(strategy, mbs, *extra):
    return plan_run(str(ROOT / "recipes/tiny.yaml"), str(S / strategy), [f"train.micro_batch_size={mbs}", *LORA,
                                                                         *extra])


@pytest.mark.parametrize("strategy, mbs", [("tiny-dp2-mp2.yaml", 8), ("tiny-dp2.yaml", 8),
                                           ("tiny-dp1-mp4-pp2.yaml", 4)])
def test_adapter_ops_take_the_base_ops_split_and_never_split_the_rank_axis(strategy, mbs):
    run = _tiny(strategy, mbs)
    for op in ("layers.0.attention.q", "layers.0.attention.out"):
        (b, k), (n, k_w) = base = run.strategy.op_strategy[op]
        derived = adapter_strategies(base)
        assert derived["mm_a"][0] == (b, k)            # reads x as the base does: no redistribution
        assert derived["mm_a"][1] == (1, k_w)          # A [rank, in]: input split as W's, rank whole
        assert derived["mm_b"][1] == (n, 1)            # B [out, rank]: output split as W's, rank whole
        assert derived["mm_b"][0] == derived["scale_mul"][0] == (b, 1)   # [tokens, rank], rank whole
        assert derived["add"] == ((b, n), (b, n))      # the base's output layout
        assert derived["drop"] == ((b, k),)
    layout = check_adapters(run.recipe, run.strategy)
    assert set(layout) == {f"layers.{i}.attention.{op}.{f}" for i in range(4) for op in ("q", "out")
                           for f in ("lora_a", "lora_b")}
    mp = run.strategy.model_parallel
    assert layout["layers.0.attention.q.lora_a"] == (1, 1) and layout["layers.0.attention.q.lora_b"] == (mp, 1)
    assert layout["layers.0.attention.out.lora_a"] == (1, mp) and layout["layers.0.attention.out.lora_b"] == (1, 1)


def test_one_device_layout_splits_nothing():
    run = plan_run(str(ROOT / "recipes/tiny.yaml"), None, LORA)
    assert set(check_adapters(run.recipe, run.strategy).values()) == {(1, 1)}
    assert adapter_layout(run.strategy, []) == {}


def _with(tmp_path, name, **sections):
    raw = read_yaml(str(S / name))
    for key, value in sections.items():
        if isinstance(value, dict):
            raw.setdefault(key, {}).update(value)
        else:
            raw[key] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.mark.parametrize("sections, key", [
    ({"ops": {"layers.0.attention.q.lora_a": [[2, 1], [2, 1]]}}, "ops.layers.0.attention.q.lora_a"),
    ({"layers": {"0-3": {"ops": {"attention.out.lora_b": [[2, 1], [1, 2]]}}}}, 'layers."0-3".ops.attention.out.lora_b'),
])
def test_a_strategy_naming_an_adapter_op_is_refused(tmp_path, capsys, sections, key):
    path = _with(tmp_path, "tiny-dp2-mp2.yaml", **sections)
    assert main(["check", "tiny", str(path), "train.micro_batch_size=8", *LORA]) == 2
    err = " ".join(capsys.readouterr().err.split())     # the paragraph is wrapped at 100 columns
    assert f"key '{key}'" in err and "rank axis never split" in err and "give the strategy to the base op" in err
    assert "Traceback" not in err and str(path) in err
    assert adapter_op_refusal("layers.0.attention.q") is None


@pytest.mark.parametrize("override, key, words", [
    ("finetune.targets=attention\\.nothing$", "finetune.targets", "matches no linear op"),
    ("finetune.rank=129", "finetune.rank", "between 1 and 128"),
    ("finetune.rank=0", "finetune.rank", "must be a positive integer"),
])
def test_bad_finetune_values_under_a_strategy_file_exit_2(capsys, override, key, words):
    rc = main(["check", "tiny", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2", "finetune.method=lora",
               override])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and f"key '{key}'" in err and words in err and "Traceback" not in err


def test_check_accepts_lora_under_the_full_layout(capsys):
    assert main(["check", "tiny", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2", *LORA]) == 0
    assert "valid" in capsys.readouterr().out


def test_planner_counts_no_gradients_or_moments_for_frozen_weights():
    """tiny, dp2 x mp2 x pp2, LoRA rank 4 on attention q (column-parallel) and out (row-parallel): per layer
    A_q [4, 128] whole + B_q [128, 4] / 2 + A_out [4, 128] / 2 + B_out [128, 4] whole = 1,536 elements per
    device, 2 layers per stage; gradients 4 bytes and Adam moments 8 bytes each, for them only."""
    from naohai.strategy.memory import adapter_placements
    from naohai.strategy.plan import build_plan
    from naohai.strategy.profiles import load_profile
    from naohai.strategy.lora import planned_adapters

    run = _tiny("tiny-dp2-mp2-pp2.yaml", 2, "finetune.rank=4")
    profile = load_profile("ascend-910a-32g")
    full = build_plan(run.recipe.model, run.strategy, profile)
    adapters = adapter_placements(run.strategy, planned_adapters(run.recipe, run.strategy))
    tuned = build_plan(run.recipe.model, run.strategy, profile, adapters=adapters)
    per_stage = 2 * (4 * 128 + 128 * 4 // 2 + 4 * 128 // 2 + 128 * 4)
    assert tuned.adapter_params == 4 * 2 * (4 * 128 + 128 * 4)
    for st, base in zip(tuned.stages, full.stages):
        assert st.grad_bytes == 4 * per_stage and st.optimizer_bytes == 8 * per_stage
        assert st.weight_bytes == base.weight_bytes + 4 * per_stage
        assert st.params_per_device == base.params_per_device + per_stage
        assert base.grad_bytes > 10 * st.grad_bytes
    assert tuned.full_training_state_bytes == [st.weight_bytes + st.grad_bytes + st.optimizer_bytes
                                               for st in full.stages]


def test_naohai_plan_shows_what_freezing_saves(capsys):
    assert main(["plan", str(ROOT / "recipes/sft-tiny.yaml"), str(S / "tiny-dp2-mp2-pp2.yaml"),
                 "--micro-batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"fine-tuning: [\d.]+K adapter parameters train; the frozen base weights keep no gradients "
                     r"or optimizer moments, saving per device \(GB of model states\): stage 0 \S+, stage 1 \S+", out)
