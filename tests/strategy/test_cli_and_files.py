"""`naohai plan` end to end, and every ready file in strategies/ validates and plans."""
import glob
import json
import math
import os

import pytest
import yaml

from naohai.cli import main
from naohai.config import preset_recipe
from naohai.strategy.plan import build_plan
from naohai.strategy.profiles import PROFILES, load_profile
from naohai.strategy.resolve import check_strategy, load_strategy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(glob.glob(os.path.join(ROOT, "strategies", "*.yaml")))


def test_ready_files_exist():
    names = {os.path.basename(f) for f in FILES}
    for want in ("tiny-dp2.yaml", "tiny-dp2-mp2.yaml", "tiny-dp2-mp2-pp2.yaml", "pangu-alpha-2.6b-8p.yaml",
                 "pangu-alpha-13b-16p.yaml", "pangu-alpha-13b-32p.yaml", "pangu-alpha-200b-2048p.yaml",
                 "pengcheng-mind-7b-16p.yaml", "naohai-200b-3456p.yaml"):
        assert want in names


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_every_strategy_file_validates_and_plans(path):
    s = load_strategy(path)
    assert s.model, "each file names its target preset"
    cfg = preset_recipe(s.model).model
    r = check_strategy(s, cfg, devices=s.devices)
    assert not r.warnings
    assert sum(r.layers_per_stage) == cfg.num_layers and len(r.stage_of_layer) == cfg.num_layers
    plan = build_plan(cfg, r, PROFILES["ascend-910a-32g"], s.model)
    assert plan.fits
    assert all(math.isfinite(st.total_bytes) and st.total_bytes > 0 for st in plan.stages)


def test_naohai_3456_split():
    r = check_strategy(load_strategy(os.path.join(ROOT, "strategies", "naohai-200b-3456p.yaml")),
                       preset_recipe("pengcheng-mind-200b").model)
    assert r.device_num == 3456 and len(r.layers_per_stage) == 27 and sum(r.layers_per_stage) == 104
    assert r.layers_per_stage.count(3) == 4 and r.layers_per_stage.count(4) == 23


def test_tiny_files_with_the_tiny_recipe_and_stated_overrides():
    from naohai.config import load_recipe
    recipe = os.path.join(ROOT, "recipes", "tiny.yaml")
    for name, mbs in (("tiny-dp2", 8), ("tiny-dp2-mp2", 8), ("tiny-dp2-mp2-pp2", 2)):
        r = check_strategy(load_strategy(os.path.join(ROOT, "strategies", name + ".yaml")),
                           load_recipe(recipe, [f"train.micro_batch_size={mbs}"]))
        assert r.gradient_accumulation == 1


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("preset,path,stages", [
    ("pangu-alpha-200b", "pangu-alpha-200b-2048p.yaml", 16),
    ("pengcheng-mind-200b", "naohai-200b-3456p.yaml", 27),
])
def test_plan_prints_full_report(capsys, preset, path, stages):
    code, out, err = run_cli(capsys, "plan", preset, os.path.join(ROOT, "strategies", path))
    assert code == 0, err
    rows = [line for line in out.splitlines() if line.rstrip().endswith(("FITS", "DOES NOT FIT"))
            and line.strip()[0].isdigit()]
    assert len(rows) == stages
    for needle in ("pipeline bubble:", "comm model", "comm data", "comm pipeline", "predicted step:", "MFU",
                   "parameter sharding", "verdict: FITS", "attention.q_weight", "assumptions:"):
        assert needle in out


def test_plan_strategy_alone_and_json(capsys):
    code, out, _ = run_cli(capsys, "plan", os.path.join(ROOT, "strategies", "pangu-alpha-13b-32p.yaml"), "--json")
    assert code == 0
    data = json.loads(out)
    assert [s["num_layers"] for s in data["stages"]] == [10, 10, 10, 10]
    assert data["mesh"] == {"data": 4, "model": 2, "pipeline": 4}


