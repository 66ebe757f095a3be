"""A strategy file's global_batch / micro_batch_size against the recipe's train batch.

The rule (naohai.strategy.batch): adopted where the recipe leaves the key to its default,
an error naming both files and keys where both state different values.  train, launch
(pre-flight) and check go through it; the figures are hand calculations of
global = data x micro-batch size x micro-batches x accumulation.
"""
import pytest
import yaml

from naohai.cli import main
from naohai.config import load_recipe
from naohai.errors import UserError
from naohai.strategy.batch import adopt_batch
from naohai.strategy.resolve import load_strategy
from naohai.strategy.run_plan import plan_run

STRATEGY = {"name": "s", "model": "tiny", "mesh": {"data": 2, "model": 1, "pipeline": 1},
            "global_batch": 32, "micro_batch_size": 4}


def _files(tmp_path, train=None, strategy=None):
    recipe = {"name": "r", "model": {"preset": "tiny"}}
    if train is not None:
        recipe["train"] = train
    r, s = tmp_path / "r.yaml", tmp_path / "s.yaml"
    r.write_text(yaml.safe_dump(recipe))
    s.write_text(yaml.safe_dump(strategy or STRATEGY))
    return str(r), str(s)


def test_recipe_silent_adopts_the_strategys_batch(tmp_path):
    r, s = _files(tmp_path)
    recipe = load_recipe(r)
    assert (recipe.train.global_batch_size, recipe.train.micro_batch_size) == (16, 16)   # TrainConfig defaults
    adopted, notes = adopt_batch(recipe, load_strategy(s))
    assert (adopted.train.global_batch_size, adopted.train.micro_batch_size) == (32, 4)
    assert len(notes) == 2 and "global_batch in" in notes[0] and "recipe default" in notes[0]
    # 32 sequences = data 2 x micro-batch 4 x 1 micro-batch x 4 accumulation steps
    resolved = plan_run(recipe, s).strategy
    assert resolved.micro_batch_size == 4 and resolved.gradient_accumulation == 4


def test_recipe_stating_another_batch_is_refused_naming_both(tmp_path):
    r, s = _files(tmp_path, train={"global_batch_size": 16, "micro_batch_size": 4})
    with pytest.raises(UserError) as e:
        adopt_batch(load_recipe(r), load_strategy(s))
    msg = str(e.value)
    assert e.value.where == s and e.value.key == "global_batch"
    assert r in msg and "train.global_batch_size 16" in msg and "global_batch 32" in msg
    assert "train.global_batch_size=32" in msg                      # the way out is spelled
    with pytest.raises(UserError):
        plan_run(load_recipe(r), s)                                 # the run plan agrees


def test_an_override_counts_as_stated(tmp_path):
    r, s = _files(tmp_path)
    with pytest.raises(UserError) as e:
        adopt_batch(load_recipe(r, ["train.micro_batch_size=8"]), load_strategy(s))
    assert e.value.key == "micro_batch_size"
    ok, notes = adopt_batch(load_recipe(r, ["train.global_batch_size=32"]), load_strategy(s))
    assert ok.train.global_batch_size == 32 and ok.train.micro_batch_size == 4 and len(notes) == 1


def test_agreeing_or_silent_strategy_changes_nothing(tmp_path):
    r, s = _files(tmp_path, train={"global_batch_size": 32, "micro_batch_size": 4})
    recipe = load_recipe(r)
    assert adopt_batch(recipe, load_strategy(s)) == (recipe, [])
    bare = {k: v for k, v in STRATEGY.items() if k not in ("global_batch", "micro_batch_size")}
    (tmp_path / "bare").mkdir()
    r2, s2 = _files(tmp_path / "bare", strategy=bare)
    recipe2 = load_recipe(r2)
    assert adopt_batch(recipe2, load_strategy(s2)) == (recipe2, [])


