"""Recipes: loading, overrides, and one-paragraph errors (exit 2, no traceback) for bad input."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from naohai.cli import main
from naohai.config import load_recipe, parse_overrides, resolve_recipe_path, write_recipe
from naohai.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_tiny_recipe_loads_with_overrides():
    r = load_recipe("tiny", ["train.lr=1e-3", "model.num_layers=2", "data.corpus=[builtin:pydoc]"])
    assert r.train.lr_schedule.lr == 1e-3 and r.model.num_layers == 2 and r.data.corpus == ["builtin:pydoc"]
    assert r.model.padded_vocab_size % 128 == 0


def test_overrides_parse_yaml_values():
    assert parse_overrides(["a.b=3", "a.c=true", "d=x"]) == {"a": {"b": 3, "c": True}, "d": "x"}


def _cli_error(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err


def test_missing_recipe(capsys, tmp_path):
    err = _cli_error(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert "nope.yaml" in err and "no such recipe file" in err
    err = " ".join(_cli_error(capsys, ["train", "tiyn"]).split())   # a name: the closest and every shipped recipe
    shipped = sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "recipes")) if f.endswith(".yaml"))
    assert "Did you mean: 'tiny'" in err and f"Recipes: {', '.join(shipped)}" in err


def test_override_mistakes_are_blamed_on_the_command_line(capsys, tmp_path):
    err = " ".join(_cli_error(capsys, ["train", "tiny", "train.stpes=100"]).split())
    assert err.startswith("naohai: error: command line override 'train.stpes=100' (recipe ")
    assert "'steps'" in err
    err = " ".join(_cli_error(capsys, ["train", "tiny", "train.global_batch_size=10"]).split())
    assert "command line override 'train.global_batch_size=10'" in err and "multiple of micro_batch_size" in err
    # a mistake in the file itself is still the file's, whatever the overrides
    bad = _write(tmp_path, "model: {preset: tiny}\ntrain: {stpes: 3}\n")
    with pytest.raises(UserError) as info:
        load_recipe(bad, ["train.lr=0.1"])
    assert info.value.where == bad and info.value.key == "train.stpes"


def test_malformed_yaml_names_line(capsys, tmp_path):
    path = _write(tmp_path, "model:\n  preset: tiny\n train: [\n")
    err = _cli_error(capsys, ["train", path])
    assert path in err and "line" in err


def test_unknown_key_did_you_mean(capsys, tmp_path):
    path = _write(tmp_path, "model:\n  preset: tiny\n  hiden_size: 64\n")
    err = _cli_error(capsys, ["train", path])
    assert "model.hiden_size" in err and "hidden_size" in err and "Did you mean" in err


def test_unknown_section_and_preset(capsys, tmp_path):
    err = _cli_error(capsys, ["train", _write(tmp_path, "modle: {}\n")])
    assert "modle" in err and "'model'" in err
    err = _cli_error(capsys, ["train", _write(tmp_path, "model: {preset: tinny}\n", "p.yaml")])
    assert "model.preset" in err and "'tiny'" in err


def test_wrong_type(capsys, tmp_path):
    err = _cli_error(capsys, ["train", _write(tmp_path, "train: {steps: lots}\n")])
    assert "train.steps" in err and "integer" in err


def test_seq_length_larger_than_positions(capsys, tmp_path):
    path = _write(tmp_path, "model: {preset: tiny-pangu, seq_length: 256, max_positions: 128}\n")
    err = _cli_error(capsys, ["train", path])
    assert "model.seq_length" in err and "max_positions" in err


def test_missing_corpus(capsys, tmp_path):
    path = _write(tmp_path, f"model: {{preset: tiny}}\ndata: {{corpus: [{tmp_path / 'none.txt'}]}}\n"
                            f"train: {{output_dir: {tmp_path / 'run'}}}\n")
    err = _cli_error(capsys, ["train", path])
    assert "none.txt" in err and "data.corpus" in err
    assert not (tmp_path / "run").exists()        # the failed start leaves no empty run folder behind


def test_empty_corpus(capsys, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    path = _write(tmp_path, f"model: {{preset: tiny}}\ndata: {{corpus: [{empty}]}}\n"
                            f"train: {{output_dir: {tmp_path / 'run'}}}\n")
    err = _cli_error(capsys, ["train", path])
    assert "empty.txt" in err or "data.corpus" in err


def test_tokenizer_vocab_mismatch(capsys, tmp_path, micro_data):
    _, tok = micro_data   # a 320-piece tokenizer
    path = _write(tmp_path, f"model: {{preset: tiny}}\ndata: {{tokenizer: {tok}}}\n"
                            f"train: {{output_dir: {tmp_path / 'run'}}}\n")
    err = _cli_error(capsys, ["train", path])
    assert "model.vocab_size" in err and "320" in err and "2048" in err


def test_bad_flag(capsys):
    err = _cli_error(capsys, ["train", "tiny", "--no-such-flag"])
    assert "--no-such-flag" in err


def test_console_script_exit_code_and_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "naohai.cli", "train", str(tmp_path / "missing.yaml")],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "missing.yaml" in proc.stderr


def test_user_error_renders_file_key_rule():
    err = UserError("is 3", where="a.yaml", key="model.x", rule="x > 3")
    assert str(err) == "a.yaml: key 'model.x': is 3 (rule: x > 3)"


RECIPE_STRATEGIES = [("pangu-alpha-2.6b", "pangu-alpha-2.6b-8p"), ("pangu-alpha-13b", "pangu-alpha-13b-16p"),
                     ("pangu-alpha-13b", "pangu-alpha-13b-32p"), ("pangu-alpha-200b", "pangu-alpha-200b-2048p"),
                     ("pengcheng-mind-7b", "pengcheng-mind-7b-16p"), ("pengcheng-mind-200b", "naohai-200b-3456p")]


@pytest.mark.parametrize("recipe, strategy", RECIPE_STRATEGIES)
def test_published_recipes_validate_with_their_strategies(recipe, strategy):
    from naohai.strategy.resolve import check_strategy, load_strategy

    r = load_recipe(os.path.join(REPO, "recipes", recipe + ".yaml"))
    resolved = check_strategy(load_strategy(os.path.join(REPO, "strategies", strategy + ".yaml")), r)
    assert sum(resolved.layers_per_stage) == r.model.num_layers
    assert r.train.global_batch_size % (resolved.mesh["data"] * r.train.micro_batch_size) == 0


def test_bad_device_is_named(capsys):
    err = _cli_error(capsys, ["train", "tiny", "train.device=TPU"])
    assert "train.device" in err and "'TPU' is not one of auto, CPU, GPU, Ascend" in " ".join(err.split())
    err = _cli_error(capsys, ["train", "tiny", "--device", "TPU"])
    assert "--device" in err and "TPU" in err


def test_write_recipe_reads_back_the_same_recipe(tmp_path):
    r = load_recipe(resolve_recipe_path("pangu-alpha-2.6b"), ["train.lr=1e-4"])
    back = load_recipe(write_recipe(r, str(tmp_path / "r.yaml")))
    assert back.to_dict() == r.to_dict() and back.name == r.name


def test_preset_token_ids_follow_their_roles_into_another_tokenizer():
    """PanGu-alpha: eod = pad = 6 (pangu_alpha_config.py), so the loss drops predictions made from EOD;
    PengCheng-Mind: eod 2, pad 0.  With naohai's tokenizer (eod 1, pad 0) the roles carry over."""
    from naohai.config import MODEL_PRESETS, ModelConfig
    pangu = ModelConfig(**MODEL_PRESETS["pangu-alpha-2.6b"])
    assert (pangu.eod_id, pangu.loss_pad_id) == (6, 6)
    got = pangu.with_token_ids(eod_id=1, pad_id=0)
    assert (got.eod_id, got.loss_pad_id) == (1, 1)
    pcm = ModelConfig(**MODEL_PRESETS["pengcheng-mind-7b"])
    assert (pcm.eod_id, pcm.loss_pad_id) == (2, 0)
    got = pcm.with_token_ids(eod_id=1, pad_id=3)
    assert (got.eod_id, got.loss_pad_id) == (1, 3)
    tiny = ModelConfig(**MODEL_PRESETS["tiny"]).with_token_ids(eod_id=1, pad_id=0)
    assert (tiny.eod_id, tiny.loss_pad_id) == (None, None)


