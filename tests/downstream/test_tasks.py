"""`naohai eval RUN --tasks`: lm-eval's metrics from naohai's backend against metrics computed by hand from
the model's own log-probabilities (step path, numpy), and every bad task input -> one paragraph, exit 2,
nothing written."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from naohai.cli import main
from naohai.downstream import tasks as dt
from naohai.errors import UserError
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe

MC_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
  - metric: acc_norm
"""

GEN_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: false
metric_list:
  - metric: exact_match
"""

# short: the micro model's window is 32 tokens of a 320-piece vocabulary (truncation: test_engine.py)
MC_ROWS = [{"context": "The for loop", "choices": ["is", "in the", "x y"], "label": 0},
           {"context": "A function", "choices": ["object", "the", "if"], "label": 0},
           {"context": "The return", "choices": ["value", "may only", "import"], "label": 1}]


def write_task(folder, name, yaml_text, rows):
    os.makedirs(folder, exist_ok=True)
    data = os.path.join(folder, f"{name}.jsonl")
    with open(data, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    with open(os.path.join(folder, f"{name}.yaml"), "w", encoding="utf-8") as fh:
        fh.write(yaml_text.format(name=name, data=data))
    return data


@pytest.fixture(scope="module")
def micro_run(tmp_path_factory, micro_data):
    prepared, tok = micro_data
    out = tmp_path_factory.mktemp("dsrun") / "run"
    recipe = micro_recipe(out, prepared, tok, steps=4, save_every=4)
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    return str(out)


def _fail(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("naohai: error:")
    return " ".join(err.split())


def test_metrics_equal_hand_computed_log_probabilities(tmp_path, micro_run, capsys):
    import mindspore as ms
    from mindspore import Tensor

    from naohai.data.tokenizer import Tokenizer
    from naohai.checkpoint.weights import load_model

    folder = tmp_path / "tasks"
    write_task(folder, "mc_probe", MC_YAML, MC_ROWS)
    gen_rows = [{"context": r["context"], "answer": "the"} for r in MC_ROWS]
    write_task(folder, "gen_probe", GEN_YAML, gen_rows)
    out = tmp_path / "res.json"
    assert main(["eval", micro_run, "--tasks", "mc_probe,gen_probe", "--include-path", str(folder), "--out", str(out),
                 "--batch", "4", "--log-samples"]) == 0
    printed = capsys.readouterr().out
    assert "mc_probe" in printed and "acc_norm" in printed
    doc = json.load(open(out))
    got = {(r["task"], r["metric"]): r for r in doc["rows"]}
    assert doc["step"] == 4 and got[("mc_probe", "acc")]["n"] == 3 and got[("mc_probe", "acc")]["step"] == 4

    # by hand: TemplateLM's pairing (context and context + " " + choice encoded, split at the context's
    # length), each sequence alone through the model's forward, float64 log-softmax
    ms.set_context(mode=ms.PYNATIVE_MODE)
    found, model = load_model(micro_run)
    recipe = found.recipe
    tok = Tokenizer.load(found.tokenizer_file())
    cfg = recipe.model

    def logits(ids):                 # the model's own forward, one request in one right-padded row
        row = np.zeros((1, cfg.seq_length), np.int32)
        row[0, :len(ids)] = ids[-cfg.seq_length:]
        y = model.logits(Tensor(row)).asnumpy()[0, :len(ids)].astype(np.float64)
        return y - np.log(np.exp(y - y.max(-1, keepdims=True)).sum(-1, keepdims=True)) - y.max(-1, keepdims=True)

    acc, acc_norm = [], []
    for r in MC_ROWS:
        ctx = tok.encode(r["context"])
        assert len(tok.encode(r["context"] + " " + max(r["choices"], key=len))) <= 33
        scores = []
        for choice in r["choices"]:
            whole = tok.encode(r["context"] + " " + choice)
            cont = whole[len(ctx):]
            logp = logits(whole[:-1])
            scores.append(sum(logp[len(ctx) - 1 + i, t] for i, t in enumerate(cont)))
        lens = [len(" " + c) for c in r["choices"]]
        acc.append(float(np.argmax(scores) == r["label"]))
        acc_norm.append(float(np.argmax(np.asarray(scores) / lens) == r["label"]))
        logged = [s for s in doc["samples"]["mc_probe"] if s["doc"]["context"] == r["context"]][0]
        np.testing.assert_allclose([x[0][0] for x in logged["resps"]], scores, atol=1e-4)
    assert got[("mc_probe", "acc")]["value"] == pytest.approx(np.mean(acc))
    assert got[("mc_probe", "acc_norm")]["value"] == pytest.approx(np.mean(acc_norm))

    # generation: greedy by re-running the window, cut at the stop string
    hits = []
    for r in gen_rows:
        ids, new = tok.encode(r["context"]), []
        for _ in range(4):
            t = int(np.argmax(logits(ids)[-1, :cfg.vocab_size]))
            if t == tok.eod_id:
                break
            new.append(t)
            ids.append(t)
            if "\n" in tok.decode(new):
                break
        text = tok.decode(new).split("\n")[0]
        logged = [s for s in doc["samples"]["gen_probe"] if s["doc"]["context"] == r["context"]][0]
        assert logged["resps"][0][0] == text
        hits.append(float(text == r["answer"]))
    assert got[("gen_probe", "exact_match")]["value"] == pytest.approx(np.mean(hits))


def test_unknown_task(tmp_path, micro_run, capsys):
    msg = _fail(["eval", micro_run, "--tasks", "naohai_pydoc_cnt"], capsys)
    assert "no task named 'naohai_pydoc_cnt'" in msg and "naohai_pydoc_cont" in msg and "--tasks" in msg
    assert not os.path.exists(os.path.join(micro_run, "downstream"))


def test_task_yaml_that_does_not_parse(tmp_path, micro_run, capsys):
    folder = tmp_path / "bad"
    write_task(folder, "ok_task", MC_YAML, MC_ROWS)
    (folder / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    msg = _fail(["eval", micro_run, "--tasks", "ok_task", "--include-path", str(folder)], capsys)
    assert "broken.yaml" in msg and "does not parse" in msg
    (folder / "broken.yaml").write_text("dataset_path: json\n")
    msg = _fail(["eval", micro_run, "--tasks", "ok_task", "--include-path", str(folder)], capsys)
    assert "broken.yaml" in msg and "names no 'task'" in msg


def test_missing_data_file(tmp_path, micro_run, capsys):
    folder = tmp_path / "missing"
    data = write_task(folder, "lost_task", MC_YAML, MC_ROWS)
    os.remove(data)
    msg = _fail(["eval", micro_run, "--tasks", "lost_task", "--include-path", str(folder)], capsys)
    assert "lost_task" in msg and "data files" in msg
    assert not os.path.exists(os.path.join(micro_run, "downstream"))


def test_bad_flags(micro_run, capsys):
    assert "--include-path" in _fail(["eval", micro_run, "--tasks", "x", "--include-path", "/no/such/dir"], capsys)
    assert "--tasks" in _fail(["eval", micro_run, "--tasks", "a,,b"], capsys)
    assert "limit" in _fail(["eval", micro_run, "--tasks", "naohai_pydoc_cont", "--limit", "0"], capsys)


def test_without_lm_eval_says_how_to_install(micro_run, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)          # import lm_eval -> ImportError
    msg = _fail(["eval", micro_run, "--tasks", "naohai_pydoc_cont"], capsys)
    assert 'pip install -e ".[eval]"' in msg


def test_shipped_tasks_load():
    prepared = dt.prepare(["naohai_pydoc_cont", "naohai_fortunes_zh_cont", "naohai_chid_idiom", "naohai_pydoc_word"])
    sizes = {name: len(task.eval_docs) for name, task in prepared.loaded["tasks"].items()}
    assert sizes == {"naohai_pydoc_cont": 200, "naohai_fortunes_zh_cont": 200, "naohai_chid_idiom": 200,
                     "naohai_pydoc_word": 200}
    assert prepared.shots() == dict.fromkeys(sizes, 0)


def test_rows_flatten_lm_eval_results():
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact_match,strip": 0.25,
                                 "exact_match_stderr,strip": "N/A"}},
               "n-samples": {"t": {"original": 10, "effective": 4}}, "n-shot": {"t": 2}}
    assert dt.rows(results, 7) == [
        {"task": "t", "metric": "acc", "value": 0.5, "stderr": 0.1, "n": 4, "num_fewshot": 2, "step": 7},
        {"task": "t", "metric": "exact_match (strip)", "value": 0.25, "stderr": None, "n": 4, "num_fewshot": 2,
         "step": 7}]


def test_a_standard_lm_eval_task_on_a_local_copy_of_its_data(tmp_path, micro_run, capsys):
    """lm-eval's own xcopa_zh (prompt functions, metrics) with its dataset replaced by local files, offline."""
    import lm_eval

    zh = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "xcopa", "default_zh.yaml")
    rows = [{"premise": "男孩哭了", "choice1": "他摔倒了", "choice2": "他笑了", "question": "cause", "label": 0, "idx": 0},
            {"premise": "天黑了", "choice1": "我开了灯", "choice2": "我睡醒了", "question": "effect", "label": 0, "idx": 1}]
    folder = tmp_path / "local"
    folder.mkdir()
    data = folder / "test.jsonl"
    data.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    (folder / "xcopa_zh_local.yaml").write_text(
        f"include: {zh}\ntask: xcopa_zh_local\ndataset_path: json\ndataset_name: null\n"
        f"dataset_kwargs:\n  data_files:\n    validation: {data}\n    test: {data}\n", encoding="utf-8")
    out = tmp_path / "x.json"
    assert main(["eval", micro_run, "--tasks", "xcopa_zh_local", "--include-path", str(folder), "--out", str(out)]) == 0
    doc = json.load(open(out))
    assert [(r["task"], r["metric"], r["n"]) for r in doc["rows"]] == [("xcopa_zh_local", "acc", 2)]


