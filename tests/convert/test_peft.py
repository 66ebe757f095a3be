"""LoRA adapters exported in PEFT's format, against peft.PeftModel over the transformers model: a tiny
llama built locally, imported into naohai, adapted (random B so the adapter matters), exported; PEFT
loads the folder over the original transformers model and its logits equal naohai's."""
import json
import os

import numpy as np
import pytest

import hf_models
from naohai.cli import main
from naohai.config import FinetuneConfig
from naohai.convert.peft import CONFIG, write_peft_lora
from naohai.errors import UserError
from naohai.model.lora import adapter_params, apply_lora

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = r"attention\.(q|k|v|out)$|mlp\.(gate|up|down)$"


def test_lora_adapter_loads_in_peft_with_equal_logits(tmp_path):
    from mindspore import Tensor
    from transformers import AutoModelForCausalLM
    from naohai.checkpoint.weights import load_model

    src = str(tmp_path / "llama")
    hf_models.build("llama", src)
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out, f"model.seq_length={hf_models.SEQ}"]) == 0
    found, model = load_model(out)
    recipe = found.recipe
    ft = FinetuneConfig(rank=4, alpha=8.0, targets=TARGETS)
    names = apply_lora(model, ft, seed=0)
    assert len(names) == 2 * 7
    rng = np.random.default_rng(1)
    for p in adapter_params(model):
        if p.name.endswith("lora_b"):
            p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    model.set_train(False)
    ids = hf_models.windows()[:2, :-1]
    ours = model.logits(Tensor(ids.astype(np.int32))).asnumpy()

    adapter = str(tmp_path / "adapter")
    write_peft_lora(adapter, recipe.model, {p.name: p.asnumpy() for p in adapter_params(model)}, rank=4, alpha=8.0,
                    base_model=src)
    config = json.load(open(os.path.join(adapter, CONFIG)))
    assert config["r"] == 4 and len(config["target_modules"]) == 14
    base = AutoModelForCausalLM.from_pretrained(src)
    plain = hf_models.hf_logits(base.eval(), ids)
    theirs = hf_models.hf_logits(peft.PeftModel.from_pretrained(base, adapter).eval(), ids)
    assert np.abs(theirs - plain).max() > 1e-2                     # the adapter changes the logits ...
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()   # ... as naohai's does
    with pytest.raises(UserError, match="already exists"):
        write_peft_lora(adapter, recipe.model, {}, rank=4, alpha=8.0)


def _peft_adapter(src, out, targets=("q_proj", "v_proj", "down_proj", "gate_proj"), r=4, alpha=16):
    """A LoRA adapter made by peft itself over the transformers model at ``src`` (random B, so it matters)."""
    import torch
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(src)
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                      lora_dropout=0.0))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def imported_llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_import")
    src = str(root / "llama")
    hf_models.build("llama", src)
    base = str(root / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", base, f"model.seq_length={hf_models.SEQ}"]) == 0
    return root, src, base


def test_peft_trained_adapter_imports_with_equal_logits_and_serves(imported_llama, tmp_path, capsys):
    from mindspore import Tensor
    from transformers import AutoModelForCausalLM
    from naohai.checkpoint.weights import load_model

    _, src, base = imported_llama
    adapter = _peft_adapter(src, str(tmp_path / "adapter"))
    out = str(tmp_path / "naohai-adapter")
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", out]) == 0
    assert sorted(os.listdir(out)) == ["adapter.ckpt", "adapter.json", "recipe.yaml"]
    found, model = load_model(out)
    assert found.kind == "adapter folder" and found.recipe.finetune.rank == 4
    assert len(found.adapters()) == 2 * 2 * 4               # 2 layers x 4 modules x (A, B)
    ids = hf_models.windows()[:2, :-1]
    model.set_train(False)
    ours = model.logits(Tensor(ids.astype(np.int32))).asnumpy()
    torch_base = AutoModelForCausalLM.from_pretrained(src)
    plain = hf_models.hf_logits(torch_base.eval(), ids)
    theirs = hf_models.hf_logits(peft.PeftModel.from_pretrained(torch_base, adapter).eval(), ids)
    assert np.abs(theirs - plain).max() > 1e-2
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()
    # generate and eval run on the adapter folder, and on its merged model
    np.save(tmp_path / "ids.npy", hf_models.windows()[:2])
    merged = str(tmp_path / "merged")
    assert main(["ckpt", "merge-adapter", out, "--out", merged]) == 0
    for model_path in (out, merged):
        assert main(["generate", model_path, "--prompt", "The for", "--max-new-tokens", "4", "--temperature", "0"]) == 0
        capsys.readouterr()
        assert main(["eval", model_path, "--ids", str(tmp_path / "ids.npy"), "--json"]) == 0
        loss = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert np.isfinite(loss["loss"])
    _, merged_model = load_model(merged)
    merged_model.set_train(False)
    np.testing.assert_allclose(merged_model.logits(Tensor(ids.astype(np.int32))).asnumpy(), ours, atol=1e-5)
    # and back out: our export of the imported adapter is peft's own
    again = str(tmp_path / "again")
    assert main(["ckpt", "export", out, "--to", "peft", "--out", again]) == 0
    exported = hf_models.hf_logits(peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(src), again).eval(), ids)
    assert np.abs(exported - theirs).max() <= 1e-5


