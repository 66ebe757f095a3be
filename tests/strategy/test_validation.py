"""One test per validation rule: a bad file and the exact rule (and key path) in the error."""
import pytest

from naohai.config import ModelConfig, preset_recipe
from naohai.errors import UserError
from naohai.strategy.resolve import check_strategy

TINY = preset_recipe("tiny")           # 4 layers, hidden 128, 4 heads, ffn 352, vocab 2048, seq 128


def tiny(**over):
    base = {"mesh": {"data": 2, "model": 1, "pipeline": 1}}
    base.update(over)
    return base


def err(load, raw, model=None, devices=None, recipe=None):
    with pytest.raises(UserError) as e:
        check_strategy(load(raw), recipe or model or TINY.model, devices)
    return e.value


def recipe_with(gb, mbs):
    r = preset_recipe("tiny")
    r.train.global_batch_size, r.train.micro_batch_size = gb, mbs
    return r


# ---------------------------------------------------------------- syntax (load_strategy)
@pytest.mark.parametrize("raw,key,rule", [
    ({"mesh": {"data": 2}, "micro_batchs": 2}, "micro_batchs", "known keys"),
    ({"mesh": {"data": 2, "modle": 2}}, "mesh.modle", "known keys"),
    ({"mesh": {"data": 0}}, "mesh.data", "1 <= data <= 1000000"),
    ({}, "mesh", "mesh required"),
    ({"mesh": {"data": 2}, "rules": {"heds": "model"}}, "rules.heds", "logical axis exists"),
    ({"mesh": {"data": 2}, "rules": {"heads": "modle"}}, "rules.heads", "mesh axis exists"),
    ({"mesh": {"data": 2}, "rules": {"heads": "pipeline"}}, "rules.heads", "no tensor axis on the pipeline mesh axis"),
    ({"mesh": {"data": 2}, "rules": {"batch": ["data", "data"]}}, "rules.batch", "mesh axis used once per input"),
    ({"mesh": {"data": 2}, "layers": {"5-2": {}}}, 'layers."5-2"', "layer range start <= end"),
    ({"mesh": {"data": 2}, "layers": {"a-b": {}}}, 'layers."a-b"', "layer range syntax"),
    ({"mesh": {"data": 2}, "layers": {"0-1": {"recompute": {"selct": ["mlp.act"]}}}},
     'layers."0-1".recompute.selct', "known keys"),
    ({"mesh": {"data": 2}, "pipeline": {"scheduler": "1f1c"}}, "pipeline.scheduler", "allowed values"),
    ({"mesh": {"data": 2}, "pipeline": {"scheduler": "interleaved", "virtual_chunks": 1}},
     "pipeline.virtual_chunks", "interleaved needs virtual_chunks >= 2"),
    ({"mesh": {"data": 2}, "pipeline": {"layers_per_stage": [4, 0]}}, "pipeline.layers_per_stage[1]", "no empty stage"),
    ({"mesh": {"data": 2}, "optimizer_parallel": {"level": "level4"}}, "optimizer_parallel.level", "allowed values"),
    ({"mesh": {"data": 2}, "ops": {"layers.0.attention.q": [2, 1]}}, "ops.layers.0.attention.q[0]", "op strategy form"),
])
def test_syntax_rules(load, raw, key, rule):
    with pytest.raises(UserError) as e:
        load(raw)
    assert e.value.key == key and e.value.rule == rule
    assert e.value.where.endswith("s.yaml")


def test_unknown_key_suggests(load):
    with pytest.raises(UserError) as e:
        load({"mesh": {"data": 2}, "micro_batchs": 2})
    assert "Did you mean: 'micro_batches'" in str(e.value)


# ---------------------------------------------------------------- semantic rules
def test_devices_product(load):
    e = err(load, tiny(mesh={"data": 2, "model": 2}), devices=8)
    assert e.rule == "data * model * pipeline == devices" and e.key == "mesh"
    e = err(load, tiny(devices=8))
    assert e.rule == "data * model * pipeline == devices"


def test_heads_divisible(load):
    cfg = ModelConfig(**{**preset_recipe("tiny").model.__dict__, "num_heads": 2})   # hidden 128 / 2 heads
    e = err(load, tiny(mesh={"data": 1, "model": 4}), model=cfg)
    assert e.rule == "num_heads % 4 == 0" and e.key == "rules.heads"


