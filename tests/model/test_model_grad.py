"""Gradients of tiny models: MindSpore's backward against central differences of the float64 numpy
forward (and, for a few large entries, of the MindSpore float32 forward itself)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

import model_reference as ref
from naohai.config import ModelConfig
from naohai.model.transformer import NaohaiLM

SMALL = dict(vocab_size=30, vocab_pad_multiple=8, hidden_size=16, num_layers=2, num_heads=4,
             ffn_hidden_size=20, seq_length=6)
CONFIGS = {
    "pangu": dict(SMALL, position="learned", max_positions=8, activation="fast_gelu", norm="layernorm",
                  query_layer=True),
    "pengcheng-gqa": dict(SMALL, position="rope", activation="swiglu", norm="rmsnorm", num_kv_heads=2),
}
PROBES = {
    "pangu": ["embedding.word_embedding", "embedding.position_embedding", "layers.0.attention.q_weight",
              "layers.0.attention.k_bias", "layers.0.input_norm.gamma", "layers.0.mlp.up_weight",
              "layers.1.attention.query_embedding", "layers.1.attention.v_weight",
              "layers.1.post_attention_norm.beta", "layers.1.mlp.down_weight", "head.final_norm.gamma"],
    "pengcheng-gqa": ["embedding.word_embedding", "layers.0.attention.q_weight", "layers.0.attention.k_weight",
                      "layers.1.attention.out_bias", "layers.0.mlp.gate_weight", "layers.1.mlp.up_bias",
                      "layers.0.post_attention_norm.gamma", "head.final_norm.gamma"],
}


def setup(name):
    cfg = ModelConfig(**CONFIGS[name])
    cfg.validate()
    model = NaohaiLM(cfg, seed=0)
    p = ref.randomize(model, np.random.RandomState(1), scale=0.4)
    rng = np.random.RandomState(2)
    ids = rng.randint(0, cfg.vocab_size, (2, cfg.seq_length)).astype(np.int32)
    labels = rng.randint(0, cfg.vocab_size, (2, cfg.seq_length)).astype(np.int32)
    params = model.trainable_params()
    fn = ms.value_and_grad(model, None, params)
    loss, grads = fn(Tensor(ids), Tensor(labels))
    g = {prm.name: gr.asnumpy().astype(np.float64) for prm, gr in zip(params, grads)}
    return cfg, model, p, ids, labels, float(loss.asnumpy()), g


def fd64(p, cfg, ids, labels, name, idx, h=1e-5):
    q = dict(p)
    a = p[name].copy()
    a[idx] += h
    q[name] = a
    up = ref.lm_loss(q, cfg, ids, labels)
    a = p[name].copy()
    a[idx] -= h
    q[name] = a
    down = ref.lm_loss(q, cfg, ids, labels)
    return (up - down) / (2 * h)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_match_float64_finite_differences(name):
    cfg, model, p, ids, labels, loss, g = setup(name)
    assert set(g) == set(p)
    np.testing.assert_allclose(loss, ref.lm_loss(p, cfg, ids, labels), rtol=1e-5)
    rng = np.random.RandomState(3)
    checked = 0
    for pname in PROBES[name]:
        shape = p[pname].shape
        picks = [tuple(rng.randint(0, d) for d in shape) for _ in range(2)]
        if pname == "embedding.word_embedding":
            picks = [(int(ids[0, 1]), 3), (int(ids[1, 4]), 0),          # rows of input tokens
                     (int(labels[0, 2]), 5),                             # a label row (head side)
                     (cfg.vocab_size + 1, 2)]                            # a padding row: softmax only
        for idx in picks:
            want = fd64(p, cfg, ids, labels, pname, idx)
            got = g[pname][idx]
            assert abs(got - want) <= 2e-3 * abs(want) + 2e-6, (pname, idx, got, want)
            checked += abs(want) > 1e-4
    assert checked >= len(PROBES[name])          # most probes have a real (non-negligible) gradient


def test_unused_rows_get_zero_gradient():
    cfg, model, p, ids, labels, loss, g = setup("pangu")
    s = cfg.seq_length                           # max_positions 8 > seq 6: rows 6, 7 are never read
    assert np.all(g["embedding.position_embedding"][s:] == 0)
    assert np.all(g["layers.1.attention.query_embedding"][s:] == 0)
    assert np.abs(g["embedding.position_embedding"][:s]).min() > 0
    # the query layer's queries do not come from the hidden state, so nothing else feeds them
    assert np.abs(g["layers.1.attention.query_embedding"][:s]).sum() > 1e-4


def test_gradients_match_float32_finite_differences_of_the_model():
    cfg, model, p, ids, labels, loss, g = setup("pangu")
    params = {prm.name: prm for prm in model.trainable_params()}
    for pname in ("embedding.word_embedding", "layers.0.mlp.up_weight", "layers.0.attention.q_weight"):
        flat = np.abs(g[pname]).ravel()
        idx = np.unravel_index(int(np.argmax(flat)), g[pname].shape)   # the largest entry: best SNR
        prm, base, eps = params[pname], p[pname].astype(np.float32), 1e-2
        vals = []
        for sign in (1, -1):
            a = base.copy()
            a[idx] += sign * eps
            prm.set_data(Tensor(a))
            vals.append(float(model(Tensor(ids), Tensor(labels)).asnumpy()))
        prm.set_data(Tensor(base))
        fd = (vals[0] - vals[1]) / (2 * eps)
        assert abs(g[pname][idx] - fd) <= 0.03 * abs(fd) + 1e-4, (pname, idx, g[pname][idx], fd)