def test_train_keys_stay_flat_and_land_in_their_small_config(tmp_path):
    """The recipe's ``train`` keys are flat (as every shipped recipe writes them); in Python each one lives
    in the small config that validates it, and a written recipe has the same flat keys."""
    import yaml
    r = load_recipe("tiny", ["train.lr=2e-3", "train.weight_decay=0.05", "train.spike_factor=4",
                             "train.save_every=7", "train.log_every=3", "train.eval_batches=2",
                             "train.loss_scale.dynamic=true"])
    t = r.train
    assert (t.lr_schedule.lr, t.optimizer.weight_decay, t.guard.spike_factor, t.checkpoints.save_every,
            t.logging.log_every, t.held_out.eval_batches, t.guard.loss_scale.dynamic) == (2e-3, 0.05, 4.0, 7, 3, 2,
                                                                                          True)
    written = yaml.safe_load(open(write_recipe(r, str(tmp_path / "r.yaml")), encoding="utf-8"))["train"]
    for key in ("lr", "weight_decay", "spike_factor", "save_every", "log_every", "eval_batches", "loss_scale",
                "steps", "eval"):
        assert key in written
    assert not {"lr_schedule", "optimizer", "guard", "checkpoints", "logging", "held_out"} & set(written)
    for path in sorted(os.listdir(os.path.join(REPO, "recipes"))):       # every shipped recipe still loads
        load_recipe(os.path.join(REPO, "recipes", path))