def test_lm_eval_command_line_with_the_naohai_model(tmp_path, micro_run):
    """`naohai lm-eval` is lm-eval's own command line (its flags, its output files) with --model naohai."""
    import glob

    folder = tmp_path / "tasks"
    write_task(folder, "cli_probe", MC_YAML, MC_ROWS)
    out = tmp_path / "out"
    assert main(["lm-eval", "--model", "naohai", "--model_args", f"path={micro_run}", "--tasks", "cli_probe",
                 "--include_path", str(folder), "--batch_size", "4", "--log_samples", "--output_path", str(out)]) == 0
    [results] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    assert glob.glob(str(out / "**" / "samples_cli_probe_*.jsonl"), recursive=True)
    doc = json.load(open(results))
    assert doc["results"]["cli_probe"]["acc,none"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert doc["config"]["model"] == "naohai"


def test_lm_eval_naohai_model_refuses_unknown_model_args(tmp_path, micro_run, capsys):
    """`--model_args path=RUN,batch=8` (a typo of batch_size) was swallowed and ran at the default batch."""
    folder = tmp_path / "tasks"
    write_task(folder, "cli_probe", MC_YAML, MC_ROWS)
    assert main(["lm-eval", "--model", "naohai", "--model_args", f"path={micro_run},batch=8", "--tasks", "cli_probe",
                 "--include_path", str(folder)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "key '--model_args'" in err and "batch is not among them" in err and "Traceback" not in err
