"""Hugging Face tokenizers: a byte-level BPE naohai trains, against transformers.AutoTokenizer."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from naohai.data.hf_tokenizer import HFTokenizer, train_byte_bpe
from naohai.data.tokenizer import Tokenizer
from naohai.errors import UserError

pytest.importorskip("transformers")

MIXED = ("深度学习模型在鹏城实验室训练。Naohai trains 大模型 on 2 cores 🚀🔥 naïve café\n"
         "def f(x):\n\treturn {'k': [x ** 2, \"s\"]}  # 注释 ✓\r\n"
         "   多个  空格\u00a0和 tabs\t\t、emoji 👩‍👩‍👧 ZWJ, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, <eod> literal")
CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>\n"
        "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
        "{% endif %}")


@pytest.fixture(scope="module")
def bpe_dir(mixed_docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    train_byte_bpe(mixed_docs + [MIXED[:40]], 700, str(out / "tokenizer.json"))
    config = json.load(open(out / "tokenizer_config.json"))
    config["chat_template"] = CHAT
    json.dump(config, open(out / "tokenizer_config.json", "w"))
    return str(out)


@pytest.fixture(scope="module")
def both(bpe_dir):
    from transformers import AutoTokenizer
    return Tokenizer.load(os.path.join(bpe_dir, "tokenizer.json")), AutoTokenizer.from_pretrained(bpe_dir)


def test_mixed_text_encodes_and_decodes_as_auto_tokenizer(both):
    ours, theirs = both
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == len(theirs) == 700
    ids = ours.encode(MIXED)
    assert ids == theirs(MIXED, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == theirs.decode(ids) == MIXED
    assert ours.encode_batch([MIXED, "x"]) == [ids, theirs("x", add_special_tokens=False)["input_ids"]]
    assert (ours.eod_id, ours.pad_id, ours.bos_id, ours.unk_id) == (
        theirs.eos_token_id, theirs.pad_token_id, theirs.bos_token_id, theirs.unk_token_id) == (1, 0, 3, 2)
    assert ours.decode([ours.bos_id] + ids[:3]) == theirs.decode([ours.bos_id] + ids[:3])


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_any_text_round_trips_like_auto_tokenizer(both, text):
    ours, theirs = both
    ids = ours.encode(text)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == text


def test_chat_template_renders_as_transformers(both):
    ours, theirs = both
    messages = [{"role": "system", "content": "你是助手 "}, {"role": "user", "content": "hi 👋"},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}]
    for prompt in (True, False):
        assert ours.apply_chat_template(messages, prompt) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=prompt)
    with pytest.raises(UserError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


#: what published templates use beyond CHAT: Llama 3's date (strftime_now), tool-calling templates' test of
#: ``tools`` (transformers passes none), tojson's options, the {% generation %} block, loop controls
RICH = ("{% if tools is not none %}TOOLS {{ tools | tojson }}{% endif %}{% if documents is none %}[no docs]"
        "{% endif %}year {{ strftime_now('%Y') }}\n{% for m in messages %}{% if m['role'] == 'system' %}"
        "{% continue %}{% endif %}{{ m | tojson(separators=(',', ':'), sort_keys=True) }}"
        "{% if m['role'] == 'assistant' %}{% generation %}<a>{{ m['content'] }}</a>{% endgeneration %}"
        "{% endif %}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def test_published_templates_features_render_as_transformers(both):
    """transformers renders templates with strftime_now, tools / documents set to none, tojson's
    separators and sort_keys, and the {% generation %} block; naohai's renderer lacked all four, so a
    Llama 3 template printed another date, a tool-calling template took the tools branch and a template with
    {% generation %} did not compile."""
    ours, theirs = both
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "你好 \"x\""},
                {"role": "assistant", "content": "ok"}]
    saved = ours.chat_template, theirs.chat_template
    try:
        ours.chat_template = theirs.chat_template = RICH
        for prompt in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.apply_chat_template(messages, prompt) == want
        assert "TOOLS" not in want and "[no docs]" in want and '"content":"你好 \\"x\\"","role":"user"' in want
    finally:
        ours.chat_template, theirs.chat_template = saved


def test_chat_template_renders_in_a_process_without_transformers(both, bpe_dir):
    """A training run never imports transformers; jinja2 does not import its own jinja2.ext, which the
    template's loop controls need (every SFT run with a chat template died with AttributeError)."""
    import subprocess
    import sys
    ours, _ = both
    messages = [{"role": "user", "content": "hi 👋"}, {"role": "assistant", "content": "ok"}]
    code = ("import json, sys\nfrom naohai.data.tokenizer import Tokenizer\n"
            f"text = Tokenizer.load({os.path.join(bpe_dir, 'tokenizer.json')!r}).apply_chat_template("
            f"json.loads({json.dumps(json.dumps(messages))}), True)\n"
            "print(json.dumps([text, 'transformers' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [ours.apply_chat_template(messages, True), False]


def test_prepare_trains_a_byte_bpe_and_packs_with_it(tmp_path, mixed_docs):
    """data.tokenizer_type: byte_bpe -> <output_dir>/tokenizer.json; windows decode back to the corpus."""
    from naohai.config import recipe_from_dict
    from naohai.data.pipeline import ensure_prepared
    from naohai.data.prepare import load_prepared
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in mixed_docs[:120]), encoding="utf-8")
    recipe = recipe_from_dict({"model": {"preset": "tiny", "vocab_size": 600, "seq_length": 256},
                               "data": {"corpus": [str(corpus)], "tokenizer_type": "byte_bpe"},
                               "train": {"output_dir": str(tmp_path / "run"), "global_batch_size": 4,
                                         "micro_batch_size": 4}})
    out, tok = ensure_prepared(recipe, progress=False)
    assert tok.path == str(tmp_path / "run" / "tokenizer.json") and isinstance(tok, HFTokenizer)
    prep = load_prepared(out)
    encoded = {tuple(tok.encode(d)) for d in mixed_docs[:120]}
    whole = 0
    for i in range(prep.num_windows("train")):
        window = [int(x) for x in prep.window("train", i)]
        cuts = [j for j, x in enumerate(window) if x == tok.eod_id]
        for a, b in zip(cuts, cuts[1:]):            # documents wholly inside the window, between two EODs
            assert tuple(window[a + 1:b]) in encoded
            whole += 1
    assert whole >= 2
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "run"))
    assert theirs.decode(window) == tok.decode(window)


