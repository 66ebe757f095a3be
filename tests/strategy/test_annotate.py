"""naohai/strategy/annotate.py on plain CPU: what MindSpore will see per op, per cell and per parameter.

The model is built and the tiny strategies applied (no compile, no communication).
MindSpore 2.10 keeps a shard strategy in the primitive's ``in_strategy`` attribute,
selective recompute in the primitive's ``recompute`` attribute, full-cell recompute
as ``Cell._has_config_recompute`` plus ``recompute_comm_op`` on the cell's
primitives, pipeline stages in ``Cell.pipeline_stage`` and a shared parameter's
stages in ``Parameter._pipeline_stage_list``.  Expected values are written by hand
from the tiny model (hidden 128, 4 heads, ffn 352, vocab 2048) and compared with
the ResolvedStrategy as well.
"""
from pathlib import Path

import pytest

from naohai.config import load_recipe
from naohai.model.transformer import NaohaiLM
from naohai.strategy import annotate as A
from naohai.strategy.resolve import check_strategy, default_strategy, load_strategy
from naohai.strategy.run_plan import plan_run
from naohai.strategy.schema import parse_strategy

ROOT = Path(__file__).resolve().parents[2]
CASES = {"tiny-dp2": 8, "tiny-dp2-mp2": 8, "tiny-dp2-mp2-pp2": 2}


def _built(name):
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), [f"train.micro_batch_size={CASES[name]}"])
    resolved = check_strategy(load_strategy(str(ROOT / f"strategies/{name}.yaml")), recipe)
    model = NaohaiLM(recipe.model)
    A.apply_strategy(model, resolved)
    return model, resolved


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_named_op_carries_the_resolved_strategy(name):
    model, resolved = _built(name)
    ops = model.shardable_ops()
    assert set(resolved.op_strategy) <= set(ops)
    for op_name, prim in ops.items():
        assert prim.attrs.get("in_strategy") == resolved.op_strategy[op_name], op_name


HAND = {  # op -> in_strategy, written from the rules in the files (batch->data, heads/mlp/vocab->model)
    "tiny-dp2": {"layers.0.attention.q": ((2, 1), (1, 1)), "layers.3.mlp.down": ((2, 1), (1, 1)),
                 "embedding.lookup": ((1, 1), (2, 1)), "head.logits": ((2, 1), (1, 1)),
                 "loss.log_softmax": ((2, 1),), "loss.pick": ((2, 1), (2, 1))},
    "tiny-dp2-mp2": {"layers.0.attention.q": ((2, 1), (2, 1)), "layers.0.attention.out": ((2, 2), (1, 2)),
                     "layers.1.attention.scores": ((2, 2, 1, 1), (2, 2, 1, 1)),
                     "layers.2.mlp.up": ((2, 1), (2, 1)), "layers.2.mlp.down": ((2, 2), (1, 2)),
                     "embedding.lookup": ((2, 1), (2, 1)), "head.logits": ((2, 1), (2, 1))},
}


@pytest.mark.parametrize("name", sorted(HAND))
def test_hand_computed_tuples(name):
    model, _ = _built(name)
    ops = model.shardable_ops()
    for op_name, want in HAND[name].items():
        assert ops[op_name].attrs["in_strategy"] == want, op_name


def test_pipeline_stages_and_tied_table():
    model, resolved = _built("tiny-dp2-mp2-pp2")
    assert resolved.stage_of_layer == [0, 0, 1, 1]
    assert model.embedding.pipeline_stage == 0
    assert [layer.pipeline_stage for layer in model.layers] == [0, 0, 1, 1]
    assert model.head.pipeline_stage == 1 and model.loss.pipeline_stage == 1
    # the tied table is used by the lookup (stage 0) and by the head (stage 1)
    assert sorted(model.embedding.word_embedding._pipeline_stage_list) == [0, 1]


def test_no_pipeline_leaves_stages_alone():
    model, _ = _built("tiny-dp2-mp2")
    # MindSpore only creates the attribute when a stage is set
    assert all("_pipeline_stage" not in vars(layer) for layer in model.layers)
    assert list(model.embedding.word_embedding._pipeline_stage_list) == []


def test_selective_recompute_marks_exactly_the_listed_primitives():
    model, resolved = _built("tiny-dp2-mp2-pp2")
    chosen = {"attention.scores", "attention.scale", "attention.mask", "attention.softmax"}
    for i, layer in enumerate(model.layers):
        assert resolved.recompute[i].mode == "select" and set(resolved.recompute[i].ops) == chosen
        assert not layer._has_config_recompute
        for rel, prim in layer.shardable_ops().items():
            assert prim.attrs.get("recompute") is (True if rel in chosen else None), (i, rel)
    assert model.head.logits.attrs.get("recompute") is None


