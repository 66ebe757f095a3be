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
    # MindSpore shards the optimizer state of every parameter whose WHOLE size is at least 64 KB
    # ("Parameter size = shape[0] * ... * shape[n] * size(dtype)") over every device of the stage holding
    # the same slice (shard_size -1; seen in the tiny compile: a model-replicated norm vector on data 2 x
    # model 2 gets opt_shard_size 4): the 16 data ranks for a model-split parameter, 16 x 8 = 128 ranks
    # for the model-replicated out/down biases and the four norm vectors (h = 16384 fp32 = 64 KB each).
    split = 12 * h * h // t + 3 * h // t + f // t          # + q/k/v biases and the up bias, split 8 ways
    repl = h + h + 4 * h
    big = split + repl
    per_layer_bytes = split * (4 + 4 + 8 / d) + repl * (4 + 4 + 8 / (d * t))
    plan = build_plan(P200, pangu200(), PROFILE)
    mid = plan.stages[1]
    assert mid.params_per_device == 4 * big
    assert mid.weight_bytes + mid.grad_bytes + mid.optimizer_bytes == pytest.approx(4 * per_layer_bytes, rel=1e-12)
    # stage 0 adds the vocab-parallel table (40000/8 rows: 5000 % 16 != 0 -> not optimizer-sharded)
    # and the learned position table (1024 x h, replicated over model, sharded over the 16 ranks)
    word = 40000 // t * h
    pos = 1024 * h
    s0 = plan.stages[0]
    assert s0.params_per_device == 4 * big + word + pos
    want0 = 4 * per_layer_bytes + word * 16 + pos * (4 + 4 + 8 / (d * t))   # position table: model-replicated
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
    # a plain run prints no strategy warning (optimizer parallel has nothing to shard over at data 1)
    assert r.warnings == () and not r.optimizer_parallel.enabled


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


# ------------------------------------------------------------------ what the issue-10 audit found missing
P7 = preset_recipe("pengcheng-mind-7b").model


def plan7b(vocab_parallel=True):
    raw = {"mesh": {"data": 1, "model": 8, "pipeline": 2}, "micro_batches": 2,
           "embedding": {"vocab_parallel": vocab_parallel}, "layers": {"all": {"recompute": "full"}}}
    return build_plan(P7, check_strategy(parse_strategy(raw), P7), PROFILE)


def test_last_stage_loss_buffers_pengcheng_mind_7b_mp8_pp2():
    # seq 4096, padded vocab 125952, one sequence per micro-batch; the loss's class axis cannot be split
    # (MindSpore 2.10 LogSoftmax), so the fp32 logits are gathered to the whole vocabulary:
    # kept per micro-batch in flight (1 on the last 1F1B stage): the log-probabilities 4sbV (LogSoftmax's
    # backward reads its output); once, at the backward's peak, the pick's dense gradient 4sbV + the
    # log-softmax input gradient 4sbV + the fp32 logits slice 4sbV/8 (reduce-scattered back)
    sbv = 4096 * 1 * 125952
    want = 4 * sbv + (4 * sbv + 4 * sbv + 4 * sbv / 8)
    plan = plan7b()
    last = plan.stages[-1]
    assert last.loss_bytes == pytest.approx(want)
    assert want / 1024 ** 3 == pytest.approx(6.01, abs=0.01)        # about 5.8 GiB real, 0.24 GiB before
    assert plan.stages[0].loss_bytes == 0
    # the stage total holds the loss: last-stage activations exceed its layers' alone by the kept log-probs
    assert last.activation_bytes >= 4 * sbv + max(last.recompute_working_set, want - 4 * sbv)
    # without a vocab-parallel head nothing is gathered: the two backward [t, V] gradients once, log-probs kept
    assert plan7b(False).stages[-1].loss_bytes == pytest.approx(12 * sbv)


def test_logits_gather_in_step_time():
    with_gather, without = plan7b(), plan7b(False)
    model = {c.axis: c for c in with_gather.comm}["model"]
    sbv = 4096 * 125952
    # all-gather of 4sbV and reduce-scatter of its gradient, (t-1)/t each, per micro-batch on the last stage
    gather = 2 * 7 / 8 * 4 * sbv
    hidden = 4096 * 4096 * 2
    layers = with_gather.stages[-1].num_layers
    allreduces = (4 * layers + 1) * 2 * 7 / 8 * hidden             # 4 per layer + the head's backward
    assert model.bytes_per_step == pytest.approx((allreduces + gather) * 2)
    assert with_gather.stages[-1].micro_batch_seconds > without.stages[-1].micro_batch_seconds


def test_full_recompute_keeps_comm_outputs_under_sequence_parallel():
    s, h, t = 1024, 16384, 8
    sbh = s * h
    # input sliced by sp 2sbh/t; two all-gathers 2sbh each, two reduce-scatters 2sbh/t each
    keep = layer_activation_bytes(P200, pangu200("full", sp=True), 5)
    assert keep == pytest.approx(2 * sbh / t + 2 * 2 * sbh + 2 * 2 * sbh / t)
    assert layer_activation_bytes(P200, pangu200({"mode": "full", "comm": True}, sp=True), 5) == \
        pytest.approx(2 * sbh / t)


def test_data_parallel_traffic_is_float32():
    from naohai.model.params import count_params
    cfg = preset_recipe("pangu-alpha-2.6b").model
    r = check_strategy(parse_strategy({"mesh": {"data": 8}}), cfg)
    data = {c.axis: c for c in build_plan(cfg, r, PROFILE).comm}["data"]
    # every parameter on every rank; float32 gradient ring all-reduce over 8 ranks
    assert data.bytes_per_step == pytest.approx(count_params(cfg) * 4 * 2 * 7 / 8)


def test_gradient_accumulation_buffer_counted():
    from naohai.config import load_recipe
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    recipe = load_recipe(os.path.join(root, "recipes", "tiny.yaml"), ["train.micro_batch_size=4"])    # 16 / (2 x 4) = 2 micro-steps
    r = check_strategy(parse_strategy({"mesh": {"data": 2}}), recipe)
    assert r.gradient_accumulation == 2
    st = build_plan(recipe.model, r, PROFILE).stages[0]
    assert st.grad_bytes == st.params_per_device * (4 + 4) and st.weight_bytes == st.params_per_device * 4


@pytest.mark.parametrize("mesh,links", [
    ({"data": 2, "model": 4}, {"model": "hccs", "data": "pcie"}),        # 4 cards: one HCCS group; dp spans 8
    ({"data": 1, "model": 8}, {"model": "pcie"}),                          # 8 cards cross the two 4-card groups
    ({"data": 4, "model": 4}, {"model": "hccs", "data": "roce"}),        # 16 cards: two nodes
    ({"data": 2, "model": 2, "pipeline": 2}, {"model": "hccs", "data": "hccs", "pipeline": "pcie"}),
])
def test_910a_topology_names_the_link_of_each_group(mesh, links):
    cfg = preset_recipe("pangu-alpha-2.6b").model
    raw = {"mesh": mesh, "micro_batches": mesh.get("pipeline", 1)}
    plan = build_plan(cfg, check_strategy(parse_strategy(raw), cfg), PROFILE)
    comm = {c.axis: c for c in plan.comm}
    for axis, name in links.items():
        assert comm[axis].link.startswith(name), (axis, comm[axis].link)
    gbs = {"hccs": 90, "pcie": 16, "roce": 12.5}[links["model"]]
    assert comm["model"].seconds_per_step == pytest.approx(comm["model"].bytes_per_step / (gbs * 1e9))
