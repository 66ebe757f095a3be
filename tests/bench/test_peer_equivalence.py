"""The PyTorch peer of `naohai bench` computes naohai's loss: same weights in, same loss out.

PyTorch is an optional extra (``.[bench]``), so this file alone is skipped without it.
"""
import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import mindspore as ms  # noqa: E402
from mindspore import Tensor  # noqa: E402

from naohai.bench.models import bench_models  # noqa: E402
from naohai.bench.torch_row import peer_module  # noqa: E402
from naohai.model.transformer import NaohaiLM  # noqa: E402


@pytest.fixture(autouse=True)
def _pynative_cpu():
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield


def _peer():
    peer, why = peer_module()
    assert peer is not None, why
    return peer


def _losses(cfg, weights_of, batch=2, seed=0):
    """(naohai loss, peer loss) of one random batch with the weights ``weights_of(naohai_model)``."""
    model = NaohaiLM(cfg, seed=seed)
    weights = weights_of(model)
    for p in model.trainable_params():
        p.set_data(Tensor(weights[p.name]))
    tok = np.random.default_rng(seed + 7).integers(0, cfg.vocab_size, (batch, cfg.seq_length + 1)).astype(np.int32)
    ours = float(model(Tensor(tok[:, :-1]), Tensor(tok[:, 1:])).asnumpy())
    peer = _peer().make_peer(cfg)
    peer.load_numpy(weights)
    t = torch.from_numpy(tok.astype(np.int64))
    with torch.no_grad():
        theirs = float(peer(t[:, :-1], t[:, 1:]))
    return ours, theirs


def _initial(model):
    return {p.name: p.asnumpy() for p in model.trainable_params()}


def _randomized(model):
    """Every tensor random (biases, gains and shifts too), so each one's role is checked."""
    rng = np.random.RandomState(3)
    out = {}
    for p in model.trainable_params():
        v = p.asnumpy()
        scale = 0.3 if v.ndim == 1 else 1.0 / np.sqrt(v.shape[-1])
        out[p.name] = (v * 0 + rng.standard_normal(v.shape) * scale + (1.0 if p.name.endswith("gamma") else 0.0)
                       ).astype(np.float32)
    return out


def test_peer_names_are_naohais():
    cfg = bench_models()["tiny"].model
    names = {p.name for p in NaohaiLM(cfg).trainable_params()}
    assert {n for n, _ in _peer().make_peer(cfg).named_parameters()} == names


@pytest.mark.parametrize("weights", [_initial, _randomized], ids=["initial", "randomized"])
def test_tiny_preset_loss_equals_naohai(weights):
    ours, theirs = _losses(bench_models()["tiny"].model, weights)
    assert theirs == pytest.approx(ours, abs=1e-5, rel=1e-5)


def test_rmsnorm_variant_loss_equals_naohai():
    cfg = dataclasses.replace(bench_models()["tiny"].model, norm="rmsnorm", num_layers=2, seq_length=32)
    ours, theirs = _losses(cfg, _randomized)
    assert theirs == pytest.approx(ours, abs=1e-5, rel=1e-5)


def test_peer_refuses_what_it_does_not_implement():
    peer = _peer()
    cfg = dataclasses.replace(bench_models()["tiny"].model, activation="gelu", eod_reset=True, eod_id=0)
    why = peer.unsupported(cfg)
    assert "swiglu" in why and "EOD" in why
    with pytest.raises(ValueError):
        peer.make_peer(cfg)
