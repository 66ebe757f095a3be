"""SFT data: chat-template rendering and the loss mask against transformers and a reference packer
written from the definition (naohai/data/sft.py's docstring), malformed lines, truncation."""
import json

import numpy as np
import pytest

from naohai.data.hf_tokenizer import train_byte_bpe
from naohai.data.prepare import holdout_mask
from naohai.data.sft import (IGNORE, SFTLoader, load_sft, masked_labels, prepare_sft, prompt_ids, render,
                             report_text)
from naohai.data.tokenizer import Tokenizer
from naohai.errors import UserError

pytest.importorskip("transformers")

CHAT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "{% if m['content'] == 'REFUSE' %}{{ raise_exception('refused content') }}{% endif %}<|{{ m['role'] }}|>\n"
        "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n"
        "{% endif %}")

CONVS = [
    {"messages": [{"role": "system", "content": "你是助手"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                  {"role": "assistant", "content": "six, 6 🚀"}]},
    {"prompt": "Name a colour.", "response": "Blue."},
    {"prompt": "翻译: cat", "response": "猫", "system": "be short"},
    {"messages": [{"role": "user", "content": "long " * 60}, {"role": "assistant", "content": "ok " * 40}]},
    {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                  {"role": "user", "content": "trailing question"}]},
] + [{"prompt": f"echo {i} {i * 7}", "response": f"{i} {i * 7}"} for i in range(30)]
BAD = ['{"prompt": "no response"}', "not json at all", '{"messages": [{"role": "tool", "content": "x"}]}',
       '{"messages": [{"role": "user", "content": "only a question"}]}', "[1, 2]",
       '{"prompt": "p", "response": "REFUSE"}']
SEQ = 96


@pytest.fixture(scope="module")
def bpe(mixed_docs, tmp_path_factory):
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("sftbpe")
    train_byte_bpe(mixed_docs, 600, str(out / "tokenizer.json"))
    config = json.load(open(out / "tokenizer_config.json"))
    config["chat_template"] = CHAT
    json.dump(config, open(out / "tokenizer_config.json", "w"))
    return Tokenizer.load(str(out / "tokenizer.json")), AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("sft") / "chat.jsonl"
    lines = [json.dumps(c, ensure_ascii=False) for c in CONVS]
    for k, bad in enumerate(BAD):            # malformed lines at known places
        lines.insert(3 * k + 1, bad)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path), lines


def _messages(c):
    if "messages" in c:
        return c["messages"]
    return ([{"role": "system", "content": c["system"]}] if "system" in c else []) + [
        {"role": "user", "content": c["prompt"]}, {"role": "assistant", "content": c["response"]}]


def _reference_conversation(theirs, msgs):
    """ids and learned flags from transformers' own renders: the tokens between the generation
    prompt before an assistant turn and the end of that turn are learned, then EOD."""
    def tokens(m, gen):
        out = theirs.apply_chat_template(m, tokenize=True, add_generation_prompt=gen)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    ids = tokens(msgs, False)
    learned = np.zeros(len(ids), np.uint8)
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            lo, hi = len(tokens(msgs[:i], True)), len(tokens(msgs[:i + 1], False))
            learned[lo:hi] = 1
    return list(ids) + [theirs.eos_token_id], list(learned) + [int(msgs[-1]["role"] == "assistant")]


def _reference_pack(convs, seq, pad, packing=True):
    """Windows of seq+1 tokens, conversations in order, a new window when one does not fit (unpacked: for
    every conversation), pad after."""
    size = seq + 1
    windows, masks, fill = [], [], size
    for ids, learned in convs:
        if len(ids) > size:
            continue
        if fill + len(ids) > size or not packing:
            windows.append(np.full(size, pad, np.int64))
            masks.append(np.zeros(size, np.uint8))
            fill = 0
        windows[-1][fill:fill + len(ids)] = ids
        masks[-1][fill:fill + len(ids)] = learned
        fill += len(ids)
    return np.array(windows), np.array(masks)


def test_render_matches_transformers_chat_template(bpe):
    ours, theirs = bpe
    for c in CONVS[:5]:
        msgs = _messages(c)
        ids, learned = render(msgs, ours)
        ref_ids, ref_learned = _reference_conversation(theirs, msgs)
        assert ids == ref_ids
        assert learned == ref_learned
    ids, learned = render(_messages(CONVS[0]), ours)
    text = ours.decode([i for i, f in zip(ids, learned) if f])
    assert text == "4<eod>\nsix, 6 🚀<eod>\n<eod>"        # the answers, their end-of-turn, the final EOD


