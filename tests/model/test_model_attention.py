"""Attention against the numpy reference: plain causal, RoPE, ALiBi, GQA, PanGu query layer."""
import dataclasses
import math

import numpy as np
import pytest
from mindspore import Tensor

import model_reference as ref
from naohai.config import ModelConfig
from naohai.model.layers import Attention, alibi_slopes
from naohai.model.transformer import DecoderLayer

BASE = ModelConfig(vocab_size=64, vocab_pad_multiple=8, hidden_size=16, num_layers=2, num_heads=4,
                   ffn_hidden_size=32, seq_length=8, position="none", activation="swiglu",
                   norm="layernorm", bias=True, compute_dtype="float32")


def cfg_of(**kw):
    cfg = dataclasses.replace(BASE, **kw)
    cfg.validate()
    return cfg


def build(cfg, seed=0, scale=0.3):
    cell = Attention(cfg, np.random.RandomState(seed))
    p = ref.randomize(cell, np.random.RandomState(seed + 100), scale)
    return cell, p


def run(cell, x):
    return cell(Tensor(x.astype(np.float32))).asnumpy()


def check(cfg, batch=2, seed=0, x=None):
    cell, p = build(cfg, seed)
    if x is None:
        x = np.random.RandomState(seed + 7).standard_normal((batch * cfg.seq_length, cfg.hidden_size))
    got = run(cell, x)
    # parameters are named relative to the cell ("q_weight"); reference uses a prefix
    want = ref.attention(x.astype(np.float32).astype(np.float64), {f"a.{k}": v for k, v in p.items()}, "a", cfg)
    assert got.shape == (batch * cfg.seq_length, cfg.hidden_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return cell, got


@pytest.mark.parametrize("position", ["none", "learned"])
def test_causal_attention_matches_numpy(position):
    # "learned" positions live in the embedding: inside attention it is plain causal attention
    check(cfg_of(position=position))


def test_attention_without_bias_matches_numpy():
    cfg = cfg_of(bias=False)
    cell, _ = check(cfg)
    assert cell.q_bias is None and not [p for p in cell.get_parameters() if "bias" in p.name]


@pytest.mark.parametrize("position", ["none", "rope", "alibi"])
def test_attention_is_causal(position):
    cfg = cfg_of(position=position)
    cell, _ = build(cfg)
    s, h = cfg.seq_length, cfg.hidden_size
    rng = np.random.RandomState(1)
    x = rng.standard_normal((2, s, h))
    base = run(cell, x.reshape(-1, h)).reshape(2, s, h)
    for t in range(s - 1):
        y = x.copy()
        y[:, t + 1:] = rng.standard_normal(y[:, t + 1:].shape) * 3
        out = run(cell, y.reshape(-1, h)).reshape(2, s, h)
        np.testing.assert_allclose(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
        assert np.abs(out[:, t + 1:] - base[:, t + 1:]).max() > 1e-4   # later positions do see it


def test_batch_rows_are_independent():
    cfg = cfg_of(position="rope")
    cell, _ = build(cfg)
    rng = np.random.RandomState(2)
    x = rng.standard_normal((2, 8, 16))
    both = run(cell, x.reshape(-1, 16)).reshape(2, 8, 16)
    y = x.copy()
    y[1] = rng.standard_normal((8, 16))
    np.testing.assert_allclose(run(cell, y.reshape(-1, 16)).reshape(2, 8, 16)[0], both[0], atol=1e-6)


# ------------------------------------------------------------------------------ RoPE
@pytest.mark.parametrize("heads,hidden,base", [(4, 16, 10000.0), (2, 16, 100.0), (4, 32, 500.0)])
def test_rope_attention_matches_numpy(heads, hidden, base):
    check(cfg_of(position="rope", num_heads=heads, hidden_size=hidden, rope_base=base))


def test_rope_rotation_matches_numpy_and_is_relative():
    cfg = cfg_of(position="rope", num_heads=2, hidden_size=16, rope_base=100.0)
    cell, _ = build(cfg)
    s, d = cfg.seq_length, cfg.head_dim
    rng = np.random.RandomState(4)
    x = rng.standard_normal((1, 2, s, d))
    got = cell.apply_rope(Tensor(x.astype(np.float32)), cell.cos, cell.sin).asnumpy()
    np.testing.assert_allclose(got, ref.rope(x, np.arange(s), 100.0), atol=1e-5)
    # a rotation: norms preserved
    np.testing.assert_allclose(np.linalg.norm(got, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    # the same q at every position and the same k at every position: q_m . k_n depends on m - n only
    u, w = rng.standard_normal(d), rng.standard_normal(d)
    q = cell.apply_rope(Tensor(np.tile(u, (1, 1, s, 1)).astype(np.float32)), cell.cos, cell.sin).asnumpy()[0, 0]
    k = cell.apply_rope(Tensor(np.tile(w, (1, 1, s, 1)).astype(np.float32)), cell.cos, cell.sin).asnumpy()[0, 0]
    sc = q @ k.T                                                    # [m, n]
    for m in range(s):
        for n in range(s):
            np.testing.assert_allclose(sc[m, n], sc[m - n, 0] if m >= n else sc[0, n - m], atol=1e-4)
            np.testing.assert_allclose(sc[m, n], ref.rope(u[None], [m - n], 100.0)[0] @ w, atol=1e-4)
    assert np.ptp(np.diag(sc, -3)) < 1e-4 and np.ptp(sc[:, 0]) > 1e-2     # not trivially constant


# ------------------------------------------------------------------------------ ALiBi
def test_alibi_slopes_follow_the_paper():
    np.testing.assert_allclose(alibi_slopes(4), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8], rtol=1e-6)
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -i for i in range(1, 9)], rtol=1e-6)
    # 6 heads: the 4-head slopes, then every other 8-head slope: 2^-(8*1/8), 2^-(8*3/8)
    np.testing.assert_allclose(alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3], rtol=1e-6)
    for n in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24):
        np.testing.assert_allclose(alibi_slopes(n), ref.alibi_slopes(n), rtol=1e-6)


