"""The Houlsby bottleneck adapter (method ``adapter``) against a float64 numpy forward written from the
definition (Houlsby et al. 2019): after the attention block's output projection and after the MLP, before
each residual add, ``y + up(swish(down(y)))``; the adapters start as the identity."""
import numpy as np
import pytest
from mindspore import Tensor

import model_reference as ref
from naohai.config import FinetuneConfig, MODEL_PRESETS, ModelConfig
from naohai.model.finetune import apply_finetune, method_params
from naohai.model.transformer import NaohaiLM

SMALL = dict(vocab_size=60, vocab_pad_multiple=8, hidden_size=16, num_layers=2, num_heads=4,
             ffn_hidden_size=24, seq_length=8)
VARIANTS = {"pengcheng": dict(MODEL_PRESETS["pengcheng-mind-7b"], **SMALL, compute_dtype="float32"),
            "learned-gelu": dict(SMALL, position="learned", activation="gelu", norm="layernorm")}


def bottleneck(y, p, name):
    z = y @ p[f"{name}.down_weight"].T + p[f"{name}.down_bias"]
    z = z / (1.0 + np.exp(-z))                                    # swish
    return y + z @ p[f"{name}.up_weight"].T + p[f"{name}.up_bias"]


def reference_logits(p, cfg, ids):
    b, s = ids.shape
    x = p["embedding.word_embedding"][ids]
    if cfg.position == "learned":
        x = x + p["embedding.position_embedding"][np.arange(s)[None]]
    x = x.reshape(b * s, -1)
    for i in range(cfg.num_layers):
        pre = f"layers.{i}"
        h = ref.norm(cfg.norm, x, p, f"{pre}.input_norm", cfg.norm_eps)
        x = x + bottleneck(ref.attention(h, p, f"{pre}.attention", cfg), p, f"{pre}.attention.adapter")
        h = ref.norm(cfg.norm, x, p, f"{pre}.post_attention_norm", cfg.norm_eps)
        x = x + bottleneck(ref.mlp(h, p, f"{pre}.mlp", cfg), p, f"{pre}.mlp.adapter")
    x = ref.norm(cfg.norm, x, p, "head.final_norm", cfg.norm_eps)
    w = p["embedding.word_embedding"] if cfg.tie_embeddings else p["head.weight"]
    return (x @ w.T).reshape(b, s, -1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_houlsby_adapter_matches_numpy(name):
    cfg = ModelConfig(**VARIANTS[name])
    cfg.validate()
    model = NaohaiLM(cfg, seed=0)
    ids = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, cfg.seq_length)).astype(np.int32)
    plain = model.logits(Tensor(ids)).asnumpy()
    apply_finetune(model, FinetuneConfig(method="adapter", bottleneck=3), seed=0)
    np.testing.assert_array_equal(model.logits(Tensor(ids)).asnumpy(), plain)      # up = 0: the identity
    p = ref.randomize(model, np.random.RandomState(2), scale=0.3)    # the adapters' tensors random too
    assert len(method_params(model)) == 2 * 2 * 4
    ours = model.logits(Tensor(ids)).asnumpy()
    theirs = reference_logits(p, cfg, ids)
    without = dict(p)
    for q in method_params(model):
        if q.name.endswith("up_weight"):
            without[q.name] = 0 * p[q.name]
    assert np.abs(theirs - reference_logits(without, cfg, ids)).max() > 1e-2     # the adapters matter
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
