"""Prefix tuning, prompt tuning and LLaMA-Adapter (PEFT's adaption prompt) against peft.PeftModel over the
transformers model: a tiny random llama built locally is imported into naohai; naohai's adapter gets random
values, is exported in PEFT's folder format and loaded by PEFT over the original model (logits equal), and a
PEFT adapter with random values is imported into naohai (logits equal).  PEFT's logits of a prompt-tuned
model include the virtual tokens' rows; the real tokens' rows are compared."""
import os

import numpy as np
import pytest

import hf_models
from naohai.cli import main
from naohai.config import FinetuneConfig
from naohai.convert.peft import read_peft, write_peft
from naohai.errors import UserError
from naohai.model.finetune import apply_finetune, method_params

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SEQ = 56           # the model's tokens; up to 8 virtual ones fit the 64 positions of the tiny llama
N = 5

CONFIGS = {"prefix": FinetuneConfig(method="prefix", num_virtual_tokens=N),
           "prompt": FinetuneConfig(method="prompt", num_virtual_tokens=N),
           "llama_adapter": FinetuneConfig(method="llama_adapter", num_virtual_tokens=N, adapter_layers=1)}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_prompts")
    src = str(root / "llama")
    hf_models.build("llama", src)
    base = str(root / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", base, f"model.seq_length={SEQ}",
                 f"model.max_positions={hf_models.SEQ}"]) == 0
    return src, base


def _ids():
    return hf_models.windows()[:2, :SEQ]


def _naohai(base, ft, values=None, seed=3):
    """(logits, trained tensors) of the model at ``base`` with method ``ft``, its tensors random non-zero
    (or ``values``)."""
    from mindspore import Tensor
    from naohai.checkpoint.weights import load_model
    _, model = load_model(base)
    apply_finetune(model, ft, seed=0)
    rng = np.random.default_rng(seed)
    for p in method_params(model):
        if values is not None:
            p.set_data(Tensor(values[p.name]))
        else:                 # the gate too, which starts at zero
            p.set_data(Tensor(rng.normal(0, 1.0 if "gate" not in p.name else 0.7, p.shape).astype(np.float32)))
    model.set_train(False)
    logits = model.logits(Tensor(_ids().astype(np.int32))).asnumpy()
    return logits, {p.name: p.asnumpy() for p in method_params(model)}


def _peft_logits(src, adapter, n_virtual):
    from transformers import AutoModelForCausalLM
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src), adapter).eval()
    logits = hf_models.hf_logits(model, _ids())
    return logits[:, n_virtual:]


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_naohai_adapter_loads_in_peft_with_equal_logits(llama, tmp_path, method):
    from transformers import AutoModelForCausalLM
    src, base = llama
    ft = CONFIGS[method]
    ours, tensors = _naohai(base, ft)
    adapter = str(tmp_path / "adapter")
    write_peft(adapter, _recipe(base).model, ft, tensors, base_model=src)
    theirs = _peft_logits(src, adapter, N if method == "prompt" else 0)
    plain = hf_models.hf_logits(AutoModelForCausalLM.from_pretrained(src).eval(), _ids())
    assert np.abs(theirs - plain).max() > 1e-2                          # the adapter changes the logits ...
    print(f"export {method}: max |naohai - peft| {np.abs(ours - theirs).max():.2e}, "
          f"adapter's effect {np.abs(theirs - plain).max():.2e}")
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()   # ... as naohai's does
    with pytest.raises(UserError, match="already exists"):
        write_peft(adapter, _recipe(base).model, ft, tensors)


def _peft_greedy(model, prompt, new):
    """Greedy continuation by ``model``'s full forward over the whole sequence at every step (no cache).
    PEFT's own ``generate`` is not the reference: with transformers 5.24 / peft 0.21 it continued a
    prefix-tuned model exactly as the base model (the prefix lost in generation), while its forward
    agrees with naohai's logits (the tests above)."""
    ids = list(prompt)
    for _ in range(new):
        ids.append(int(np.argmax(hf_models.hf_logits(model, np.asarray([ids]))[0, -1])))
    return ids[len(prompt):]


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_cached_generation_equals_peft_recompute(llama, tmp_path, method):
    """naohai's key/value-cached greedy generation (prefix tuning's virtual keys/values in every layer's
    cache, prompt tuning's virtual tokens, LLaMA-Adapter's gated prompts) on two left-padded prompts gives
    the greedy tokens of ``peft.PeftModel`` over the transformers model recomputing the whole sequence."""
    from mindspore import Tensor
    from transformers import AutoModelForCausalLM
    from naohai.checkpoint.weights import load_model
    from naohai.generate import CachedDecoder, SamplingConfig
    src, base = llama
    ft = CONFIGS[method]
    _, tensors = _naohai(base, ft)
    adapter = str(tmp_path / "adapter")
    write_peft(adapter, _recipe(base).model, ft, tensors, base_model=src)
    peft_model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(src), adapter).eval()
    prompts = [list(map(int, _ids()[0, :9])), list(map(int, _ids()[1, :4]))]
    found, model = load_model(base)
    apply_finetune(model, ft, seed=0)
    for p in method_params(model):
        p.set_data(Tensor(tensors[p.name]))
    model.set_train(False)
    cfg = found.recipe.model
    ours = CachedDecoder(model, cfg, pad_id=0).generate_ids(prompts, SamplingConfig(max_new_tokens=6, temperature=0),
                                                           cfg.vocab_size)
    theirs = [_peft_greedy(peft_model, p, 6) for p in prompts]
    plain = [_peft_greedy(AutoModelForCausalLM.from_pretrained(src).eval(), p, 6) for p in prompts]
    print(f"{method}: naohai {ours}, peft {theirs}, base model {plain}")
    assert theirs != plain                                   # the adapter changes the continuation ...
    assert ours == theirs                                    # ... as naohai's cached generation does


