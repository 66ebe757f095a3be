"""Equality with an independent backend: a trained micro LLaMA-family run exported to a Hugging Face folder
(``naohai ckpt export --to hf``) and scored by lm-eval's own ``hf`` model (transformers + PyTorch, float32)
gives the same metrics and per-sample log-likelihoods (1e-4) and the same generations as the ``naohai``
model on the run, for a multiple-choice task (acc, acc_norm, acc_mutual_info: empty-context requests too)
and a generate_until task (exact match)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from naohai.cli import main
from naohai.config import recipe_from_dict
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.downstream.test_tasks import GEN_YAML, MC_YAML as BASE_MC_YAML, write_task

MC_YAML = BASE_MC_YAML + "  - metric: acc_mutual_info\n"

MC_ROWS = [{"context": "The for statement is used to", "choices": ["iterate over", "import the", "return a value"],
            "label": 0},
           {"context": "A class definition", "choices": ["defines a class", "is a number", "x"], "label": 0},
           {"context": "Exceptions are raised", "choices": ["by the raise statement", "slowly", "in a loop"],
            "label": 0},
           {"context": "The with statement", "choices": ["is used to wrap", "yes", "of the module"], "label": 0}]
GEN_ROWS = [{"context": r["context"], "answer": r["choices"][0].split()[0]} for r in MC_ROWS]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    from naohai.data.corpus import pydoc_documents
    from naohai.data.hf_tokenizer import train_byte_bpe

    root = tmp_path_factory.mktemp("hfeq")
    # a byte-level BPE tokenizer.json named by the recipe, so the export carries it to the HF folder
    tok = str(root / "tok" / "tokenizer.json")
    train_byte_bpe(list(pydoc_documents())[:40], 384, tok)
    recipe = recipe_from_dict({
        "name": "micro-llama",
        "model": dict(family="llama", preset="tiny-llama", vocab_size=384, hidden_size=32, num_layers=2, num_heads=4,
                      num_kv_heads=2, ffn_hidden_size=64, seq_length=48),
        "data": {"corpus": ["builtin:pydoc"], "holdout_fraction": 0.05, "tokenizer": tok},
        "train": dict(steps=6, global_batch_size=4, micro_batch_size=4, lr=3e-3, min_lr=3e-4, warmup_steps=2,
                      log_every=2, eval_every=6, eval_batches=1, save_every=6, output_dir=str(root / "run"))},
        where="test recipe")
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    assert main(["ckpt", "export", str(root / "run"), "--to", "hf", "--out", str(root / "hf")]) == 0
    folder = root / "tasks"
    write_task(folder, "eq_mc", MC_YAML, MC_ROWS)
    write_task(folder, "eq_gen", GEN_YAML, GEN_ROWS)
    return str(root / "run"), str(root / "hf"), str(folder)


def _evaluate(lm, folder):
    from naohai.downstream import tasks as dt
    prepared = dt.prepare(["eq_mc", "eq_gen"], include=[folder])
    return dt.run(lm, prepared, log_samples=True)


def test_naohai_backend_equals_transformers_on_the_exported_model(llama_run):
    from lm_eval.models.huggingface import HFLM

    from naohai.data.tokenizer import Tokenizer
    from naohai.downstream.backend import NaohaiEvalLM

    run, hf, folder = llama_run
    ours = NaohaiEvalLM(path=run, batch_size=4)
    eod = ours.eot_token_id
    # the same window and the same prefix token (naohai's is the EOD its documents are joined with)
    theirs = HFLM(pretrained=hf, dtype="float32", batch_size=4, device="cpu", max_length=ours.max_length,
                  prefix_token_id=eod)
    assert Tokenizer.load(os.path.join(hf, "tokenizer.json")).encode("The for statement") == \
        ours.tok_encode("The for statement")
    a, b = _evaluate(ours, folder), _evaluate(theirs, folder)
    for task in ("eq_mc", "eq_gen"):
        mine = {k: v for k, v in a["results"][task].items() if k != "alias"}
        ref = {k: v for k, v in b["results"][task].items() if k != "alias"}
        assert mine.keys() == ref.keys()
        for key in ref:
            assert mine[key] == pytest.approx(ref[key], abs=1e-9), (task, key)
    for x, y in zip(sorted(a["samples"]["eq_mc"], key=lambda s: s["doc_id"]),
                    sorted(b["samples"]["eq_mc"], key=lambda s: s["doc_id"])):
        got = np.array([r[0][0] for r in x["resps"]])
        want = np.array([r[0][0] for r in y["resps"]])
        assert len(got) == len(want) == 6                       # 3 choices + 3 unconditional (mutual info)
        np.testing.assert_allclose(got, want, atol=1e-4)
        assert [r[0][1] for r in x["resps"]] == [r[0][1] for r in y["resps"]]      # greedy flags
    for x, y in zip(sorted(a["samples"]["eq_gen"], key=lambda s: s["doc_id"]),
                    sorted(b["samples"]["eq_gen"], key=lambda s: s["doc_id"])):
        assert x["resps"] == y["resps"]


def test_an_imported_llama_with_bos_equals_lm_evals_hf_model_at_its_defaults(tmp_path):
    """A published-style Llama folder whose tokenizer adds BOS (its TemplateProcessing): imported, naohai's
    backend puts BOS before an empty context and each rolling window, as lm-eval's `hf` model does by
    default for such a model (no prefix given to it), so per-sample log-likelihoods (empty-context requests
    included) and perplexity equal it; before, naohai's EOD prefix gave other numbers."""
    from lm_eval.models.huggingface import HFLM
    from tokenizers import Tokenizer as Backend, processors

    from naohai.downstream.backend import NaohaiEvalLM
    from tests.convert import hf_models

    folder = str(tmp_path / "Llama-folder")
    hf_models.build("llama", folder)
    backend = Backend.from_file(os.path.join(folder, "tokenizer.json"))
    bos = backend.token_to_id("<s>")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos)])
    backend.save(os.path.join(folder, "tokenizer.json"))
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", folder, "--from", "hf", "--out", out]) == 0
    ours = NaohaiEvalLM(path=out, batch_size=4)
    theirs = HFLM(pretrained=folder, dtype="float32", batch_size=4, device="cpu", max_length=ours.max_length)
    assert ours.prefix_token_id == theirs.prefix_token_id == bos != ours.eot_token_id
    tasks = tmp_path / "tasks"
    write_task(tasks, "eq_mc", MC_YAML, MC_ROWS)
    from naohai.downstream import tasks as dt
    prepared = dt.prepare(["eq_mc"], include=[str(tasks)])
    a, b = dt.run(ours, prepared, log_samples=True), dt.run(theirs, prepared, log_samples=True)
    for x, y in zip(sorted(a["samples"]["eq_mc"], key=lambda s: s["doc_id"]),
                    sorted(b["samples"]["eq_mc"], key=lambda s: s["doc_id"])):
        got, want = np.array([r[0][0] for r in x["resps"]]), np.array([r[0][0] for r in y["resps"]])
        assert len(got) == len(want) == 6
        np.testing.assert_allclose(got, want, atol=1e-4)
    from lm_eval.api.instance import Instance
    text = " ".join(r["context"] for r in MC_ROWS) * 3
    request = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    assert ours.loglikelihood_rolling(request)[0] == pytest.approx(theirs.loglikelihood_rolling(request)[0], abs=1e-3)


