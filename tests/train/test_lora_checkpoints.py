"""A LoRA run's checkpoints hold its adapters only (and their optimizer state), name their base, verify,
resume exactly; `ckpt merge-adapter` folds them into the base (logits equal the unmerged adapter model's
to 1e-5); generate / eval read the run as the merged model; a run resumed over other base weights is
refused."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from naohai.checkpoint.adapters import BASE_KEY
from naohai.checkpoint.store import list_checkpoints, read_manifest
from naohai.checkpoint.weights import find_weights, load_model
from naohai.cli import main
from naohai.config import recipe_from_dict
from naohai.convert.model_dir import write_model_dir
from naohai.convert.weights import assign_weights
from naohai.errors import UserError
from naohai.model.lora import apply_lora
from naohai.model.params import param_shapes
from naohai.model.transformer import NaohaiLM
from naohai.strategy.run_plan import plan_run
from naohai.train.job import train
from tests.conftest import micro_recipe


def _quiet(recipe, **kw):
    return train(plan_run(recipe), log=lambda *_: None, progress=False, **kw)


def _sft_recipe(root, tok, out, init_from, steps):
    path = Path(root) / "chat.jsonl"
    if not path.exists():
        path.write_text("\n".join(json.dumps({"prompt": f"echo {i}", "response": f"{i}"}) for i in range(200)))
    raw = micro_recipe(out, steps=steps, global_batch_size=4, micro_batch_size=2, lr=2e-2, save_every=3,
                       eval_every=3).to_dict()
    raw["data"].update(format="sft", corpus=[str(path)], tokenizer=tok, holdout_fraction=0.1,
                       prepared_dir=str(Path(root) / "sft"))
    raw["train"]["init_from"] = str(init_from)
    raw["finetune"] = {"method": "lora", "rank": 4, "alpha": 8.0, "targets": r"attention\.(q|v)$|mlp\.down$"}
    return recipe_from_dict(raw, where="test recipe")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, micro_data):
    prepared, tok = micro_data
    root = tmp_path_factory.mktemp("lora_ckpt")
    base = root / "base"
    _quiet(micro_recipe(base, prepared, tok, steps=4))
    ft = root / "ft"
    result = _quiet(_sft_recipe(root, tok, ft, base, steps=6))
    return root, tok, base, ft, result


def test_checkpoints_hold_adapters_and_their_moments_only(runs):
    root, _, base, ft, _ = runs
    ckpt = list_checkpoints(str(ft))[-1]
    man = read_manifest(ckpt)
    assert man["step"] == 6
    assert man[BASE_KEY]["path"] == os.path.abspath(list_checkpoints(str(base))[-1])
    names = list(json.load(open(os.path.join(ckpt, "rank_0.json")))["tensors"])
    model_names = {p.name for p in param_shapes(recipe_from_dict(man["recipe"]).model)}
    assert not model_names & set(names)                                    # no base tensor
    lora = [n for n in names if n.endswith((".lora_a", ".lora_b")) and not n.startswith("adam_")]
    assert len(lora) == 2 * 3 * 2                                          # 2 layers x (q, v, down) x (A, B)
    assert sorted(n for n in names if n.startswith(("adam_m.", "adam_v."))) == sorted(
        f"adam_{m}.{n}" for n in lora for m in "mv")
    assert all(int(np.prod(shape)) <= 1 for n, shape in json.load(open(os.path.join(ckpt, "rank_0.json")))[
        "tensors"].items() if n not in lora and not n.startswith("adam_"))    # the rest: step state scalars
    small = sum(e["bytes"] for e in man["files"].values())
    full = sum(e["bytes"] for e in read_manifest(list_checkpoints(str(base))[-1])["files"].values())
    assert small * 4 < full, (small, full)
    assert main(["ckpt", "verify", str(ft)]) == 0


def test_resume_continues_exactly(runs, tmp_path):
    """8 steps straight == the same run stopped at its step-6 checkpoint and resumed (same schedule)."""
    import shutil
    root, tok, base, ft, first = runs
    straight = _quiet(_sft_recipe(root, tok, tmp_path / "straight", base, steps=8))
    again = tmp_path / "again"
    shutil.copytree(tmp_path / "straight", again)
    shutil.rmtree(again / "checkpoints" / "step_00000008")
    resumed = _quiet(_sft_recipe(root, tok, again, base, steps=8))
    assert sorted(resumed.losses) == [7, 8]
    for step in (7, 8):
        assert resumed.losses[step] == pytest.approx(straight.losses[step], rel=1e-6, abs=1e-7)


def test_merged_model_equals_the_adapter_model_and_serves(runs, tmp_path, capsys):
    ms.set_context(mode=ms.GRAPH_MODE)
    root, _, base, ft, _ = runs
    found = find_weights(str(ft))
    factors = found.adapters()
    assert any(np.abs(v).max() > 0 for k, v in factors.items() if k.endswith("lora_b"))   # B has been trained
    # the adapter model: the base's weights under LoRA cells holding the run's factors
    recipe = found.recipe
    model = NaohaiLM(recipe.model, seed=1)
    apply_lora(model, recipe.finetune, seed=1)
    _, plain = load_model(str(base))
    tensors = {p.name: p.asnumpy() for p in plain.get_parameters()}
    assign_weights(model, {**tensors, **factors})
    ids = np.random.default_rng(0).integers(0, 320, size=(2, 32)).astype(np.int32)
    model.set_train(False)
    adapted = model.logits(Tensor(ids)).asnumpy()
    plain.set_train(False)
    assert np.abs(adapted - plain.logits(Tensor(ids)).asnumpy()).max() > 1e-4      # the adapters matter
    merged = str(tmp_path / "merged")
    assert main(["ckpt", "merge-adapter", str(ft), "--out", merged]) == 0
    found_merged, merged_model = load_model(merged)
    assert found_merged.recipe.finetune is None and found_merged.adapters is None
    merged_model.set_train(False)
    np.testing.assert_allclose(merged_model.logits(Tensor(ids)).asnumpy(), adapted, rtol=1e-5, atol=1e-5)
    _, run_model = load_model(str(ft))                      # the run itself reads as the merged model
    run_model.set_train(False)
    np.testing.assert_allclose(run_model.logits(Tensor(ids)).asnumpy(), adapted, rtol=1e-5, atol=1e-5)
    windows = np.random.default_rng(1).integers(3, 320, size=(4, 33))
    np.save(tmp_path / "ids.npy", windows)
    for path in (str(ft), merged):
        assert main(["generate", path, "--prompt", "User: echo 3", "--max-new-tokens", "4"]) == 0
        capsys.readouterr()
        assert main(["eval", path, "--ids", str(tmp_path / "ids.npy"), "--json"]) == 0
        assert np.isfinite(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"])


def test_the_merged_model_is_read_a_base_tensor_at_a_time(runs, monkeypatch):
    """generate / eval / merge-adapter of a LoRA run fold each adapter into its base weight when that weight is
    asked for: the base is read a tensor at a time (each once), never whole, and each merged weight is
    W + alpha / rank * B A of the base's stored W (MindSpore's load_checkpoint) in float32."""
    from naohai import ckpt_format
    from naohai.checkpoint.weights import load_bytes, LOAD_BYTES_PER_PARAM
    _, _, base, ft, _ = runs
    found = find_weights(str(ft))
    assert not found.reads_whole
    sizes = [int(np.prod(p.shape)) for p in param_shapes(found.recipe.model)]
    assert load_bytes(found) == LOAD_BYTES_PER_PARAM * (sum(sizes) + max(sizes))
    factors = found.adapters()
    base_file = os.path.join(list_checkpoints(str(base))[-1], "rank_0.ckpt")
    read, real = [], ckpt_format.read
    monkeypatch.setattr(ckpt_format, "read", lambda path, entry: read.append((path, entry.name)) or real(path, entry))
    tensors = found.tensors()
    assert not [name for path, name in read if path == base_file]       # nothing of the base read yet
    stored = {k: v.asnumpy() for k, v in ms.load_checkpoint(base_file).items()}
    ft_cfg = found.recipe.finetune
    for name in tensors:
        value = tensors[name]
        op = name[:-len("_weight")]
        if f"{op}.lora_a" in factors:
            a, b = factors[f"{op}.lora_a"], factors[f"{op}.lora_b"]
            want = (stored[name] + np.float32(ft_cfg.alpha / ft_cfg.rank) * (b @ a)).astype(np.float32)
            assert not np.array_equal(value, stored[name]), name
        else:
            want = stored[name]
        np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-7, err_msg=name)
    base_reads = [name for path, name in read if path == base_file]
    assert sorted(base_reads) == sorted(tensors) and len(set(base_reads)) == len(base_reads)


def test_bad_inputs_exit_2(runs, tmp_path, capsys):
    root, tok, base, ft, _ = runs
    err = lambda: " ".join(capsys.readouterr().err.split())       # noqa: E731 - the message is wrapped
    assert main(["ckpt", "merge-adapter", str(base), "--out", str(tmp_path / "m")]) == 2
    assert "holds no adapters" in err()
    assert main(["ckpt", "export", str(ft), "--to", "peft", "--out", str(tmp_path / "p")]) == 2   # naohai family
    text = err()
    assert "Traceback" not in text and "model.family" in text, text
    assert main(["ckpt", "export", str(ft), "--format", "safetensors", "--out", str(tmp_path / "s")]) == 2
    assert "merge-adapter" in err()
    assert not any(os.path.exists(tmp_path / n) for n in ("m", "p", "s"))


def test_resuming_over_other_base_weights_is_refused(runs, tmp_path):
    root, tok, base, ft, _ = runs
    import shutil
    found = find_weights(str(base))
    other = str(tmp_path / "other")
    write_model_dir(other, found.recipe, {k: v * 1.01 for k, v in found.tensors().items()})
    again = tmp_path / "again"
    shutil.copytree(ft, again)
    with pytest.raises(UserError, match=r"key 'train.init_from'.*base mismatch"):
        _quiet(_sft_recipe(root, tok, again, other, steps=8))
