"""The scoring engine against references computed another way: each request alone in one row through the
model's own forward (``NaohaiLM.logits``: its causal mask, position ids and EOD resets, PyNative), the
log-softmax and greedy choice in float64 numpy -- while the engine packs several requests per row through
the explicit-bias step path; generation against re-running the whole window for every token (no cache)."""
from __future__ import annotations

import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor

from naohai.config import recipe_from_dict
from naohai.downstream.engine import Scorer
from naohai.model.transformer import NaohaiLM
from tests.conftest import MICRO_MODEL


VARIANTS = {
    "rope": {},
    # PanGu-alpha's choices: learned positions, top query layer, final norm before it, EOD resets of
    # attention and positions (an EOD inside a request splits it as in a packed training window)
    "pangu": dict(position="learned", query_layer=True, final_norm="before_query_layer", eod_reset=True,
                  eod_reset_positions=True, eod_id=2, activation="fast_gelu", num_layers=3),
    "alibi": dict(position="alibi", norm="rmsnorm", bias=False),
    # prefix / prompt tuning (random trained tensors): the scoring step puts the virtual positions first
    "prefix": dict(max_positions=MICRO_MODEL["seq_length"] + 4),
    "prompt": dict(max_positions=MICRO_MODEL["seq_length"] + 4),
}


def _model(variant):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = recipe_from_dict({"name": "m", "model": dict(MICRO_MODEL, **VARIANTS[variant])}, where="test").model
    model = NaohaiLM(cfg, seed=3)
    if variant in ("prefix", "prompt"):
        from naohai.config import FinetuneConfig
        from naohai.model.finetune import apply_finetune, method_params
        apply_finetune(model, FinetuneConfig(method=variant, num_virtual_tokens=3), seed=0)
        for p in method_params(model):
            p.set_data(Tensor(np.random.default_rng(1).normal(0, 0.5, p.shape).astype(np.float32)))
    model.set_train(False)
    return cfg, model


@pytest.fixture(scope="module")
def micro():
    return _model("rope")


def _logits(model, cfg, ids):
    """[len(ids), padded vocab] float64 logits of one sequence: one row of seq_length, right-padded."""
    row = np.zeros((1, cfg.seq_length), np.int32)
    row[0, :len(ids)] = ids
    return model.logits(Tensor(row)).asnumpy()[0, :len(ids)].astype(np.float64)


def _reference(model, cfg, ctx, cont):
    """log p(cont | ctx) and greedy flag, the last seq_length + 1 ids, one unpadded sequence."""
    ids = (list(ctx) + list(cont))[-(cfg.seq_length + 1):]
    logits = _logits(model, cfg, ids[:-1])
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    n = min(len(cont), len(ids) - 1)
    targets = np.asarray(ids[1:])[-n:]
    rows = logp[-n:]
    return float(rows[np.arange(n), targets].sum()), bool((rows.argmax(-1) == targets).all())


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_packed_loglikelihood_equals_one_request_per_row(variant):
    cfg, model = _model(variant)
    rng = np.random.default_rng(0)
    pairs = [(list(rng.integers(3, cfg.vocab_size, size=int(rng.integers(1, 20)))),
              list(rng.integers(3, cfg.vocab_size, size=int(rng.integers(1, 6))))) for _ in range(11)]
    pairs += [([2, 7, 9, 2, 11, 5], [13, 2, 8])]                   # EODs inside a request
    # multiple-choice shape: one context, several continuations (branches sharing it), EODs included
    for ctx in ([int(x) for x in rng.integers(3, cfg.vocab_size, size=9)], [4, 2, 9, 6], [5]):
        pairs += [(ctx, [int(x) for x in rng.integers(3, cfg.vocab_size, size=k)]) for k in (1, 3, 2, 4)]
    pairs += [([4, 2, 9, 6], [2, 7]), ([4, 2, 9, 6], [8, 2, 3])]
    scorer = Scorer(model, cfg, pad_id=0, eod_id=2, batch=4)
    got = scorer.loglikelihood(pairs)
    for (ctx, cont), (logp, greedy) in zip(pairs, got):
        ref_logp, ref_greedy = _reference(model, cfg, ctx, cont)
        assert abs(logp - ref_logp) < 1e-4, (logp, ref_logp)
        assert greedy == ref_greedy
    # one fixed shape for the whole call: the requests packed into fewer rows of seq_length, each
    # context placed once however many continuations it has
    assert scorer.shapes == {(4, cfg.seq_length)}
    seqs = [(list(c) + list(x), len(x)) for c, x in pairs]
    assert len(scorer._units(seqs, share=True)) == len({tuple(c) for c, _ in pairs})
    assert len(Scorer._pack([len(c) + len(x) - 1 for c, x in pairs], cfg.seq_length)) < len(pairs)
    assert scorer.truncated.total() == 0


def test_greedy_flag_is_true_for_the_models_own_argmax(micro):
    cfg, model = micro
    ctx = [5, 9, 14, 7]
    ids = list(ctx)
    for _ in range(3):
        logits = _logits(model, cfg, ids)[-1]
        ids.append(int(np.argmax(logits)))
    (logp, greedy), = Scorer(model, cfg, pad_id=0, eod_id=2, batch=2).loglikelihood([(ctx, ids[4:])])
    assert greedy and logp < 0


def test_long_requests_are_cut_from_the_left_and_counted(micro):
    cfg, model = micro
    rng = np.random.default_rng(1)
    ctx = list(rng.integers(3, cfg.vocab_size, size=cfg.seq_length + 9))
    cont = [11, 12, 13]
    scorer = Scorer(model, cfg, pad_id=0, eod_id=2, batch=2)
    (logp, greedy), = scorer.loglikelihood([(ctx, cont)])
    ref_logp, ref_greedy = _reference(model, cfg, ctx, cont)
    assert abs(logp - ref_logp) < 1e-4 and greedy == ref_greedy
    assert scorer.truncated.loglikelihood == 1
    assert scorer.shapes == {(2, cfg.seq_length)}


def test_generation_equals_recomputing_the_window(micro):
    cfg, model = micro
    prompts = [[5, 9, 14], [7, 8, 21, 30, 4, 6], [12]]
    scorer = Scorer(model, cfg, pad_id=0, eod_id=2, batch=2)
    got = scorer.generate(prompts, max_new_tokens=5)
    for prompt, new in zip(prompts, got):
        ids, ref = list(prompt), []
        for _ in range(5):
            logits = _logits(model, cfg, ids)[-1, :cfg.vocab_size]
            tok = int(np.argmax(logits))
            if tok == 2:
                break
            ref.append(tok)
            ids.append(tok)
        assert new == ref


def test_generation_stops_when_told(micro):
    cfg, model = micro
    scorer = Scorer(model, cfg, pad_id=0, eod_id=2, batch=2)
    full = scorer.generate([[5, 9, 14]], max_new_tokens=6)[0]
    cut = scorer.generate([[5, 9, 14]], max_new_tokens=6, stop=lambda ids: len(ids) >= 2)[0]
    assert cut == full[:2]
