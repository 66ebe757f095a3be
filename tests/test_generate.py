"""Sampling rules against numpy, and generation from a trained checkpoint."""
from __future__ import annotations

import numpy as np
import pytest

from naohai.errors import UserError
from naohai.generate import Generator, SamplingConfig, sample_next
from naohai.strategy.run_plan import plan_run
from naohai.train.job import start
from tests.conftest import micro_recipe


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).standard_normal(50)
    assert sample_next(logits, SamplingConfig(temperature=0), np.random.default_rng(1), 50) == int(np.argmax(logits))


def test_padding_rows_are_never_sampled():
    logits = np.zeros(64)
    logits[60:] = 100.0                       # rows past the real vocabulary (padding) must be ignored
    picks = {sample_next(logits, SamplingConfig(temperature=1.0), np.random.default_rng(i), 60) for i in range(50)}
    assert max(picks) < 60


def test_top_k_and_top_p_restrict_the_support():
    rng = np.random.default_rng(0)
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.05, 0.05]))
    k2 = {sample_next(logits, SamplingConfig(temperature=1.0, top_k=2), rng, 5) for _ in range(300)}
    assert k2 == {0, 1}
    p = {sample_next(logits, SamplingConfig(temperature=1.0, top_p=0.85), rng, 5) for _ in range(300)}
    assert p == {0, 1, 2}                     # 0.5 + 0.3 < 0.85 <= 0.9: the third is needed


def test_temperature_sharpens_like_numpy_softmax():
    logits = np.array([1.0, 0.0, -1.0])
    rng = np.random.default_rng(3)
    n = 4000
    counts = np.bincount([sample_next(logits, SamplingConfig(temperature=0.5), rng, 3) for _ in range(n)],
                         minlength=3) / n
    expected = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum()
    np.testing.assert_allclose(counts, expected, atol=0.03)


def test_bad_sampling_flags():
    with pytest.raises(UserError, match="--top-p"):
        SamplingConfig(top_p=0).validate()
    for bad in (-1, float("nan"), float("inf")):     # nan raised NumPy's "probabilities contain NaN" (a traceback)
        with pytest.raises(UserError, match="--temperature"):
            SamplingConfig(temperature=bad).validate()
    with pytest.raises(UserError, match="--seed"):           # -1 raised NumPy's ValueError
        SamplingConfig(seed=-1).validate()