def test_kv_heads_divisible_only_when_sharded(load):
    cfg = ModelConfig(**{**preset_recipe("tiny").model.__dict__, "num_kv_heads": 1})
    e = err(load, tiny(mesh={"data": 1, "model": 2}), model=cfg)
    assert e.rule == "num_kv_heads % 2 == 0" and e.key == "rules.kv_heads"
    ok = check_strategy(load(tiny(mesh={"data": 1, "model": 2}, rules={"kv_heads": None})), cfg)
    assert ok.op_strategy["layers.0.attention.k"] == ((1, 1), (1, 1))


def test_hidden_divisible(load):
    cfg = ModelConfig(**{**preset_recipe("tiny").model.__dict__, "hidden_size": 132, "num_heads": 2,
                         "position": "learned"})
    e = err(load, tiny(mesh={"data": 1, "model": 8}, rules={"heads": None, "mlp": None, "kv_heads": None},
                       embedding={"vocab_parallel": False}), model=cfg)
    assert e.rule == "hidden_size % model == 0"


def test_ffn_divisible(load):
    cfg = ModelConfig(**{**preset_recipe("tiny").model.__dict__, "ffn_hidden_size": 350})
    e = err(load, tiny(mesh={"data": 1, "model": 4}), model=cfg)
    assert e.rule == "ffn_hidden_size % 4 == 0" and e.key == "rules.mlp"


def test_vocab_divisible_when_vocab_parallel(load):
    cfg = ModelConfig(**{**preset_recipe("tiny").model.__dict__, "vocab_size": 2050, "vocab_pad_multiple": 1})
    e = err(load, tiny(mesh={"data": 1, "model": 4}), model=cfg)
    assert e.rule == "vocab % model == 0" and e.key == "embedding.vocab_parallel"
    check_strategy(load(tiny(mesh={"data": 1, "model": 4}, embedding={"vocab_parallel": False})), cfg)


def test_layers_at_least_stages(load):
    e = err(load, tiny(mesh={"data": 1, "pipeline": 8}, micro_batches=8))
    assert e.rule == "layers >= stages" and e.key == "mesh.pipeline"


def test_micro_batches_at_least_stages(load):
    e = err(load, tiny(mesh={"data": 1, "pipeline": 4}, micro_batches=2))
    assert e.rule == "micro_batches >= stages" and e.key == "micro_batches"


def test_stage_list_sums_to_layers(load):
    e = err(load, tiny(mesh={"data": 1, "pipeline": 2}, micro_batches=2, pipeline={"layers_per_stage": [2, 3]}))
    assert e.rule == "stage list sums to layers" and e.key == "pipeline.layers_per_stage"


def test_stage_list_length(load):
    e = err(load, tiny(mesh={"data": 1, "pipeline": 2}, micro_batches=2, pipeline={"layers_per_stage": [1, 1, 2]}))
    assert e.rule == "one entry per stage"


def test_optimizer_shard_divides_dp(load):
    e = err(load, tiny(mesh={"data": 4}, optimizer_parallel={"enabled": True, "shard_size": 3}))
    assert e.rule == "optimizer shard size divides data" and e.key == "optimizer_parallel.shard_size"


def test_batch_divisible_by_dp(load):
    e = err(load, tiny(mesh={"data": 3}), recipe=recipe_with(16, 1))
    assert e.rule == "batch % data == 0"


def test_global_batch_vs_micro_batches(load):
    e = err(load, tiny(mesh={"data": 2, "pipeline": 2}, micro_batches=4), recipe=recipe_with(16, 4))
    assert e.rule == "global_batch % (data * micro_batch_size * micro_batches) == 0"
    r = check_strategy(load(tiny(mesh={"data": 2, "pipeline": 2}, micro_batches=4)), recipe_with(32, 2))
    assert r.gradient_accumulation == 2


def test_sequence_parallel_needs_mp(load):
    e = err(load, tiny(sequence_parallel=True))
    assert e.rule == "sequence parallel requires model > 1" and e.key == "sequence_parallel"


def test_unknown_op_name_with_suggestion(load):
    e = err(load, tiny(ops={"layers.0.attention.qq": [[2, 1], [1, 1]]}))
    assert e.rule == "op name exists" and e.key == "ops.layers.0.attention.qq"
    assert "layers.0.attention.q" in str(e)


