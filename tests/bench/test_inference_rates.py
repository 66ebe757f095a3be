"""The inference rows: naohai's `data score` and KV-cache generation against transformers on one model."""
import pytest

from naohai.bench.inference_rates import GEN_BATCH, NEW_TOKENS, measure
from naohai.bench.report import render_markdown

from tests.bench.test_report import _results


@pytest.mark.slow
def test_both_rows_measure_the_same_model(tmp_path):
    """Both workers read one model (a random tiny-llama and the naohai folder imported from it): the
    perplexities naohai's scoring gives equal transformers' (an independent implementation), and greedy
    generation with naohai's KV cache picks the tokens transformers' generate picks."""
    res = measure(str(tmp_path), rounds=1, log=lambda line: None)
    assert "note" not in res, res
    sc, gen = res["score"], res["generate"]
    assert sc["documents"] == 79 and sc["tokens"] > 10_000
    assert sc["perplexity_max_rel_diff"] < 1e-4
    assert gen["same_tokens"] >= 0.95
    for row in (sc, gen):
        assert row["naohai"] > 0 and row["hf"] > 0
        assert row["ratio"] == pytest.approx(row["naohai"] / row["hf"])
    text = render_markdown({**_results(), "inference": res})
    assert "## Inference: data score and generation" in text
    assert f"{GEN_BATCH} prompts of 16 tokens, {NEW_TOKENS} new tokens each" in text


def test_a_missing_peer_is_a_note_not_a_crash(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError("no transformers", name="transformers")
        return real(name, *args, **kwargs)
    monkeypatch.setattr(builtins, "__import__", no_transformers)
    res = measure("/nonexistent", rounds=1)
    assert res == {"note": 'not measured: transformers is not installed (pip install -e ".[test]")'}
    assert res["note"] in render_markdown({**_results(), "inference": res})