@pytest.mark.parametrize("heads,hidden", [(4, 16), (8, 32), (6, 24)])
def test_alibi_attention_matches_numpy(heads, hidden):
    check(cfg_of(position="alibi", num_heads=heads, hidden_size=hidden))


def test_alibi_bias_is_slope_times_distance():
    # zero q/k weights: scores are pure bias, so each row's probabilities are softmax(slope*(j-i))
    cfg = cfg_of(position="alibi", num_heads=4, bias=False)
    cell = Attention(cfg, np.random.RandomState(0))
    hd, s = cfg.head_dim, cfg.seq_length
    for p in (cell.q_weight, cell.k_weight):
        p.set_data(Tensor(np.zeros(p.shape, np.float32)))
    # v and out are identities, so head n's output block is sum_j p_ij x_j[block n]
    x = np.random.RandomState(6).standard_normal((s, 16)).astype(np.float32)
    cell.v_weight.set_data(Tensor(np.eye(16, dtype=np.float32)))
    cell.out_weight.set_data(Tensor(np.eye(16, dtype=np.float32)))
    out = run(cell, x)                                               # [s, 16]
    slopes = ref.alibi_slopes(4)
    for head in range(4):
        for i in range(s):
            logits = slopes[head] * (np.arange(i + 1) - i)
            probs = ref.softmax(logits)
            # head `head` outputs coordinates head*hd .. head*hd+hd-1 = sum_j p_ij x_j[those coords]
            want = probs @ x[: i + 1, head * hd:(head + 1) * hd]
            np.testing.assert_allclose(out[i, head * hd:(head + 1) * hd], want, atol=1e-6)


# ------------------------------------------------------------------------------ GQA
@pytest.mark.parametrize("kv,position", [(2, "none"), (1, "none"), (2, "rope"), (1, "alibi")])
def test_gqa_matches_numpy_with_repeated_kv_heads(kv, position):
    cfg = cfg_of(num_kv_heads=kv, position=position)
    cell, _ = check(cfg)
    assert cell.k_weight.shape == (kv * cfg.head_dim, cfg.hidden_size)


