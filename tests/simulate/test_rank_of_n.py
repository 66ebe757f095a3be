"""`naohai check --compile --ranks first,last,K|stages`: chosen ranks of the real layout, one pair each.

Fast tests: which ranks, which depth, what the compiled copy keeps, and the command line's
refusals.  Slow tests compile with MindSpore: the per-rank layouts and bytes of this mode equal
those of the whole-layout msrun compile rank for rank (tiny), rank 37 of a 64-rank layout, and
the planner's parameter / optimizer bytes equal the compiled slices of a 200B rank exactly.
"""
import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from naohai.cli import main
from naohai.commands.check import choose_ranks
from naohai.config import load_recipe, preset_recipe, read_yaml, recipe_from_dict
from naohai.simulate.scale_down import default_depth, reduce_depth
from naohai.strategy.batch import adopt_batch
from naohai.strategy.rank_memory import compiled_state
from naohai.strategy.resolve import check_strategy, load_strategy
from naohai.strategy.schema import parse_strategy

ROOT = Path(__file__).resolve().parents[2]
S = ROOT / "strategies"


def _resolved(preset, name):
    recipe, _ = adopt_batch(preset_recipe(preset), load_strategy(str(S / name)))
    return recipe, check_strategy(load_strategy(str(S / name)), recipe)