def test_bad_tokenizer_files_are_user_errors(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not a Hugging Face tokenizer.json"):
        Tokenizer.load(str(bad))
    with pytest.raises(UserError, match="not found"):
        Tokenizer.load(str(tmp_path / "missing.json"))
    with pytest.raises(UserError, match="jieba"):
        from naohai.config import recipe_from_dict
        recipe_from_dict({"data": {"tokenizer_type": "byte_bpe", "jieba": True}})


def test_data_tokenizer_command_trains_a_byte_bpe(tmp_path, mixed_docs, capsys):
    from transformers import AutoTokenizer
    from naohai.cli import main
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(mixed_docs[:60]), encoding="utf-8")
    out = tmp_path / "tok" / "tokenizer"
    assert main(["data", "tokenizer", "--corpus", str(corpus), "--vocab-size", "500", "--out", str(out),
                 "--type", "byte_bpe"]) == 0
    assert "scheme hf" in capsys.readouterr().out
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ours = Tokenizer.load(str(out) + ".json")
    assert ours.encode(MIXED) == theirs(MIXED, add_special_tokens=False)["input_ids"] and len(theirs) == 500
    assert main(["data", "tokenizer", "--corpus", str(corpus), "--vocab-size", "500", "--out", str(out),
                 "--type", "byte_bpe"]) == 2


