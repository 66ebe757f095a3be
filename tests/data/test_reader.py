"""Reading one .jsonl file in byte ranges (the Spark engine's splits) gives exactly what reading it whole gives:
the same records and problems, with the whole file's line numbers, wherever the ranges cut the lines."""
from __future__ import annotations

import gzip
import json
import random

import pytest

from naohai.data.reader import Split, byte_ranges, count_newlines, read_inputs, read_split


def _seen(records):
    return [(type(r).__name__, r.where, getattr(r, "text", None), getattr(r, "extra", None),
             getattr(r, "reason", None)) for r in records]


def _random_jsonl(rng: random.Random) -> str:
    lines = []
    for i in range(rng.randint(0, 40)):
        k = rng.random()
        if k < 0.1:
            lines.append("")                                              # blank: skipped, still counted
        elif k < 0.2:
            lines.append("{not json")
        elif k < 0.25:
            lines.append(json.dumps({"text": "x" * rng.randint(50, 300)}))  # over-long at small limits
        else:
            lines.append(json.dumps({"text": f"doc {i} " + "é" * rng.randint(0, 20), "id": i}, ensure_ascii=False))
    return "\n".join(lines) + ("\n" if rng.random() < 0.7 else "")


@pytest.mark.parametrize("seed", range(4))
def test_byte_ranges_read_exactly_the_whole_file(tmp_path, seed):
    rng = random.Random(seed)
    path = str(tmp_path / "f.jsonl")
    for _ in range(60):
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(_random_jsonl(rng))
        max_line = rng.choice([60, 100, 1 << 20])
        whole = _seen(read_inputs([path], "text", max_line))
        split_bytes = rng.randint(1, 200)
        got, before = [], 0
        ranges = byte_ranges(path, split_bytes)
        for start, end in ranges:
            got += _seen(read_split(path, Split(start, end, before), "text", max_line))
            before += count_newlines(path, start, end)
        assert got == whole, (split_bytes, max_line)


def test_only_plain_jsonl_is_split(tmp_path):
    body = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(100))
    (tmp_path / "a.jsonl").write_text(body)
    (tmp_path / "a.txt").write_text(body)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.write(body)
    assert len(byte_ranges(str(tmp_path / "a.jsonl"), 100)) == -(-len(body) // 100)
    assert byte_ranges(str(tmp_path / "a.jsonl"), len(body)) == [(0, None)]
    assert byte_ranges(str(tmp_path / "a.txt"), 100) == [(0, None)]
    assert byte_ranges(str(tmp_path / "a.jsonl.gz"), 100) == [(0, None)]
    with pytest.raises(ValueError):
        list(read_split(str(tmp_path / "a.txt"), Split(100, 200, 0)))


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e300"])
def test_bad_split_size_is_one_paragraph_exit_2(tmp_path, capsys, value):
    from naohai.cli import main
    (tmp_path / "a.jsonl").write_text('{"text": "hello"}\n')
    code = main(["data", "clean", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "o"), "--engine", "spark",
                 f"--split-mb={value}"])
    assert code == 2 and "'--split-mb'" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_folder_input_leaves_hidden_entries_out(tmp_path):
    """A clean output's .work/unit-N.jsonl copies (and any hidden file or folder) are not read from a folder;
    globs skip hidden names as glob.glob does; a file named directly is read whatever its name."""
    from naohai.data.reader import resolve_inputs
    from naohai.errors import UserError
    (tmp_path / "c" / ".work").mkdir(parents=True)
    (tmp_path / "c" / "sub" / ".hid").mkdir(parents=True)
    for rel in ("c/part-00000.jsonl", "c/.work/unit-000000.jsonl", "c/.draft.jsonl", "c/sub/b.txt",
                "c/sub/.hid/x.jsonl"):
        (tmp_path / rel).write_text('{"text": "a"}\n')
    c = tmp_path / "c"
    assert resolve_inputs([str(c)]) == [str(c / "part-00000.jsonl"), str(c / "sub" / "b.txt")]
    assert resolve_inputs([str(c / "**" / "*.jsonl")]) == [str(c / "part-00000.jsonl")]
    assert resolve_inputs([str(c / ".work" / "unit-000000.jsonl")]) == [str(c / ".work" / "unit-000000.jsonl")]
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / ".x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(UserError, match="holds no .* files .hidden entries"):
        resolve_inputs([str(tmp_path / "only")])
