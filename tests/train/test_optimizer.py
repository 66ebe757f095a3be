"""Weight decay groups as in the references' ``set_weight_decay``.

Both PanGu-alpha (``official/nlp/Pangu_alpha/train.py`` set_weight_decay) and
PengCheng-Mind (``train_mPCmind7B.py`` set_weight_decay) decay every parameter whose
*reference* name contains neither ``layernorm`` nor ``bias`` -- the embedding tables
(word, position, top-query) included.  The test maps each naohai parameter to its
reference checkpoint name, applies that rule, and checks what MindSpore's AdamWeightDecay
actually does in one update with zero gradients: a decayed parameter becomes
``p * (1 - lr * weight_decay)``, the others stay as they are.
"""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.config import MODEL_PRESETS, ModelConfig, Recipe, TrainConfig
from naohai.convert.names import links
from naohai.model.transformer import NaohaiLM
from naohai.train.builder import make_optimizer

SMALL = dict(hidden_size=16, num_heads=4, seq_length=8, compute_dtype="float32", vocab_pad_multiple=64)

@pytest.fixture(autouse=True)
def _pynative_cpu():
    """Eager CPU, with the device named before any kernel runs (later tests set it again)."""
    ms.set_device("CPU")
    ms.set_context(mode=ms.PYNATIVE_MODE)



def reference_decays(ref_name: str) -> bool:
    return "layernorm" not in ref_name.lower() and "bias" not in ref_name.lower()


@pytest.mark.parametrize("preset,extra", [
    ("pangu-alpha-2.6b", dict(vocab_size=40, num_layers=3, ffn_hidden_size=64)),
    ("pengcheng-mind-7b", dict(vocab_size=64, num_layers=2, ffn_hidden_size=24)),
])
def test_decay_groups_follow_the_reference_rule(preset, extra):
    cfg = ModelConfig(**dict(MODEL_PRESETS[preset], **SMALL, **extra, dropout=0.0))
    lr, wd = 0.25, 0.5
    recipe = Recipe(model=cfg, train=TrainConfig.from_keys(steps=2, lr=lr, min_lr=lr, warmup_steps=0, decay="constant",
                                                 weight_decay=wd))
    recipe.validate()
    model = NaohaiLM(cfg)
    opt = make_optimizer(model, recipe)
    ref_of = {ours: link.ref for link in links(cfg) for ours in link.ours}
    params = list(opt.parameters)          # the order the optimizer takes gradients in
    assert set(ref_of) == {p.name for p in params}
    before = {p.name: p.asnumpy().copy() for p in params}
    opt(tuple(Tensor(np.zeros(p.shape, np.float32)) for p in params))
    decayed = []
    for p in params:
        if reference_decays(ref_of[p.name]):
            np.testing.assert_allclose(p.asnumpy(), before[p.name] * (1 - lr * wd), rtol=1e-6, err_msg=p.name)
            decayed.append(p.name)
        else:
            np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)
    assert "embedding.word_embedding" in decayed
    if cfg.query_layer:
        assert f"layers.{cfg.num_layers - 1}.attention.query_embedding" in decayed


# Published values, read from the reference code (file:line in each recipe's comments):
# PanGu-alpha train.py:131, :221, src/utils.py:343-348, :386-391;
# PengCheng-Mind train_mPCmind7B.py:401, :424-425, src/utils.py:612-617.
PANGU = dict(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, weight_decay=0.1, grad_clip=1.0, warmup_steps=2000,
             decay_steps=200000, lr=5e-5, min_lr=1e-6, ls=(2.0 ** 32, 1000, 2.0))
PCM = dict(adam_beta1=0.9, adam_beta2=0.98, adam_eps=1e-8, weight_decay=0.1, grad_clip=1.0, warmup_steps=1000,
           decay_steps=150000, min_lr=1e-6, ls=(2.0 ** 21, 200, 2.0))


@pytest.mark.parametrize("name,want", [("pangu-alpha-2.6b", PANGU), ("pangu-alpha-13b", PANGU),
                                       ("pangu-alpha-200b", PANGU), ("pengcheng-mind-7b", PCM),
                                       ("pengcheng-mind-200b", PCM)])
def test_recipes_carry_the_reference_optimizer(name, want):
    from naohai.config import load_recipe
    t = load_recipe(name).train
    ls = t.guard.loss_scale
    assert t.lr_schedule.schedule == "pangu" and t.lr_schedule.decay == "cosine" and ls.dynamic
    assert (ls.init, ls.window, ls.factor) == want["ls"]
    for key, value in want.items():
        if key != "ls":
            assert t.flat()[key] == value, key
