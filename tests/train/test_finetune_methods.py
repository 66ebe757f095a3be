"""Prefix tuning, prompt tuning, LLaMA-Adapter and the Houlsby adapter (naohai.model.finetune) through the
trainer on one device: frozen means frozen (a few steps change only the method's tensors, every base tensor
bit-identical, the optimizer holds the method's tensors only), initial values from (seed, name), bad input."""
import re

import numpy as np
import pytest
import mindspore as ms

from naohai.config import recipe_from_dict
from naohai.data.loader import TokenWindowLoader
from naohai.errors import UserError
from naohai.model.finetune import method_params
from naohai.strategy.run_plan import plan_run
from naohai.train.builder import build
from tests.conftest import micro_recipe

METHODS = {"prefix": ({"num_virtual_tokens": 4}, ["prefix.embedding"]),
           "prompt": ({"num_virtual_tokens": 4}, ["prompt.embedding"]),
           "llama_adapter": ({"num_virtual_tokens": 3, "adapter_layers": 1},
                             ["layers.1.attention.adaption_gate", "layers.1.attention.adaption_prompt"]),
           "adapter": ({"bottleneck": 4}, sorted(f"layers.{i}.{part}.adapter.{w}_{t}" for i in range(2)
                                                 for part in ("attention", "mlp") for w in ("down", "up")
                                                 for t in ("weight", "bias")))}


@pytest.fixture(autouse=True)
def _cpu_graph():
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)


def _recipe(tmp_path, data=(), method="prefix", model=None, **finetune):
    raw = micro_recipe(tmp_path, *data, steps=5, grad_clip=1.0).to_dict()
    raw["model"].update({"max_positions": 40, **(model or {})})
    raw["finetune"] = {"method": method, **finetune}
    return recipe_from_dict(raw, where="test recipe")


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_few_steps_train_only_the_method(tmp_path, micro_data, method):
    keys, names = METHODS[method]
    built = build(plan_run(_recipe(tmp_path, micro_data, method, **keys)))
    trained = sorted(p.name for p in method_params(built.model))
    assert trained == sorted(names)
    base = {p.name: p.asnumpy().copy() for p in built.model.get_parameters() if p.name not in names}
    start = {p.name: p.asnumpy().copy() for p in method_params(built.model)}
    loader = TokenWindowLoader(micro_data[0], "train", 4, seed=0)
    losses = [built.steps.train(loader.next_batch()).loss for _ in range(5)]
    for p in built.model.get_parameters():
        if p.name in base:
            assert np.array_equal(p.asnumpy(), base[p.name]), p.name             # bit-identical
    now = {p.name: p.asnumpy() for p in method_params(built.model)}
    assert sorted(n for n in names if not np.array_equal(now[n], start[n])) == sorted(names)   # all trained
    assert sorted(p.name for p in built.optimizer.parameters) == sorted(names)
    assert sorted(p.name for p in built.optimizer.moments1) == sorted(f"adam_m.{n}" for n in names)
    assert np.isfinite(losses).all()


def test_initial_values_come_from_seed_and_name(tmp_path):
    from naohai.model.finetune import apply_finetune
    from naohai.model.transformer import NaohaiLM
    recipe = _recipe(tmp_path, method="adapter", bottleneck=4)
    one, two = NaohaiLM(recipe.model, seed=1), NaohaiLM(recipe.model, seed=2)
    apply_finetune(one, recipe.finetune, seed=7)
    apply_finetune(two, recipe.finetune, seed=7)
    a = {p.name: p.asnumpy() for p in method_params(one)}
    b = {p.name: p.asnumpy() for p in method_params(two)}
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    down = "layers.1.mlp.adapter.down_weight"
    import zlib
    want = np.random.default_rng([7, zlib.crc32(down.encode())]).uniform(-1, 1, (4, 32)) / np.sqrt(32)
    np.testing.assert_allclose(a[down], want.astype(np.float32), rtol=1e-6)
    assert not np.any(a["layers.1.mlp.adapter.up_weight"])           # the adapter starts as the identity


@pytest.mark.parametrize("method, finetune, model, key, message", [
    ("prefixes", {}, None, "finetune.method", "not one of"),
    ("prefix", {"num_virtual_tokens": 0}, None, "finetune.num_virtual_tokens", "positive integer"),
    ("prompt", {"num_virtual_tokens": -3}, None, "finetune.num_virtual_tokens", "positive integer"),
    ("prefix", {"num_virtual_tokens": 9}, None, "finetune.num_virtual_tokens", "exceeds the 40 positions"),
    ("prompt", {"num_virtual_tokens": 4}, {"max_positions": None}, "finetune.num_virtual_tokens", "exceeds"),
    ("adapter", {"bottleneck": 0}, None, "finetune.bottleneck", "positive integer"),
    ("llama_adapter", {"adapter_layers": 3}, None, "finetune.adapter_layers", "between 1 and"),
    ("llama_adapter", {"adapter_layers": 0}, None, "finetune.adapter_layers", "positive integer"),
    ("llama_adapter", {"num_virtual_tokens": 41}, None, "finetune.num_virtual_tokens", "longer than the 40"),
    ("llama_adapter", {"num_virtual_tokens": 10 ** 9}, None, "finetune.num_virtual_tokens", "longer than the 40"),
    ("prefix", {"rank": 4}, None, "finetune.rank", "not a key of method prefix"),
    ("prompt", {"num_virtual_tokens": 4}, {"eod_reset": True, "eod_id": 1}, "finetune.method", "EOD resets"),
    ("prefix", {"num_virtual_tokens": 4}, {"position": "alibi"}, "finetune.method", "ALiBi"),
])
def test_bad_input_names_the_key(tmp_path, method, finetune, model, key, message):
    with pytest.raises(UserError, match=rf"key '{re.escape(key)}'.*{message}"):
        _recipe(tmp_path, method=method, model=model, **finetune)


def test_bad_recipe_exits_2_with_one_paragraph(tmp_path, capsys):
    import yaml
    from naohai.cli import main
    path = tmp_path / "r.yaml"
    raw = _recipe(tmp_path, method="prefix").to_dict()
    raw["finetune"] = {"method": "prefix", "num_virtual_tokens": 0}
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "finetune.num_virtual_tokens" in err, err


@pytest.mark.parametrize("method", ["prefix", "adapter"])
def test_a_strategy_file_is_refused_naming_the_method(method):
    """The methods other than LoRA have no sharding rules yet: the run plan refuses them under a strategy
    file (exit 2 naming finetune.method) rather than train them unsharded."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    with pytest.raises(UserError, match=r"key 'finetune.method'.*one device so far"):
        plan_run(str(root / "recipes/tiny.yaml"), str(root / "strategies/tiny-dp2-mp2-pp2.yaml"),
                 ["train.micro_batch_size=2", f"finetune.method={method}", "model.max_positions=600"])