def test_unknown_select_op_key_path(load):
    e = err(load, tiny(layers={"0-3": {"recompute": {"select": ["mlp.act", "attention.sofmax"]}}}))
    assert e.key == 'layers."0-3".recompute.select[1]' and e.rule == "op name exists"
    assert "attention.softmax" in str(e)


def test_dropout_is_never_in_a_recompute_list(load):
    import dataclasses
    model = dataclasses.replace(TINY.model, dropout=0.1)
    e = err(load, tiny(layers={"0-3": {"recompute": {"select": ["mlp.act", "attention.prob_dropout"]}}}),
            model=model)
    assert e.key == 'layers."0-3".recompute.select[1]' and e.rule == "no dropout in a recompute list"


def test_escape_hatch_must_divide_shape(load):
    # the mask's second input has shape (1, s, s): its first dim cannot be split 2 ways
    e = err(load, tiny(mesh={"data": 2}, ops={"layers.0.attention.mask": [[2, 1, 1, 1], [2, 1, 1]]}))
    assert e.rule == "slices divide the op's input shape"      # mask input 1 has a dim of size 1


def test_escape_hatch_product_vs_stage_devices(load):
    e = err(load, tiny(mesh={"data": 2}, ops={"layers.0.attention.q": [[4, 1], [1, 1]]}))
    assert e.rule == "product of slices divides devices per stage" and e.key == "ops.layers.0.attention.q[0]"


def test_escape_hatch_input_count_and_dims(load):
    e = err(load, tiny(ops={"layers.0.attention.q": [[2, 1]]}))
    assert e.rule == "one slice list per op input"
    e = err(load, tiny(ops={"layers.0.attention.q": [[2, 1, 1], [1, 1]]}))
    assert e.rule == "one slice count per input dimension"


def test_escape_hatch_consistent_axes(load):
    e = err(load, tiny(mesh={"data": 1, "model": 2}, ops={"layers.0.attention.q": [[1, 2], [2, 1]]}))
    assert e.rule == "same logical axis, same slices within an op"


def test_rule_assignment_divides_catalog_shape(load):
    # seq 127 cannot be split 2 ways: the catalog shape of attention.scores input 0 is (b, 4, 127, 32)
    cfg = ModelConfig(**{**TINY.model.__dict__, "seq_length": 127, "max_positions": 128})
    e = err(load, tiny(mesh={"data": 1, "model": 2}, rules={"seq": "model", "heads": None, "kv_heads": None,
                                                            "mlp": None}, embedding={"vocab_parallel": False}),
            model=cfg)
    assert e.rule == "slices divide the op's input shape" and e.key == "rules.seq"
    assert "127" in str(e)


def test_same_mesh_axis_twice_in_one_input(load):
    e = err(load, tiny(mesh={"data": 1, "model": 2}, rules={"embed": "model"}))
    assert e.rule == "mesh axis used once per input" and e.key == "rules.embed"


def test_layer_override_key_path(load):
    e = err(load, tiny(mesh={"data": 1, "model": 2}, layers={"1-2": {"rules": {"embed": "model"}}}))
    assert e.rule == "mesh axis used once per input" and e.key == 'layers."1-2".rules.embed'


def test_range_out_of_bounds(load):
    e = err(load, tiny(layers={"2-7": {"recompute": "full"}}))
    assert e.rule == "layer range in bounds" and e.key == 'layers."2-7"'


def test_gap_in_coverage(load):
    e = err(load, tiny(require_full_coverage=True, layers={"0": {}, "3": {}}))
    assert e.rule == "no gaps in layer coverage" and "1-2" in str(e)
    check_strategy(load(tiny(require_full_coverage=True, layers={"0-2": {}, "2-3": {}})), TINY.model)  # overlap ok


def test_interleaved_micro_batch_multiple(load):
    e = err(load, tiny(mesh={"data": 1, "pipeline": 2}, micro_batches=3,
                       pipeline={"scheduler": "interleaved", "virtual_chunks": 2}))
    assert e.rule == "micro_batches % stages == 0 when interleaved"


def test_vocab_rule_contradiction(load):
    e = err(load, tiny(mesh={"data": 1, "model": 2}, rules={"vocab": None}))
    assert e.rule == "vocab rule agrees with embedding.vocab_parallel"


def test_model_mismatch_warns(load):
    r = check_strategy(load(tiny(model="pangu-alpha-200b")), TINY.model)
    assert r.warnings and "pangu-alpha-200b" in r.warnings[0]