def with_post_processor(src_dir: str, dst_dir: str, template: str) -> str:
    """A copy of the tokenizer folder ``src_dir`` whose tokenizer.json adds ``template``'s special tokens
    to every text (``"<s> $A"``: Llama's BOS), a TemplateProcessing as published tokenizers have."""
    import shutil
    from tokenizers import Tokenizer as Backend, processors
    shutil.copytree(src_dir, dst_dir)
    path = os.path.join(dst_dir, "tokenizer.json")
    backend = Backend.from_file(path)
    specials = [(t, backend.token_to_id(t)) for t in template.split() if t != "$A"]
    backend.post_processor = processors.TemplateProcessing(single=template, pair=f"{template} {template.replace('$A', '$B')}",
                                                           special_tokens=sorted(set(specials)))
    backend.save(path)
    return path


@pytest.mark.parametrize("template", ["<s> $A", "<s> $A <eod>"])
def test_add_special_tokens_packs_each_document_as_auto_tokenizer_encodes_it(bpe_dir, tmp_path, mixed_docs, template):
    """data.add_special_tokens: every document of the prepared splits is AutoTokenizer(text)['input_ids']
    (a Llama-style BOS post-processor; one that also ends with EOD gets no second EOD), then EOD; without
    the key the documents are encoded without them, as before, and a note says what the tokenizer adds."""
    from collections import Counter
    from transformers import AutoTokenizer
    from naohai.config import recipe_from_dict
    from naohai.data.pipeline import ensure_prepared
    from naohai.data.prepare import load_prepared
    path = with_post_processor(bpe_dir, str(tmp_path / "tok"), template)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    docs = mixed_docs[:80]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    eod = Tokenizer.load(path).eod_id
    want = Counter()
    for d in docs:
        ids = theirs(d)["input_ids"]
        assert ids[0] == 3 and (ids[-1] == eod) == template.endswith("<eod>")
        want[tuple(ids if ids[-1] == eod else ids + [eod])] += 1

    def documents(add: bool, run: str) -> Counter:
        recipe = recipe_from_dict({"model": {"preset": "tiny", "vocab_size": Tokenizer.load(path).vocab_size,
                                             "seq_length": 64},
                                   "data": {"corpus": [str(corpus)], "tokenizer": path, "add_special_tokens": add},
                                   "train": {"output_dir": str(tmp_path / run), "global_batch_size": 4,
                                             "micro_batch_size": 4}})
        said = []
        out, _ = ensure_prepared(recipe, progress=False, log=said.append)
        prep = load_prepared(out)
        assert prep.meta.get("add_special_tokens", False) is add
        assert any("data.add_special_tokens is true" in line for line in said) is not add   # the note without it
        got = Counter()
        for split in ("train", "valid"):
            stream = [int(x) for x in np.load(os.path.join(out, f"{split}.npy"))]
            cuts = [-1] + [j for j, x in enumerate(stream) if x == eod]
            got.update(tuple(stream[a + 1:b + 1]) for a, b in zip(cuts, cuts[1:]))
        return got

    assert documents(True, "with") == want
    without = documents(False, "without")
    assert sum(without.values()) == len(docs) and not any(doc[0] == 3 for doc in without)


def test_add_special_tokens_refusals(tmp_path, tok):
    from naohai.config import recipe_from_dict
    from naohai.data.pipeline import ensure_prepared
    with pytest.raises(UserError, match="data.add_special_tokens") as err:
        recipe_from_dict({"data": {"format": "sft", "add_special_tokens": True, "tokenizer": "t.json"}})
    assert "chat template" in str(err.value)
    recipe = recipe_from_dict({"model": {"preset": "tiny", "vocab_size": tok.vocab_size},
                               "data": {"tokenizer": tok.path, "add_special_tokens": True},
                               "train": {"output_dir": str(tmp_path / "run")}})
    with pytest.raises(UserError, match="sentencepiece") as err:
        ensure_prepared(recipe, progress=False)
    assert err.value.key == "data.add_special_tokens"