def test_plan_bad_file_exits_2(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: {data: 2, model: 3}\n")
    code, out, err = run_cli(capsys, "plan", "tiny", str(bad))
    assert code == 2 and "Traceback" not in err
    assert "bad.yaml" in err and "rule:" in err


def test_plan_devices_mismatch(capsys):
    code, _, err = run_cli(capsys, "plan", "tiny", os.path.join(ROOT, "strategies", "tiny-dp2.yaml"),
                           "--devices", "4")
    assert code == 2 and "data * model * pipeline == devices" in err


def test_search_and_write(capsys, tmp_path):
    out_file = tmp_path / "best.yaml"
    code, out, err = run_cli(capsys, "plan", "pangu-alpha-2.6b", "--devices", "8", "--search", "--top", "3",
                             "--global-batch", "32", "--write", str(out_file))
    assert code == 0, err
    assert out.count("\n 1 ") + out.count("\n 2 ") + out.count("\n 3 ") == 3
    # progress on stderr (not a terminal here: a line per quarter of the meshes, the last one complete)
    said = [line for line in err.splitlines() if line.startswith("search: ")]
    assert said[0].startswith("search: 0 of ") and said[-1].split()[1] == said[-1].split()[3]
    s = load_strategy(str(out_file))
    assert s.model == "pangu-alpha-2.6b" and s.device_count == 8
    r = check_strategy(s, preset_recipe("pangu-alpha-2.6b").model, devices=8)
    assert build_plan(preset_recipe("pangu-alpha-2.6b").model, r, PROFILES["ascend-910a-32g"]).fits


def test_search_ranks_by_step_time():
    from naohai.strategy.search import search
    calls = []
    cands = search(preset_recipe("tiny").model, 4, 16, 2, PROFILES["ascend-910a-32g"], top=50,
                   progress=lambda done, total: calls.append((done, total)))
    total = calls[0][1]
    assert [done for done, _ in calls] == list(range(total + 1)) and {t for _, t in calls} == {total}
    times = [c.plan.step_seconds for c in cands]
    assert times == sorted(times) and len(cands) > 3
    assert all(c.plan.fits and c.plan.global_batch == 16 for c in cands)


def test_user_profile(tmp_path):
    p = tmp_path / "prof.yaml"
    p.write_text("base: ascend-910a-32g\nname: small\nmemory_gb: 8\n")
    prof = load_profile(str(p))
    assert prof.memory_gb == 8 and prof.peak_tflops_16 == 256
    p.write_text("base: ascend-910a-32g\nmemory_gbs: 8\n")
    from naohai.errors import UserError
    with pytest.raises(UserError) as e:
        load_profile(str(p))
    assert e.value.key == "memory_gbs" and "memory_gb" in str(e.value)


def test_a_recipe_name_means_the_same_recipe_in_train_check_and_plan(capsys):
    """'tiny' is recipes/tiny.yaml for train and check alike (not the preset of that name); a preset
    with no recipe of its name is the preset for check; train refuses a preset, saying it is one; plan
    reads a name that is both as the preset and says so."""
    from naohai.config import load_recipe, load_recipe_or_preset
    from naohai.errors import UserError
    tiny = os.path.join(ROOT, "recipes", "tiny.yaml")
    assert os.path.samefile(load_recipe("tiny").source, tiny)
    assert os.path.samefile(load_recipe_or_preset("tiny").source, tiny)
    assert load_recipe_or_preset("tiny").train.steps == load_recipe(tiny).train.steps != preset_recipe("tiny").train.steps
    assert load_recipe_or_preset("llama-7b").source.startswith("preset llama-7b")
    with pytest.raises(UserError, match="'llama-7b' is a model preset, not a recipe"):
        load_recipe("llama-7b")
    # the recipe's batch (16 x 16) does not fit dp2 x micro_batches 1: the error names the recipe file
    assert main(["check", "tiny", os.path.join(ROOT, "strategies", "tiny-dp2.yaml")]) == 2
    err = capsys.readouterr().err
    assert "recipes/tiny.yaml" in err.replace("\n", " "), err
    assert main(["plan", "tiny", os.path.join(ROOT, "strategies", "tiny-dp2.yaml")]) == 0
    assert "'tiny' read as the model preset tiny" in capsys.readouterr().out
