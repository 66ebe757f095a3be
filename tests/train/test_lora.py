"""LoRA (naohai.model.lora) on one device: frozen means frozen, the adapted model starts equal to the
base, folding B A into the base weights gives the same logits, initialisation by op name, bad input."""
import re
import zlib

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.config import recipe_from_dict
from naohai.data.loader import TokenWindowLoader
from naohai.errors import UserError
from naohai.model.lora import adapter_params, lora_ops
from naohai.model.transformer import TokenNLLNet
from naohai.strategy.run_plan import plan_run
from naohai.train.builder import build
from tests.conftest import micro_recipe

TARGETS = r"attention\.(q|v)$|mlp\.down$"


@pytest.fixture(autouse=True)
def _cpu_graph():
    """The device is named before MindSpore's runtime starts (a later run's set_device must agree)."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)


def _lora_recipe(tmp_path, data=None, **finetune):
    raw = micro_recipe(tmp_path, *(data or ()), steps=20, grad_clip=1.0).to_dict()
    raw["finetune"] = {"method": "lora", "rank": 4, "alpha": 8.0, "targets": TARGETS, **finetune}
    return recipe_from_dict(raw, where="test recipe")


def _batch(micro_data, n=0):
    loader = TokenWindowLoader(micro_data[0], "train", 4, seed=0)
    for _ in range(n):
        loader.next_batch()
    return loader.next_batch()


def _nll(model, batch):
    b = batch.astype(np.int32)
    return TokenNLLNet(model)(Tensor(b[:, :-1]), Tensor(b[:, 1:])).asnumpy()


def test_twenty_lora_steps_leave_every_base_tensor_bit_identical(tmp_path, micro_data):
    ms.set_context(mode=ms.GRAPH_MODE)
    built = build(plan_run(_lora_recipe(tmp_path, micro_data)))
    adapters = {p.name for p in adapter_params(built.model)}
    want = {f"{op}.lora_{ab}" for op in lora_ops(built.model.cfg) if re.search(TARGETS, op) for ab in "ab"}
    assert adapters == want and len(want) == 2 * 3 * 2          # 2 layers x (q, v, down) x (A, B)
    base = {p.name: p.asnumpy().copy() for p in built.model.get_parameters() if p.name not in adapters}
    start = {p.name: p.asnumpy().copy() for p in adapter_params(built.model)}
    loader = TokenWindowLoader(micro_data[0], "train", 4, seed=0)
    losses = [built.steps.train(loader.next_batch()).loss for _ in range(20)]
    for p in built.model.get_parameters():
        if p.name in base:
            assert np.array_equal(p.asnumpy(), base[p.name]), p.name          # bit-identical
    moved = [n for n in adapters if not np.array_equal(start[n], dict(
        (p.name, p.asnumpy()) for p in adapter_params(built.model))[n])]
    assert sorted(moved) == sorted(adapters)                                  # A and B both trained
    names = lambda tup: sorted(p.name for p in tup)                           # noqa: E731
    assert names(built.optimizer.parameters) == sorted(adapters)
    assert names(built.optimizer.moments1) == sorted(f"adam_m.{n}" for n in adapters)
    assert names(built.optimizer.moments2) == sorted(f"adam_v.{n}" for n in adapters)
    assert losses[-1] < losses[0]


def test_adapter_starts_equal_to_base_and_merges_into_it(tmp_path, micro_data):
    ms.set_context(mode=ms.GRAPH_MODE)
    batch = _batch(micro_data)
    plain = build(plan_run(micro_recipe(tmp_path / "p", *micro_data))).model
    lora = build(plan_run(_lora_recipe(tmp_path / "l", micro_data))).model
    np.testing.assert_array_equal(_nll(lora, batch), _nll(plain, batch))       # B = 0 at the start
    rng = np.random.default_rng(3)
    params = {p.name: p for p in lora.get_parameters()}
    for p in adapter_params(lora):
        if p.name.endswith("lora_b"):
            p.set_data(Tensor(rng.normal(0, 0.2, p.shape).astype(np.float32)))
    adapted = _nll(lora, batch)
    assert np.abs(adapted - _nll(plain, batch)).max() > 1e-3
    merged = {p.name: p for p in plain.get_parameters()}
    for op in lora_ops(lora.cfg):
        if re.search(TARGETS, op):
            a, b = params[f"{op}.lora_a"].asnumpy(), params[f"{op}.lora_b"].asnumpy()
            w = merged[f"{op}_weight"]
            w.set_data(Tensor(w.asnumpy() + (8.0 / 4) * b @ a))                  # W + alpha/r B A
    np.testing.assert_allclose(_nll(plain, batch), adapted, rtol=1e-5, atol=1e-5)


def test_init_depends_on_the_op_name_only(tmp_path, micro_data):
    one = build(plan_run(_lora_recipe(tmp_path / "a", micro_data))).model
    two = build(plan_run(_lora_recipe(tmp_path / "b", micro_data, targets=r"layers\.1\.attention\.v$"))).model
    a1 = {p.name: p.asnumpy() for p in adapter_params(one)}
    a2 = {p.name: p.asnumpy() for p in adapter_params(two)}
    assert set(a2) == {"layers.1.attention.v.lora_a", "layers.1.attention.v.lora_b"}
    for name, value in a2.items():
        np.testing.assert_array_equal(value, a1[name])
    a = a1["layers.0.attention.q.lora_a"]                       # from the definition: (seed, crc32(name))
    ref = np.random.default_rng([42, zlib.crc32(b"layers.0.attention.q")]).uniform(-1, 1, a.shape) / np.sqrt(32)
    np.testing.assert_allclose(a, ref.astype(np.float32), rtol=1e-6)
    assert not np.any(a1["layers.0.attention.q.lora_b"])


@pytest.mark.parametrize("finetune, key, message", [
    ({"targets": r"attention\.nope"}, "finetune.targets", "matches no linear op"),
    ({"targets": r"softmax"}, "finetune.targets", "matches no linear op"),
    ({"targets": "(("}, "finetune.targets", "not a regular expression"),
    ({"rank": 33}, "finetune.rank", "between 1 and 32"),
])
def test_bad_targets_and_ranks_name_the_key(tmp_path, micro_data, finetune, key, message):
    with pytest.raises(UserError, match=rf"key '{re.escape(key)}'.*{message}"):
        build(plan_run(_lora_recipe(tmp_path, micro_data, **finetune)))


@pytest.mark.parametrize("finetune, key", [({"rank": 0}, "finetune.rank"), ({"method": "prefixes"}, "finetune.method"),
                                           ({"dropout": 1.0}, "finetune.dropout"), ({"rnak": 2}, "finetune.rnak")])
def test_bad_recipe_values_name_the_key(tmp_path, finetune, key):
    with pytest.raises(UserError, match=rf"key '{re.escape(key)}'"):
        _lora_recipe(tmp_path, **finetune)
