"""Source mixing: shares by bytes, epoch caps, a deterministic recorded order, and `data prepare` reading it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from naohai.data.corpus import iter_documents
from naohai.data.mix import MixSource, build_mixture, iter_mixture, parse_source_spec
from naohai.errors import UserError


def _source(path, n, size):
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": f"{path.stem}-{i:04d}-" + "x" * (size - 12)}) + "\n")


def test_shares_caps_and_order(tmp_path):
    _source(tmp_path / "a.jsonl", 100, 100)    # 100 documents of equal size in each source
    _source(tmp_path / "b.jsonl", 50, 100)
    desc = build_mixture([MixSource(str(tmp_path / "a.jsonl"), 1.0), MixSource(str(tmp_path / "b.jsonl"), 1.0, 3)],
                         str(tmp_path / "mix.json"), seed=7)
    # hand calculation: equal shares; a can give at most 1 x its bytes, b 3 x -> T = min(1*B_a/0.5, 3*B_b/0.5)
    # = 2 B_a -> 100 documents from a (1 epoch) and 100 from b (2 epochs)
    a, b = desc["sources"]
    assert (a["taken"], b["taken"]) == (100, 100) and b["epochs"] == 2.0
    docs = list(iter_mixture(str(tmp_path / "mix.json")))
    assert len(docs) == 200
    assert sorted(d for d in docs if d.startswith("a-")) == sorted(set(d for d in docs if d.startswith("a-")))
    counts = {}
    for d in docs:
        if d.startswith("b-"):
            counts[d] = counts.get(d, 0) + 1
    assert set(counts.values()) == {2} and len(counts) == 50   # two whole passes over b
    again = build_mixture([MixSource(str(tmp_path / "a.jsonl"), 1.0), MixSource(str(tmp_path / "b.jsonl"), 1.0, 3)],
                          str(tmp_path / "mix2.json"), seed=7)
    assert np.array_equal(np.load(tmp_path / "mix.order.npy"), np.load(tmp_path / "mix2.order.npy"))
    assert again["documents"] == 200
    # the prepare path: a mixture file is a corpus source
    assert list(iter_documents([str(tmp_path / "mix.json")])) == docs


def test_changed_source_and_bad_specs(tmp_path):
    _source(tmp_path / "a.jsonl", 10, 50)
    build_mixture([MixSource(str(tmp_path / "a.jsonl"), 1.0)], str(tmp_path / "m.json"))
    with open(tmp_path / "a.jsonl", "a") as fh:
        fh.write('{"text": "new"}\n')
    with pytest.raises(UserError, match="changed"):
        list(iter_mixture(str(tmp_path / "m.json")))
    with pytest.raises(UserError, match="PATH:WEIGHT"):
        parse_source_spec("only-a-path")
    assert parse_source_spec("d/x.jsonl:0.3:2") == MixSource("d/x.jsonl", 0.3, 2.0)
    with pytest.raises(UserError, match="weight"):
        build_mixture([MixSource(str(tmp_path / "a.jsonl"), float("nan"))], str(tmp_path / "n.json"))


def test_a_file_in_two_sources_is_refused(tmp_path):
    """The same file named twice (or reached by a glob, a clean folder's link, a symbolic link) was mixed twice,
    each copy under its own cap: 'a.jsonl:1 a.jsonl:1' took every document of a twice at 'cap 1.0'.  Refused
    before anything is written, naming both sources."""
    import os
    _source(tmp_path / "a.jsonl", 10, 50)
    _source(tmp_path / "b.jsonl", 10, 50)
    os.symlink(tmp_path / "a.jsonl", tmp_path / "link.jsonl")
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    for second in (a, str(tmp_path / "*.jsonl"), str(tmp_path / "link.jsonl")):
        with pytest.raises(UserError, match="is a file of two sources") as info:
            build_mixture([MixSource(a, 1.0), MixSource(second, 2.0)], str(tmp_path / "m.json"))
        assert f"'{a}' (source 1)" in str(info.value) and f"'{second}' (source 2)" in str(info.value)
    assert not (tmp_path / "m.json").exists() and not (tmp_path / "m.order.npy").exists()
    assert build_mixture([MixSource(a, 1.0), MixSource(b, 2.0)], str(tmp_path / "m.json"))["documents"] > 0