def test_gqa_equals_mha_with_duplicated_kv_weights():
    # an independent route: copy each kv head's rows into a full multi-head cell
    gcfg = cfg_of(num_kv_heads=2, position="rope")
    g, gp = build(gcfg)
    mcfg = cfg_of(position="rope")
    m = Attention(mcfg, np.random.RandomState(9))
    hd, group = gcfg.head_dim, 2
    for name in ("k", "v"):
        w, b = gp[f"{name}_weight"], gp[f"{name}_bias"]
        rows = np.concatenate([np.arange(j // group * hd, (j // group + 1) * hd) for j in range(4)])
        getattr(m, f"{name}_weight").set_data(Tensor(w[rows].astype(np.float32)))
        getattr(m, f"{name}_bias").set_data(Tensor(b[rows].astype(np.float32)))
    for name in ("q_weight", "q_bias", "out_weight", "out_bias"):
        getattr(m, name).set_data(Tensor(gp[name].astype(np.float32)))
    x = np.random.RandomState(5).standard_normal((16, 16))
    np.testing.assert_allclose(run(g, x), run(m, x), atol=1e-5)


# ------------------------------------------------------------------------------ PanGu query layer
@pytest.mark.parametrize("max_positions", [None, 12])
def test_query_layer_matches_numpy(max_positions):
    cfg = cfg_of(position="learned", query_layer=True, activation="fast_gelu", max_positions=max_positions)
    rng = np.random.RandomState(0)
    first = DecoderLayer(cfg, 0, rng)
    last = DecoderLayer(cfg, cfg.num_layers - 1, rng)
    assert not first.is_query_layer and last.is_query_layer
    assert not [p for p in first.get_parameters() if "query_embedding" in p.name]
    p = ref.randomize(last, np.random.RandomState(11), 0.3)
    assert p["attention.query_embedding"].shape == (cfg.positions, cfg.hidden_size)
    x = np.random.RandomState(12).standard_normal((2 * cfg.seq_length, cfg.hidden_size)).astype(np.float32)
    got = last(Tensor(x)).asnumpy()
    want = ref.decoder_layer(x.astype(np.float64), {f"L.{k}": v for k, v in p.items()}, "L", cfg,
                             is_query_layer=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # and it is not an ordinary layer: queries from the hidden state give something else
    plain = ref.decoder_layer(x.astype(np.float64), {f"L.{k}": v for k, v in p.items()}, "L", cfg)
    assert np.abs(got - plain).max() > 1e-2


def test_query_layer_queries_come_from_position_embedding():
    # the attention cell alone: queries are query_embedding[pos] @ Wq^T + bq (not x @ Wq^T + bq)
    cfg = cfg_of(position="learned", query_layer=True)
    cell = Attention(cfg, np.random.RandomState(0), query_layer=True)
    p = ref.randomize(cell, np.random.RandomState(1), 0.3)
    s, h = cfg.seq_length, cfg.hidden_size
    x = np.random.RandomState(2).standard_normal((s, h))
    got = run(cell, x)
    q = p["query_embedding"][:s] @ p["q_weight"].T + p["q_bias"]
    q_from_x = x @ p["q_weight"].T + p["q_bias"]
    want = ref.attention(x, {f"a.{k}": v for k, v in p.items()}, "a", cfg, q_src=p["query_embedding"][:s])
    wrong = ref.attention(x, {f"a.{k}": v for k, v in p.items()}, "a", cfg)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.abs(q - q_from_x).max() > 0.1 and np.abs(got - wrong).max() > 1e-3


# ------------------------------------------------------------------------------ float16 compute
@pytest.mark.parametrize("softmax_fp32", [True, False])
@pytest.mark.parametrize("position", ["rope", "alibi"])
def test_float16_attention_close_to_numpy(softmax_fp32, position):
    cfg = cfg_of(compute_dtype="float16", softmax_fp32=softmax_fp32, position=position)
    cell, p = build(cfg, scale=0.3)
    x = np.random.RandomState(8).standard_normal((16, 16)).astype(np.float32)
    got = run(cell, x)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    want = ref.attention(x.astype(np.float64), {f"a.{k}": v for k, v in p.items()}, "a", cfg)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_cpu_softmax_backward_equals_mindspores_own():
    """On the CPU backend attention's softmax has a hand-written backward (row sums as a MatMul);
    MindSpore's derived backward of the same Softmax primitive is the reference."""
    from mindspore import nn, ops
    from naohai.model.layers import RowSumSoftmax
    rng = np.random.RandomState(0)
    x = Tensor((rng.standard_normal((2, 3, 5, 7)) * 3).astype(np.float32))
    w = Tensor(rng.standard_normal((2, 3, 5, 7)).astype(np.float32))
    prim = ops.Softmax(axis=-1)
    ours = RowSumSoftmax(prim)

    class Plain(nn.Cell):
        def construct(self, x):
            return prim(x)

    np.testing.assert_allclose(ours(x).asnumpy(), prim(x).asnumpy(), rtol=1e-6)
    got = ops.grad(lambda x: (ours(x) * w).sum())(x).asnumpy()
    want = ops.grad(lambda x: (Plain()(x) * w).sum())(x).asnumpy()
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
