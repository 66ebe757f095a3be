"""Hugging Face folders in and out, per family, against transformers itself (tiny random models built
locally; see hf_models.py): import -> `naohai eval --ids` equals transformers' mean token NLL, logits
equal, export -> `from_pretrained` loads every tensor and gives the same logits."""
import copy
import json
import os

import numpy as np
import pytest

import hf_models
from naohai.cli import main

pytest.importorskip("transformers")

FAMILIES = list(hf_models.configs())


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """model_type -> (transformers model, its saved folder); built once per module."""
    root = tmp_path_factory.mktemp("hf")
    return {name: (hf_models.build(name, str(root / name)), str(root / name)) for name in FAMILIES}


def _naohai_logits(folder, ids):
    from mindspore import Tensor
    from naohai.checkpoint.weights import load_model
    found, model = load_model(folder)
    recipe = found.recipe
    model.set_train(False)
    return recipe, model.logits(Tensor(ids.astype(np.int32))).asnumpy()


@pytest.mark.parametrize("name", FAMILIES)
def test_import_eval_logits_export(name, built, tmp_path, capsys):
    model, src = built[name]
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out, f"model.seq_length={hf_models.SEQ}"]) == 0
    windows = hf_models.windows()
    np.save(tmp_path / "w.npy", windows)
    capsys.readouterr()
    assert main(["eval", out, "--ids", str(tmp_path / "w.npy"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["loss"]
    want = hf_models.hf_mean_nll(model, windows)
    assert abs(got - want) <= 1e-5 * want, (name, got, want)

    ids = windows[:2, :-1]
    recipe, ours = _naohai_logits(out, ids)
    ref = hf_models.hf_logits(model, ids)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= 1e-4, (name, np.abs(ours - ref).max())

    prompt = "The for statement 深度"       # greedy generation of 32 tokens, token for token
    capsys.readouterr()
    assert main(["generate", out, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "32"]) == 0
    printed = capsys.readouterr().out
    from naohai.data.tokenizer import Tokenizer
    tok = Tokenizer.load(os.path.join(out, "tokenizer.json"))
    want_ids = hf_models.hf_greedy(model, tok.encode(prompt))
    assert printed == prompt + tok.decode(want_ids) + "\n", (name, printed)
    from naohai.generate import Generator, SamplingConfig
    gen = Generator(out, device="CPU")
    got_ids = gen.decoder.generate_ids([tok.encode(prompt)], SamplingConfig(max_new_tokens=32, temperature=0),
                                       hf_models.VOCAB, stop_ids=())[0]
    want_ids = hf_models.hf_greedy(model, tok.encode(prompt), stop=False)
    assert got_ids == want_ids and len(want_ids) == 32, (name, got_ids, want_ids)

    exported = str(tmp_path / "exported")
    assert main(["ckpt", "export", out, "--to", "hf", "--out", exported]) == 0
    from transformers import AutoModelForCausalLM
    back, info = AutoModelForCausalLM.from_pretrained(exported, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert type(back) is type(model)
    assert np.abs(hf_models.hf_logits(back.eval(), ids) - ref).max() <= 1e-5


@pytest.mark.parametrize("kind", ["llama3", "linear"])
def test_rope_frequencies_are_transformers(kind):
    """Llama 3.1's own settings (head 128, theta 500,000, factor 8, bands 1 / 4 over 8,192 positions): naohai's
    frequencies equal transformers' (float32 there, float64 here), and the scaling moves them."""
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from naohai.model.config import ModelConfig
    from naohai.model.layers import rope_frequencies
    params = {"rope_type": kind, "rope_theta": 500000.0, "factor": 8.0}
    if kind == "llama3":
        params.update(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=params)
    want, _ = ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))
    cfg = ModelConfig(family="llama", hidden_size=4096, num_heads=32, rope_base=500000.0, rope_scaling=kind,
                      rope_factor=8.0)
    got = rope_frequencies(128, 500000.0, cfg)
    np.testing.assert_allclose(got, want.double().numpy(), rtol=1e-6)
    assert not np.allclose(got, rope_frequencies(128, 500000.0), rtol=1e-3)


def test_a_sliding_window_is_the_imported_models_position_limit(tmp_path, capsys):
    """Mistral-7B-v0.1 attends over a 4,096-token window; naohai attends to every earlier position, the same
    computation on sequences no longer than the window.  A window of 32 in a 64-position model: the import
    numbers 32 positions (seq_length 32), its logits on 32 tokens are transformers' (which differ from full
    attention beyond them), and a longer model.seq_length exits 2."""
    model = hf_models.build("mistral", str(tmp_path / "mistral-w32"), sliding_window=32)
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", str(tmp_path / "mistral-w32"), "--from", "hf", "--out", out]) == 0
    recipe, ours = _naohai_logits(out, hf_models.windows()[:2, :32])
    assert (recipe.model.max_positions, recipe.model.seq_length) == (32, 32)
    assert np.abs(ours - hf_models.hf_logits(model, hf_models.windows()[:2, :32])).max() <= 1e-4
    full = hf_models.build("mistral", str(tmp_path / "mistral-full"))     # same seed: the same weights
    ids = hf_models.windows()[:1, :64]
    assert np.abs(hf_models.hf_logits(model, ids)[:, 40:] - hf_models.hf_logits(full, ids)[:, 40:]).max() > 1e-3
    capsys.readouterr()
    assert main(["ckpt", "import", str(tmp_path / "mistral-w32"), "--from", "hf", "--out", str(tmp_path / "long"),
                 "model.seq_length=64"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "seq_length" in err and "max_positions 32" in err and "Traceback" not in err, err
    assert not os.path.exists(tmp_path / "long")


def test_sharded_export_reads_back_and_half_precision_upcasts(built, tmp_path):
    """--shard-size splits the weights over shards + index; a bf16 / fp16 folder imports as float32."""
    import torch
    from naohai.convert.hf.convert import read_hf
    model, src = built["llama"]
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out]) == 0
    sharded = str(tmp_path / "sharded")
    assert main(["ckpt", "export", out, "--to", "hf", "--out", sharded, "--shard-size", "100KB"]) == 0
    shards = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    _, a = read_hf(src)
    _, b = read_hf(sharded)
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)
    for dtype in (torch.bfloat16, torch.float16):
        half = str(tmp_path / f"half-{dtype}")
        copy.deepcopy(model).to(dtype).save_pretrained(half)
        _, h = read_hf(half)
        for k, v in h.items():
            assert v.dtype == np.float32
            want = a[k].astype(np.float32)
            expect = torch.as_tensor(want).to(dtype).to(torch.float32).numpy()   # the rounding of that dtype
            assert np.array_equal(v, expect), k


def _edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    config = json.load(open(path))
    config.update(changes)
    json.dump(config, open(path, "w"))


def test_bad_folders_exit_2_naming_file_and_key(built, tmp_path, capsys):
    import shutil
    _, src = built["llama"]

    def attempt(folder, *needles):
        capsys.readouterr()
        assert main(["ckpt", "import", folder, "--from", "hf", "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("naohai: error:") and "Traceback" not in err and err.count("\n") <= 6, err
        flat = " ".join(err.split())
        for needle in needles:
            assert needle in flat, (needle, err)
        assert not os.path.exists(tmp_path / "out")

    def copy(name):
        folder = str(tmp_path / name)
        shutil.copytree(src, folder)
        return folder

    attempt(_with(copy("unknown"), model_type="mamba"), "config.json", "key 'model_type'", "'mamba'")
    attempt(_with(copy("scaled"), rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}),
            "config.json", "rope_parameters.rope_type", "yarn")
    attempt(_with(copy("legacy-scaled"), rope_scaling={"type": "dynamic", "factor": 2.0}),
            "key 'rope_scaling.rope_type'", "dynamic")
    # the scalings naohai computes (linear, llama3) need their settings
    attempt(_with(copy("llama3-no-bands"), rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            "key 'rope_scaling.low_freq_factor'", "is missing")
    attempt(_with(copy("linear-inf"), rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                        "factor": float("inf")}),
            "key 'rope_parameters.factor'", "finite number")
    attempt(_with(copy("shape"), intermediate_size=201), "model.safetensors", "mlp.gate_proj.weight", "(201, 144)",
            "config.json")
    attempt(_with(copy("act"), hidden_act="relu"), "key 'hidden_act'", "'relu'")
    # a head count of 0 was a ZeroDivisionError traceback; the shape keys are positive integers
    attempt(_with(copy("heads0"), num_attention_heads=0), "key 'num_attention_heads'", "positive integer, got 0")
    attempt(_with(copy("vocab-1"), vocab_size=-1), "key 'vocab_size'", "positive integer, got -1")
    # a key written twice: json keeps the last silently (here hidden_size 96), naohai refuses to guess
    twice = copy("twice")
    text = open(os.path.join(twice, "config.json")).read()
    open(os.path.join(twice, "config.json"), "w").write(text.replace("{", '{"hidden_size": 96, ', 1))
    attempt(twice, "config.json", "'hidden_size' is written twice")
    sharded = str(tmp_path / "sharded")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", str(tmp_path / "imp")]) == 0
    assert main(["ckpt", "export", str(tmp_path / "imp"), "--to", "hf", "--out", sharded, "--shard-size", "200KB"]) == 0
    second = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[1]
    os.remove(os.path.join(sharded, second))
    attempt(sharded, "model.safetensors.index.json", "key 'weight_map'", second, "missing")
    attempt(str(tmp_path / "nowhere"), "nowhere", "not a folder")


def _with(folder, **changes):
    _edit_config(folder, **changes)
    return folder


def test_export_refuses_what_no_architecture_holds(tmp_path, capsys):
    """PanGu-alpha's query layer has no Hugging Face architecture: exit 2 naming the recipe key."""
    from naohai.config import preset_recipe
    from naohai.convert.model_dir import write_model_dir
    from naohai.model.spec import param_shapes
    recipe = preset_recipe("tiny-pangu")
    weights = {p.name: np.zeros(p.shape, np.float32) for p in param_shapes(recipe.model)}
    write_model_dir(str(tmp_path / "pangu"), recipe, weights)
    capsys.readouterr()
    assert main(["ckpt", "export", str(tmp_path / "pangu"), "--to", "hf", "--out", str(tmp_path / "x")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.family" in err and "pangu" in err and not os.path.exists(tmp_path / "x")


def test_eval_text_encodes_with_the_folders_tokenizer(built, tmp_path, capsys):
    """`naohai eval --text` of an imported model: its tokenizer.json (AutoTokenizer's ids), its loss."""
    from transformers import AutoTokenizer
    model, src = built["gpt_neox"]
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out]) == 0
    text = (hf_models.TEXT + "\n") * 6
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", out, "--text", str(tmp_path / "t.txt"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = np.asarray(AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False)["input_ids"])
    n = len(ids) // (hf_models.SEQ + 1)
    assert n >= 2 and got["windows"] == n
    want = hf_models.hf_mean_nll(model, ids[: n * (hf_models.SEQ + 1)].reshape(n, -1))
    assert abs(got["loss"] - want) <= 1e-5 * want


def test_generation_stops_at_every_end_id_of_generation_config(built, tmp_path, capsys):
    """A folder whose generation_config.json lists end ids besides the tokenizer's EOS (Llama 3's
    <|eot_id|>, GLM-4's <|user|>): `naohai generate` and the downstream scorer stop before the first of
    them, where transformers' `generate` stops; a wrong list or a key written twice exits 2 naming it."""
    from transformers import AutoModelForCausalLM
    from naohai.data.tokenizer import Tokenizer
    from naohai.downstream.tasks import load_scorer
    model, src = built["llama"]
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out]) == 0
    prompt = "The for statement"
    tok = Tokenizer.load(os.path.join(out, "tokenizer.json"))
    eos = tok.eod_id
    free = hf_models.hf_greedy(model, tok.encode(prompt), stop=False)
    head = free[:free.index(eos)] if eos in free else free
    k = next(i for i, t in enumerate(head) if i >= 3 and t not in head[:i])    # first generated at position k
    config_path = os.path.join(out, "generation_config.json")
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    config["eos_token_id"] = [eos, head[k]]
    with open(config_path, "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    theirs = AutoModelForCausalLM.from_pretrained(src)
    theirs.generation_config.eos_token_id = [eos, head[k]]     # as from_pretrained reads that file
    want = hf_models.hf_greedy(theirs.eval(), tok.encode(prompt))
    assert want == head[:k]                       # transformers stops at the listed id

    capsys.readouterr()
    assert main(["generate", out, "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "32"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(want) + "\n"
    scorer, scorer_tok, _ = load_scorer(out, device="CPU")
    assert scorer.generate([scorer_tok.encode(prompt)], 32) == [want]

    for wrong, said in (('{"eos_token_id": [1, "x"]}', "eos_token_id"), ('{"eos_token_id": 1, "eos_token_id": 2}',
                                                                        "eos_token_id")):
        with open(config_path, "w", encoding="utf-8") as fh:
            fh.write(wrong)
        capsys.readouterr()
        assert main(["generate", out, "--prompt", prompt]) == 2
        err = capsys.readouterr().err
        assert "generation_config.json" in err and said in err and "Traceback" not in err, err


def test_import_sets_add_special_tokens_where_the_tokenizer_adds_them(built, tmp_path, capsys):
    """An imported recipe prepares text as the folder's tokenizer(text) encodes it: data.add_special_tokens
    is true for a tokenizer whose post-processor adds a BOS (Llama's), false for one that adds nothing;
    `eval --text` of such a model encodes the file so too."""
    import shutil
    import yaml
    from tokenizers import Tokenizer as Backend, processors
    _, src = built["llama"]
    with_bos = str(tmp_path / "with-bos")
    shutil.copytree(src, with_bos)
    backend = Backend.from_file(os.path.join(with_bos, "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", backend.token_to_id("<s>"))])
    backend.save(os.path.join(with_bos, "tokenizer.json"))
    for folder, adds in ((src, False), (with_bos, True)):
        out = str(tmp_path / f"imported-{adds}")
        assert main(["ckpt", "import", folder, "--from", "hf", "--out", out]) == 0
        with open(os.path.join(out, "recipe.yaml"), encoding="utf-8") as fh:
            written = yaml.safe_load(fh)
        assert written["data"]["add_special_tokens"] is adds
        # and it fine-tunes the imported weights, at Llama 2's fine-tuning rate (not naohai's from-scratch 3e-3)
        assert written["train"]["init_from"] == os.path.abspath(out)
        assert (written["train"]["lr"], written["train"]["min_lr"]) == (2e-5, 2e-6)
    # `eval --text` reads the file as one such document: transformers' NLL of AutoTokenizer(text)'s ids, BOS first
    from transformers import AutoTokenizer
    text = (hf_models.TEXT + "\n") * 6
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    capsys.readouterr()
    assert main(["eval", out, "--text", str(tmp_path / "t.txt"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = np.asarray(AutoTokenizer.from_pretrained(with_bos)(text)["input_ids"])
    assert ids[0] == backend.token_to_id("<s>")
    n = len(ids) // (hf_models.SEQ + 1)
    want = hf_models.hf_mean_nll(built["llama"][0], ids[: n * (hf_models.SEQ + 1)].reshape(n, -1))
    assert got["windows"] == n and abs(got["loss"] - want) <= 1e-5 * want
    # `data score` scores each document so too: EOD, tokenizer(text) (BOS first), EOD
    import math
    import torch
    from naohai.commands.data import load_scorer
    from naohai.data.score import ScoreSettings, score
    line = hf_models.TEXT[:40]
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": line}) + "\n", encoding="utf-8")
    score([str(tmp_path / "docs.jsonl")], str(tmp_path / "scored"), load_scorer(out, device="CPU"),
          ScoreSettings(batch=1), progress=False)
    scored = [json.loads(x) for f in sorted((tmp_path / "scored").rglob("*.jsonl")) for x in open(f, encoding="utf-8")]
    eod = backend.token_to_id("<eod>")
    seq = [eod] + AutoTokenizer.from_pretrained(with_bos)(line)["input_ids"] + [eod]
    assert len(seq) - 1 <= hf_models.SEQ
    with torch.no_grad():
        logp = torch.log_softmax(built["llama"][0](torch.as_tensor([seq[:-1]])).logits[0].double(), -1)
    want = math.exp(-logp[torch.arange(len(seq) - 1), torch.as_tensor(seq[1:])].mean().item())
    assert [r["naohai"]["perplexity"] for r in scored] == [pytest.approx(want, rel=1e-4)]


def test_generate_samples_as_the_folders_generation_config_asks(built, tmp_path, capsys):
    """Without sampling flags `naohai generate` reads generation_config.json as transformers' GenerationConfig
    does: greedy unless do_sample is true (the tests' folder: transformers' greedy tokens), else its
    temperature / top-k / top-p, transformers' defaults filling what it leaves out; flags override; a value of
    the wrong kind exits 2 naming the file and key."""
    from transformers import GenerationConfig
    from naohai.data.tokenizer import Tokenizer
    from naohai.generate import sampling_defaults
    model, src = built["llama"]
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out]) == 0
    prompt = "The for statement"
    tok = Tokenizer.load(os.path.join(out, "tokenizer.json"))
    capsys.readouterr()
    assert main(["generate", out, "--prompt", prompt, "--max-new-tokens", "32"]) == 0
    printed = capsys.readouterr()
    assert printed.out == prompt + tok.decode(hf_models.hf_greedy(model, tok.encode(prompt))) + "\n"
    assert "greedy, as" in printed.err and "generation_config.json" in printed.err

    config_path = os.path.join(out, "generation_config.json")
    with open(config_path, encoding="utf-8") as fh:
        config = json.load(fh)
    config.update(do_sample=True, temperature=0.6, top_p=0.9)
    with open(config_path, "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    theirs = GenerationConfig.from_pretrained(out)       # its unset fields take generate()'s global defaults
    fill = GenerationConfig._get_default_generation_params()
    got, note = sampling_defaults(Tokenizer.load(os.path.join(out, "tokenizer.json")))
    assert got == {k: fill[k] if getattr(theirs, k) is None else getattr(theirs, k)
                   for k in ("temperature", "top_k", "top_p", "repetition_penalty")} == \
        {"temperature": 0.6, "top_k": 50, "top_p": 0.9, "repetition_penalty": 1.0}
    assert main(["generate", out, "--prompt", prompt, "--max-new-tokens", "4", "--temperature", "0", "--top-k", "3",
                 "--top-p", "1", "--repetition-penalty", "1"]) == 0
    assert "generation_config" not in capsys.readouterr().err          # every setting given: nothing read
    config["temperature"] = "hot"
    with open(config_path, "w", encoding="utf-8") as fh:
        json.dump(config, fh)
    assert main(["generate", out, "--prompt", prompt, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "generation_config.json" in err and "temperature" in err and "Traceback" not in err


def test_repetition_penalty_is_transformers(built, tmp_path, capsys):
    """generation_config.json's repetition_penalty (Qwen2.5 Instruct's is 1.05) is applied as transformers'
    generate applies it, to the ids of the prompt and of the answer: greedy tokens equal transformers' with
    that penalty (and differ from those without it); --repetition-penalty overrides; 0 exits 2."""
    import torch
    from naohai.data.tokenizer import Tokenizer
    model, src = built["llama"]
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out]) == 0
    prompt = "The for statement iterates. The for statement"
    tok = Tokenizer.load(os.path.join(out, "tokenizer.json"))
    ids = tok.encode(prompt)
    ends = {model.generation_config.eos_token_id}

    def theirs(penalty):
        with torch.no_grad():
            new = model.generate(torch.as_tensor([ids]), do_sample=False, max_new_tokens=24, min_new_tokens=0,
                                 attention_mask=torch.ones((1, len(ids)), dtype=torch.long),
                                 repetition_penalty=penalty)[0, len(ids):].tolist()
        return new[:next((i for i, t in enumerate(new) if t in ends), len(new))]
    penalised, plain = theirs(1.5), theirs(1.0)
    assert penalised != plain                         # the penalty changes this prompt's greedy answer

    config_path = os.path.join(out, "generation_config.json")
    config = json.load(open(config_path, encoding="utf-8"))
    json.dump(dict(config, repetition_penalty=1.5), open(config_path, "w", encoding="utf-8"))
    capsys.readouterr()
    assert main(["generate", out, "--prompt", prompt, "--max-new-tokens", "24"]) == 0
    printed = capsys.readouterr()
    assert printed.out == prompt + tok.decode(penalised) + "\n"
    assert "repetition penalty 1.5" in printed.err
    assert main(["generate", out, "--prompt", prompt, "--max-new-tokens", "24", "--repetition-penalty", "1"]) == 0
    assert capsys.readouterr().out == prompt + tok.decode(plain) + "\n"
    assert main(["generate", out, "--prompt", prompt, "--repetition-penalty", "0"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--repetition-penalty" in err and "Traceback" not in err
    json.dump(dict(config, repetition_penalty=-1), open(config_path, "w", encoding="utf-8"))
    assert main(["generate", out, "--prompt", prompt]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "generation_config.json" in err and "repetition_penalty" in err and "Traceback" not in err


def test_chat_conversation_is_transformers_turn_by_turn(built, tmp_path, capsys, monkeypatch):
    """`generate --chat` without --prompt holds a conversation read from standard input: each answer equals
    transformers' greedy answer to the chat template's rendering of every turn so far (the answers before as their
    decoded text without trailing line breaks, as printed); once the conversation and the new tokens no longer fit
    the model's window, the oldest user turn and its answer are left out, with a note; /reset starts over; a line
    that is not UTF-8 exits 2 naming standard input."""
    import io
    import shutil
    import sys
    from transformers import AutoTokenizer
    model, src = built["llama"]
    folder = str(tmp_path / "chat-llama")
    shutil.copytree(src, folder)
    config_path = os.path.join(folder, "tokenizer_config.json")
    config = json.load(open(config_path, encoding="utf-8"))
    config["chat_template"] = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    json.dump(config, open(config_path, "w", encoding="utf-8"))
    tok = AutoTokenizer.from_pretrained(folder)
    new, window = 6, model.config.max_position_embeddings
    turns = ["The for statement", "iterates over", "a sequence", "def f(x)", "return x + 1"]

    def theirs(messages):
        ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                  add_special_tokens=False)["input_ids"]
        return ids, tok.decode(hf_models.hf_greedy(model, ids, new=new)).rstrip("\n")

    messages, want, left = [], [], []
    for text in turns:
        messages.append({"role": "user", "content": text})
        asked = list(messages)
        ids, answer = theirs(asked)
        while len(ids) + new > window:                     # the oldest user turn and its answer left out
            asked = asked[2:]
            ids, answer = theirs(asked)
        left.append(len(messages) - len(asked))
        want.append(answer)
        messages.append({"role": "assistant", "content": answer})
    assert left[0] == 0 and left[-1] > 0, left              # the last turns do not fit whole: the rule is used

    def chat(lines: bytes, *flags):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(lines)))
        capsys.readouterr()
        code = main(["generate", folder, "--chat", "--temperature", "0", "--max-new-tokens", str(new), *flags])
        return code, capsys.readouterr()
    code, got = chat(("\n".join(turns) + "\n").encode())
    assert code == 0
    assert got.out == "".join(answer + "\n" for answer in want)
    assert chat(("\n".join(turns) + "\n").encode(), "--stream")[1].out == got.out     # printed as they come
    assert got.err.count("left out of this answer's prompt") == sum(1 for n in left if n)
    assert "are read" not in got.err
    # a turn longer than the window: read from its end, with a note
    code, got = chat((" ".join(["statement"] * window) + "\n").encode())
    assert code == 0 and "only its last" in got.err and "Traceback" not in got.err
    # /reset: the next turn is asked alone; blank lines are no turns
    code, got = chat(f"{turns[0]}\n\n/reset\n{turns[1]}\n".encode())
    assert code == 0 and got.out == want[0] + "\n" + theirs([{"role": "user", "content": turns[1]}])[1] + "\n"
    code, got = chat(b"The for\n\xff\xfe\n")
    err = " ".join(got.err.split())
    assert code == 2 and "standard input" in err and "line 2 is not valid UTF-8" in err and "Traceback" not in err
