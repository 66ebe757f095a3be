import json
import re

import pytest

from naohai.data.corpus import fingerprint, fortunes_documents, iter_documents, pydoc_documents
from naohai.errors import UserError

_HAN = re.compile(r"[\u4e00-\u9fff]")


def test_builtin_pydoc_is_the_topics_dict():
    from pydoc_data.topics import topics
    docs = list(iter_documents(["builtin:pydoc"]))
    assert len(docs) == len(topics) > 50
    assert docs == [topics[k] for k in sorted(topics)]
    assert sum(map(len, docs)) > 100_000


def test_builtin_fortunes_zh_chinese_entries():
    docs = list(iter_documents(["builtin:fortunes-zh"]))
    assert len(docs) > 1000
    assert all(_HAN.search(d) for d in docs[:200])
    assert not any("\x1b" in d or d.strip() == "%" for d in docs)
    assert "劝君莫惜金缕衣" in "".join(docs)


def test_fortunes_missing_says_how_to_install(tmp_path):
    with pytest.raises(UserError) as err:
        list(fortunes_documents(str(tmp_path)))
    assert "apt-get install fortunes-zh" in str(err.value)
    assert err.value.key == "data.corpus"


def test_jsonl_documents_and_bad_line(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text(json.dumps({"text": "第一"}) + "\n\n" + json.dumps({"text": "two", "x": 1}) + "\n",
                    encoding="utf-8")
    assert list(iter_documents([str(good)])) == ["第一", "two"]
    bad = tmp_path / "b.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + "{not json\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        list(iter_documents([str(bad)]))
    assert err.value.where == f"{bad}:2" and "line 2" in str(err.value)
    assert err.value.key == "data.corpus"


def test_jsonl_missing_key_names_line_and_key(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "a"}\n{"txt": "b"}\n', encoding="utf-8")
    with pytest.raises(UserError) as err:
        list(iter_documents([str(f)]))
    assert err.value.where == f"{f}:2" and err.value.key == "data.jsonl_key"
    assert "'txt'" in str(err.value)  # did-you-mean / keys present


def test_text_files_split_at_two_blank_lines_and_globs(tmp_path):
    (tmp_path / "1.txt").write_text("para one\n\npara two\n\n\nsecond doc\n\n  \n\nthird", encoding="utf-8")
    (tmp_path / "2.md").write_text("only doc", encoding="utf-8")
    (tmp_path / "skip.bin").write_text("ignored", encoding="utf-8")
    expected = ["para one\n\npara two", "second doc", "third", "only doc"]
    assert list(iter_documents([str(tmp_path / "*")])) == expected
    assert list(iter_documents([str(tmp_path)])) == expected


def test_a_folder_leaves_hidden_files_and_folders_out(tmp_path):
    """macOS's ._name copies (binary), editors' lock files and the .work/ of a clean output are not corpus
    documents: a folder source leaves every hidden entry out, as a glob does; named directly, a file is read."""
    (tmp_path / "doc.txt").write_text("the document", encoding="utf-8")
    (tmp_path / "._doc.txt").write_bytes(b"\x00\x05\x16\x07\xff\xfe Mac OS X")
    (tmp_path / ".~lock.doc.txt").write_text("lock", encoding="utf-8")
    (tmp_path / ".work").mkdir()
    (tmp_path / ".work" / "unit-0.jsonl").write_text('{"text": "a copy"}\n', encoding="utf-8")
    assert list(iter_documents([str(tmp_path)])) == ["the document"]
    assert list(iter_documents([str(tmp_path / "*.txt")])) == ["the document"]
    (tmp_path / ".notes.md").write_text("named directly", encoding="utf-8")
    assert list(iter_documents([str(tmp_path / ".notes.md")])) == ["named directly"]


def test_missing_sources_and_empty_corpus(tmp_path):
    with pytest.raises(UserError) as err:
        list(iter_documents(["builtin:pydoc", str(tmp_path / "nope.txt")]))
    assert err.value.key == "data.corpus[1]" and "not found" in str(err.value)
    with pytest.raises(UserError, match="matches no files"):
        list(iter_documents([str(tmp_path / "*.jsonl")]))
    with pytest.raises(UserError, match="builtin:pydoc"):
        list(iter_documents(["builtin:pydocs"]))
    (tmp_path / "empty.txt").write_text("\n \n\n\n", encoding="utf-8")
    with pytest.raises(UserError) as err:
        list(iter_documents([str(tmp_path / "empty.txt")]))
    assert err.value.key == "data.corpus" and "no non-empty documents" in str(err.value)
    (tmp_path / "x.csv").write_text("a", encoding="utf-8")
    with pytest.raises(UserError, match="unsupported"):
        list(iter_documents([str(tmp_path / "x.csv")]))


def test_non_utf8_file_is_a_user_error(tmp_path):
    f = tmp_path / "gbk.txt"
    f.write_bytes("中文".encode("gbk"))
    with pytest.raises(UserError, match="UTF-8"):
        list(iter_documents([str(f)]))


def test_fingerprint_changes_with_file(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("one", encoding="utf-8")
    before = fingerprint([str(f)])
    f.write_text("one two", encoding="utf-8")
    assert fingerprint([str(f)]) != before