@pytest.mark.parametrize("packing", [True, False])
def test_prepared_windows_and_masks_equal_reference(bpe, jsonl, tmp_path, packing):
    """data.packing: false (one conversation a window) for templates that put EOD inside conversations,
    where resetting attention at EOD cannot keep packed conversations apart."""
    ours, theirs = bpe
    path, lines = jsonl
    meta = prepare_sft([path], ours, str(tmp_path / "sft"), SEQ, holdout_fraction=0.1, seed=3, packing=packing)
    good = [_messages(c) for c in CONVS if c.get("response") != "REFUSE"]
    ref = [_reference_conversation(theirs, m) for m in good]
    held = holdout_mask(np.array([len(r[0]) for r in ref]), 0.1, 3)
    prep = load_sft(str(tmp_path / "sft"))
    for split, take in (("train", ~held), ("valid", held)):
        ids, mask = _reference_pack([r for r, t in zip(ref, take) if t], SEQ, ours.pad_id, packing)
        np.testing.assert_array_equal(np.asarray(prep.tokens(split)), ids)
        np.testing.assert_array_equal(np.asarray(prep.mask(split)), mask)
        assert (len(ids) == meta["splits"][split]["conversations"]) is not packing, (split, len(ids))
    rep = meta["report"]
    assert rep["malformed"] == len(BAD) and rep["lines_read"] == len(lines)
    listed = {m.split(": ")[0] for m in rep["malformed_lines"]}
    assert listed == {f"{path}:{lines.index(b) + 1}" for b in BAD}
    assert any("refused content" in m for m in rep["malformed_lines"])
    too_long = [len(r[0]) > SEQ + 1 for r in ref]
    assert too_long[3] and not too_long[0] and sum(too_long) == 1          # the multi-turn one is packed
    assert rep["dropped_truncated"] == 1 and rep["truncated"] == 0
    assert rep["conversations"] == len(good) - 1
    assert "6 malformed, 1 dropped as too long" in report_text(meta)
    assert meta["packing"] is packing and ("one a window (data.packing: false)" in report_text(meta)) is not packing


def test_truncate_keeps_the_head_and_unlearns_the_cut_answer(bpe, jsonl, tmp_path):
    ours, _ = bpe
    path, _ = jsonl
    meta = prepare_sft([path], ours, str(tmp_path / "sft"), SEQ, holdout_fraction=0.1, seed=3, truncation="truncate")
    ids, learned = render(_messages(CONVS[3]), ours)
    assert len(ids) > SEQ + 1 and meta["report"]["dropped_truncated"] == 1   # its only answer is cut: nothing left
    long_two_turn = _messages(CONVS[0])[:3] + [{"role": "user", "content": "more " * 100},
                                               {"role": "assistant", "content": "done"}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps({"messages": m}) for m in
                                                [long_two_turn] * 2 + [_messages(CONVS[1])] * 3))
    meta = prepare_sft([str(tmp_path / "t.jsonl")], ours, str(tmp_path / "t"), SEQ, holdout_fraction=0.2,
                       seed=1, truncation="truncate")
    assert meta["report"]["truncated"] == 2 and meta["report"]["dropped_truncated"] == 0
    prep = load_sft(str(tmp_path / "t"))
    full, full_learned = render(long_two_turn, ours)
    rows = [r for s in ("train", "valid") for r in zip(np.asarray(prep.tokens(s)), np.asarray(prep.mask(s)))
            if list(r[0][:10]) == full[:10]]
    assert rows
    row_ids, row_mask = rows[0]
    assert list(row_ids) == full[:SEQ + 1]
    assert list(row_mask) == full_learned[:SEQ + 1]        # the first answer is kept learned ...
    assert sum(row_mask) == sum(full_learned[:SEQ + 1]) and sum(full_learned[SEQ + 1:]) > 0   # ... "done" is cut


