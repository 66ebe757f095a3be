"""`naohai data score`: perplexity filtering with a trained micro model.

The model is the micro recipe trained for 300 steps on the pydoc topics (a few seconds on
CPU) with PanGu's conventions (EOD blocks attention, predictions made from EOD leave the
loss).  Garbage planted among its training text -- random characters drawn from the text's
own alphabet, and documents whose token ids were shuffled -- must score higher perplexity
and be what the filter drops; one document's perplexity must equal exp(mean NLL) computed
with numpy from the model's logits (MindSpore's forward output).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import random

import numpy as np
import pytest

from naohai.cli import main
from naohai.commands.data import load_scorer
from naohai.data.corpus import pydoc_documents
from naohai.data.score import LM, ScoreSettings, score
from naohai.data.tokenizer import Tokenizer
from naohai.errors import UserError
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe

N_TEXT, N_RANDOM, N_SHUFFLED = 40, 10, 10


@pytest.fixture(scope="module")
def trained(tmp_path_factory, micro_data):
    prepared, tok = micro_data
    run = tmp_path_factory.mktemp("score_run") / "run"
    recipe = micro_recipe(run, prepared, tok, steps=300, save_every=300, eval_every=300, log_every=300)
    recipe = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, eod_reset=True, eod_id=6,
                                                                   loss_pad_id=6))
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    return str(run), tok


@pytest.fixture(scope="module")
def corpus(trained, tmp_path_factory):
    """(path of a .jsonl corpus, {where-line: 'text' | 'random' | 'shuffled'})."""
    _, tok_path = trained
    tok = Tokenizer.load(tok_path)
    rng = random.Random(0)
    docs = list(itertools.islice(pydoc_documents(), N_TEXT + N_SHUFFLED))
    text = [d[:600] for d in docs[:N_TEXT]]
    alphabet = sorted(set("".join(text)) - set(" \n"))
    randoms = ["".join(rng.choice(alphabet) if rng.random() > 0.15 else " " for _ in range(400))
               for _ in range(N_RANDOM)]
    shuffled = []
    for d in docs[N_TEXT:]:
        ids = tok.encode(d[:600])
        rng.shuffle(ids)
        shuffled.append(tok.decode(ids))
    items = [(t, "text") for t in text] + [(t, "random") for t in randoms] + [(t, "shuffled") for t in shuffled]
    rng.shuffle(items)
    path = tmp_path_factory.mktemp("score_corpus") / "in.jsonl"
    kinds = {}
    with open(path, "w", encoding="utf-8") as fh:
        for i, (t, kind) in enumerate(items):
            fh.write(json.dumps({"text": t, "id": i, "naohai": {"source": f"x:{i}"}}) + "\n")
            kinds[i] = kind
    return str(path), kinds


def _read_out(out_dir):
    recs = []
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("part-"):
            with open(os.path.join(out_dir, name), encoding="utf-8") as fh:
                recs.extend(json.loads(line) for line in fh)
    return recs


def test_garbage_scores_higher_and_is_what_the_filter_drops(trained, corpus, tmp_path, capsys):
    run, _ = trained
    path, kinds = corpus
    garbage = {i for i, k in kinds.items() if k != "text"}
    # keep the share of real text: the filter then has to rank every garbage document below every kept one
    keep = N_TEXT / len(kinds)
    out = tmp_path / "out"
    assert main(["data", "score", path, "--model", run, "--out", str(out), "--keep-fraction", str(keep),
                 "--device", "CPU", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "threshold: perplexity <=" in printed and "p50" in printed
    report = json.loads((out / "report.json").read_text())
    kept = _read_out(out)
    kept_ids = {r["id"] for r in kept}
    dropped = set(kinds) - kept_ids
    precision = len(dropped & garbage) / max(len(dropped), 1)
    recall = len(dropped & garbage) / len(garbage)
    print(f"perplexity filter: precision {precision:.3f} recall {recall:.3f} "
          f"(dropped {len(dropped)}, garbage {len(garbage)})")
    # the model was trained on exactly this text for 300 steps; garbage is from no distribution it saw.
    # 0.9 allows two of the twenty garbage documents on the wrong side of the cut
    assert precision >= 0.9 and recall >= 0.9
    s = report["score"]
    assert s["docs_in"] == len(kinds) and s["kept"] + s["dropped"] == len(kinds) and s["kept"] == len(kept)
    assert report["threshold"] is not None and all(r["naohai"]["perplexity"] <= report["threshold"] for r in kept)
    # metadata of the input (as `data clean` writes it) is kept, the perplexity added
    assert all(r["naohai"]["source"] == f"x:{r['id']}" for r in kept)
    # both kinds of garbage score above the model's training text on the median
    ppl = {r["id"]: r["naohai"]["perplexity"] for r in kept}
    everything = _score_all(run, path, tmp_path / "all")
    assert len(everything) == len(kinds)
    med = {k: np.median([everything[i] for i, kk in kinds.items() if kk == k]) for k in ("text", "random",
                                                                                        "shuffled")}
    print("median perplexity:", {k: round(float(v), 2) for k, v in med.items()})
    assert med["random"] > 2 * med["text"] and med["shuffled"] > 1.5 * med["text"]
    assert all(abs(everything[i] - p) <= 1e-9 for i, p in ppl.items())
    assert report["score"]["samples"] and all(smp["perplexity"] > report["threshold"]
                                              for smp in report["score"]["samples"])


def _score_all(run, path, out):
    """Every document's perplexity, no filter (the command annotates and keeps all)."""
    assert main(["data", "score", path, "--model", run, "--out", str(out), "--device", "CPU",
                 "--no-progress"]) == 0
    recs = _read_out(out)
    return {r["id"]: r["naohai"]["perplexity"] for r in recs}


