"""Planner figures against hand calculations from the published formulas."""
from functools import lru_cache

import pytest

from naohai.config import preset_recipe
from naohai.strategy.memory import layer_activation_bytes, stage_activations
from naohai.model.flops import flops_per_token
from naohai.strategy.plan import bubble_fraction, build_plan
from naohai.strategy.profiles import PROFILES
from naohai.strategy.resolve import check_strategy, default_strategy
from naohai.strategy.schema import load_strategy, parse_strategy

P200 = preset_recipe("pangu-alpha-200b").model
PROFILE = PROFILES["ascend-910a-32g"]


def pangu200(recompute="none", sp=False, level="level1"):
    if isinstance(recompute, dict):
        key = ("comm",) if recompute.get("comm") else tuple(recompute["select"])
    else:
        key = recompute
    return _pangu200(key, sp, level)


@lru_cache(maxsize=None)
def _pangu200(recompute, sp, level):
    if recompute == ("comm",):
        recompute = {"mode": "full", "comm": True}
    elif not isinstance(recompute, str):
        recompute = {"select": list(recompute)}
    raw = {"mesh": {"data": 16, "model": 8, "pipeline": 16}, "micro_batches": 32, "sequence_parallel": sp,
           "optimizer_parallel": {"enabled": True, "level": level},
           "layers": {"all": {"recompute": recompute}}}
    return check_strategy(parse_strategy(raw), P200)


def test_param_bytes_per_device_pangu_200b_hand_calc():
    h, f, d, t = 16384, 65536, 16, 8
    # per layer on one device: q,k,v,out (h x h) and up/down (h x 4h) split 8 ways -> 12 h^2 / 8 elements.
    # naohai keeps float32 parameters (naohai.model.layers._param): 4 weight + 4 grad + 8 Adam m, v.
    # MindSpore shards over the 16 optimizer ranks every parameter of at least 64 KB ("parameters with
    # size smaller than this threshold will not be sharded"): the h-sized out/down biases and the four
    # norm vectors are exactly 16384 x 4 B = 64 KB -> sharded; the q/k/v biases (h/8) and up bias (f/8) whole.
    big = 12 * h * h // t + 6 * h
    small = 3 * h // t + f // t
    per_layer_bytes = big * (4 + 4 + 8 / d) + small * (4 + 4 + 8)
    plan = build_plan(P200, pangu200(), PROFILE)
    mid = plan.stages[1]
    assert mid.params_per_device == 4 * (big + small)
    assert mid.weight_bytes + mid.grad_bytes + mid.optimizer_bytes == pytest.approx(4 * per_layer_bytes, rel=1e-12)
    # stage 0 adds the vocab-parallel table (40000/8 rows: 5000 % 16 != 0 -> not optimizer-sharded)
    # and the learned position table (1024 x h, replicated over model, sharded over the 16 ranks)
    word = 40000 // t * h
    pos = 1024 * h
    s0 = plan.stages[0]
    assert s0.params_per_device == 4 * (big + small) + word + pos
    want0 = 4 * per_layer_bytes + word * 16 + pos * (4 + 4 + 8 / d)
    assert s0.weight_bytes + s0.grad_bytes + s0.optimizer_bytes == pytest.approx(want0, rel=1e-12)


def test_optimizer_levels_divide_more_state():
    s1, s2, s3 = (build_plan(P200, pangu200(level=lv), PROFILE).stages[1] for lv in ("level1", "level2", "level3"))
    assert s1.weight_bytes == s2.weight_bytes and s2.grad_bytes < s1.grad_bytes
    assert s3.weight_bytes < s2.weight_bytes and s3.optimizer_bytes == s1.optimizer_bytes


def test_activations_match_korthikanti():
    s, b, h, a, t = 1024, 1, 16384, 128, 8     # b = micro-batch size 1 per data-parallel rank
    sbh = s * b * h
    none = layer_activation_bytes(P200, pangu200("none"), 5)
    assert none == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    sel = layer_activation_bytes(P200, pangu200({"select": ["attention.scores", "attention.scale",
                                                             "attention.mask", "attention.softmax"]}), 5)
    assert sel == pytest.approx(sbh * (10 + 24 / t))
    # full recompute: the published 2sbh when the model-parallel communication is recomputed too ...
    full = layer_activation_bytes(P200, pangu200({"mode": "full", "comm": True}), 5)
    assert full == pytest.approx(2 * sbh)
    # ... and without comm recompute (MindSpore keeps what it does not recompute) the outputs of the
    # two all-reduces (after attention.out and mlp.down, b*s*h fp16 each) stay as well
    kept = layer_activation_bytes(P200, pangu200("full"), 5)
    assert kept == pytest.approx(2 * sbh + 2 * 2 * sbh)
    sp = layer_activation_bytes(P200, pangu200("none", sp=True), 5)
    assert sp == pytest.approx(sbh * (34 / t + 5 * a * s / (h * t)))
    # softmax alone frees nothing: its input would have to be kept
    only = layer_activation_bytes(P200, pangu200({"select": ["attention.softmax"]}), 5)
    assert only == pytest.approx(none)