def test_bfloat16_and_float16_adapters_import_as_peft_reads_them(imported_llama, tmp_path):
    """PEFT saves an adapter in its model's dtype: a bf16 or fp16 model's adapter is BF16 / F16 in the safetensors
    (numpy has no bfloat16).  naohai reads each value exactly, as float32, and its logits equal PEFT's over the
    float32 base (PEFT upcasts a half-precision adapter to float32 on load)."""
    import torch
    from mindspore import Tensor
    from transformers import AutoModelForCausalLM
    from naohai.checkpoint.weights import load_model

    _, src, base = imported_llama
    adapter = _peft_adapter(src, str(tmp_path / "adapter32"), targets=("q_proj", "down_proj"))
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src), adapter)
    ids = hf_models.windows()[:2, :-1]
    for dtype in (torch.bfloat16, torch.float16):
        half = str(tmp_path / f"adapter-{str(dtype)[6:]}")
        model.to(dtype).save_pretrained(half)
        stored = {k: v.float().numpy() for k, v in peft.utils.load_peft_weights(half).items()}
        out = str(tmp_path / f"naohai-{str(dtype)[6:]}")
        assert main(["ckpt", "import", "--from", "peft", half, "--base", base, "--out", out]) == 0
        found, ours = load_model(out)
        got = {n: np.asarray(v) for n, v in found.adapters().items()}
        a = stored["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
        assert any(np.array_equal(v, a) for v in got.values())        # bit for bit the stored half values
        ours.set_train(False)
        logits = ours.logits(Tensor(ids.astype(np.int32))).asnumpy()
        theirs = hf_models.hf_logits(peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(src), half).eval(), ids)
        assert np.abs(logits - theirs).max() <= 1e-4, (dtype, np.abs(logits - theirs).max())


def _edit_config(folder, **changes):
    path = os.path.join(folder, CONFIG)
    config = json.load(open(path))
    config.update(changes)
    json.dump(config, open(path, "w"))


