"""`naohai data info / tokenizer / mix / clean / score`: bad flag values are one-paragraph errors (exit 2) that
name the flag, checked before any work, and nothing a user already wrote is replaced or left half-written
(found by a probe)."""
from __future__ import annotations

import json
import os
import warnings

import pytest

from naohai.cli import main
from naohai.data.mix import MixSource, build_mixture
from naohai.data.score import ScoreSettings
from naohai.errors import UserError

from tests.data.test_pipeline import _recipe_file, _tree


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A recipe and its prepared run (run/tokenizer.model, run/data)."""
    tmp = tmp_path_factory.mktemp("prepared")
    path = _recipe_file(tmp)
    assert main(["data", "prepare", path, "--no-progress"]) == 0
    return path, tmp / "run"


def _fails(capsys, argv, flag):
    capsys.readouterr()
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert flag in captured.err and "Traceback" not in captured.err
    return captured


# --------------------------------------------------------------------------- data info --held-out-text
def test_held_out_text_never_replaces_a_file(prepared, capsys):
    _, run = prepared
    data = run / "data"
    before = _tree(run)
    got = _fails(capsys, ["data", "info", str(data), "--held-out-text", str(data / "train.npy")],
                 "--held-out-text")
    assert "exists" in got.err and got.out == ""          # checked before the summary is printed
    assert _tree(run) == before                            # the run's own train.npy is intact


@pytest.mark.parametrize("where", ["folder", "no-parent", "empty"])
def test_held_out_text_bad_paths(prepared, tmp_path, capsys, where):
    _, run = prepared
    target = {"folder": str(tmp_path), "no-parent": str(tmp_path / "missing" / "held.txt"), "empty": ""}[where]
    before = _tree(tmp_path)
    got = _fails(capsys, ["data", "info", str(run / "data"), "--held-out-text", target], "--held-out-text")
    assert got.out == ""
    assert _tree(tmp_path) == before and not (tmp_path / "missing").exists()


def test_held_out_text_writes_a_new_file_and_a_rerun_keeps_it(prepared, tmp_path, capsys):
    """The README's tour run twice: the second `data info --held-out-text held_out.txt` finds its own text there
    and exits 0 without writing; a file that holds anything else, one byte changed, is refused and kept."""
    _, run = prepared
    out = tmp_path / "held.txt"
    assert main(["data", "info", str(run / "data"), "--held-out-text", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert text.strip()
    mtime = os.stat(out).st_mtime_ns
    capsys.readouterr()
    assert main(["data", "info", str(run / "data"), "--held-out-text", str(out)]) == 0
    assert "(unchanged)" in capsys.readouterr().out and os.stat(out).st_mtime_ns == mtime
    other = text[:-2] + ("x" if text[-2] != "x" else "y") + "\n"
    out.write_text(other, encoding="utf-8")
    got = _fails(capsys, ["data", "info", str(run / "data"), "--held-out-text", str(out)], "--held-out-text")
    assert "holds other text" in got.err and got.out == ""
    assert out.read_text(encoding="utf-8") == other


# --------------------------------------------------------------------------- data tokenizer
@pytest.mark.parametrize("extra, flag", [
    (["--out", "", "--force"], "--out"),                   # fell back to the run's own tokenizer and rewrote it
    (["--jsonl-key", "", "--force"], "--jsonl-key"),
    (["--vocab-size", "0", "--force"], "--vocab-size"),    # silently used the recipe's size
    (["--vocab-size", "99999999999999999999", "--out", "OTHER"], "--vocab-size"),   # sentencepiece traceback
    (["--vocab-size", "-5", "--out", "OTHER"], "--vocab-size"),
])
def test_tokenizer_bad_flags(prepared, tmp_path, capsys, extra, flag):
    recipe, run = prepared
    extra = [str(tmp_path / "other") if e == "OTHER" else e for e in extra]
    before = _tree(run)
    _fails(capsys, ["data", "tokenizer", recipe] + extra, flag)
    assert _tree(run) == before and os.listdir(tmp_path) == []


def test_tokenizer_too_large_for_the_corpus_names_the_flag(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("a few words of text\n" * 20)
    got = _fails(capsys, ["data", "tokenizer", "--corpus", str(corpus), "--vocab-size", "100000",
                          "--out", str(tmp_path / "tk")], "--vocab-size")
    assert "too small" in got.err and not (tmp_path / "tk.model").exists()


# --------------------------------------------------------------------------- data mix
def _source(path, n):
    with open(path, "w", encoding="utf-8") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": f"{path.stem} document {i} " + "x" * (i % 7)}) + "\n")
    return str(path)


def test_mix_extreme_weights_are_exact(tmp_path, capsys):
    a, b = _source(tmp_path / "a.jsonl", 20), _source(tmp_path / "b.jsonl", 20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                      # no NumPy overflow / divide-by-zero warning
        assert main(["data", "mix", f"{a}:1e308", f"{b}:1e308", "--out", str(tmp_path / "m.json")]) == 0
        same = build_mixture([MixSource(a, 1.0), MixSource(b, 1.0)], str(tmp_path / "one.json"))
        huge = json.loads((tmp_path / "m.json").read_text())
        assert [s["share"] for s in huge["sources"]] == [0.5, 0.5]
        assert [s["taken"] for s in huge["sources"]] == [s["taken"] for s in same["sources"]]
        assert main(["data", "mix", f"{a}:1e300", f"{b}:1e-300", "--out", str(tmp_path / "t.json")]) == 0
        tiny = json.loads((tmp_path / "t.json").read_text())
    # a takes its one epoch; b's share is 1e-600 of the bytes: the one document every source gives
    assert [s["taken"] for s in tiny["sources"]] == [20, 1]
    assert "Traceback" not in capsys.readouterr().err


def test_mix_out_is_checked_first_and_nothing_is_left_behind(tmp_path, capsys):
    a = _source(tmp_path / "a.jsonl", 5)
    (tmp_path / "d.json").mkdir()
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "settings"}')
    before = _tree(tmp_path)
    _fails(capsys, ["data", "mix", f"{a}:1", "--out", str(tmp_path / "d.json")], "--out")
    _fails(capsys, ["data", "mix", f"{a}:1", "--out", str(mine)], "--out")          # not a mixture: kept
    _fails(capsys, ["data", "mix", f"{a}:1", "--out", str(tmp_path / "a.jsonl" / "m.json")], "--out")
    _fails(capsys, ["data", "mix", f"{a}:1", "--out", str(tmp_path / "m.json"), "--seed", "-1"], "--seed")
    assert _tree(tmp_path) == before and sorted(os.listdir(tmp_path)) == ["a.jsonl", "d.json", "mine.json"]
    with pytest.raises(UserError) as err:
        build_mixture([MixSource(a, 1.0)], str(tmp_path / "m.json"), seed=-1)
    assert err.value.key == "--seed"
    # an earlier mixture is replaced (re-running `data mix` is how a mixture is rebuilt)
    assert main(["data", "mix", f"{a}:1", "--out", str(tmp_path / "m.json")]) == 0
    assert main(["data", "mix", f"{a}:1", "--out", str(tmp_path / "m.json"), "--seed", "3"]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["seed"] == 3
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


# --------------------------------------------------------------------------- data clean / score
def test_clean_workers_is_bounded(tmp_path, capsys):
    a = _source(tmp_path / "a.jsonl", 5)
    for workers in ("99999999999999999999", "0", "4097"):
        _fails(capsys, ["data", "clean", a, "--out", str(tmp_path / "out"), "--workers", workers,
                        "--no-progress"], "--workers")
        assert not (tmp_path / "out").exists()


def test_score_batch_is_bounded(tmp_path, capsys):
    a = _source(tmp_path / "a.jsonl", 5)
    for batch in ("100000000", "0", "4097"):
        _fails(capsys, ["data", "score", a, "--model", str(tmp_path / "no-model"), "--out", str(tmp_path / "out"),
                        "--batch", batch], "--batch")
        assert not (tmp_path / "out").exists()
    with pytest.raises(UserError) as err:
        ScoreSettings(batch=100_000_000).validate()
    assert err.value.key == "--batch"
    assert ScoreSettings(batch=4096).validate().batch == 4096


@pytest.mark.parametrize("extra,flag", [(["--master", "yarn"], "--master"), (["--spark-conf", "foo"], "--spark-conf"),
                                        (["--split-mb", "nan"], "--split-mb"),
                                        (["--engine", "spark", "--workers", "2"], "--workers"),
                                        (["--print-config", "--workers", "2"], "INPUT")])
def test_clean_flags_of_another_engine_exit_2(tmp_path, capsys, extra, flag):
    """The local engine ignored --master / --spark-conf / --split-mb (even a malformed KEY=VALUE), Spark ignored
    --workers, --print-config the run's flags (found by a probe); nothing is written."""
    a = _source(tmp_path / "a.jsonl", 5)
    _fails(capsys, ["data", "clean", a, "--out", str(tmp_path / "out"), "--no-progress", *extra], f"key '{flag}'")
    assert not (tmp_path / "out").exists()