def test_command_line_flag_replaces_both(tmp_path):
    r, s = _files(tmp_path, train={"global_batch_size": 16, "micro_batch_size": 4})
    # --global-batch 64: 64 = data 2 x 4 x 1 micro-batch x 8
    run = plan_run(load_recipe(r), s, global_batch=64)
    assert run.strategy.gradient_accumulation == 8 and run.recipe.train.global_batch_size == 64


def test_adopted_batch_must_fit_the_recipe_rules(tmp_path):
    # the recipe states micro_batch_size 8; the strategy's global 12 is not a multiple of it
    r, s = _files(tmp_path, train={"micro_batch_size": 8}, strategy={**STRATEGY, "global_batch": 12,
                                                                      "micro_batch_size": 8})
    with pytest.raises(UserError) as e:
        adopt_batch(load_recipe(r), load_strategy(s))
    assert "global_batch_size" in str(e.value) and "s.yaml" in str(e.value)


def test_train_command_runs_with_the_adopted_recipe_and_records_it(tmp_path, monkeypatch, capsys):
    r, s = _files(tmp_path)
    seen = {}

    def fake_train(run, **kwargs):
        from naohai.train.job import write_run_files
        recipe, resolved = seen["recipe"], seen["resolved"] = run.recipe, run.strategy
        write_run_files(recipe, resolved, str(tmp_path / "run"))
        raise SystemExit(0)

    monkeypatch.setattr("naohai.train.job.train", fake_train)
    with pytest.raises(SystemExit):      # the run folder in tmp_path, not the checkout's runs/default
        main(["train", r, "--strategy", s, "--output-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "batch from the strategy file: train.global_batch_size: 16 (recipe default) -> 32" in out
    assert seen["recipe"].train.global_batch_size == 32 and seen["resolved"].micro_batch_size == 4
    written = yaml.safe_load((tmp_path / "run" / "recipe.resolved.yaml").read_text())
    assert written["train"]["global_batch_size"] == 32 and written["train"]["micro_batch_size"] == 4


def test_train_refuses_a_conflict_with_exit_2(tmp_path, capsys):
    r, s = _files(tmp_path, train={"global_batch_size": 64, "micro_batch_size": 4})
    assert main(["train", r, "--strategy", s]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "global_batch" in err and "r.yaml" in err


def test_launch_preflight_and_check_agree_with_train(tmp_path, capsys):
    from naohai.launch.preflight import preflight
    r, s = _files(tmp_path)
    assert preflight(plan_run(r, s), r, "CPU", dry_run=True) == "CPU"
    assert "-> 32 (global_batch in" in capsys.readouterr().out
    with pytest.raises(UserError):
        plan_run(r, s, ["train.global_batch_size=64"])
    assert main(["launch", r, "--strategy", s, "--dry-run", "--device", "CPU", "train.global_batch_size=64"]) == 2
    assert main(["check", r, s]) == 0
    out = capsys.readouterr().out
    assert "-> 4 (micro_batch_size in" in out and "micro-batch size 4 per data-parallel rank" in out
    assert main(["check", r, s, "train.global_batch_size=64"]) == 2


def test_the_run_plan_holds_the_recipe_the_job_needs(tmp_path):
    r, s = _files(tmp_path)
    run = plan_run(r, s)
    assert run.recipe.train.micro_batch_size == run.strategy.micro_batch_size == 4
    assert sum("batch from the strategy file" in note for note in run.notes) == 2
    assert "train.global_batch_size" not in load_recipe(r).stated and "train.global_batch_size" in \
        load_recipe(r, ["train.global_batch_size=32"]).stated


def test_launch_plans_the_run_once(tmp_path, monkeypatch, capsys):
    """`naohai launch` reads and checks the recipe and strategy once (the folder lock and the preflight share it)."""
    import naohai.strategy.run_plan as rp
    r, s = _files(tmp_path)
    calls = []
    real = rp.plan_run
    monkeypatch.setattr(rp, "plan_run", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert main(["launch", r, "--strategy", s, "--dry-run", "--device", "CPU"]) == 0
    assert len(calls) == 1 and "-> 32 (global_batch in" in capsys.readouterr().out
