import json
import os

import numpy as np
import pytest

from naohai.data.prepare import check_compatible, holdout_mask, load_prepared, prepare
from naohai.errors import UserError

SEQ = 32


def _docs(mixed_docs):
    # a unique tag per document lets the test tell documents apart after decoding
    return [f"<<doc {i}>> {d}" for i, d in enumerate(mixed_docs[:120])]


@pytest.fixture(scope="module")
def prepared(tok, mixed_docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prep") / "data"
    meta = prepare(iter(_docs(mixed_docs)), tok, str(out), SEQ, holdout_fraction=0.1, seed=7, progress=False)
    return str(out), meta


def _split_docs(stream, tok):
    """Decode a stream, cutting at EOD: the list of documents, in order."""
    ids = stream.tolist()
    assert ids[-1] == tok.eod_id
    docs, cur = [], []
    for i in ids:
        if i == tok.eod_id:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    return docs


def test_streams_equal_independent_concatenation(prepared, tok, mixed_docs):
    out, meta = prepared
    prep = load_prepared(out)
    docs = _docs(mixed_docs)
    valid_docs = _split_docs(prep.tokens("valid"), tok)
    train_docs = _split_docs(prep.tokens("train"), tok)
    # split by document: disjoint, complete, order preserved
    assert not set(valid_docs) & set(train_docs)
    assert sorted(valid_docs + train_docs) == sorted(docs)
    held = set(valid_docs)
    for split, keep in (("train", lambda d: d not in held), ("valid", lambda d: d in held)):
        expected = np.concatenate([np.array(tok.encode(d) + [tok.eod_id]) for d in docs if keep(d)])
        got = prep.tokens(split)
        assert got.dtype == np.uint16
        np.testing.assert_array_equal(np.asarray(got, dtype=np.int64), expected)
        assert meta["splits"][split]["tokens"] == len(expected)
        assert meta["splits"][split]["windows"] == (len(expected) - 1) // SEQ
    # the held-out part holds at least the requested share of tokens
    assert meta["splits"]["valid"]["tokens"] >= 0.1 * (meta["splits"]["valid"]["tokens"]
                                                        + meta["splits"]["train"]["tokens"])


def test_windows_reconstruct_stream(prepared):
    prep = load_prepared(prepared[0])
    stream = np.asarray(prep.tokens("train"))
    n = prep.num_windows("train")
    wins = np.stack([prep.window("train", i) for i in range(n)])
    assert wins.shape == (n, SEQ + 1)
    np.testing.assert_array_equal(wins[:, :-1].reshape(-1), stream[:n * SEQ])
    np.testing.assert_array_equal(wins[:, -1], stream[SEQ:(n + 1) * SEQ:SEQ])


def test_meta_fields(prepared, tok):
    meta = json.load(open(os.path.join(prepared[0], "meta.json")))
    assert meta["tokenizer"]["sha256"] == tok.sha256
    assert meta["tokenizer"]["vocab_size"] == 1024 and meta["tokenizer"]["eod_id"] == 1
    assert meta["seq_length"] == SEQ and meta["dtype"] == "uint16"
    assert meta["max_token_id"] < 1024


def test_holdout_mask_deterministic_and_sized():
    lengths = np.arange(1, 101)
    a, b = holdout_mask(lengths, 0.2, 3), holdout_mask(lengths, 0.2, 3)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, holdout_mask(lengths, 0.2, 4))
    assert lengths[a].sum() >= 0.2 * lengths.sum()
    assert 1 <= a.sum() < 100
    assert holdout_mask(np.array([5, 5]), 0.01, 0).sum() == 1


def test_check_compatible(prepared):
    meta = load_prepared(prepared[0]).meta
    check_compatible(meta, 1024, SEQ, where="r.yaml")
    with pytest.raises(UserError) as err:
        check_compatible(meta, 2048, SEQ, where="r.yaml")
    assert err.value.key == "model.vocab_size" and err.value.where == "r.yaml"
    with pytest.raises(UserError) as err:
        check_compatible(meta, 1024, 64, where="r.yaml")
    assert err.value.key == "model.seq_length"
    # a given tokenizer may have fewer pieces than the model's rows (a published model's padded embedding)
    check_compatible(meta, 2048, SEQ, where="r.yaml", exact_vocab=False)
    with pytest.raises(UserError) as err:
        check_compatible(meta, 512, SEQ, where="r.yaml", exact_vocab=False)
    assert err.value.key == "model.vocab_size"


def test_refuses_other_tokenizer_or_seq_length_and_keeps_old(tok, tok_jieba, mixed_docs, tmp_path):
    out = str(tmp_path / "d")
    docs = _docs(mixed_docs)[:40]
    prepare(iter(docs), tok, out, SEQ, progress=False)
    before = open(os.path.join(out, "train.npy"), "rb").read()
    with pytest.raises(UserError) as err:
        prepare(iter(docs), tok, out, SEQ * 2, progress=False)
    assert err.value.key == "data.prepared_dir"
    with pytest.raises(UserError):
        prepare(iter(docs), tok_jieba, out, SEQ, progress=False)
    # a failure half way through leaves the existing directory untouched
    def exploding():
        yield docs[0]
        raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        prepare(exploding(), tok, out, SEQ, progress=False)
    assert open(os.path.join(out, "train.npy"), "rb").read() == before
    assert sorted(os.listdir(tmp_path)) == ["d"]
    meta = prepare(iter(docs), tok, out, SEQ * 2, progress=False, overwrite=True)
    assert meta["seq_length"] == SEQ * 2
    # a non-empty foreign directory is never replaced without overwrite
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a prepared data directory"):
        prepare(iter(docs), tok, str(foreign), SEQ, progress=False)
    assert (foreign / "mine.txt").read_text() == "keep me"


def test_too_small_corpus(tok, tmp_path):
    with pytest.raises(UserError) as err:
        prepare(iter(["short one", "short two"]), tok, str(tmp_path / "s"), SEQ, progress=False)
    assert err.value.key == "data.corpus" and "too small" in str(err.value)
    with pytest.raises(UserError, match="at least 2 documents"):
        prepare(iter(["only " * 500]), tok, str(tmp_path / "s"), SEQ, progress=False)
    assert not os.path.exists(tmp_path / "s")


def test_load_prepared_detects_bad_ids_and_missing_dir(prepared, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(prepared[0], bad)
    arr = np.load(bad / "valid.npy", mmap_mode="r+")
    arr[3] = 1500  # >= vocab 1024
    arr.flush()
    del arr
    with pytest.raises(UserError, match="token id 1500"):
        load_prepared(str(bad))
    load_prepared(str(bad), verify=False)  # cheap open skips the scan
    with pytest.raises(UserError) as err:
        load_prepared(str(tmp_path / "none"))
    assert err.value.key == "data.prepared_dir"