# ----------------------------------------------------------------------------- fast
def test_first_last_and_one_rank_per_stage():
    _, r = _resolved("pengcheng-mind-200b", "naohai-200b-3456p.yaml")
    assert choose_ranks(["first", "last", "37"], r) == [0, 3455, 37]
    stages = choose_ranks(["stages"], r)
    assert stages == [k * 128 for k in range(27)]                 # 16 x 8 ranks per stage, same position on each
    assert [x // r.devices_per_stage for x in stages] == list(range(27))
    assert choose_ranks(["first", "stages", "last"], r)[:2] == [0, 128]   # no repeats


def test_depth_keeps_widths_mesh_micro_batches_and_the_last_layer():
    recipe, r = _resolved("pengcheng-mind-200b", "naohai-200b-3456p.yaml")
    assert default_depth(r)[0] is None      # the micro-batches folded: 104 layers in the graph, not 104 x 64
    deeper = dataclasses.replace(r, layers_per_stage=[12] * 27)      # 324 layers: one per stage by default
    depth, why = default_depth(deeper)
    assert depth == 1 and "324 layers" in why
    raw = read_yaml(str(S / "naohai-200b-3456p.yaml"))
    up = [list(d) for d in r.op_strategy["layers.103.mlp.up"]]   # what the rules give, as an escape hatch
    raw["ops"] = {"layers.103.mlp.up": up, "layers.51.mlp.up": up}
    rec, strat, changes = reduce_depth(recipe, raw, r, 2)
    small = recipe_from_dict(rec, "reduced")
    assert small.model.num_layers == 54 and small.model.hidden_size == 12672
    assert small.model.num_heads == 96 and small.model.padded_vocab_size == recipe.model.padded_vocab_size
    red = check_strategy(parse_strategy(strat, "reduced"), small)
    assert red.device_num == 3456 and red.mesh == r.mesh and red.micro_batches == 64
    assert red.layers_per_stage == [2] * 27 and red.micro_batch_size == r.micro_batch_size
    assert all(rc.mode == "full" and rc.comm for rc in red.recompute)
    # layer 103 (the last stage's last) is new layer 53; layer 51 is not kept (stage 13 keeps 49, 50)
    assert set(strat["ops"]) == {"layers.53.mlp.up"}
    assert any("ops.layers.51.mlp.up: layer 51 is not kept" in c for c in changes)
    assert red.op_strategy["layers.53.mlp.up"] == r.op_strategy["layers.103.mlp.up"]
    tiny = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=2"])
    rt = check_strategy(load_strategy(str(S / "tiny-dp2-mp2-pp2.yaml")), tiny)
    assert default_depth(rt)[0] is None                            # tiny compiles at its real depth


@pytest.mark.parametrize("argv,key", [
    (["--compile", "--ranks", "first,middle"], "--ranks"),
    (["--compile", "--ranks", "first,9000"], "--ranks"),
    (["--ranks", "first"], "--ranks"),                              # a list of ranks needs --compile
    (["--compile", "--depth", "2"], "--depth"),                     # --depth needs a list of ranks
    (["--compile", "--ranks", "first", "--depth", "0"], "--depth"),
    (["--compile", "--ranks", "first", "--save-slices"], "--save-slices"),
])
def test_refusals_name_the_flag(capsys, argv, key):
    rc = main(["check", "pengcheng-mind-200b", str(S / "naohai-200b-3456p.yaml"), *argv])
    err = " ".join(capsys.readouterr().err.split())
    assert rc == 2 and f"key '{key}'" in err and "Traceback" not in err


def test_subset_ir_checks_match_only_the_compiled_neighbours():
    from naohai.simulate.ircheck import CommOp, check_collectives, check_point_to_point
    send = CommOp("Send", "", (), (4, 8), peer=4, tag=0)
    recv = CommOp("Receive", "", (), (4, 8), peer=0, tag=0)
    assert check_point_to_point({0: [send]}) == []                       # rank 4 not compiled: nothing to match
    assert check_point_to_point({0: [send], 4: [recv]}) == []
    assert check_point_to_point({0: [send], 4: []}) == ["rank 0 issues 1 Send to rank 4 that never receives"]
    ar = CommOp("AllReduce", "g", (0, 1, 2, 3), (8,), "sum")
    assert check_collectives({0: [ar], 3: [ar]}) == []                 # members 1, 2 not compiled
    assert "rank 3 never joins" in check_collectives({0: [ar], 3: []})[0]


@pytest.mark.parametrize("err,key", [
    ({"message": "MicroBatch size: 2 can't less than stage num: 4"}, "micro_batches"),
    ({"message": "When pipeline_interleave is False, 'gpipe' is not supported"}, "pipeline.scheduler"),
    ({"message": "x", "op": "MatMul",
      "log_errors": ["step_parallel.cc] Default/network-TrainStep/layers-CellList/5-DecoderLayer/mlp-MLP/MatMul-op3"]},
     'layers."5" (mlp MatMul)'),
    ({"message": "LogSoftmaxInfo: The strategy corresponding to axis dimension(2) is not 1", "op": "LogSoftmax"},
     "rules / ops (the strategy of the LogSoftmax ops)"),
])
def test_mindspore_messages_map_to_strategy_keys(err, key):
    from naohai.simulate.msgparse import strategy_key
    assert strategy_key(err) == key


# ----------------------------------------------------------------------------- slow (MindSpore compiles)
TINY_PP = ["tiny", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2"]   # the argv of test_check.py


def _same_layout(a, b):
    keys = ("dev_matrix", "tensor_map", "slice_shape", "full_shape", "opt_shard_size", "opt_local_shape",
            "local_shape")
    return {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}


@pytest.mark.slow
def test_chosen_ranks_equal_the_whole_layout_compile_rank_for_rank(tmp_path, compiled_layout, capsys):
    rc, whole_dir, out = compiled_layout(TINY_PP)
    whole = {r["rank"]: r for r in json.loads((whole_dir / "summary.json").read_text())["per_rank"]}
    assert rc == 0, out[-3000:]
    work = tmp_path / "chosen"
    rc = main(["check", *TINY_PP, "--compile", "--ranks", "first,last,stages", "--workdir", str(work)])
    text = capsys.readouterr().out
    assert rc == 0, text[-4000:]
    assert "compiling ranks 0,7,4 of 8" in text and "depth: the real one, 4 layers" in text
    summary = json.loads((work / "summary.json").read_text())
    assert [r["rank"] for r in summary["per_rank"]] == [0, 7, 4] and summary["ok"]
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=2"])
    resolved = check_strategy(load_strategy(str(S / "tiny-dp2-mp2-pp2.yaml")), recipe)
    for entry in summary["per_rank"]:
        k = entry["rank"]
        mine, theirs = entry["result"]["parameters"], whole[k]["result"]["parameters"]
        assert entry["result"]["group_size"] == 8 and entry["result"]["rank"] == k
        assert set(mine) == set(theirs)
        assert all(_same_layout(mine[n], theirs[n]) for n in mine), k
        stage = k // resolved.devices_per_stage
        assert compiled_state(mine, resolved, recipe.model, stage) == compiled_state(theirs, resolved, recipe.model,
                                                                                     stage)
        mem = entry["memory"]
        assert mem["exact"] and mem["fits"] and mem["compiled"]["optimizer"] > 0
        # the same pipeline communication as in the whole compile; the chosen-ranks compile folds the
        # micro-batches (compile_target.fold_micro_batches), so a collective inside the model is in its
        # IR once per graph, not once per micro-batch: the same kinds, never more of them
        mine_ops, whole_ops = entry["result"]["comm_ops"], whole[k]["result"]["comm_ops"]
        assert {o: mine_ops.get(o) for o in ("Send", "Receive")} == \
            {o: whole_ops.get(o) for o in ("Send", "Receive")}, k
        assert set(mine_ops) == set(whole_ops) and all(mine_ops[o] <= whole_ops[o] for o in mine_ops), k
    # neighbours 0 (stage 0) and 4 (stage 1) are matched Send for Receive
    train = summary["ir_checks"]["graphs"][0]
    assert summary["ir_checks"]["passed"] and train["per_rank"]["0"]["Send"] == train["per_rank"]["4"]["Receive"] > 0
    assert "difference" in text and "exact" in text


def _tiny_64(tmp_path):
    raw = {"name": "tiny-dp8-mp2-pp4", "devices": 64, "mesh": {"data": 8, "model": 2, "pipeline": 4},
           "micro_batches": 4, "pipeline": {"scheduler": "1f1b", "layers_per_stage": "auto"},
           "optimizer_parallel": {"enabled": True, "shard_size": -1, "level": "level1", "threshold_kb": 0},
           "embedding": {"vocab_parallel": True},
           "rules": {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model"}}
    path = tmp_path / "tiny-dp8-mp2-pp4.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_rank_37_of_a_64_rank_layout(tmp_path, capsys):
    """CI's small rank-k compile: one worker told it is rank 37 of 64 compiles stage 2's graph."""
    path = _tiny_64(tmp_path)
    work = tmp_path / "w"
    rc = main(["check", "tiny", str(path), "train.micro_batch_size=1", "train.global_batch_size=32", "--compile",
               "--ranks", "37",
               "--workdir", str(work)])
    text = capsys.readouterr().out
    assert rc == 0, text[-4000:]
    entry = json.loads((work / "summary.json").read_text())["per_rank"][0]
    res = entry["result"]
    assert entry["rank"] == 37 and res["rank"] == 37 and res["group_size"] == 64
    params = res["parameters"]
    # stage 2 of 4 holds layer 2 only (one layer per stage), mp 2 splits q's output rows
    assert "slice_shape" in params["layers.2.attention.q_weight"]
    assert "slice_shape" not in params.get("layers.1.attention.q_weight", {})
    q = params["layers.2.attention.q_weight"]
    assert q["full_shape"] == [128, 128] and q["slice_shape"] == [64, 128]
    assert q["opt_shard_size"] == 8 and q["opt_local_shape"] == [8, 128]   # 8 data-parallel copies share it
    assert entry["memory"]["exact"], entry["memory"]


@pytest.mark.slow
def test_a_broken_200b_layout_fails_with_mindspores_message_mapped_to_its_key(tmp_path):
    """Raw path (our validator's rules off): rank 0 of the 3,456-card layout with scheduler gpipe fails in
    MindSpore itself, at full size, and the verdict names the strategy key behind the message."""
    from naohai.config import write_recipe
    from naohai.simulate.rank_of_n import compile_ranks
    raw = read_yaml(str(S / "naohai-200b-3456p.yaml"))
    raw["pipeline"] = dict(raw["pipeline"], scheduler="gpipe")
    path = tmp_path / "naohai-200b-gpipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    recipe, _ = adopt_batch(preset_recipe("pengcheng-mind-200b"), load_strategy(str(path)))
    kwargs = {"recipe_path": write_recipe(recipe, str(tmp_path / "recipe.yaml")), "strategy_path": str(path),
              "overrides": [], "deferred": True, "check_compat": False}
    rep = compile_ranks("naohai.train.compile_target:build_for_compile", 3456, [0], tmp_path / "w", timeout=900,
                        kwargs=kwargs)
    err = rep.rank(0).error
    assert not rep.ok and err is not None, rep.render()
    assert "When pipeline_interleave is False, 'gpipe' is not supported, only '1f1b' is allowed" in err["message"]
    assert err["strategy_key"] == "pipeline.scheduler"
    assert rep.rank(0).result["group_size"] == 3456 and "strategy key: pipeline.scheduler" in rep.render()
