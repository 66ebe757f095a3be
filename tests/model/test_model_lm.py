"""The full tiny NaohaiLM against a float64 numpy forward; parameter and op inventories."""
import dataclasses

import numpy as np
import pytest
from mindspore import Tensor, ops

import model_reference as ref
from naohai.config import MODEL_PRESETS, ModelConfig
from naohai.model.catalog import op_catalog
from naohai.model.params import count_params, param_shapes
from naohai.model.transformer import NaohaiLM

SMALL = dict(vocab_size=60, vocab_pad_multiple=8, hidden_size=16, num_layers=2, num_heads=4,
             ffn_hidden_size=24, seq_length=8)

VARIANTS = {
    # PanGu-alpha: learned positions, FastGeLU, top query layer (max_positions > seq), tied head
    "pangu": dict(SMALL, family="pangu", position="learned", max_positions=10, activation="fast_gelu",
                  norm="layernorm", query_layer=True),
    # the tiny-pangu preset's choices (exact GeLU) at a tiny size
    "tiny-pangu": dict(MODEL_PRESETS["tiny-pangu"], **SMALL),
    # PengCheng-Mind: RoPE, SwiGLU, LayerNorm with biases
    "pengcheng": dict(MODEL_PRESETS["pengcheng-mind-7b"], **SMALL, compute_dtype="float32"),
    # ALiBi + RMSNorm + GQA, no biases, 3 layers
    "alibi-gqa": dict(SMALL, num_layers=3, position="alibi", norm="rmsnorm", num_kv_heads=2, bias=False,
                      activation="swiglu"),
    # BLOOM-style embedding LayerNorm, untied head, position "none"
    "bloom-untied": dict(SMALL, position="none", embedding_norm=True, tie_embeddings=False,
                         activation="fast_gelu", vocab_pad_multiple=1),
    # non-parametric LayerNorm (OLMo), RoPE, GQA with one kv head
    "olmo": dict(SMALL, position="rope", norm="nonparam_layernorm", num_kv_heads=1, embedding_norm=True),
}


def make(name, seed=0):
    cfg = ModelConfig(**VARIANTS[name])
    cfg.validate()
    model = NaohaiLM(cfg, seed=seed)
    p = ref.randomize(model, np.random.RandomState(seed + 1), scale=0.3)
    return cfg, model, p


def batch(cfg, seed=0, b=2):
    rng = np.random.RandomState(seed)
    ids = rng.randint(0, cfg.vocab_size, (b, cfg.seq_length)).astype(np.int32)
    labels = rng.randint(0, cfg.vocab_size, (b, cfg.seq_length)).astype(np.int32)
    return ids, labels


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_and_logits_match_numpy_forward(name):
    cfg, model, p = make(name)
    ids, labels = batch(cfg)
    loss = float(model(Tensor(ids), Tensor(labels)).asnumpy())
    want = ref.lm_loss(p, cfg, ids, labels)
    assert abs(loss - want) <= 1e-5 * max(1.0, abs(want)), (loss, want)
    logits = model.logits(Tensor(ids)).asnumpy()
    assert logits.shape == (2, cfg.seq_length, cfg.padded_vocab_size)
    np.testing.assert_allclose(logits.reshape(-1, cfg.padded_vocab_size), ref.lm_logits(p, cfg, ids),
                               rtol=1e-4, atol=1e-4)
    # the loss is sensitive to the labels (not a constant)
    other = float(model(Tensor(ids), Tensor((labels + 1) % cfg.vocab_size)).asnumpy())
    assert abs(other - loss) > 1e-3


def test_loss_uses_the_padded_vocabulary():
    cfg, model, p = make("pangu")
    assert cfg.padded_vocab_size == 64 and p["embedding.word_embedding"].shape == (64, 16)
    ids, labels = batch(cfg)
    # a reference that dropped the 4 padding rows from the softmax gives a different loss
    logits = ref.lm_logits(p, cfg, ids)[:, :60]
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    truncated = float(np.mean(lse - logits[np.arange(16), labels.reshape(-1)]))
    loss = float(model(Tensor(ids), Tensor(labels)).asnumpy())
    assert abs(loss - truncated) > 1e-4 and abs(loss - ref.lm_loss(p, cfg, ids, labels)) < 1e-5


def test_initial_loss_is_near_log_vocab():
    # untouched init (std 0.02): near-uniform predictions
    cfg = ModelConfig(**VARIANTS["pengcheng"])
    model = NaohaiLM(cfg, seed=3)
    ids, labels = batch(cfg)
    loss = float(model(Tensor(ids), Tensor(labels)).asnumpy())
    assert abs(loss - np.log(cfg.padded_vocab_size)) < 0.05
    np.testing.assert_allclose(loss, ref.lm_loss(ref.params_of(model), cfg, ids, labels), rtol=1e-5)


def test_same_seed_same_weights_and_tied_head_shares_embedding():
    cfg = ModelConfig(**VARIANTS["pangu"])
    a, b, c = NaohaiLM(cfg, seed=5), NaohaiLM(cfg, seed=5), NaohaiLM(cfg, seed=6)
    pa, pb, pc = ref.params_of(a), ref.params_of(b), ref.params_of(c)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert not np.array_equal(pa["embedding.word_embedding"], pc["embedding.word_embedding"])
    assert not [k for k in pa if k.startswith("head.") and "weight" in k]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_parameter_names_and_shapes_match_param_shapes(name):
    cfg = ModelConfig(**VARIANTS[name])
    model = NaohaiLM(cfg)
    real = {p.name: tuple(p.shape) for p in model.get_parameters()}
    listed = {s.name: tuple(s.shape) for s in param_shapes(cfg)}
    assert len(listed) == len(param_shapes(cfg))          # no duplicate names
    assert real == listed
    assert count_params(cfg) == sum(int(np.prod(s)) for s in real.values())


KIND_TYPES = {
    "MatMul": ops.MatMul, "BatchMatMul": ops.BatchMatMul, "Gather": ops.Gather, "Add": ops.Add,
    "Mul": ops.Mul, "Softmax": ops.Softmax, "LayerNorm": ops.LayerNorm,
    "LogSoftmax": ops.LogSoftmax, "GatherD": ops.GatherD, "Dropout": ops.Dropout,
    "Activation": (ops.Sigmoid, ops.Erf, ops.FastGeLU),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_shardable_ops_match_the_catalog(name):
    cfg = ModelConfig(**VARIANTS[name])
    model = NaohaiLM(cfg)
    real = model.shardable_ops()
    catalog = op_catalog(cfg)
    assert set(real) == set(catalog)
    for op_name, spec in catalog.items():
        assert isinstance(real[op_name], KIND_TYPES[spec.kind]), (op_name, spec.kind, real[op_name])
    # every primitive object is distinct (a strategy shards each one separately)
    assert len({id(p) for p in real.values()}) == len(real)