@pytest.mark.parametrize("damage, where, key", [
    ("missing", "nowhere", None),
    ("no_config", "adapter", None),
    ("bad_json", "adapter_config.json", None),
    ("key_twice", "adapter_config.json", "r"),
    ("rank0", "adapter_config.json", "r"),
    ("dora", "adapter_config.json", "use_dora"),
    ("garbage_weights", "adapter_model.safetensors", None),
    ("wrong_rank", "adapter_model.safetensors", "r"),
    ("other_base", "adapter_model.safetensors", "target_modules"),
    ("no_base", "command line", "--base"),
    ("int_weights", "adapter_model.safetensors", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("nan_weights", "adapter_model.safetensors", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("f64_overflow", "adapter_model.safetensors", "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("header_beyond_file", "adapter_model.safetensors", None),
    ("offsets_beyond_data", "adapter_model.safetensors", None),
    ("shape_not_bytes", "adapter_model.safetensors", None),
])
def test_bad_peft_imports_exit_2_naming_the_file(imported_llama, tmp_path, capsys, damage, where, key):
    from safetensors.numpy import load_file, save_file
    root, src, base = imported_llama
    adapter = str(tmp_path / "adapter")
    _peft_adapter(src, adapter, targets=("q_proj", "v_proj"))
    weights = os.path.join(adapter, "adapter_model.safetensors")
    argv = ["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", str(tmp_path / "out")]
    if damage == "missing":
        argv[4] = str(tmp_path / "nowhere")
    elif damage == "no_config":
        os.remove(os.path.join(adapter, CONFIG))
    elif damage == "bad_json":
        open(os.path.join(adapter, CONFIG), "w").write("{not json")
    elif damage == "key_twice":      # json keeps the last 'r' silently
        text = open(os.path.join(adapter, CONFIG)).read()
        open(os.path.join(adapter, CONFIG), "w").write(text.replace("{", '{"r": 64, ', 1))
    elif damage == "rank0":
        _edit_config(adapter, r=0)
    elif damage == "dora":
        _edit_config(adapter, use_dora=True)
    elif damage == "garbage_weights":
        open(weights, "wb").write(b"\x00garbage")
    elif damage in ("header_beyond_file", "offsets_beyond_data", "shape_not_bytes"):
        raw = open(weights, "rb").read()
        size = int(np.frombuffer(raw[:8], "<u8")[0])
        header = json.loads(raw[8:8 + size])
        entry = header["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
        if damage == "header_beyond_file":
            raw = np.array([len(raw) * 4], "<u8").tobytes() + raw[8:]
        else:
            if damage == "offsets_beyond_data":
                entry["data_offsets"] = [entry["data_offsets"][0], len(raw) * 2]
            else:
                entry["shape"] = [entry["shape"][0] + 1, entry["shape"][1]]
            text = json.dumps(header).encode()
            raw = np.array([len(text)], "<u8").tobytes() + text + raw[8 + size:]
        open(weights, "wb").write(raw)
    elif damage == "wrong_rank":
        _edit_config(adapter, r=3)
    elif damage == "other_base":
        tensors = load_file(weights)
        tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
        save_file(tensors, weights)
    elif damage == "no_base":
        argv = argv[:5] + argv[7:]
    elif damage in ("int_weights", "nan_weights", "f64_overflow"):
        tensors = load_file(weights)
        name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        value = tensors[name]
        if damage == "int_weights":            # read as float32 it would be numbers nobody trained
            value = np.ones(value.shape, np.int32)
        elif damage == "nan_weights":
            value = value.copy()
            value[0, 0] = np.nan
        else:                                  # finite in float64, inf in float32 (naohai's type)
            value = value.astype(np.float64)
            value[0, 0] = 1e300
        tensors[name] = value
        save_file(tensors, weights)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and where in err, err
    if key:
        assert f"'{key}'" in err, err
    assert not os.path.exists(tmp_path / "out")


@pytest.fixture(scope="module")
def lora_adapter(imported_llama):
    """A pristine LoRA adapter made by peft (r 4, q_proj and v_proj of the hidden-144 llama), copied per test."""
    root, src, _ = imported_llama
    return _peft_adapter(src, str(root / "lora-r4"), targets=("q_proj", "v_proj"), r=4, alpha=16)


FLOAT16_MAX = float(np.finfo(np.float16).max)      # 65504: the largest LoRA scale the compute dtype holds


@pytest.mark.parametrize("key, value, rule", [
    ("lora_alpha", float("inf"), "finite number"),           # json reads Infinity and NaN
    ("lora_alpha", float("nan"), "finite number"),
    ("lora_alpha", 10 ** 400, "finite number"),               # a JSON integer beyond float's range
    ("lora_alpha", 4 * FLOAT16_MAX + 1, "0 < lora_alpha / r <= 65504"),
    ("lora_alpha", 1e300, "0 < lora_alpha / r <= 65504"),
    ("lora_alpha", 0, "lora_alpha > 0"),
    ("lora_alpha", -16, "lora_alpha > 0"),
    ("lora_alpha", True, "type: number"),
    ("lora_alpha", "16", "type: number"),
    ("lora_alpha", [16], "type: number"),
    ("lora_alpha", None, "type: number"),
    ("lora_dropout", float("nan"), "finite number"),
    ("lora_dropout", float("inf"), "finite number"),
    ("lora_dropout", 1.0, "lora_dropout >= 0 and < 1"),
    ("lora_dropout", -0.1, "lora_dropout >= 0 and < 1"),
    ("lora_dropout", "0.1", "type: number"),
    ("lora_dropout", True, "type: number"),
    ("r", 10 ** 30, "1 <= r <= 2147483647"),
    ("r", 10 ** 400, "1 <= r <= 2147483647"),
    ("r", 145, "r <= the smallest dimension of each adapted weight"),     # q_proj / v_proj are [144, 144]
    ("r", -4, "1 <= r <= 2147483647"),
    ("r", 4.5, "type: integer"),
    ("r", float("inf"), "finite integer"),
    ("r", "4", "type: integer"),
    ("r", [4], "type: integer"),
    ("r", False, "type: integer"),
    ("peft_type", ["LORA"], "type: string"),
])
def test_bad_lora_config_numbers_exit_2_naming_the_key_and_rule(lora_adapter, imported_llama, tmp_path, capsys,
                                                                  key, value, rule):
    """Every number naohai reads from a LoRA adapter_config.json: NaN, Infinity, huge, zero, negative, a boolean,
    string or list is refused before anything is written, naming the file, the key and the rule (a probe found
    lora_alpha: Infinity accepted; lora_dropout "x" was a ValueError traceback)."""
    import shutil
    _, _, base = imported_llama
    adapter = str(tmp_path / "adapter")
    shutil.copytree(lora_adapter, adapter)
    _edit_config(adapter, **{key: value})
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and os.path.join(adapter, CONFIG) in err, err
    assert f"key '{key}'" in err and f"(rule: {rule})" in err, err
    assert not out.exists()


@pytest.mark.parametrize("changes", [{"lora_alpha": 4 * FLOAT16_MAX}, {"lora_dropout": None}, {"r": 4.0}])
def test_lora_config_numbers_at_the_bounds_import(lora_adapter, imported_llama, tmp_path, changes):
    """The largest scale float16 holds (alpha / r = 65504), PEFT's null dropout (read as 0) and r written 4.0
    import; the adapter folder's recipe holds them."""
    import shutil
    from naohai.checkpoint.weights import find_weights
    _, _, base = imported_llama
    adapter = str(tmp_path / "adapter")
    shutil.copytree(lora_adapter, adapter)
    _edit_config(adapter, **changes)
    out = str(tmp_path / "out")
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", out]) == 0
    ft = find_weights(out).recipe.finetune
    assert ft.rank == 4 and isinstance(ft.rank, int)
    assert ft.alpha == changes.get("lora_alpha", 16) and ft.dropout == 0.0
    assert ft.alpha / ft.rank <= FLOAT16_MAX and np.isfinite(np.float16(ft.alpha / ft.rank))


def test_a_model_trained_with_eod_resets_exports_and_says_what_the_export_does_not_carry(imported_llama, tmp_path):
    """model.eod_reset / eod_reset_positions / loss_pad_id are how naohai packed windows and counted the loss,
    not the network: an SFT run sets eod_reset, and its adapter must leave naohai (the export refused it).  It is
    written, with a note for each; query_layer, which is the network, is still refused."""
    import dataclasses
    from naohai.checkpoint.weights import find_weights
    from naohai.convert.hf.arch import training_conventions
    _, _, base = imported_llama
    cfg = find_weights(base).recipe.model
    assert training_conventions(cfg) == []
    trained = dataclasses.replace(cfg, eod_reset=True, eod_reset_positions=True, eod_id=1, loss_pad_id=0)
    notes = training_conventions(trained)
    assert len(notes) == 2 and "attention and positions at each EOD (id 1)" in notes[0] and "loss_pad_id 0" in notes[1]
    a = np.zeros((4, 144), np.float32)
    b = np.zeros((144, 4), np.float32)
    files = write_peft_lora(str(tmp_path / "adapter"), trained, {"layers.0.attention.q.lora_a": a,
                                                                  "layers.0.attention.q.lora_b": b}, rank=4, alpha=8.0)
    assert files == [CONFIG, "adapter_model.safetensors"]
    with pytest.raises(UserError, match="no top query layer"):
        write_peft_lora(str(tmp_path / "other"), dataclasses.replace(cfg, query_layer=True),
                        {"layers.0.attention.q.lora_a": a, "layers.0.attention.q.lora_b": b}, rank=4, alpha=8.0)