def test_generate_from_checkpoint(tmp_path, micro_data, capsys):
    prepared, tok = micro_data
    recipe = micro_recipe(tmp_path / "run", prepared, tok, steps=4, save_every=4)
    start(plan_run(recipe), log=lambda *_: None, progress=False).run()
    gen = Generator(str(tmp_path / "run"))
    assert gen.step == 4
    greedy = gen.generate("The ", SamplingConfig(max_new_tokens=8, temperature=0))
    again = gen.generate("The ", SamplingConfig(max_new_tokens=8, temperature=0))
    assert isinstance(greedy, str) and greedy == again
    sampled = gen.generate("The ", SamplingConfig(max_new_tokens=8, temperature=1.0, seed=5))
    assert isinstance(sampled, str)
    # the command line: several prompts, each under its own header
    from naohai.cli import main
    assert main(["generate", str(tmp_path / "run"), "--prompt", "The ", "--prompt", "A ", "--max-new-tokens", "8",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("\n\n=== prompt 2 of 2: 'A ' ===\n")
    assert first.startswith("=== prompt 1 of 2: 'The ' ===\nThe ") and second.startswith("A ")
    assert first.endswith(greedy)
    # a billion new tokens: the cache is one window (main 10b9408 tried to allocate 477 GiB); generation
    # stops at the window, as with any length past it
    huge = gen.decoder.generate_ids([[5, 6, 7]], SamplingConfig(max_new_tokens=10 ** 9, temperature=0),
                                    gen.tokenizer.vocab_size)
    assert len(huge[0]) == recipe.model.seq_length - 3 + 1
    # ... and the command says so before generating (it cut the request silently), as it does for a prompt
    # longer than the window, which is read from its end
    assert gen.window_notes(["The "], 8) == []
    n = len(gen.tokenizer.encode("The "))
    room = recipe.model.seq_length - n + 1
    assert gen.window_notes(["The "], room) == [] and len(gen.window_notes(["The "], room + 1)) == 1
    assert main(["generate", str(tmp_path / "run"), "--prompt", "The ", "--prompt", "x " * 200,
                 "--max-new-tokens", "1000", "--temperature", "0"]) == 0
    err = capsys.readouterr().err
    assert f"prompt 2 has {len(gen.tokenizer.encode('x ' * 200))} tokens" in err
    assert f"only its last {recipe.model.seq_length - 1} are read" in err
    assert "--max-new-tokens 1000: at most 2 new tokens fit" in err
    # a prompt that is not UTF-8 (bytes the locale could not decode reach argv as surrogates)
    assert main(["generate", str(tmp_path / "run"), "--prompt", "ok", "--prompt", "caf\udce9"]) == 2


def test_chat_asks_a_fine_tuned_run_as_its_data_did_from_any_folder(tmp_path, micro_data, capsys, monkeypatch):
    """`generate --chat`: each prompt is a user turn rendered as SFT data was (`prompt_ids`), and the answer
    alone is printed, ending at EOD.  The run was trained in its project folder with a relative
    data.tokenizer (as recipes/sft-tiny.yaml's `runs/tiny/tokenizer.model`); read from another folder it
    failed ('tokenizer model not found'), and a file at the same relative path there is not taken for it."""
    import json
    import shutil
    from naohai.cli import main
    from naohai.config import recipe_from_dict
    from naohai.data.sft import prompt_ids

    _, tok = micro_data
    work, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    shutil.copy(tok, work / "tok.model")
    rows = [{"prompt": f"echo {i}", "response": f"{i}"} for i in range(100)]
    (work / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    raw = micro_recipe("run", steps=2, global_batch_size=4, micro_batch_size=4, eval_every=2).to_dict()
    raw["data"].update(format="sft", corpus=["chat.jsonl"], tokenizer="tok.model", holdout_fraction=0.1)
    monkeypatch.chdir(work)
    start(plan_run(recipe_from_dict(raw, where="test recipe")), log=lambda *_: None, progress=False).run()
    monkeypatch.chdir(elsewhere)
    (elsewhere / "tok.model").write_bytes(b"not this run's tokenizer")
    run = str(work / "run")
    gen = Generator(run)
    asked = prompt_ids([{"role": "user", "content": "echo 7"}], gen.tokenizer)
    assert gen.tokenizer.decode(asked) == "User: echo 7\nAssistant: "
    want = gen.decoder.generate_ids([asked], SamplingConfig(max_new_tokens=6, temperature=0),
                                    gen.tokenizer.vocab_size, gen.tokenizer.stop_ids)[0]
    capsys.readouterr()
    assert main(["generate", run, "--chat", "--prompt", "echo 7", "--max-new-tokens", "6", "--temperature", "0"]) == 0
    got = capsys.readouterr()
    assert got.out == gen.tokenizer.decode(want).rstrip("\n") + "\n" and "--chat asks" not in got.err
    assert main(["generate", run, "--chat", "--system", "be short", "--prompt", "echo 7", "--prompt", "echo 8",
                 "--max-new-tokens", "3", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("=== prompt 1 of 2: 'echo 7' ===\n") and "=== prompt 2 of 2: 'echo 8' ===" in out
    # without --chat the text is continued as it is, and the command points at --chat
    assert main(["generate", run, "--prompt", "echo 7", "--max-new-tokens", "2", "--temperature", "0"]) == 0
    got = capsys.readouterr()
    assert got.out.startswith("echo 7") and "--chat asks it as its training data did" in got.err
    # --system without --chat, or an empty user turn: exit 2 naming the flag
    for argv, key in ((["--system", "be short", "--prompt", "x"], "--system"), (["--chat", "--prompt", " "], "--prompt")):
        assert main(["generate", run, *argv]) == 2
        err = capsys.readouterr().err
        assert f"key '{key}'" in err and "Traceback" not in err, err


def test_a_prompt_that_is_not_utf8_is_one_paragraph(capsys):
    from naohai.cli import main
    assert main(["generate", "/nonexistent", "--prompt", "\udcff\udcfe"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "prompt 1 is not valid UTF-8 text (byte 0xff at character 0)" in err and "Traceback" not in err


# ------------------------------------------------------------------------------ key/value cache
def _tiny_models():
    import dataclasses

    from naohai.config import MODEL_PRESETS, ModelConfig
    tiny = dict(hidden_size=16, num_heads=4, seq_length=24, compute_dtype="float32", softmax_fp32=True, dropout=0.0)
    yield ModelConfig(**dict(MODEL_PRESETS["pangu-alpha-2.6b"], **tiny, vocab_size=40, num_layers=3,
                             ffn_hidden_size=32))
    yield ModelConfig(**dict(MODEL_PRESETS["pengcheng-mind-200b"], **tiny, vocab_size=64, vocab_pad_multiple=64,
                             num_layers=3, ffn_hidden_size=32))
    base = ModelConfig(**dict(MODEL_PRESETS["tiny"], **tiny, vocab_size=64, vocab_pad_multiple=64, num_layers=2,
                              ffn_hidden_size=32))
    yield dataclasses.replace(base, position="alibi", num_kv_heads=2)


def _greedy_by_recompute(model, cfg, prompt, n, pad):
    """Greedy continuation recomputing the whole right-padded window every step (no cache)."""
    from mindspore import Tensor
    ids = list(prompt)
    for _ in range(n):
        arr = np.full((1, cfg.seq_length), pad, np.int32)
        arr[0, :len(ids)] = ids
        logits = model.logits(Tensor(arr)).asnumpy()[0, len(ids) - 1]
        ids.append(int(np.argmax(logits[:cfg.vocab_size])))
    return ids[len(prompt):]


def test_cached_generation_equals_full_recompute_and_batches_match_single_rows():
    import mindspore as ms

    from naohai.generate import CachedDecoder
    from naohai.model.transformer import NaohaiLM
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    greedy = SamplingConfig(max_new_tokens=10, temperature=0)
    for cfg in _tiny_models():
        cfg.validate()
        model = NaohaiLM(cfg, seed=3)
        pad = 1
        dec = CachedDecoder(model, cfg, pad_id=pad)
        prompts = [[5, 9, 11, 7, 20, 13], [8, 30]]
        batch = dec.generate_ids(prompts, greedy, cfg.vocab_size)
        for prompt, got in zip(prompts, batch):
            want = _greedy_by_recompute(model, cfg, prompt, 10, pad)
            assert got == want, (cfg.position, prompt, got, want)
            assert dec.generate_ids([prompt], greedy, cfg.vocab_size)[0] == want


def test_generation_stops_at_the_window_and_streams_every_token():
    import mindspore as ms

    from naohai.generate import CachedDecoder
    from naohai.model.transformer import NaohaiLM
    ms.set_context(mode=ms.PYNATIVE_MODE)
    cfg = next(_tiny_models())
    dec = CachedDecoder(NaohaiLM(cfg), cfg, pad_id=1)
    seen = []
    out = dec.generate_ids([list(range(7, 27))], SamplingConfig(max_new_tokens=50, temperature=0), cfg.vocab_size,
                           on_token=lambda r, t: seen.append(t))
    assert len(out[0]) == cfg.seq_length - 20 + 1 and seen == out[0]   # positions 20..23 fed, one more sampled


def test_repetition_penalties_follow_pangu_formula():
    logits = np.array([2.0, 1.9, 0.0])
    counts = np.array([1, 0, 0])
    cfg = SamplingConfig(temperature=0, frequency_penalty=1.5, presence_penalty=0.3)
    logp = logits - np.log(np.exp(logits).sum())
    revised = logp - counts * 1.5 - (counts > 0) * 0.3
    assert sample_next(logits, cfg, np.random.default_rng(0), 3, counts) == int(np.argmax(revised)) == 1
    assert sample_next(logits, cfg, np.random.default_rng(0), 3, np.zeros(3, int)) == 0
    with pytest.raises(UserError, match="--frequency-penalty"):
        SamplingConfig(frequency_penalty=float("nan")).validate()


def test_cached_generation_of_every_finetune_method_equals_full_recompute():
    """prefix / prompt tuning (virtual positions in the cache), LLaMA-Adapter, the Houlsby adapter and LoRA,
    their tensors random so that each matters: the cached batch generation (left padding) gives the greedy
    tokens of recomputing the whole window without a cache, whose forward tests/model/test_model_finetune.py
    and tests/convert/test_peft*.py check against numpy and peft."""
    import dataclasses

    import mindspore as ms
    from mindspore import Tensor

    from naohai.config import FinetuneConfig
    from naohai.generate import CachedDecoder
    from naohai.model.finetune import apply_finetune, method_params
    from naohai.model.transformer import NaohaiLM
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    greedy = SamplingConfig(max_new_tokens=6, temperature=0)
    methods = [FinetuneConfig(method="prefix", num_virtual_tokens=3),
               FinetuneConfig(method="prompt", num_virtual_tokens=3),
               FinetuneConfig(method="llama_adapter", num_virtual_tokens=3, adapter_layers=1),
               FinetuneConfig(method="adapter", bottleneck=4),
               FinetuneConfig(method="lora", rank=2, alpha=4.0, targets=r"attention\.(q|v)$")]
    models = list(_tiny_models())
    for k, ft in enumerate(methods):
        cfg = models[k % len(models)]
        # room for the virtual positions; prompt tuning is built without EOD resets
        cfg = dataclasses.replace(cfg, max_positions=cfg.seq_length + 8, eod_reset=False, eod_reset_positions=False)
        model = NaohaiLM(cfg, seed=3)
        apply_finetune(model, ft, seed=0)
        rng = np.random.default_rng(k)
        for p in method_params(model):
            p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
        model.set_train(False)
        dec = CachedDecoder(model, cfg, pad_id=1)
        prompts = [[5, 9, 11, 7, 20, 13], [8, 30]]
        batch = dec.generate_ids(prompts, greedy, cfg.vocab_size)
        for prompt, got in zip(prompts, batch):
            want = _greedy_by_recompute(model, cfg, prompt, 6, 1)
            assert got == want, (ft.method, cfg.position, prompt, got, want)


def test_compiled_prompt_pass_equals_the_op_by_op_one_bit_for_bit():
    """A decoder's first prompt pass runs op by op, later ones through the compiled PromptStep: on CPU both give
    the same last logits and keys/values, exactly, for each tiny family (PanGu's query layer, PengCheng-Mind,
    ALiBi with grouped keys/values) and for prefix tuning's virtual columns (on PanGu); and a decoder's first and later
    calls generate the same tokens."""
    import dataclasses

    import mindspore as ms
    from mindspore import Tensor

    from naohai.config import FinetuneConfig
    from naohai.generate import CachedDecoder, step_bias
    from naohai.model.finetune import apply_finetune, method_params
    from naohai.model.transformer import NaohaiLM, PromptStep
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    rng = np.random.default_rng(0)
    models = list(_tiny_models())
    for k, cfg in enumerate(models + [models[0]]):
        if k == len(models):      # prefix tuning: n virtual columns before the prompt's
            cfg = dataclasses.replace(cfg, max_positions=cfg.seq_length + 8)
        model = NaohaiLM(cfg, seed=k)
        if k == len(models):
            apply_finetune(model, FinetuneConfig(method="prefix", num_virtual_tokens=3), seed=0)
            for p in method_params(model):
                p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
        model.set_train(False)
        pads = [9, 8, 20]                          # at most 24 real tokens: the window
        ids = rng.integers(2, cfg.vocab_size, (3, 32)).astype(np.int32)
        positions = np.maximum(np.arange(32)[None] - np.asarray(pads)[:, None], 0).astype(np.int32)
        bias = step_bias(cfg, pads, 0, 32)
        logits, cache = model.step(Tensor(ids), Tensor(positions), Tensor(bias))
        last, keys, values = PromptStep(model)(Tensor(ids), Tensor(positions), Tensor(bias))
        assert np.array_equal(logits.asnumpy()[:, -1], last.asnumpy()), cfg.position
        for (k0, v0), k1, v1 in zip(cache, keys, values):
            assert np.array_equal(k0.asnumpy(), k1.asnumpy()) and np.array_equal(v0.asnumpy(), v1.asnumpy())
        dec = CachedDecoder(model, cfg, pad_id=1)
        greedy = SamplingConfig(max_new_tokens=5, temperature=0)
        prompts = [[5, 9, 11, 7, 20, 13], [8, 30]]
        first = dec.generate_ids(prompts, greedy, cfg.vocab_size)
        assert dec.generate_ids(prompts, greedy, cfg.vocab_size) == first
