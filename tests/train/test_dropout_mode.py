"""The train graph drops out and the eval graph does not, whichever is compiled first.

The two graphs share one model, and MindSpore reads a cell's ``training`` flag when it compiles a graph.
Before :meth:`naohai.train.builder.CompiledSteps._mode`, ``build`` left the model in inference mode (the
eval step's ``set_train(False)`` came last), so a recipe's ``model.dropout`` never reached training: the
train step's loss at step 0 equalled the held-out loss of the same batch and weights.
"""
import numpy as np
import pytest

from naohai.config import recipe_from_dict
from naohai.strategy.run_plan import plan_run
from naohai.train import job
from naohai.train.builder import build

from tests.conftest import MICRO_MODEL


def _steps(tmp_path, dropout: float):
    recipe = recipe_from_dict({"name": "micro-dropout", "model": dict(MICRO_MODEL, dropout=dropout),
                               "data": {"corpus": ["builtin:pydoc"]},
                               "train": dict(steps=4, global_batch_size=4, micro_batch_size=4, lr=1e-3,
                                             output_dir=str(tmp_path), device="CPU", mode="graph")},
                              where="test recipe")
    job.set_context(recipe, "CPU")
    steps = build(plan_run(recipe)).steps
    window = np.random.RandomState(0).randint(0, recipe.model.vocab_size, (steps.rows, recipe.model.seq_length + 1))
    return steps, window.astype(np.int32)


@pytest.mark.parametrize("dropout", [0.5, 0.0])
def test_eval_compiled_first(tmp_path, dropout):
    steps, window = _steps(tmp_path, dropout)
    held_out = steps.evaluate(window)
    train = steps.train(window).loss           # same batch, same weights: only dropout can differ
    if dropout:
        assert train != pytest.approx(held_out, rel=1e-6, abs=0)
    else:
        assert train == held_out
    after = [steps.evaluate(window) for _ in range(2)]
    assert after[0] == after[1]                # the eval graph never drops out


def test_both_compiled_before_any_call(tmp_path):
    """As on resume and ``train.init_from``: :meth:`CompiledSteps.compile` compiles train, then eval."""
    steps, window = _steps(tmp_path, 0.5)
    steps.compile()
    held_out = steps.evaluate(window)
    assert steps.evaluate(window) == held_out
    assert steps.train(window).loss != pytest.approx(held_out, rel=1e-6, abs=0)


def test_compile_targets_prepare_each_graph_in_its_mode(tmp_path):
    """``naohai check --compile`` and the simulated-device worker compile the targets one by one: each
    carries the call that puts the shared model in its graph's mode first."""
    from naohai.train.builder import TRAINING_GRAPHS
    steps, _ = _steps(tmp_path, 0.5)
    targets = steps.compile_targets()
    assert [t[0] for t in targets] == ["train", "eval"]
    for name, _, _, prepare in targets + targets[::-1]:
        prepare()
        assert steps.model.training is (name in TRAINING_GRAPHS)
        assert all(c.training is steps.model.training for _, c in steps.model.cells_and_names())
