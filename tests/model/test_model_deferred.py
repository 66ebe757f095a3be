"""Deferred parameter creation (naohai.model.layers.deferred_parameters): no data until MindSpore asks.

``naohai check --compile`` builds the model this way, so a rank of a 200B layout compiles on a
host that could never hold the model's ~800 GB of float32 state.
"""
import resource

import numpy as np

from naohai.config import preset_recipe
from naohai.model.layers import deferred_parameters, parameters_deferred
from naohai.model.params import param_shapes
from naohai.model.stack import stacked_count
from naohai.model.transformer import NaohaiLM
from naohai.train.builder import make_optimizer
from naohai.train.step import make_buffers


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def test_a_200b_model_and_its_optimizer_build_without_their_data():
    recipe = preset_recipe("pengcheng-mind-200b")
    cfg = recipe.model
    before = _rss_mb()
    with deferred_parameters():
        assert parameters_deferred()
        model = NaohaiLM(cfg)
        optimizer = make_optimizer(model, recipe)
    assert not parameters_deferred()
    grown = _rss_mb() - before
    params = list(model.get_parameters())
    total = sum(int(np.prod(p.shape)) for p in params)
    want = {p.name: tuple(p.shape) for p in param_shapes(cfg)}
    assert {p.name: tuple(p.shape) for p in params} == want      # every parameter, its full shape
    assert total > 1.9e11                                          # ~200B parameters (800 GB in float32) ...
    assert all(p.has_init for p in params)                         # ... none of them materialised
    moments = [p for p in optimizer.get_parameters() if p.name.startswith(("adam_m.", "adam_v."))]
    assert len(moments) == 2 * len(params) and all(p.has_init for p in moments)
    assert grown < 2048, f"building grew the process by {grown:.0f} MB"


def test_deferred_draws_keep_the_descriptions_initialisers():
    recipe = preset_recipe("tiny")
    with deferred_parameters():
        model = NaohaiLM(recipe.model)
    p = dict(model.parameters_and_names())
    q = p["layers.0.attention.q_weight"]
    q.init_data()
    std = float(np.std(q.asnumpy()))
    eager = NaohaiLM(recipe.model)
    want = float(np.std(dict(eager.parameters_and_names())["layers.0.attention.q_weight"].asnumpy()))
    assert abs(std - want) / want < 0.1                     # the description's std, MindSpore's draw
    for name in ("layers.0.input_norm.gamma", "layers.0.input_norm.beta"):
        if name in p:
            p[name].init_data()
            assert np.array_equal(p[name].asnumpy(), dict(eager.parameters_and_names())[name].asnumpy())


def test_layer_loop_stacks_deferred_initialisers():
    recipe = preset_recipe("tiny")
    with deferred_parameters():
        model = NaohaiLM(recipe.model, layer_loop=True)
    stacked = [p for n, p in model.parameters_and_names() if n.startswith("stack.layer.")]
    assert stacked and all(p.has_init and p.shape[0] == stacked_count(recipe.model) for p in stacked)


def test_accumulation_buffers_are_zeros_outside_and_lazy_inside():
    recipe = preset_recipe("tiny")
    model = NaohaiLM(recipe.model)
    bufs = make_buffers(list(model.trainable_params())[:3])
    assert all(not b.has_init and not np.any(b.asnumpy()) for b in bufs)
    with deferred_parameters():
        lazy = make_buffers(list(model.trainable_params())[:3])
    assert all(b.has_init for b in lazy)