def test_selecting_a_norm_for_recompute_recomputes_its_cell():
    """A norm is one named op, but on CPU the cell computes it from several primitives: the cell is
    marked, so the whole norm is recomputed in either form; other ops stay primitive-marked."""
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=8"])
    raw = {"name": "t", "mesh": {"data": 1, "model": 1, "pipeline": 1},
           "layers": {"0": {"recompute": {"select": ["input_norm", "mlp.up"]}}}}
    resolved = check_strategy(parse_strategy(raw, "inline"), recipe)
    model = NaohaiLM(recipe.model)
    A.apply_strategy(model, resolved)
    assert model.layers[0].input_norm._has_config_recompute
    assert not model.layers[0].post_attention_norm._has_config_recompute
    assert not model.layers[1].input_norm._has_config_recompute
    assert model.layers[0].mlp.up.attrs.get("recompute") is True
    assert model.layers[1].mlp.up.attrs.get("recompute") is None


def test_full_recompute_with_comm_on_a_layer_range():
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=8"])
    raw = {"name": "t", "mesh": {"data": 2, "model": 2, "pipeline": 1},
           "rules": {"batch": "data", "heads": "model", "kv_heads": "model", "mlp": "model"},
           "layers": {"1-2": {"recompute": {"mode": "full", "comm": True}}}}
    resolved = check_strategy(parse_strategy(raw, "inline"), recipe)
    model = NaohaiLM(recipe.model)
    A.apply_strategy(model, resolved)
    flags = [layer._has_config_recompute for layer in model.layers]
    assert flags == [False, True, True, False]
    assert model.layers[1].attention.q.attrs.get("recompute_comm_op") is True
    assert model.layers[1].mlp.down.attrs.get("recompute_comm_op") is True
    assert "recompute_comm_op" not in model.layers[0].attention.q.attrs
    assert model.layers[2].get_flags().get("output_recompute") is False


def test_full_recompute_keeps_dropout_out_of_the_recomputation():
    """MindSpore 2.10 re-draws a recomputed Dropout's mask; apply.py keeps every dropout out of it."""
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=8", "model.dropout=0.1"])
    raw = {"name": "t", "mesh": {"data": 1, "model": 1, "pipeline": 1},
           "layers": {"0-3": {"recompute": "full"}}}
    resolved = check_strategy(parse_strategy(raw, "inline"), recipe)
    model = NaohaiLM(recipe.model)
    A.apply_strategy(model, resolved)
    for layer in model.layers:
        assert layer._has_config_recompute
        drops = [p for p in layer.shardable_ops().values() if type(p).__name__ == "Dropout"]
        assert len(drops) == 3                                   # attention probs, attention out, mlp out
        assert all(p.attrs.get("recompute") is False for p in drops)
        assert layer.attention.q.attrs.get("recompute") is not False


