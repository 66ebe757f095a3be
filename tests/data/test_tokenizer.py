import os

import pytest
from hypothesis import given, settings, strategies as st

from naohai.data.tokenizer import Tokenizer, train_tokenizer
from naohai.errors import UserError

MIXED = ("PanGu-α  is a 中文 language model.\tTabs\t\tand  double  spaces.\n\n"
         "第二段：鹏程·盘古，Naohai 脑海！\r\n  indented line\n\n\n"
         "escapes: \u2581 \u2582 \u2583 \u2584\u2584 \u2584_ \u25842 </s> <pad> <eod> 😀 \x00 end  ")
TRICKY = ["", " ", "  ", "\n", "\n\n", "\t", "a", "中", "\u2581", "\u2584", "\u2584_", "\u2584\u2584_",
          "\u2582", "\u2584" + "2", " \u2582 ", "x\u2584", "  lead", "trail  ", "\u2581\u2581 \u2581"]


@pytest.mark.parametrize("which", ["tok", "tok_jieba"])
def test_exact_round_trip_mixed_text(which, request):
    tok = request.getfixturevalue(which)
    for text in [MIXED] + TRICKY:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text


@pytest.mark.parametrize("which", ["tok", "tok_jieba"])
def test_round_trip_corpus_documents(which, request, mixed_docs):
    tok = request.getfixturevalue(which)
    for doc in mixed_docs[:60]:
        assert tok.decode(tok.encode(doc)) == doc


_ALPHABET = st.sampled_from(list("ab Z9 \n\t\r.,中文脑海，。") + ["\u2581", "\u2582", "\u2583", "\u2584", "😀", "_", "2"])


@settings(max_examples=150, deadline=None)
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_round_trip_property_plain(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=150, deadline=None)
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_round_trip_property_jieba(tok_jieba, text):
    assert tok_jieba.decode(tok_jieba.encode(text)) == text


def test_special_ids_and_scheme(tok, tok_jieba):
    for t in (tok, tok_jieba):
        assert (t.pad_id, t.eod_id, t.unk_id, t.bos_id) == (0, 1, 2, 3)
        assert t.vocab_size == 1024
        assert t.id_to_piece(5) == "\n"
        assert t.unk_id not in t.encode(MIXED)
        # control pieces are never produced from text
        assert t.eod_id not in t.encode("<eod></s><pad>")
    assert (tok.scheme, tok.jieba) == ("naohai-v1", False)
    assert (tok_jieba.scheme, tok_jieba.jieba) == ("naohai-v1-jieba", True)


def test_jieba_splits_words(tok, tok_jieba):
    # word boundaries become pieces starting with the space symbol
    pieces = [tok_jieba.id_to_piece(i) for i in tok_jieba.encode("我们喜欢学习中文")]
    assert sum(p.startswith("\u2581") for p in pieces) >= 2
    assert not any(tok.id_to_piece(i).startswith("\u2581") for i in tok.encode("我们喜欢学习中文"))


def test_save_load_and_determinism(tok, mixed_docs, tmp_path):
    loaded = Tokenizer.load(tok.path)
    assert loaded.sha256 == tok.sha256 and loaded.scheme == tok.scheme
    assert loaded.encode(MIXED) == tok.encode(MIXED)
    again = train_tokenizer(mixed_docs, 1024, str(tmp_path / "again"))
    assert again.sha256 == tok.sha256
    assert os.path.exists(tmp_path / "again.model")


def test_vocab_too_small_or_too_large(mixed_docs):
    with pytest.raises(UserError) as err:
        train_tokenizer(mixed_docs, 100)
    assert err.value.key == "model.vocab_size"
    with pytest.raises(UserError) as err:
        train_tokenizer(["tiny corpus"], 5000)
    assert err.value.key == "model.vocab_size"


def test_load_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        Tokenizer.load(str(tmp_path / "nope.model"))
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="sentencepiece"):
        Tokenizer.load(str(bad))