def test_perplexity_is_exp_mean_nll_from_the_model_logits(trained, tmp_path):
    """One document spanning three windows: numpy log-softmax of the MindSpore logits, the EOD mask."""
    import mindspore as ms
    from mindspore import Tensor

    from naohai.checkpoint.weights import load_model

    run, tok_path = trained
    tok = Tokenizer.load(tok_path)
    text = next(d for d in pydoc_documents() if len(tok.encode(d)) > 70)[:1500]
    ids = tok.encode(text)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    lm = load_scorer(run, device="CPU")
    report = score([str(path)], str(tmp_path / "out"), lm, ScoreSettings(batch=2), progress=False)
    got = _read_out(tmp_path / "out")[0]["naohai"]["perplexity"]

    ms.set_context(mode=ms.PYNATIVE_MODE)
    found, model = load_model(run)
    recipe = found.recipe
    cfg = recipe.model
    assert cfg.loss_pad_id == tok.eod_id
    seq = np.array([tok.eod_id] + ids + [tok.eod_id])
    s = cfg.seq_length
    assert len(seq) - 1 > 2 * s                      # the document is split into at least three windows
    nll = []
    for start_ in range(0, len(seq) - 1, s):
        inputs, labels = seq[start_:start_ + s], seq[start_ + 1:start_ + s + 1]
        full = np.zeros(s, np.int32)                 # the model takes whole windows; causal, so right
        full[:len(inputs)] = inputs                  # padding changes nothing before it
        logits = model.logits(Tensor(full[None])).asnumpy()[0].astype(np.float64)
        m = logits.max(-1, keepdims=True)
        logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
        for t in range(len(labels)):
            if inputs[t] != cfg.loss_pad_id:
                nll.append(-logp[t, labels[t]])
    want = math.exp(np.mean(nll))
    print(f"one document: {len(ids)} tokens, {len(nll)} counted, perplexity {got} vs numpy {want:.6f}")
    assert abs(got - want) <= 1e-4 * want
    assert report["score"]["tokens"] == len(nll) == len(ids)   # the first prediction (from EOD) is masked


def test_malformed_lines_are_counted_and_resume_keeps_the_output(trained, tmp_path):
    run, _ = trained
    docs = list(itertools.islice(pydoc_documents(), 7))
    path = tmp_path / "in.jsonl"
    with open(path, "wb") as fh:
        for i, d in enumerate(docs):
            fh.write((json.dumps({"text": d[:300], "n": i}) + "\n").encode())
            if i == 2:
                fh.write(b"{not json\n")
                fh.write(b'{"body": "no text key"}\n')
                fh.write(b'{"text": "bad utf8 \xff"}\n')
    lm = load_scorer(run, device="CPU")
    settings = ScoreSettings(unit_docs=3, shard_docs=3, keep_fraction=0.5)
    out = tmp_path / "out"
    first = score([str(path)], str(out), lm, settings, progress=False)
    problems = first["read"]["problems"]
    assert problems["total"] == 3 and [p["where"].rsplit(":", 1)[1] for p in problems["listed"]] == ["4", "5", "6"]
    assert first["score"]["docs_in"] == 7 and first["score"]["kept"] == 4      # ceil(0.5 * 7)
    reference = _read_out(out)
    assert [r["n"] for r in reference] == sorted(r["n"] for r in reference) and first["output"]["shards"] == 2
    # an interrupted run: the report, the shards and the last unit are gone; a rerun restores the same output
    os.remove(out / "report.json")
    os.remove(out / "part-00001.jsonl")
    os.remove(out / ".work" / "unit-000002.npy")
    again = score([str(path)], str(out), lm, settings, progress=False)
    assert _read_out(out) == reference and again["score"] == first["score"]
    # other settings in the same directory: refused without restart, redone with it
    with pytest.raises(UserError, match="--restart"):
        score([str(path)], str(out), lm, ScoreSettings(unit_docs=3, keep_fraction=0.9), progress=False)
    redone = score([str(path)], str(out), lm, ScoreSettings(unit_docs=3, keep_fraction=1.0), progress=False,
                   restart=True)
    assert redone["score"]["kept"] == 7
    # a directory that holds something else is never written into
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="holds no `naohai data score` run"):
        score([str(path)], str(other), lm, settings, progress=False)