def test_generate_until_applies_the_folders_repetition_penalty_as_lm_evals_hf_model(tmp_path):
    """A folder whose generation_config.json asks for a repetition_penalty (Qwen2.5 Instruct's 1.05): lm-eval's
    `hf` model applies it to its greedy generate_until (transformers' generate starts from that file), so the
    naohai backend on the imported folder does too: equal generations, which differ from those without it."""
    import json

    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from naohai.downstream.backend import NaohaiEvalLM
    from tests.convert import hf_models

    folder = str(tmp_path / "hf")
    hf_models.build("llama", folder)
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", folder, "--from", "hf", "--out", out]) == 0

    def penalty(value):
        for where in (folder, out):
            path = os.path.join(where, "generation_config.json")
            config = json.load(open(path, encoding="utf-8"))
            json.dump(dict(config, repetition_penalty=value), open(path, "w", encoding="utf-8"))

    requests = [Instance("generate_until", {}, (r["context"] + " " + r["context"],
                                                {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}), i)
                for i, r in enumerate(MC_ROWS)]

    def both():
        ours = NaohaiEvalLM(path=out, batch_size=4)
        theirs = HFLM(pretrained=folder, dtype="float32", batch_size=4, device="cpu", max_length=ours.max_length)
        return ours.generate_until(requests), theirs.generate_until(requests)
    penalty(1.0)
    plain, plain_hf = both()
    penalty(1.5)
    penalised, penalised_hf = both()
    assert penalised_hf != plain_hf                     # lm-eval's hf model applied the file's penalty
    assert penalised == penalised_hf and plain == plain_hf