@pytest.mark.parametrize("override,key,words", [
    ("train.min_lr=1", "train.min_lr", "0 <= min_lr <= lr"),
    ("train.grad_clip=-1", "train.grad_clip", "must be >= 0"),
    ("train.spike_factor=0.5", "train.spike_factor", "0 (off) or > 1"),
    ("train.save_every=0", "train.save_every", "positive integer"),
    ("train.log_every=0", "train.log_every", "positive integer"),
    ("train.device_peak_tflops=-2", "train.device_peak_tflops", "TFLOP/s"),
    ("train.eval_every=0", "train.eval_every", "positive integer"),
    ("train.loss_scale.factor=1", "train.loss_scale", "1 < factor <= 2^16"),
    ("train.seed=-1", "train.seed", ">= 0"),             # MindSpore's set_seed raised after the run folder was made
    ("data.shuffle_seed=-1", "data.shuffle_seed", ">= 0"),   # NumPy's default_rng raised (a traceback)
    ("train.output_dir=", "train.output_dir", "is empty"),
    # found by a probe: a clip of 1e300 is inf in float32 and the first step wrote NaN into every weight; an
    # epsilon of 0 or a beta of 1.5 was MindSpore's traceback once the data was prepared; lr 1e30 accepted
    ("train.grad_clip=1e300", "train.grad_clip", "0 turns clipping off"),
    ("train.adam_beta1=1.5", "train.adam_beta1", "strictly between 0 and 1"),
    ("train.adam_beta2=0", "train.adam_beta2", "strictly between 0 and 1"),
    ("train.adam_eps=0", "train.adam_eps", "between 1e-30 and 1"),
    ("train.adam_eps=1e-50", "train.adam_eps", "between 1e-30 and 1"),
    ("train.weight_decay=-0.1", "train.weight_decay", ">= 0"),
    ("train.weight_decay=2000", "train.weight_decay", "must be below 1"),
    ("train.lr=1e30", "train.lr", "overwrite the weights"),
    ("train.loss_scale.init=1e300", "train.loss_scale", "init <= 2^64"),
    # found by a probe: min_scale 1e-300 is 0 in float32 (the gradients unscaled by 1 / 0); a negative keep count
    # was read as 0 (keep everything); a spike factor of 1e300 is inf in float32; an empty init_from trained from
    # fresh weights; an unknown device_profile was a UserError blamed on --profile after data and model were built
    ("train.loss_scale.min_scale=1e-300", "train.loss_scale", "2^-64 <= min_scale"),
    ("train.keep_checkpoints=-1", "train.keep_checkpoints", "0 keeps every checkpoint"),
    ("train.keep_every=-2", "train.keep_every", ">= 0"),
    ("train.spike_factor=1e300", "train.spike_factor", "0 turns the guard off"),
    ("train.init_from=", "train.init_from", "is empty"),
    ("train.device_profile=", "train.device_profile", "is empty"),
])
def test_each_small_train_config_names_its_flat_key(override, key, words):
    with pytest.raises(UserError) as info:
        load_recipe("tiny", [override])
    assert info.value.key == key and words in info.value.message


