"""MindFormers YAML -> naohai strategy."""
import os

import pytest
import yaml

from naohai.cli import main
from naohai.config import preset_recipe
from naohai.errors import UserError
from naohai.strategy.migrate import import_mindformers, map_pattern, stage_split_from_offset
from naohai.strategy.resolve import check_strategy
from naohai.strategy.schema import load_strategy

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures_mindformers.yaml")


def test_import_fixture_fields():
    out, notes = import_mindformers(FIXTURE, model="pengcheng-mind-7b")
    assert out["mesh"] == {"data": 2, "model": 2, "pipeline": 4}
    assert out["micro_batches"] == 16 and out["sequence_parallel"] is True
    assert out["embedding"] == {"vocab_parallel": True}            # vocab_emb_dp: False
    assert out["optimizer_parallel"] == {"enabled": True, "shard_size": 2, "level": "level1", "threshold_kb": 64}
    # even split 8/8/8/8 shifted by offset [-1, 1, 1, -1] -> the published 7/9/9/7
    assert out["pipeline"]["layers_per_stage"] == [7, 9, 9, 7]
    layers = out["layers"]
    # select patterns mapped by keyword; the reshape has no catalog op and is noted
    assert layers["all"]["recompute"]["select"] == ["mlp.mul", "mlp.act"]
    assert any("wq" in n and "reshape" in n and "ignored" in n for n in notes)
    # per-stage full recompute counts [1, 2, 0, 0]: first layer of stage 0, first two of stage 1 (starts at 7)
    assert layers["0-0"]["recompute"]["mode"] == "full" and layers["7-8"]["recompute"]["mode"] == "full"
    assert layers["0-0"]["recompute"]["comm"] is True and layers["0-0"]["recompute"]["slice_activation"] is True


def test_imported_strategy_resolves(tmp_path):
    code = main(["plan", "--import-mindformers", FIXTURE, "--out", str(tmp_path / "s.yaml"),
                 "--model", "pengcheng-mind-7b"])
    assert code == 0
    r = check_strategy(load_strategy(str(tmp_path / "s.yaml")), preset_recipe("pengcheng-mind-7b").model)
    assert r.layers_per_stage == [7, 9, 9, 7]
    assert [x.mode for x in r.recompute[:10]] == ["full", "select", "select", "select", "select", "select",
                                                  "select", "full", "full", "select"]
    assert r.recompute[1].ops == ("mlp.mul", "mlp.act")
    assert r.optimizer_parallel.shard_size == 2


def test_int_offset_uses_pangu_rule():
    # 64 layers, 16 stages: pp_dis = 4; offset 0 -> 4 each; offset 2 -> stage 0 gets 2 layers, last gets 6
    assert stage_split_from_offset(64, 16, 0, "f") == [4] * 16
    assert stage_split_from_offset(64, 16, 2, "f") == [2] + [4] * 14 + [6]


def test_bad_offset_list():
    with pytest.raises(UserError) as e:
        stage_split_from_offset(32, 4, [0, 0, 1], "f.yaml")
    assert e.value.rule == "one offset per stage" and e.value.key == "model.model_config.offset"
    with pytest.raises(UserError) as e:
        stage_split_from_offset(32, 4, [1, 1, 1, 1], "f.yaml")
    assert e.value.rule == "stage list sums to layers"


def test_pattern_map():
    assert map_pattern(r"feed_forward\.w1\.activation") == ("mlp.act",)
    assert map_pattern(r"feed_forward\.w1", swiglu=True) == ("mlp.gate",)
    assert map_pattern(r"feed_forward\.w1", swiglu=False) == ("mlp.up",)
    assert map_pattern(r"attention\.softmax") == ("attention.softmax",)
    assert map_pattern(r"attention\.wq\.reshape") == ()


def test_context_parallel_rejected(tmp_path):
    p = tmp_path / "mf.yaml"
    p.write_text(yaml.safe_dump({"parallel_config": {"data_parallel": 2, "context_parallel": 2}}))
    with pytest.raises(UserError) as e:
        import_mindformers(str(p))
    assert e.value.rule == "context_parallel == 1"


def test_select_true_and_full_bool(tmp_path):
    p = tmp_path / "mf.yaml"
    p.write_text(yaml.safe_dump({"parallel_config": {"data_parallel": 8, "vocab_emb_dp": True},
                                 "recompute_config": {"select_recompute": True, "recompute": False}}))
    out, _ = import_mindformers(str(p))
    assert out["layers"]["all"]["recompute"]["select"] == ["attention.scores", "attention.scale", "attention.mask",
                                              "attention.softmax"]
    assert out["embedding"]["vocab_parallel"] is False and out["optimizer_parallel"]["enabled"] is False


def test_missing_mp_comm_recompute_takes_mindspores_default_true(tmp_path):
    # MindSpore's Cell.recompute(mp_comm_recompute=True) and MindFormers' recompute_config default it to True
    raw = yaml.safe_load(open(FIXTURE, encoding="utf-8"))
    del raw["recompute_config"]["mp_comm_recompute"]
    path = tmp_path / "mf.yaml"
    path.write_text(yaml.safe_dump(raw))
    out, _ = import_mindformers(str(path), model="pengcheng-mind-7b")
    assert out["layers"]["0-0"]["recompute"]["comm"] is True
