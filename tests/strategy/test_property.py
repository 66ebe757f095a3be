"""Property: whatever the validator accepts plans to the model's layer count with finite, positive memory.

Strategies are drawn broadly (many are invalid); the validator may only answer with a
UserError, and every accepted one must give a consistent plan.
"""
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from naohai.config import ModelConfig
from naohai.errors import UserError
from naohai.strategy.plan import build_plan
from naohai.strategy.profiles import PROFILES
from naohai.strategy.resolve import check_strategy
from naohai.strategy.schema import parse_strategy

@st.composite
def model_and_strategy(draw):
    heads = draw(st.sampled_from([2, 4, 6, 8]))
    head_dim = draw(st.sampled_from([8, 16]))
    cfg = ModelConfig(vocab_size=draw(st.integers(100, 600)), vocab_pad_multiple=draw(st.sampled_from([1, 64])),
                      hidden_size=heads * head_dim, num_layers=draw(st.integers(1, 10)), num_heads=heads,
                      ffn_hidden_size=draw(st.sampled_from([48, 64, 96, 100])), seq_length=draw(st.sampled_from([16, 32])),
                      activation=draw(st.sampled_from(["gelu", "swiglu"])), bias=draw(st.booleans()),
                      query_layer=draw(st.booleans()), position=draw(st.sampled_from(["rope", "learned"])),
                      compute_dtype=draw(st.sampled_from(["float32", "float16"])))
    dp, mp, pp = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(3))
    sched = draw(st.sampled_from(["1f1b", "gpipe", "interleaved"]))
    raw = {"mesh": {"data": dp, "model": mp, "pipeline": pp},
           "micro_batches": draw(st.integers(1, 9)),
           "sequence_parallel": draw(st.booleans()),
           "pipeline": {"scheduler": sched, "virtual_chunks": 2 if sched == "interleaved" else 1},
           "optimizer_parallel": {"enabled": draw(st.booleans()), "level": draw(st.sampled_from(["level1", "level2", "level3"]))},
           "embedding": {"vocab_parallel": draw(st.booleans())}}
    if draw(st.booleans()):
        raw["pipeline"]["layers_per_stage"] = draw(st.lists(st.integers(1, 4), min_size=1, max_size=6))
    n = cfg.num_layers
    layers = {}
    for _ in range(draw(st.integers(0, 3))):
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        rec = draw(st.sampled_from(["none", "full", {"select": ["attention.scores", "attention.scale",
                                                                "attention.mask", "attention.softmax"]},
                                    {"select": ["mlp.act"], "comm": True}]))
        layers[f"{a}-{b}"] = {"recompute": rec}
    raw["layers"] = layers
    mbs = draw(st.integers(1, 3))
    return cfg, raw, mbs


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_strategy())
def test_accepted_strategies_plan_consistently(case):
    cfg, raw, mbs = case
    cfg.validate()
    try:
        r = check_strategy(parse_strategy(raw, where="generated"), cfg, micro_batch_size=mbs)
    except UserError as e:
        assert e.where == "generated" and e.rule      # every rejection names the file and a rule
        return
    plan = build_plan(cfg, r, PROFILES["ascend-910a-32g"])
    assert sum(r.layers_per_stage) == cfg.num_layers == len(r.stage_of_layer)
    assert sum(st_.num_layers for st_ in plan.stages) == cfg.num_layers
    assert all(n >= 1 for n in r.layers_per_stage)
    assert r.stage_of_layer == sorted(r.stage_of_layer) or r.virtual_chunks > 1
    for s in plan.stages:
        for v in (s.weight_bytes, s.grad_bytes, s.optimizer_bytes, s.activation_bytes, s.total_bytes):
            assert math.isfinite(v) and v > 0
    assert math.isfinite(plan.step_seconds) and plan.step_seconds > 0 and 0 < plan.mfu < 1
    stage_devices = r.device_num // r.stages
    for tup in r.op_strategy.values():
        for dims in tup:
            prod = math.prod(dims)
            assert stage_devices % prod == 0


def test_valid_grid_is_accepted():
    # the accepted side of the property, deterministically: every layout in this grid obeys all rules
    import itertools
    from naohai.config import preset_recipe
    cfg = preset_recipe("tiny").model
    for dp, mp, pp, sched in itertools.product([1, 2], [1, 2, 4], [1, 2], ["1f1b", "gpipe", "interleaved"]):
        if sched == "interleaved" and pp == 1:
            continue
        raw = {"mesh": {"data": dp, "model": mp, "pipeline": pp}, "micro_batches": 2 * pp,
               "pipeline": {"scheduler": sched, "virtual_chunks": 2 if sched == "interleaved" else 1}}
        r = check_strategy(parse_strategy(raw), cfg)
        plan = build_plan(cfg, r, PROFILES["ascend-910a-32g"])
        assert sum(r.layers_per_stage) == 4 and all(s.total_bytes > 0 for s in plan.stages)