def test_in_flight_1f1b_vs_gpipe():
    r = pangu200("full")
    acts = stage_activations(P200, r)
    assert [a.in_flight for a in acts] == [16 - k for k in range(16)]
    g = check_strategy(parse_strategy({"mesh": {"data": 16, "model": 8, "pipeline": 16}, "micro_batches": 32,
                                       "pipeline": {"scheduler": "gpipe"}}), P200)
    assert all(a.in_flight == 32 for a in stage_activations(P200, g))


def test_bubble_formulas():
    assert bubble_fraction(16, 32) == pytest.approx(15 / 47)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    plan = build_plan(P200, pangu200("full"), PROFILE)
    assert plan.bubble_fraction == pytest.approx(15 / 47)


def test_model_flops_per_token_palm():
    from naohai.model.params import count_params
    # PaLM 6N + 12*L*h*s with N the matmul parameters: the learned position table and the
    # query layer's position table (each 1024 x 16384) only feed lookups
    want = 6 * (count_params(P200) - 2 * 1024 * 16384) + 12 * 64 * 16384 * 1024
    assert flops_per_token(P200) == want
    plan = build_plan(P200, pangu200("full"), PROFILE)
    # MFU = model FLOPs per token x tokens/s/device / peak
    assert plan.mfu == pytest.approx(want * plan.tokens_per_second_per_device / 256e12)
    assert 0 < plan.mfu < 1


def test_tp_comm_volume_hand_calc():
    plan = build_plan(P200, pangu200("none"), PROFILE)
    # middle stage: 4 layers x 4 all-reduces x 2(t-1)/t x b*s*h*2 bytes, x 32 micro-batches
    per_mb = 4 * 4 * 2 * 7 / 8 * 1024 * 16384 * 2
    model = [c for c in plan.comm if c.axis == "model"][0]
    # the busiest stage is the last: one head all-reduce, and the float32 logits (s x b x V) all-gathered
    # over the 8 vocab slices for the loss and their gradient reduce-scattered back, (t-1)/t each
    gather = 2 * 7 / 8 * 1024 * 40000 * 4
    assert model.bytes_per_step == pytest.approx((per_mb + 2 * 7 / 8 * 1024 * 16384 * 2 + gather) * 32)


def test_default_strategy_is_all_ones():
    cfg = preset_recipe("tiny").model
    r = default_strategy(cfg)
    assert r.device_num == 1 and r.stage_of_layer == [0] * 4 and r.layers_per_stage == [4]
    assert all(all(d == 1 for dims in v for d in dims) for v in r.op_strategy.values())
    assert set(r.op_strategy) == set(__import__("naohai.model.catalog", fromlist=["op_catalog"]).op_catalog(cfg, 1))
    assert r.op_strategy["layers.0.attention.scale"][1] == ()


def test_auto_split_reproduces_published_7b():
    cfg = preset_recipe("pengcheng-mind-7b").model
    r = check_strategy(parse_strategy({"mesh": {"data": 1, "model": 1, "pipeline": 4}, "micro_batches": 4}), cfg)
    assert r.layers_per_stage == [7, 9, 9, 7]
    assert r.stage_of_layer[:8] == [0] * 7 + [1]


def test_interleaved_placement():
    cfg = preset_recipe("tiny").model
    r = check_strategy(parse_strategy({"mesh": {"data": 1, "pipeline": 2}, "micro_batches": 2,
                                       "pipeline": {"scheduler": "interleaved", "virtual_chunks": 2}}), cfg)
    assert r.stage_of_layer == [0, 1, 0, 1] and r.chunk_of_layer == [0, 0, 1, 1] and r.layers_per_stage == [2, 2]


def test_escape_hatch_replaces_tuple(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("mesh: {data: 2, model: 2}\nops:\n  layers.3.attention.q: [[4, 1], [1, 1]]\n"
                    "layers:\n  '1': {ops: {mlp.down: [[2, 1], [1, 1]]}}\n")
    r = check_strategy(load_strategy(str(path)), preset_recipe("tiny").model)
    assert r.op_strategy["layers.3.attention.q"] == ((4, 1), (1, 1))
    assert r.op_strategy["layers.1.mlp.down"] == ((2, 1), (1, 1))
    assert r.op_strategy["layers.0.mlp.down"] == ((2, 2), (1, 2))