def _recipe(base):
    from naohai.checkpoint.weights import find_weights
    return find_weights(base).recipe


def _peft_made(src, out, method):
    """An adapter made by peft itself, its tensors random (the gate non-zero)."""
    import torch
    from transformers import AutoModelForCausalLM
    config = {"prefix": peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N),
              "prompt": peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N),
              "llama_adapter": peft.AdaptionPromptConfig(task_type="CAUSAL_LM", adapter_len=N, adapter_layers=1)}
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(src), config[method])
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen))
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_peft_adapter_imports_with_equal_logits(llama, tmp_path, method):
    src, base = llama
    adapter = _peft_made(src, str(tmp_path / "adapter"), method)
    fields, tensors = read_peft(adapter, _recipe(base).model)
    assert fields["method"] == method
    ft = FinetuneConfig(**fields)
    ours, _ = _naohai(base, ft, values=tensors)
    theirs = _peft_logits(src, adapter, N if method == "prompt" else 0)
    print(f"import {method}: max |naohai - peft| {np.abs(ours - theirs).max():.2e}")
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_cli_import_reads_serves_and_exports_back(llama, tmp_path, capsys, method):
    """``ckpt import --from peft`` writes an adapter folder; eval reads it over its base (logits as PEFT's);
    generate runs it; ``ckpt export --to peft`` gives PEFT's own."""
    import json
    from mindspore import Tensor
    from naohai.checkpoint.weights import load_model
    src, base = llama
    adapter = _peft_made(src, str(tmp_path / "adapter"), method)
    out = str(tmp_path / "naohai-adapter")
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", out]) == 0
    found, model = load_model(out)
    assert found.kind == "adapter folder" and found.recipe.finetune.method == method
    model.set_train(False)
    ours = model.logits(Tensor(_ids().astype(np.int32))).asnumpy()
    theirs = _peft_logits(src, adapter, N if method == "prompt" else 0)
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()
    np.save(tmp_path / "ids.npy", hf_models.windows()[:2, :SEQ + 1])
    capsys.readouterr()
    assert main(["eval", out, "--ids", str(tmp_path / "ids.npy"), "--json"]) == 0
    assert np.isfinite(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["loss"])
    code = main(["generate", out, "--prompt", "The for", "--max-new-tokens", "3", "--temperature", "0"])
    assert code == 0, capsys.readouterr().err
    for refused in (["ckpt", "merge-adapter", out, "--out", str(tmp_path / "merged")],):
        assert main(refused) == 2
        assert "does not fold" in capsys.readouterr().err
    again = str(tmp_path / "again")
    assert main(["ckpt", "export", out, "--to", "peft", "--out", again]) == 0
    assert np.abs(_peft_logits(src, again, N if method == "prompt" else 0) - theirs).max() <= 1e-5


@pytest.mark.parametrize("damage, key", [
    ("type", "peft_type"), ("submodules", "num_transformer_submodules"), ("shape", "prompt_embeddings"),
    ("virtual", "num_virtual_tokens"),
])
def test_bad_peft_prompt_folders_exit_2(llama, tmp_path, capsys, damage, key):
    import json
    from safetensors.numpy import load_file, save_file
    src, base = llama
    adapter = _peft_made(src, str(tmp_path / "adapter"), "prefix")
    path = os.path.join(adapter, "adapter_config.json")
    config = json.load(open(path))
    if damage == "type":
        config["peft_type"] = "IA3"
    elif damage == "submodules":
        config["num_transformer_submodules"] = 2
    elif damage == "virtual":
        config["num_virtual_tokens"] = 0
    elif damage == "shape":
        weights = os.path.join(adapter, "adapter_model.safetensors")
        save_file({"prompt_embeddings": load_file(weights)["prompt_embeddings"][:, :-1].copy()}, weights)
    json.dump(config, open(path, "w"))
    capsys.readouterr()
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"'{key}'" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "o")