def test_loader_batches_and_masked_labels(bpe, jsonl, tmp_path):
    ours, _ = bpe
    prepare_sft([jsonl[0]], ours, str(tmp_path / "sft"), SEQ, holdout_fraction=0.1, seed=3)
    prep = load_sft(str(tmp_path / "sft"))
    loader = SFTLoader(prep, "train", global_batch_size=2, seed=5)
    tokens, mask, learned = loader.next_batch()
    order = loader.window_indices(0, 2)
    assert learned == int(mask[:, 1:].sum()) > 0           # one rank: its rows are the global batch
    halves = [SFTLoader(prep, "train", global_batch_size=2, rank=r, world_size=2, seed=5).next_batch() for r in (0, 1)]
    np.testing.assert_array_equal(np.concatenate([h.tokens for h in halves]), tokens)
    assert [h.learned for h in halves] == [learned, learned]   # every rank knows the global count
    np.testing.assert_array_equal(tokens, np.asarray(prep.tokens("train"))[order])
    ids, labels = masked_labels((tokens, mask))
    assert ids.shape == labels.shape == (2, SEQ) and ids.dtype == labels.dtype == np.int32
    np.testing.assert_array_equal(labels == IGNORE, mask[:, 1:] == 0)
    np.testing.assert_array_equal(labels[mask[:, 1:] == 1], tokens[:, 1:][mask[:, 1:] == 1])
    assert loader.state_dict()["sample"] == 2


def test_generation_prompt_is_what_training_put_before_an_answer(bpe, tok):
    """`naohai generate --chat` asks with prompt_ids: with a chat template, transformers' own
    apply_chat_template(..., add_generation_prompt=True) ids; with naohai's template, the ids training put
    before the first learned token of the same conversation with its answer."""
    ours, theirs = bpe
    for c in CONVS[:5]:
        msgs = _messages(c)
        asked = msgs[:max(i for i, m in enumerate(msgs) if m["role"] == "user") + 1]
        want = theirs.apply_chat_template(asked, tokenize=True, add_generation_prompt=True)
        assert prompt_ids(asked, ours) == list(want["input_ids"] if hasattr(want, "keys") else want)
    for msgs in ([{"role": "user", "content": "hi"}],
                 [{"role": "system", "content": "be short"}, {"role": "user", "content": "翻译: cat"}],
                 [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                  {"role": "user", "content": "again"}]):
        ids, learned = render(msgs + [{"role": "assistant", "content": "the answer"}], tok)
        first = max(i for i, f in enumerate(learned) if not f) + 1      # the answer and EOD: the last learned run
        assert prompt_ids(msgs, tok) == ids[:first]
        assert tok.decode(prompt_ids(msgs, tok)).endswith("Assistant: ")


def test_naohai_template_without_chat_template(tok):
    ids, learned = render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tok)
    assert tok.decode(ids[:-1]) == "User: hi\nAssistant: yo\n"
    assert tok.decode([i for i, f in zip(ids[:-1], learned) if f]) == "yo\n"
    assert ids[-1] == tok.eod_id and learned[-1] == 1


def test_bad_inputs_are_user_errors(bpe, tmp_path):
    ours, _ = bpe
    (tmp_path / "bad.jsonl").write_text("nope\n{}\n")
    with pytest.raises(UserError, match="0 usable conversation.*2 malformed.*bad.jsonl:1"):
        prepare_sft([str(tmp_path / "bad.jsonl")], ours, str(tmp_path / "o"), SEQ)
    with pytest.raises(UserError, match="key 'data.corpus'.*matches no file"):
        prepare_sft([str(tmp_path / "missing*.jsonl")], ours, str(tmp_path / "o"), SEQ)
    (tmp_path / "ok.jsonl").write_text("\n".join(json.dumps(c) for c in CONVS[:3]))
    with pytest.raises(UserError, match="data.truncation"):
        prepare_sft([str(tmp_path / "ok.jsonl")], ours, str(tmp_path / "o"), SEQ, truncation="cut")
    broken = ours.chat_template
    try:
        ours.chat_template = "{% for m in messages %}{{ m.content "
        with pytest.raises(UserError, match="key 'chat_template'.*does not render"):
            prepare_sft([str(tmp_path / "ok.jsonl")], ours, str(tmp_path / "o"), SEQ)
        ours.chat_template = "{% for m in messages|reverse %}{{ m.content }}{% endfor %}"
        with pytest.raises(UserError, match="key 'chat_template'.*incrementally"):
            prepare_sft([str(tmp_path / "ok.jsonl")], ours, str(tmp_path / "o"), SEQ)
    finally:
        ours.chat_template = broken


