"""`naohai check`: validation, scale-down, and MindSpore compiling naohai's real train step per rank."""
import json
import re
from pathlib import Path

import pytest

from naohai.cli import main
from naohai.config import preset_recipe, read_yaml, recipe_from_dict
from naohai.errors import UserError
from naohai.simulate.harness import run_compile
from naohai.simulate.scale_down import scale_down
from naohai.strategy.compat import check_compat, compat_fixes
from naohai.strategy.resolve import check_strategy, load_strategy
from naohai.strategy.schema import parse_strategy

ROOT = Path(__file__).resolve().parents[2]
S = ROOT / "strategies"


# ----------------------------------------------------------------------------- fast
def test_validation_only_prints_summary(capsys):
    assert main(["check", "tiny", str(S / "tiny-dp2.yaml"), "train.micro_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "data 2 x model 1 x pipeline 1 = 2 devices" in out and "valid" in out


def test_a_check_that_writes_nothing_leaves_no_folder_behind(capsys, tmp_path, monkeypatch):
    """Validation alone makes no work folder (it made an empty naohai-check-* in the temporary folder per call);
    a compat fix writes its copy into one, and names it."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["check", "tiny", str(S / "tiny-dp2.yaml"), "train.micro_batch_size=8"]) == 0
    assert main(["check", str(S / "tiny-dp2.yaml")]) == 0
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "in").mkdir()
    path = _with_ops(tmp_path / "in", "tiny-dp2-mp2-pp2.yaml", CLASS_SPLIT)
    assert main(["check", "tiny", str(path), "train.micro_batch_size=2", "--compat-fixes"]) == 0
    made = [p for p in tmp_path.iterdir() if p.name.startswith("naohai-check-")]
    assert len(made) == 1 and (made[0] / "compat-strategy.yaml").is_file()
    assert str(made[0] / "compat-strategy.yaml") in capsys.readouterr().out


def test_a_workdir_that_cannot_be_a_folder_is_named(capsys, tmp_path):
    path = _with_ops(tmp_path, "tiny-dp2-mp2-pp2.yaml", CLASS_SPLIT)
    (tmp_path / "afile").write_text("x")
    assert main(["check", "tiny", str(path), "train.micro_batch_size=2", "--compat-fixes",
                 "--workdir", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert "--workdir" in err and str(tmp_path / "afile") in err and "Traceback" not in err
    assert (tmp_path / "afile").read_text() == "x"


@pytest.mark.parametrize("args,key", [(["--keep-ir"], "--keep-ir"), (["--save-slices"], "--save-slices"),
                                      (["--timeout", "60"], "--timeout"), (["--profile", "ascend-910b-64g"], "--profile"),
                                      (["--compile", "--profile", "ascend-910b-64g"], "--profile")])
def test_a_compile_option_that_nothing_would_read_exits_2(capsys, args, key, tmp_path, monkeypatch):
    """--keep-ir & co. without --compile (and --profile without a compile of chosen ranks) used to be ignored;
    nothing is compiled or written."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["check", str(S / "tiny-dp2.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert f"key '{key}'" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("value", ["nan", "inf", "-5", "0", "1e400", "1e9", "soon"])
@pytest.mark.parametrize("command", [["check", str(S / "tiny-dp2.yaml"), "--compile"],
                                     ["ckpt", "reshard", "CKPT", "--to", str(S / "tiny-dp2.yaml"), "--out", "OUT"]])
def test_a_timeout_is_a_finite_positive_number_of_seconds(capsys, command, value):
    """nan compiled with no limit, 0 and -5 timed the compile out at once; each now exits 2 naming --timeout."""
    assert main([*command, "--timeout", value]) == 2
    err = capsys.readouterr().err
    assert "--timeout" in err and "seconds above 0" in err and "Traceback" not in err


@pytest.mark.parametrize("path", sorted(S.glob("*.yaml")), ids=lambda p: p.name)
def test_a_strategy_alone_is_checked_with_the_batch_plan_plans(capsys, path):
    """`naohai check STRATEGY`: the recipe is the preset the file's model: key names, at the batch
    `naohai plan STRATEGY` plans (its --json is the reference); every shipped file is valid so."""
    assert main(["plan", str(path), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    model = read_yaml(str(path))["model"]
    assert f"recipe: the model preset {model} (the strategy's model: key); batch {planned['global_batch']} " \
           f"sequences, micro-batch size {planned['micro_batch_size']}" in out
    assert f"micro-batch size {planned['micro_batch_size']} per data-parallel rank" in out and "valid" in out


def test_a_strategy_alone_takes_overrides_after_it(capsys):
    assert main(["check", str(S / "tiny-dp2.yaml"), "train.micro_batch_size=8", "train.global_batch_size=16"]) == 0
    assert "micro-batch size 8 per data-parallel rank" in capsys.readouterr().out
    # the same file given with its recipe reads the recipe as before (recipes/tiny.yaml: global batch 16)
    assert main(["check", "tiny", str(S / "tiny-dp2.yaml"), "train.micro_batch_size=8"]) == 0
    assert "recipe: the model preset" not in capsys.readouterr().out


@pytest.mark.parametrize("text, args, key", [
    (None, [], "STRATEGY"),                                                         # nothing
    (None, [str(ROOT / "recipes" / "tiny.yaml")], "STRATEGY"),                      # a recipe alone
    (None, [str(ROOT / "recipes" / "tiny.yaml"), "train.steps=3"], "STRATEGY"),     # ... with an override
    ("mesh: {data: 2}\n", [], "model"),                                            # no model: key
    ("mesh: {data: 2}\nmodel: nopreset\n", [], "model"),                          # not a preset
])
def test_a_strategy_alone_needs_a_model_preset(capsys, tmp_path, text, args, key):
    if text is not None:
        path = tmp_path / "s.yaml"
        path.write_text(text)
        args = [str(path)]
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert f"key '{key}'" in err and "Traceback" not in err


def _with_ops(tmp_path, name, ops):
    """A copy of a shipped strategy with escape-hatch op strategies added."""
    import yaml
    raw = read_yaml(str(S / name))
    raw.setdefault("ops", {}).update(ops)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


CLASS_SPLIT = {"loss.log_softmax": [[2, 2]]}   # class (vocab) axis split: 2.10 refuses it


def test_vocab_rule_never_splits_the_loss_class_axis():
    from naohai.config import load_recipe
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=2"])
    resolved = check_strategy(load_strategy(str(S / "tiny-dp2-mp2-pp2.yaml")), recipe)
    assert resolved.vocab_parallel and resolved.op_strategy["head.logits"] == ((2, 1), (2, 1))
    assert resolved.op_strategy["loss.log_softmax"] == ((2, 1),)
    assert resolved.op_strategy["loss.pick"] == ((2, 1), (2, 1))
    check_compat(resolved, recipe)


def test_validator_refuses_loss_class_split_with_mindspores_reason(capsys, tmp_path):
    path = _with_ops(tmp_path, "tiny-dp2-mp2.yaml", CLASS_SPLIT)
    assert main(["check", "tiny", str(path), "train.micro_batch_size=8"]) == 2
    err = capsys.readouterr().err
    assert "loss.log_softmax" in err and "loss-class-axis" in err and "[[2, 1]]" in err
    assert "Traceback" not in err


def test_the_old_loss_op_name_is_refused_with_its_replacements(capsys, tmp_path):
    """Strategy files written for the one-hot loss say loss.xent; the error names the two ops that replaced it."""
    path = _with_ops(tmp_path, "tiny-dp2-mp2.yaml", {"loss.xent": [[2, 1], [2, 1]]})
    assert main(["check", "tiny", str(path), "train.micro_batch_size=8"]) == 2
    err = capsys.readouterr().err
    assert "ops.loss.xent" in err and str(path) in err and "Traceback" not in err
    assert "loss.log_softmax: [[2, 1]]" in err and "loss.pick: [[2, 1], [2, 1]]" in err


def test_compat_fix_keeps_batch_split_and_passes(tmp_path):
    from naohai.config import load_recipe
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=2"])
    path = _with_ops(tmp_path, "tiny-dp2-mp2-pp2.yaml", CLASS_SPLIT)
    resolved = check_strategy(load_strategy(str(path)), recipe)
    assert resolved.op_strategy["loss.log_softmax"] == ((2, 2),)   # what the escape hatch gives
    with pytest.raises(UserError, match="loss-class-axis"):
        check_compat(resolved)
    fixed, notes = compat_fixes(read_yaml(str(path)), resolved)
    again = check_strategy(parse_strategy(fixed, "fixed"), recipe)
    check_compat(again)
    assert again.op_strategy["loss.log_softmax"] == ((2, 1),) and len(notes) == 1
    assert again.op_strategy["head.logits"] == resolved.op_strategy["head.logits"] == ((2, 1), (2, 1))


def _with_pipeline(tmp_path, name, **pipeline):
    import yaml
    raw = read_yaml(str(S / name))
    raw["pipeline"] = dict(raw.get("pipeline") or {}, **pipeline)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.mark.parametrize("pipeline,rule", [({"scheduler": "gpipe"}, "pipeline-gpipe-needs-interleave"),
                                           ({"scheduler": "interleaved", "virtual_chunks": 2, "layers_per_stage": "auto"},
                                            "pipeline-interleaved-not-wired")])
def test_check_refuses_pipeline_schedulers_mindspore_cannot_compile(capsys, tmp_path, pipeline, rule):
    """Exit 2 before any compile, naming pipeline.scheduler; --compat-fixes writes a 1f1b copy that passes."""
    path = _with_pipeline(tmp_path, "tiny-dp4-pp2.yaml", **pipeline)
    assert main(["check", "tiny", str(path), "train.micro_batch_size=2", "--compile"]) == 2
    err = " ".join(capsys.readouterr().err.split())   # the CLI wraps the paragraph
    assert "key 'pipeline.scheduler'" in err and rule in err and str(path) in err and "Traceback" not in err
    assert "1f1b" in err
    assert main(["check", "tiny", str(path), "train.micro_batch_size=2", "--compat-fixes",
                 "--workdir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    assert f"pipeline.scheduler {pipeline['scheduler']} -> 1f1b" in out and "scheduler 1f1b" in out


def test_gpipe_rule_is_mindspores_own_refusal():
    """The rule's source: MindSpore 2.10 refuses a pipeline config of gpipe without interleave, and
    AutoParallel.pipeline does not know the scheduler name 'interleaved' (in-process, no compile)."""
    import mindspore as ms
    from mindspore import nn
    from mindspore.parallel.auto_parallel import AutoParallel
    try:
        with pytest.raises(TypeError, match="When pipeline_interleave is False, 'gpipe' is not supported, "
                                            "only '1f1b' is allowed"):
            ms.set_auto_parallel_context(pipeline_config={"pipeline_interleave": False, "pipeline_scheduler": "gpipe"})
        ms.set_auto_parallel_context(pipeline_config={"pipeline_interleave": True, "pipeline_scheduler": "gpipe"})
    finally:
        ms.reset_auto_parallel_context()
    with pytest.raises(ValueError, match="scheduler"):
        AutoParallel(nn.Dense(2, 2)).pipeline(stages=2, interleave=True, scheduler="interleaved")


def test_one_stage_layout_ignores_the_scheduler():
    from naohai.config import load_recipe
    recipe = load_recipe(str(ROOT / "recipes/tiny.yaml"), ["train.micro_batch_size=8"])
    raw = dict(read_yaml(str(S / "tiny-dp2.yaml")), pipeline={"scheduler": "gpipe"})
    check_compat(check_strategy(parse_strategy(raw, "one-stage"), recipe), recipe)   # MindSpore never reads it


@pytest.mark.parametrize("preset,name,old_pp", [("pangu-alpha-200b", "pangu-alpha-200b-2048p", 16),
                                                ("pengcheng-mind-200b", "naohai-200b-3456p", 27)])
def test_scale_down_keeps_mp_rules_recompute_and_says_what_changed(preset, name, old_pp):
    raw = read_yaml(str(S / f"{name}.yaml"))
    rec, strat, changes = scale_down(preset_recipe(preset), raw, 8)
    assert strat["mesh"] == {"data": 1, "model": 8, "pipeline": 1}
    assert changes[0] == f"pipeline stages {old_pp} -> 1: model 8 x pipeline {old_pp} needs {8 * old_pp} ranks " \
                         f"at data 1, more than 8"
    assert strat["rules"] == raw["rules"] and strat["embedding"] == raw["embedding"]
    assert list(strat["layers"].values()) == [{"recompute": {"mode": "full", "comm": True}}]
    m = rec["model"]
    assert m["num_heads"] % 8 == 0 and m["ffn_hidden_size"] % 8 == 0 and m["vocab_size"] % 8 == 0
    assert m["query_layer"] == raw_query(preset) and m["num_layers"] == 2
    resolved = check_strategy(parse_strategy(strat, "scaled"), recipe_from_dict(rec, "scaled"))
    assert resolved.device_num == 8 and all(r.mode == "full" and r.comm for r in resolved.recompute)
    # 16 stages of 8 fit 16 ranks with stages 2 kept at data 1
    _, strat16, _ = scale_down(preset_recipe(preset), raw, 16)
    assert strat16["mesh"] == {"data": 1, "model": 8, "pipeline": 2}
    assert strat16["pipeline"]["layers_per_stage"] == [1, 1]


def test_scale_down_drops_the_strategys_batch_keys():
    """The scaled recipe states its own batch; the cluster file's global_batch / micro_batch_size would contradict it."""
    raw = read_yaml(str(S / "naohai-200b-3456p.yaml"))
    assert (raw["global_batch"], raw["micro_batch_size"]) == (1024, 1)
    rec, strat, changes = scale_down(preset_recipe("pengcheng-mind-200b"), raw, 8)
    assert "global_batch" not in strat and "micro_batch_size" not in strat
    assert any("global_batch 1024 dropped" in c for c in changes)
    check_strategy(parse_strategy(strat, "scaled"), recipe_from_dict(rec, "scaled"))


def raw_query(preset):
    from naohai.config import MODEL_PRESETS
    return MODEL_PRESETS[preset].get("query_layer", False)


# ----------------------------------------------------------------------------- compiles
CASES = {
    # name: (argv after 'check', ranks) -- every shipped strategy: the tiny ones at full size,
    # the cluster ones scaled down to 8 ranks
    "tiny-dp2-mp2-pp2": (["tiny", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2"], 8),
    "tiny-dp1-mp4-pp2": (["tiny", str(S / "tiny-dp1-mp4-pp2.yaml"), "train.micro_batch_size=4"], 8),
    "tiny-dp4-pp2": (["tiny", str(S / "tiny-dp4-pp2.yaml"), "train.micro_batch_size=2"], 8),
    "tiny-dp2": (["tiny", str(S / "tiny-dp2.yaml"), "train.micro_batch_size=8"], 2),
    "tiny-dp2-mp2": (["tiny", str(S / "tiny-dp2-mp2.yaml"), "train.micro_batch_size=8"], 4),
    # the Hugging Face families on the full tiny layout: GQA + RMSNorm + untied head (llama), ALiBi +
    # embedding norm (bloom), the parallel block with one shared norm (falcon)
    # (llama's compile also builds the in-loop downstream scoring graph: train.eval.tasks)
    "tiny-llama-dp2-mp2-pp2": (["tiny-llama", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2",
                                "train.eval.tasks=[naohai_pydoc_cont]", "train.eval.batch=8"], 8),
    "tiny-bloom-dp2-mp2-pp2": (["tiny-bloom", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2"], 8),
    "tiny-falcon-dp2-mp2-pp2": (["tiny-falcon", str(S / "tiny-dp2-mp2-pp2.yaml"), "train.micro_batch_size=2"], 8),
    "pangu-200b-scaled": (["pangu-alpha-200b", str(S / "pangu-alpha-200b-2048p.yaml"), "--scale-down"], 8),
    "naohai-200b-scaled": (["pengcheng-mind-200b", str(S / "naohai-200b-3456p.yaml"), "--scale-down"], 8),
    "pangu-13b-16p-scaled": (["pangu-alpha-13b", str(S / "pangu-alpha-13b-16p.yaml"), "--scale-down"], 8),
    "pangu-13b-32p-scaled": (["pangu-alpha-13b", str(S / "pangu-alpha-13b-32p.yaml"), "--scale-down"], 8),
    "pangu-2.6b-8p-scaled": (["pangu-alpha-2.6b", str(S / "pangu-alpha-2.6b-8p.yaml"), "--scale-down"], 8),
    "pengcheng-7b-16p-scaled": (["pengcheng-mind-7b", str(S / "pengcheng-mind-7b-16p.yaml"), "--scale-down"], 8),
}


def test_every_shipped_strategy_is_compile_checked():
    shipped = {p.stem for p in S.glob("*.yaml")}
    checked = {Path(argv[1]).stem for argv, _ in CASES.values()}
    assert shipped == checked


def why(out):
    """A failed compile's output for an assertion message: the failed ranks' sections first (they come
    before the long parameter table), then the end."""
    lines = out.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("--- rank") or line.startswith("(first run")]
    head = "\n".join(line for i in starts for line in lines[i:i + 20])
    return head + "\n...\n" + out[-2000:]


def on_rank(params, name):
    """Whether the compiled step gave this rank a slice of ``name`` (it is in the parameter layout)."""
    return "slice_shape" in params.get(name, {})


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_ready_layouts_compile_on_every_rank(case, compiled_layout):
    argv, ranks = CASES[case]
    rc, tmp_path, out = compiled_layout(argv)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0 and summary["ok"], why(out)
    per = summary["per_rank"]
    assert len(per) == ranks and all(r["ok"] for r in per)
    # one short progress line per rank while it compiles
    assert all(len(re.findall(rf"^  rank {r}: ok after \d+ s$", out, re.M)) == 1 for r in range(ranks)), out[-4000:]
    # what `naohai train` compiles, train step then eval net, on every rank; deadlock checks pass
    scored = ["score"] if any(a.startswith("train.eval.tasks=") for a in argv) else []
    assert all(r["result"]["graphs"] in (["train", "eval"] + scored, ["accumulate", "apply", "eval"] + scored)
               for r in per)
    ir = summary["ir_checks"]
    assert ir["passed"] and [g["graph"] for g in ir["graphs"]] == per[0]["result"]["graphs"], ir
    assert "IR checks, graph train: passed" in out or "IR checks, graph accumulate: passed" in out
    if "pp2" in case:   # pipeline: activations and their gradients cross stages, the norm too
        sends = [ir["graphs"][0]["per_rank"][str(r)]["Send"] for r in range(ranks)]
        assert all(n > 0 for n in sends), sends
        assert all(ir["graphs"][0]["per_rank"][str(r)]["global_norm"] >= 1 for r in range(ranks))
    if "runs on: Ascend (or GPU) only" in out:   # MindSpore writes a strategy file for semi-auto jobs only
        assert all(Path(r["result"]["strategy_file"]).stat().st_size > 0 for r in per)
    comm = [r["result"].get("comm_ops", {}) for r in per]
    params = [r["result"]["parameters"] for r in per]
    if case == "tiny-dp2-mp2-pp2":
        for r in range(4):   # stage 0 sends activations forward
            assert comm[r].get("Send", 0) > 0 and comm[r].get("Receive", 0) > 0
        for r in range(8):   # optimizer parallel inserted ReduceScatter; tied table vocab-split by mp on both stages
            assert comm[r].get("ReduceScatter", 0) > 0
            emb = params[r]["embedding.word_embedding"]
            assert emb["full_shape"] == [2048, 128] and emb["slice_shape"] == [1024, 128]
            # the tied table stays whole for the optimizer under pipeline (2.10 fails otherwise) ...
            assert emb["opt_shard_group"] == "" and emb["local_shape"] == [1024, 128]
            q = params[r][f"layers.{0 if r < 4 else 3}.attention.q_weight"]
            # ... every other parameter is optimizer-sharded over the 2 data-parallel ranks
            assert q["slice_shape"] == [64, 128] and q["opt_shard_size"] == 2 and q["local_shape"] == [32, 128]
        assert on_rank(params[4], "layers.3.attention.q_weight") and not on_rank(params[0], "layers.3.attention.q_weight")
    elif case == "tiny-dp2-mp2":
        q = params[0]["layers.0.attention.q_weight"]
        assert q["slice_shape"] == [64, 128] and q["full_shape"] == [128, 128]
        assert comm[0].get("AllReduce", 0) > 0
    elif case == "tiny-dp2":
        assert all(c.get("AllReduce", 0) > 0 for c in comm)   # data-parallel gradient all-reduce
    elif case == "tiny-dp1-mp4-pp2":
        q = params[0]["layers.0.attention.q_weight"]
        assert q["slice_shape"] == [32, 128] and on_rank(params[7], "layers.3.attention.q_weight")
    elif case == "tiny-dp4-pp2":   # uneven split: layers 0-2 on stage 0, layer 3 (+ head) on stage 1
        assert all(on_rank(params[0], f"layers.{i}.attention.q_weight") for i in range(3))
        assert on_rank(params[4], "layers.3.attention.q_weight") and not on_rank(params[4], "layers.2.attention.q_weight")
        q = params[0]["layers.0.attention.q_weight"]
        assert q["opt_shard_size"] == 4 and q["local_shape"] == [32, 128]
    elif case in ("pangu-200b-scaled", "naohai-200b-scaled"):
        q = params[0]["layers.0.attention.q_weight"]
        assert q["full_shape"] == [128, 128] and q["slice_shape"] == [16, 128]   # 8 heads over mp 8
        assert "pipeline stages" in out and "compiling on 8 simulated devices" in out


@pytest.mark.slow
def test_in_loop_downstream_scoring_graph_compiles_under_dp2_mp2_pp2(compiled_layout):
    """train.eval.tasks under dp2 x mp2 x pp2 (tiny-llama's compile of CASES, shared per session): the
    downstream scoring graph (naohai/strategy/scoring.py) compiles on all 8 ranks after the train and
    eval steps; the IR checks pass for it; on the last stage each micro-batch's results are summed over
    the data-parallel group (one all-reduce per micro-batch) and the pipeline broadcasts the result to
    the first stage, so every rank holds every request's scores."""
    from naohai.simulate.ircheck import parse_comm_ops

    rc, workdir, out = compiled_layout(CASES["tiny-llama-dp2-mp2-pp2"][0])
    summary = json.loads((workdir / "summary.json").read_text())
    assert rc == 0 and summary["ok"], why(out)
    assert all(r["result"]["graphs"] == ["train", "eval", "score"] for r in summary["per_rank"])
    assert "IR checks, graph score: passed" in out, out[-4000:]
    [score] = [g for g in summary["ir_checks"]["graphs"] if g["graph"] == "score"]
    assert score["passed"]
    assert all(score["per_rank"][str(r)]["Send"] > 0 for r in range(4))       # activations to stage 1
    assert all(score["per_rank"][str(r)]["Receive"] > 0 for r in range(4, 8))
    for rank in range(8):
        ops = parse_comm_ops((workdir / f"rank_{rank}" / "score.ir").read_text())
        local = rank % 4
        assert [op.members for op in ops if op.name == "PARALLEL_RESULT_BROADCAST"] == [(local, local + 4)]
        if rank >= 4:     # data-parallel group: the same model-parallel position in the other data half
            group = tuple(sorted((rank, rank + 2 if local < 2 else rank - 2)))
            assert sum(op.kind == "AllReduce" and op.members == group for op in ops) == 4    # micro-batches


@pytest.mark.slow
def test_the_checked_train_graph_drops_out_and_the_eval_graph_does_not(tmp_path):
    """The worker compiles train, then eval, in one process over one model: each target's ``prepare`` sets
    the model's mode first (before it, the checked train graph of a model with dropout held none)."""
    rc = main(["check", "tiny", str(S / "tiny-dp2.yaml"), "model.dropout=0.1", "train.micro_batch_size=8",
               "--compile", "--workdir", str(tmp_path), "--timeout", "600"])
    assert rc == 0
    for rank in range(2):
        train = (tmp_path / f"rank_{rank}" / "train.ir").read_text()
        evaluation = (tmp_path / f"rank_{rank}" / "eval.ir").read_text()
        assert train.count("PrimFunc_Dropout") > 0 and "PrimFunc_Dropout" not in evaluation


@pytest.mark.slow
def test_mindspore_rejects_what_only_compat_refuses(tmp_path):
    """Raw path (no compat rules): our validator accepts an escape hatch splitting loss.log_softmax's class axis."""
    path = _with_ops(tmp_path, "tiny-dp2-mp2.yaml", CLASS_SPLIT)
    kwargs = {"recipe_path": str(ROOT / "recipes/tiny.yaml"), "strategy_path": str(path),
              "overrides": ["train.micro_batch_size=8"], "check_compat": False}
    rep = run_compile("naohai.train.compile_target:build_for_compile", 4, tmp_path / "run", timeout=600,
                      kwargs=kwargs)
    assert rep.failed_ranks == [0, 1, 2, 3]
    err = rep.rank(2).error
    assert err["op"] == "LogSoftmax"
    assert any("The strategy corresponding to axis dimension(2) is not 1" in e for e in err["log_errors"])
    assert "rank 0,1,2,3: RuntimeError op=LogSoftmax" in rep.render()


def test_sequence_parallel_residual_split_differently_is_refused():
    """Found by compiling naohai-200b scaled: MindSpore's AddInfo refuses ((8, 1), (1, 1)) on a residual Add.

    Sequence parallel now splits both operands of the residual Adds; an escape hatch that
    splits them differently is refused by the validator ("same logical axis, same slices").
    """
    raw = read_yaml(str(S / "naohai-200b-3456p.yaml"))
    rec_raw, strat, _ = scale_down(preset_recipe("pengcheng-mind-200b"), raw, 8)
    recipe = recipe_from_dict(rec_raw, "scaled")
    resolved = check_strategy(parse_strategy(strat, "scaled"), recipe)
    assert resolved.op_strategy["layers.0.attention.residual"] == ((8, 1), (8, 1))
    check_compat(resolved, recipe)
    strat = dict(strat, ops={"layers.1.mlp.residual": [[8, 1], [1, 1]]})
    with pytest.raises(UserError, match="same logical axis, same slices within an op"):
        check_strategy(parse_strategy(strat, "hatch"), recipe)


def test_a_strategy_alone_that_is_not_yaml_is_named(capsys, tmp_path):
    """A file given alone is read to see whether it is a strategy: a broken one is reported against the file."""
    path = tmp_path / "broken.yaml"
    path.write_text("mesh: [1\n")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not valid YAML" in err and "Traceback" not in err