def test_perplexity_step_of_data_clean(trained, corpus, tmp_path, capsys):
    """`perplexity: {enabled, model, max}` in the clean config keeps what `data score --max-perplexity` keeps."""
    run, _ = trained
    path, kinds = corpus
    ppl = _score_all(run, path, tmp_path / "all")
    ranked = sorted(ppl.values())
    cut = math.sqrt(ranked[N_TEXT - 1] * ranked[N_TEXT])        # between the 40th and 41st lowest
    cfg = tmp_path / "clean.yaml"
    cfg.write_text(f"batch_docs: 16\nnormalize: {{enabled: false}}\nlanguage: {{enabled: false}}\n"
                   f"quality: {{enabled: false}}\npii: {{enabled: false}}\n"
                   f"perplexity: {{enabled: true, model: {run}, max: {cut}, device: CPU}}\n", encoding="utf-8")
    out = tmp_path / "clean"
    argv = ["data", "clean", path, "--out", str(out), "--config", str(cfg), "--workers", "2", "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table
    recs = _read_out(out)
    assert {r["id"] for r in recs} == {i for i, p in ppl.items() if p <= cut}
    for r in recs:
        assert abs(r["naohai"]["perplexity"] - ppl[r["id"]]) <= 1e-4 * ppl[r["id"]]
        assert r["naohai"]["source"].endswith(f":{r['id'] + 1}")         # clean's own metadata, line numbers
    report = json.loads((out / "report.json").read_text())
    step = report["steps"]["perplexity"]
    assert step["enabled"] and step["docs_in"] == len(kinds) and step["kept"] == len(recs) == N_TEXT
    assert step["dropped"] == len(kinds) - N_TEXT and report["perplexity"]["quantiles"]["p100"] == \
        pytest.approx(max(ppl.values()), rel=1e-4)
    # a rerun after the report is lost takes the cached scores and writes the same output
    cached = sorted(p for p in os.listdir(out / ".work") if ".ppl-" in p)
    assert len(cached) == 4                                            # 60 documents in units of 16
    os.remove(out / "report.json")
    assert main(argv) == 0
    assert _read_out(out) == recs
    # mistakes in the section name their key
    for section, key in (("{enabled: true, max: 50}", "perplexity.model"),
                         (f"{{enabled: true, model: {tmp_path / 'nope'}, max: 50}}", "perplexity.model"),
                         (f"{{enabled: true, model: {run}}}", "perplexity.max"),
                         (f"{{enabled: true, model: {run}, max: .nan}}", "perplexity.max")):
        cfg.write_text(f"perplexity: {section}\n", encoding="utf-8")
        capsys.readouterr()
        assert main(["data", "clean", path, "--out", str(tmp_path / "x"), "--config", str(cfg)]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert key in err and "Traceback" not in err, err


@pytest.mark.slow
def test_perplexity_step_on_spark_writes_what_the_local_engine_writes(trained, corpus, tmp_path):
    """`data clean --engine spark` with the perplexity step: each Spark Python worker loads the model once and
    scores its partition; the shards (kept documents, their perplexities) and the report (counts, reasons,
    samples, quantiles, model) equal the local engine's."""
    run, _ = trained
    path, kinds = corpus
    ppl = _score_all(run, path, tmp_path / "all")
    ranked = sorted(ppl.values())
    cut = math.sqrt(ranked[N_TEXT + 4] * ranked[N_TEXT + 5])        # a few garbage documents are kept too
    cfg = tmp_path / "clean.yaml"
    cfg.write_text(f"batch_docs: 16\nshard_docs: 20\nnormalize: {{enabled: false}}\nlanguage: {{enabled: false}}\n"
                   f"quality: {{enabled: false}}\npii: {{enabled: false}}\n"
                   f"perplexity: {{enabled: true, model: {run}, max: {cut}, device: CPU, batch: 4}}\n",
                   encoding="utf-8")
    outs = {}
    for engine in ("local", "spark"):
        outs[engine] = tmp_path / engine
        argv = ["data", "clean", path, "--out", str(outs[engine]), "--config", str(cfg), "--no-progress",
                "--engine", engine] + (["--master", "local[2]", "--split-mb", "0.004"] if engine == "spark" else [])
        assert main(argv) == 0
    local, spark = (_read_out(outs[e]) for e in ("local", "spark"))
    assert spark == local and len(local) == N_TEXT + 5
    assert {r["id"] for r in local} == {i for i, p in ppl.items() if p <= cut}
    a, b = (json.loads((outs[e] / "report.json").read_text()) for e in ("local", "spark"))
    assert a["steps"]["perplexity"]["dropped"] == len(kinds) - N_TEXT - 5 and a["steps"]["perplexity"]["samples"]
    assert a == b


@pytest.mark.parametrize("argv, flag", [
    (["--keep-fraction", "0"], "--keep-fraction"),
    (["--keep-fraction", "nan"], "--keep-fraction"),
    (["--max-perplexity", "inf"], "--max-perplexity"),
    (["--max-perplexity", "0.5"], "--max-perplexity"),
    (["--batch", "0"], "--batch"),
    (["--model", "/nonexistent/run"], "--model"),
    (["--tokenizer", "/nonexistent/tok.model"], "--tokenizer"),
])
def test_bad_flags_are_user_errors(trained, corpus, tmp_path, capsys, argv, flag):
    run, _ = trained
    path, _ = corpus
    base = ["data", "score", path, "--model", run, "--out", str(tmp_path / "o"), "--device", "CPU"]
    assert main(base + argv) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert flag in err and "Traceback" not in err


def test_missing_inputs_and_out_are_user_errors(trained, tmp_path, capsys):
    run, _ = trained
    assert main(["data", "score", str(tmp_path / "missing.jsonl"), "--model", run, "--out",
                 str(tmp_path / "o")]) == 2
    assert "input not found" in " ".join(capsys.readouterr().err.split())
    assert main(["data", "score", str(tmp_path / "x.jsonl"), "--model", run]) == 2
    assert "--out" in " ".join(capsys.readouterr().err.split())


def _toy_lm():
    """An LM without a model: token ids are characters, a prediction's NLL its next id over 100."""
    return LM(nll=lambda w: w[:, 1:].astype(np.float64) / 100.0,
              encode_batch=lambda texts: [[3 + ord(c) % 90 for c in t[:40]] for t in texts],
              seq_length=16, eod_id=1, pad_id=0, loss_pad_id=None, describe={"model": "toy"})


def _clean_output(tmp_path, n=30):
    """A `data clean` output folder of n documents (its .work/ holds copies of them)."""
    from naohai.data.clean import clean
    from naohai.data.clean_config import CleanConfig
    path = tmp_path / "in.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        for i, d in enumerate(itertools.islice(pydoc_documents(), n)):
            fh.write(json.dumps({"text": d[:300], "id": i}) + "\n")
    cfg = CleanConfig(batch_docs=8)
    for step in ("normalize", "language", "quality", "pii", "exact_dedup", "near_dedup"):
        getattr(cfg, step).enabled = False
    report = clean([str(path)], str(tmp_path / "clean"), cfg.validate(), workers=1, progress=False)
    assert report["output"]["documents"] == n and os.listdir(tmp_path / "clean" / ".work")
    return tmp_path / "clean"


def test_a_clean_output_folder_given_as_input_is_scored_once(tmp_path):
    """`data score clean/web` (the README's usage): each document once, not again from clean's .work/."""
    folder = _clean_output(tmp_path)
    report = score([str(folder)], str(tmp_path / "scored"), _toy_lm(), ScoreSettings(keep_fraction=0.9),
                   progress=False)
    s = report["score"]
    assert report["inputs"] == [str(folder / "part-00000.jsonl")]
    assert s["docs_in"] == 30 and s["kept"] + s["dropped"] == 30
    kept = _read_out(tmp_path / "scored")
    assert len(kept) == s["kept"] == len({r["id"] for r in kept}) >= 27


@pytest.mark.parametrize("inside", [False, True])
def test_an_out_that_is_or_lies_in_an_input_folder_is_refused_before_the_model_loads(tmp_path, capsys, inside):
    folder = _clean_output(tmp_path)
    out = folder / "scored" if inside else folder
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    for more in (["--restart"], []):
        assert main(["data", "score", str(folder), "--model", str(tmp_path / "no-model"), "--out", str(out),
                     "--keep-fraction", "0.9", "--no-progress"] + more) == 2
        err = " ".join(capsys.readouterr().err.split())
        said = "lies inside the input folder" if inside else "is the input folder"
        assert "'--out'" in err and said in err and "Traceback" not in err, err
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert not (folder / "scored").exists()
    with pytest.raises(UserError, match=said):                        # the API refuses too, before it writes
        score([str(folder)], str(out), _toy_lm(), ScoreSettings(), progress=False, restart=True)
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