def test_a_template_that_puts_eod_inside_conversations_is_counted_and_refuses_eod_reset(bpe, jsonl, tmp_path, tok):
    """This file's template ends every turn with EOS, the EOD (as Qwen's <|im_end|> or Llama-2's </s> do):
    prepare_sft counts the conversations that hold EOD before their end, and training refuses model.eod_reset
    with such data (attention restarting at each turn's EOD hid every question from its answer; a LoRA run over
    an imported llama learned nothing); naohai's template puts none inside, and eod_reset stays allowed."""
    import dataclasses
    from naohai.train.job import adopt_token_ids
    from tests.conftest import micro_recipe
    ours, _ = bpe
    path, _ = jsonl
    meta = prepare_sft([path], ours, str(tmp_path / "tpl"), SEQ)
    usable = meta["report"]["lines_read"] - meta["report"]["malformed"]
    assert meta["eod_inside"]["conversations"] == usable          # every conversation: EOS after each turn
    assert meta["eod_inside"]["example"].endswith("<eod>")
    plain = prepare_sft([path], tok, str(tmp_path / "plain"), SEQ)
    assert plain["eod_inside"] == {"conversations": 0, "example": None}
    recipe = micro_recipe(tmp_path / "run")
    on = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, eod_reset=True, eod_id=0))
    with pytest.raises(UserError, match="answer could not see its question") as info:
        adopt_token_ids(on, str(tmp_path / "tpl"), lambda *_: None)
    assert info.value.key == "model.eod_reset"
    logs = []
    adopt_token_ids(recipe, str(tmp_path / "tpl"), logs.append)       # off: a note, and no advice to turn it on
    assert any("cannot keep them apart" in line for line in logs) and not any("eod_reset=true" in line for line in logs)
    assert adopt_token_ids(on, str(tmp_path / "plain"), lambda *_: None).model.eod_reset
    # one conversation a window: nothing is seen across conversations, so no note; the reset stays refused
    prepare_sft([path], ours, str(tmp_path / "alone"), SEQ, packing=False)
    logs = []
    adopt_token_ids(recipe, str(tmp_path / "alone"), logs.append)
    assert not any("attends to the conversations" in line for line in logs), logs
    with pytest.raises(UserError, match="data.packing=false"):
        adopt_token_ids(on, str(tmp_path / "alone"), lambda *_: None)


def test_packing_off_is_for_sft_data_and_a_change_prepares_again(tmp_path, micro_data):
    """data.packing: false with pretraining text exits 2 naming the key; an SFT folder made with the other
    setting is prepared again (the setting is part of what the folder was made for)."""
    import dataclasses
    from naohai.config import recipe_from_dict
    from naohai.data.pipeline import ensure_prepared
    with pytest.raises(UserError, match="applies only to data.format: sft") as info:
        recipe_from_dict({"name": "t", "model": {"preset": "tiny"}, "data": {"packing": False}}, where="r.yaml")
    assert info.value.key == "data.packing"
    rows = [{"prompt": f"say {w}", "response": f"{w} {w}"} for w in ("alpha", "beta", "gamma", "delta") * 10]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from tests.conftest import micro_recipe
    base = micro_recipe(tmp_path / "run", tokenizer=micro_data[1])
    data = dataclasses.replace(base.data, format="sft", corpus=[str(tmp_path / "c.jsonl")])
    recipe = dataclasses.replace(base, data=data, model=dataclasses.replace(base.model, seq_length=96))
    logs = []
    out, _ = ensure_prepared(recipe, log=logs.append)
    packed = load_sft(out).meta
    unpacked_recipe = dataclasses.replace(recipe, data=dataclasses.replace(data, packing=False))
    logs.clear()
    ensure_prepared(unpacked_recipe, log=logs.append)
    alone = load_sft(out).meta
    assert any(line.startswith("preparing conversations") for line in logs), logs
    assert packed["packing"] and not alone["packing"]
    assert alone["splits"]["train"]["windows"] == alone["splits"]["train"]["conversations"] > \
        packed["splits"]["train"]["windows"]