@pytest.fixture(scope="module")
def pristine(llama, tmp_path_factory):
    """``pristine(method)``: a folder peft made for ``method`` (prefix, prompt, llama_adapter), made once."""
    src, _ = llama
    root, made = tmp_path_factory.mktemp("pristine"), {}

    def get(method):
        if method not in made:
            made[method] = _peft_made(src, str(root / method), method)
        return made[method]
    return get


@pytest.mark.parametrize("method, key, value, rule", [
    ("prefix", "num_virtual_tokens", float("inf"), "finite integer"),
    ("prefix", "num_virtual_tokens", float("nan"), "finite integer"),
    ("prefix", "num_virtual_tokens", 10 ** 30, "1 <= num_virtual_tokens <= 2147483647"),
    ("prefix", "num_virtual_tokens", 10 ** 400, "1 <= num_virtual_tokens <= 2147483647"),
    ("prefix", "num_virtual_tokens", 0, "1 <= num_virtual_tokens <= 2147483647"),
    ("prefix", "num_virtual_tokens", -5, "1 <= num_virtual_tokens <= 2147483647"),
    ("prefix", "num_virtual_tokens", True, "type: integer"),
    ("prefix", "num_virtual_tokens", "5", "type: integer"),
    ("prefix", "num_virtual_tokens", 5.5, "type: integer"),
    # 9 virtual tokens + the base's 56 > its 64 positions (before the tensor's shape is compared)
    ("prefix", "num_virtual_tokens", 9, "num_virtual_tokens + the base's seq_length <= its max_positions"),
    ("prompt", "num_virtual_tokens", 10 ** 6, "num_virtual_tokens + the base's seq_length <= its max_positions"),
    ("prefix", "num_transformer_submodules", float("nan"), "finite integer"),
    ("prefix", "num_transformer_submodules", float("inf"), "finite integer"),
    ("prefix", "num_transformer_submodules", "x", "type: integer"),
    ("prefix", "num_transformer_submodules", [1], "type: integer"),
    ("prefix", "num_transformer_submodules", 1.5, "type: integer"),     # int(1.5) was read as 1
    ("prefix", "num_transformer_submodules", 0, "1 <= num_transformer_submodules <= 2147483647"),
    ("prefix", "num_transformer_submodules", 2, "num_transformer_submodules == 1"),
    ("prefix", "peft_type", ["PREFIX_TUNING"], "type: string"),          # was TypeError: unhashable type
    ("llama_adapter", "adapter_len", float("inf"), "finite integer"),
    ("llama_adapter", "adapter_len", 10 ** 30, "1 <= adapter_len <= 2147483647"),
    ("llama_adapter", "adapter_len", -1, "1 <= adapter_len <= 2147483647"),
    ("llama_adapter", "adapter_len", "5", "type: integer"),
    ("llama_adapter", "adapter_layers", float("nan"), "finite integer"),
    ("llama_adapter", "adapter_layers", True, "type: integer"),
    ("llama_adapter", "adapter_layers", 0, "1 <= adapter_layers <= 2147483647"),
    ("llama_adapter", "adapter_layers", 3, "1 <= adapter_layers <= the base's num_layers"),    # the base has 2
])
def test_bad_peft_prompt_numbers_exit_2_naming_the_key_and_rule(llama, pristine, tmp_path, capsys, method, key,
                                                                value, rule):
    """Every number naohai reads from a prefix / prompt / adaption-prompt adapter_config.json: NaN, Infinity,
    huge, zero, negative, a boolean, string or list exits 2 naming the file, the key and the rule, and writes
    nothing (a probe found num_transformer_submodules NaN / "x" / a list tracebacks, 1.5 read as 1)."""
    import json
    import shutil
    _, base = llama
    adapter = str(tmp_path / "adapter")
    shutil.copytree(pristine(method), adapter)
    path = os.path.join(adapter, "adapter_config.json")
    config = json.load(open(path))
    config[key] = value
    json.dump(config, open(path, "w"))
    capsys.readouterr()
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and path in err, err
    assert f"key '{key}'" in err and f"(rule: {rule})" in err, err
    assert not os.path.exists(tmp_path / "o")


def test_peft_prompt_with_nan_values_exits_2(llama, pristine, tmp_path, capsys):
    """A prompt tensor holding NaN is refused naming the file and the tensor (its outputs would be NaN)."""
    import shutil
    from safetensors.numpy import load_file, save_file
    _, base = llama
    adapter = str(tmp_path / "adapter")
    shutil.copytree(pristine("prompt"), adapter)
    weights = os.path.join(adapter, "adapter_model.safetensors")
    tensors = load_file(weights)
    value = tensors["prompt_embeddings"].copy()
    value[1, 2] = np.inf
    tensors["prompt_embeddings"] = value
    save_file(tensors, weights)
    capsys.readouterr()
    assert main(["ckpt", "import", "--from", "peft", adapter, "--base", base, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and weights in err and "key 'prompt_embeddings'" in err, err
    assert "(rule: finite values)" in err and not os.path.exists(tmp_path / "o")