def test_recomputed_layer_backward_uses_the_forward_dropout_mask():
    """Behaviour, on a one-layer stand-in: loss = sum(2 * dropout(x) * w), so dloss/dw = 2 * dropout(x)
    with the forward's mask and sum(w * dloss/dw) must equal the loss.  Without apply.py's exclusion
    MindSpore's recompute gives another mask (the two differ)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops
    from naohai.model.layers import Dropout
    from naohai.strategy.resolve import RecomputeSpec

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.drop = Dropout(0.5)
            self.w = Parameter(Tensor(np.random.RandomState(0).randn(512).astype(np.float32)), name="w")

        def construct(self, x):
            return self.drop(x * 1.0) * self.w

        def shardable_ops(self):
            return {"dropout": self.drop.drop}

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Layer()])

        def construct(self, x):
            return ops.ReduceSum()(self.layers[0](x) * 2.0)

        def layer_cells(self):
            return list(self.layers)

    class Resolved:
        recompute = [RecomputeSpec("full")]

    ms.set_device("CPU")               # before any kernel runs (later tests set it again)
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    x = Tensor(np.random.RandomState(1).rand(512).astype(np.float32) + 1.0)
    gaps = {}
    try:
        for exclude in (True, False):
            model = Model()
            model.set_train(True)
            if exclude:
                A.apply_recompute(model, Resolved())
            else:
                model.layers[0].recompute()
            loss, (g,) = ms.value_and_grad(model, None, model.trainable_params())(x)
            gaps[exclude] = abs(float(loss) - float((g.asnumpy() * model.layers[0].w.asnumpy()).sum()))
    finally:
        ms.set_context(mode=mode)
    assert gaps[True] < 1e-3
    assert gaps[False] > 1e-2          # what MindSpore does to a recomputed dropout (the reason for the rule)


# ------------------------------------------------------------------------------ one graph per equal layer
def test_layer_graph_keys_group_layers_by_strategy_recompute_and_stage():
    """Layers 0-1 and 2-3 of tiny-dp2-mp2-pp2 differ only by stage; a recompute range splits a group;
    PanGu's query layer is a structure of its own."""
    model, resolved = _built("tiny-dp2-mp2-pp2")
    keys = A.layer_graph_keys(model, resolved)
    assert keys[0] == keys[1] and keys[2] == keys[3] and keys[0] != keys[2]

    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=8"])
    raw = {"name": "t", "mesh": {"data": 2, "model": 1, "pipeline": 1}, "rules": {"batch": "data"},
           "layers": {"1-2": {"recompute": "full"}}}
    resolved = check_strategy(parse_strategy(raw, "inline"), recipe)
    keys = A.layer_graph_keys(NaohaiLM(recipe.model), resolved)
    assert [keys.index(k) for k in keys] == [0, 1, 1, 0]

    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["model.preset=tiny-pangu"])
    keys = A.layer_graph_keys(NaohaiLM(recipe.model), default_strategy(recipe.model))
    assert keys[0] == keys[1] == keys[2] != keys[3]


@pytest.mark.parametrize("preset", ["tiny", "tiny-pangu"])
def test_shared_layer_graphs_train_exactly_like_separate_ones(preset):
    """Behaviour on CPU: two optimizer steps with the layers compiled once (lazy_inline 'front') give
    the same losses and the same updated weights as the plain compile (MindSpore's own outputs)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from naohai.train.builder import build

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    over = [f"model.preset={preset}", "model.num_layers=3", "train.global_batch_size=2", "train.micro_batch_size=2",
            "model.seq_length=32"]
    if preset == "tiny-pangu":
        over += ["model.eod_reset=true", "model.eod_reset_positions=true", "model.eod_id=3"]
    tokens = np.random.RandomState(0).randint(0, 2048, (2, 2, 33)).astype(np.int32)
    tokens[:, :, 10] = 3                                     # an EOD inside each window
    out = {}
    for reuse in (False, True):
        recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"),
                             over + [f"train.reuse_layer_graphs={reuse}", "train.layer_loop=never"])
        built = build(plan_run(recipe))
        graphs = {layer.cell_init_args for layer in built.model.layers if hasattr(layer, "_cell_init_args")}
        assert len(graphs) == (0 if not reuse else 1 if preset == "tiny" else 2)
        losses = [float(built.steps.train_step(Tensor(t[:, :-1]), Tensor(t[:, 1:]))[0].asnumpy()) for t in tokens]
        out[reuse] = losses, {p.name: p.asnumpy().copy() for p in built.model.trainable_params()}
    assert out[True][0] == out[False][0]
    for name, value in out[False][1].items():
        np.testing.assert_array_equal(out[True][1][name], value, err_msg=name)


def test_fold_micro_batches_marks_each_pipelined_model_once_as_lazy_inline_does():
    """Each model a ``Pipeline`` runs per micro-batch gets the key MindSpore's own ``@lazy_inline`` writes (its
    prefix and the class name), once however many networks hold it; a model outside a pipeline is left alone."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.parallel.nn import Pipeline
    from naohai.strategy.annotate import fold_micro_batches

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(4, 4)

        def construct(self, x):
            return self.dense(x)

    class Decorated(nn.Cell):
        @ms.lazy_inline
        def __init__(self):
            super().__init__()

        def construct(self, x):
            return x

    piped, alone = Model(), Model()
    train, evaluate = Pipeline(piped, 2), nn.SequentialCell([Pipeline(piped, 2)])
    assert fold_micro_batches([train, evaluate, alone]) == 1
    prefix = getattr(Decorated(), "cell_init_args")[:len("lazy_inline_")]
    assert piped.cell_init_args == prefix + "Model"
    assert not str(getattr(alone, "cell_init_args", "") or "").startswith(prefix)
    assert fold_micro_batches([alone]) == 0