@pytest.mark.parametrize("overrides,key,words", [
    # found by a probe: each was accepted; a negative norm_eps or a rope_base of 0 or below made the first loss
    # NaN, norm_eps 1e300 (inf in float32) or init_std 0 gave no weight a gradient, init_std 1e30 a NaN gradient;
    # num_kv_heads / max_positions 0 were read as left out; 2^31 - 1 layers was a MemoryError in `naohai plan`
    (["model.norm_eps=-1e-5"], "model.norm_eps", "between 1e-30 and 1"),
    (["model.norm_eps=0"], "model.norm_eps", "between 1e-30 and 1"),
    (["model.norm_eps=1e300"], "model.norm_eps", "between 1e-30 and 1"),
    (["model.rope_base=0"], "model.rope_base", "must be above 1"),
    (["model.rope_base=-10000"], "model.rope_base", "must be above 1"),
    (["model.init_std=0"], "model.init_std", "above 0 and at most 1"),
    (["model.init_std=-0.02"], "model.init_std", "above 0 and at most 1"),
    (["model.init_std=1e30"], "model.init_std", "above 0 and at most 1"),
    (["model.num_kv_heads=0"], "model.num_kv_heads", "left out for num_heads"),
    (["model.max_positions=0"], "model.max_positions", "left out for seq_length"),
    (["model.num_layers=2147483647"], "model.num_layers", "more than 10,000"),
    (["model.vocab_size=2147483647", "model.vocab_pad_multiple=1000"], "model.vocab_size", "more than 2^31"),
    (["model.preset=[tiny]"], "model.preset", "must be a preset name"),      # a TypeError (unhashable list)
    (["model.family=[naohai]", "model.preset=null"], "model.family", "must be a family name"),
    (["name=[a, b]"], "name", "line of text"),
    # data: an empty tokenizer trained a new one, an empty prepared_dir used the default folder
    (["data.tokenizer="], "data.tokenizer", "is empty"),
    (["data.prepared_dir="], "data.prepared_dir", "is empty"),
    (["data.corpus=[builtin:pydoc, '']"], "data.corpus[1]", "is empty"),
    # finetune: alpha 1e300 is an inf scale (NaN at the first step); an empty pattern adapts every op; a
    # bottleneck of 2^31 - 1 was accepted (8 TB of adapters)
    (["finetune.method=lora", "finetune.alpha=1e300"], "finetune.alpha", "float16's largest value"),
    (["finetune.method=lora", "finetune.targets="], "finetune.targets", "is empty"),
    (["finetune.method=adapter", "finetune.bottleneck=2147483647"], "finetune.bottleneck", "wider than"),
    # RoPE scaling (Llama 3.1's llama3, linear): the kinds naohai computes, finite factors, ordered bands
    (["model.rope_scaling=linear", "model.rope_factor=0.5"], "model.rope_factor", "between 1 and 1e6"),
    (["model.rope_scaling=linear", "model.rope_factor=.nan"], "model.rope_factor", "finite number"),
    (["model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=4",
      "model.rope_high_freq_factor=1"], "model.rope_high_freq_factor", "above rope_low_freq_factor"),
    (["model.rope_scaling=llama3", "model.rope_original_positions=0"], "model.rope_original_positions",
     "positive integer"),
    (["model.rope_scaling=linear", "model.position=learned"], "model.rope_scaling", "position is 'learned'"),
])
def test_each_model_data_and_finetune_key_names_its_rule(overrides, key, words):
    with pytest.raises(UserError) as info:
        load_recipe("tiny", overrides)
    assert info.value.key == key and words in info.value.message and info.value.rule


@pytest.mark.parametrize("overrides", [
    ["model.rope_base=500000", "model.norm_eps=1e-6"],           # LLaMA 3's theta, LLaMA's RMSNorm eps
    ["model.norm_eps=1.5625e-07", "model.init_std=1"],           # GLM-4's eps; the largest std
    ["model.num_layers=10000", "model.vocab_size=250880", "model.vocab_pad_multiple=1"],   # BLOOM's vocabulary
    ["train.keep_checkpoints=0", "train.spike_factor=1000000", "train.loss_scale.min_scale=1e-5"],
    ["finetune.method=lora", "finetune.alpha=524032"],           # alpha / rank 8 = 65504
    ["finetune.method=adapter", "finetune.bottleneck=128"],      # as wide as hidden
])
def test_the_bounds_keep_the_values_published_models_use(overrides):
    load_recipe("tiny", overrides)


def test_an_unknown_train_key_lists_the_flat_keys(tmp_path):
    with pytest.raises(UserError) as info:
        load_recipe(_write(tmp_path, "model: {preset: tiny}\ntrain: {optimizer: {weight_decay: 0.1}}\n"))
    assert info.value.key == "train.optimizer" and "weight_decay" in info.value.message


@pytest.mark.parametrize("args,key", [(["--output-dir", ""], "--output-dir"), (["--resume-from", ""], "--resume-from"),
                                      (["--strategy", " "], "--strategy"), (["--max-steps", "0"], "--max-steps"),
                                      (["--max-steps", "-1"], "--max-steps")])
def test_empty_train_paths_and_no_steps_are_refused(capsys, tmp_path, args, key):
    """--output-dir "" trained into the recipe's runs/tiny, --resume-from "" resumed from the newest checkpoint,
    --max-steps 0 prepared and compiled, trained nothing and exited 0 (found by a probe)."""
    from naohai.cli import main
    assert main(["train", "tiny", "train.output_dir=" + str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert f"key '{key}'" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()

