"""Scheme ``pangu``: a PanGu-alpha ``vocab.model`` used as the reference's JIEBATokenizer uses it.

The published ``vocab.model`` is not available here, so the test trains a small
sentencepiece model shaped like it (default sentencepiece normalisation and dummy prefix,
``<eod>`` / ``<eot>`` / ``<pad>`` pieces, trained on text mapped the reference's way) and
compares naohai's Tokenizer with a re-statement of the reference class
(mindspore-ai/models official/nlp/Pangu_alpha/src/tokenization_jieba.py: JIEBATokenizer
tokenize + convert_tokens_to_ids to encode, decode + process_tokens to decode), which
uses sentencepiece and jieba directly.
"""
import io

import jieba
import pytest
import sentencepiece as spm

from naohai.data.tokenizer import Tokenizer, train_tokenizer

SAMPLES = ["鹏程·盘古是一个中文预训练语言模型。", "PanGu-α  has two  spaces\nand a newline.",
           "第一段。\n\n第二段：脑海 Naohai，训练 MindSpore 模型！", "  leading and trailing  ", "",
           "数字 12345 和 English words mixed 在一起\t制表符"]


class ReferenceJieba:
    """The reference JIEBATokenizer, written again from its source (ids from the pieces' names)."""

    def __init__(self, proto: bytes):
        self.sp = spm.SentencePieceProcessor(model_proto=proto)
        self.encoder = {self.sp.id_to_piece(i): i for i in range(self.sp.get_piece_size())}
        self.translator = str.maketrans(" \n", "\u2582\u2583")
        self.eod_id, self.eot_id, self.pad_id = self.encoder["<eod>"], self.encoder["<eot>"], self.encoder["<pad>"]

    def encode(self, text):
        tokens = [x.translate(self.translator) for x in jieba.cut(text, cut_all=False)]
        return self.sp.encode(" ".join(tokens))

    def decode(self, ids):
        return self.sp.decode(ids).replace(" ", "").replace("\u2582", " ").replace("\u2583", "\n")


@pytest.fixture(scope="module")
def pangu_proto(mixed_docs):
    translator = str.maketrans(" \n", "\u2582\u2583")
    lines = [" ".join(w.translate(translator) for w in jieba.cut(doc, cut_all=False)) for doc in mixed_docs]
    buf = io.BytesIO()
    # <unk> 0, <s> 1, </s> 2, then the three pieces PanGu's tokenizer looks up by name
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=1500,
                                   model_type="bpe", control_symbols=["<eod>", "<eot>", "<pad>"],
                                   character_coverage=0.98, minloglevel=2)
    return buf.getvalue()


def test_pangu_scheme_encodes_and_decodes_like_the_reference(pangu_proto, mixed_docs):
    ours, ref = Tokenizer(pangu_proto), ReferenceJieba(pangu_proto)
    assert ours.scheme == "pangu" and ours.jieba
    assert (ours.eod_id, ours.pad_id) == (ref.eod_id, ref.pad_id) == (3, 5)
    for text in SAMPLES + mixed_docs[:40]:
        ids = ours.encode(text)
        assert ids == ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.encode_batch(SAMPLES) == [ref.encode(t) for t in SAMPLES]
    # spaces and newlines survive through the reference's markers
    assert ours.decode(ours.encode("a b\nc")) == "a b\nc"
    assert "\u2582" in "".join(ours.sp.id_to_piece(i) for i in ours.encode("a b"))


def test_models_without_the_pangu_pieces_keep_their_scheme(pangu_proto, mixed_docs, tmp_path):
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(mixed_docs), model_writer=buf, vocab_size=1500, character_coverage=0.98,
                                   model_type="bpe", control_symbols=["<eod>", "<pad>"], minloglevel=2)
    assert Tokenizer(buf.getvalue()).scheme == "raw"
    assert train_tokenizer(mixed_docs[:60], 400, str(tmp_path / "own"), jieba=True).scheme == "naohai-v1-jieba"
    path = tmp_path / "vocab.model"
    path.write_bytes(pangu_proto)
    assert Tokenizer.load(str(path)).scheme == "pangu"
