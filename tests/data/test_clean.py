"""`naohai data clean` end to end on the planted corpus: dedup precision/recall, malformed input, report,
parallel == serial, and interrupt + resume == uninterrupted."""
from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from naohai.data.clean import clean, output_files, report_table
from naohai.data.clean_config import CleanConfig, clean_config_from_dict, load_clean_config
from naohai.data.dedup import jaccard, shingles
from naohai.errors import UserError
from tests.data import planted

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def dedup_only(**near) -> CleanConfig:
    cfg = CleanConfig(batch_docs=40)
    for step in ("normalize", "language", "quality", "pii"):
        getattr(cfg, step).enabled = False
    for k, v in near.items():
        setattr(cfg.near_dedup, k, v)
    return cfg.validate()


def write_jsonl(path, docs):
    with open(path, "w", encoding="utf-8") as fh:
        for i, d in enumerate(docs):
            fh.write(json.dumps({"text": d, "id": i}, ensure_ascii=False) + "\n")


def read_out(out_dir):
    return [json.loads(line) for p in output_files(out_dir) for line in open(p, encoding="utf-8")]


@pytest.fixture(scope="module")
def corpus():
    return planted.build()


def test_dedup_precision_and_recall(corpus, tmp_path):
    keep = [i for i, k in enumerate(corpus.kind) if k in ("base-en", "base-zh", "exact", "near")]
    docs = [corpus.docs[i] for i in keep]
    write_jsonl(tmp_path / "in.jsonl", docs)
    cfg = dedup_only()
    report = clean([str(tmp_path / "in.jsonl")], str(tmp_path / "out"), cfg, workers=2, progress=False)
    kept_ids = {r["id"] for r in read_out(tmp_path / "out")}
    nd = cfg.near_dedup
    sh = [shingles(d, nd.shingle, nd.ngram) for d in docs]
    kinds = [corpus.kind[i] for i in keep]
    exact_dropped = report["steps"]["exact_dedup"]["dropped"]
    exact_planted = kinds.count("exact")

    def letters(t):
        return re.sub(r"[\W_]+", "", t).casefold()

    def smallest(group):    # the documented choice, from the definition: smallest BLAKE2b-64 of the text, then line
        return min(group, key=lambda j: (hashlib.blake2b(docs[j].encode(), digest_size=8).hexdigest(), j))
    groups = collections.defaultdict(list)
    for j in range(len(docs)):
        groups[letters(docs[j])].append(j)
    # exact: of every group of letter-for-letter equal documents (casefolded, letters and digits only,
    # compared as plain strings here) the step keeps the one with the smallest text hash
    exact_kept = {smallest(g) for g in groups.values()}
    exact_drops = [j for j in range(len(docs)) if j not in exact_kept]
    assert exact_dropped == len(exact_drops) >= exact_planted     # planted copies, and any the sources share
    dropped = [j for j in range(len(docs)) if j not in kept_ids]
    near_dropped = [j for j in dropped if j in exact_kept]
    # near: a drop is right if the document's true Jaccard (exact set arithmetic) with another document that
    # survived the exact step reaches the threshold less 0.1 (LSH works on estimates); a planted pair at true
    # Jaccard >= the threshold is found when not both of it are kept
    right = [j for j in near_dropped if any(jaccard(sh[j], sh[i]) >= nd.threshold - 0.1 for i in exact_kept
                                            if i != j)]
    planted_near = [j for j in range(len(docs)) if kinds[j] == "near"]
    origin = {j: keep.index(corpus.origin[keep[j]]) for j in planted_near}
    truly_near = [j for j in planted_near if jaccard(sh[j], sh[origin[j]]) >= nd.threshold]
    found = [j for j in truly_near if j not in kept_ids or origin[j] not in kept_ids]
    p = len(right) / len(near_dropped) if near_dropped else 1.0
    r = len(found) / len(truly_near)
    print(f"exact dedup: dropped {exact_dropped}, planted {exact_planted}")
    print(f"near dedup: precision {p:.3f} recall {r:.3f} ({len(near_dropped)} dropped, {len(right)} right; "
          f"{len(found)}/{len(truly_near)} planted with true Jaccard >= {nd.threshold}; LSH {report['lsh']})")
    assert not set(dropped) - set(exact_drops) - set(near_dropped)
    assert report["steps"]["near_dedup"]["dropped"] == len(near_dropped)
    # with the defaults' b x r = 21 x 6 a pair at J = 0.7 becomes a candidate with probability
    # 1 - (1 - 0.7^6)^21 = 0.93, and more for higher J; verification accepts estimates from 0.62 up
    assert report["lsh"] == {"bands": 21, "rows": 6}
    # (at 0.8: 16 x 8, 0.947 at J = 0.8, estimates from 0.73 up).  Expected recall is >= 0.95 on
    # the ~20 planted pairs; we require 0.85 (about two misses) so that the bound is not a coin toss, and
    # precision 1 because candidates are checked against their signatures
    assert r >= 0.85
    assert p == 1.0


def test_malformed_lines_are_reported_not_fatal(tmp_path):
    good = {"text": "hello world " * 20}
    lines = [json.dumps(good).encode(), b"{not json", b'{"txt": "no text key"}', b"[1, 2]",
             b'{"text": 5}', b'{"text": "caf\xe9"}', json.dumps({"text": "x" * 5000}).encode(),
             json.dumps(good).encode()]
    (tmp_path / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as fh:
        fh.write(json.dumps(good).encode() + b"\n")
    raw = gzip.compress(b"\n".join([json.dumps(good).encode()] * 200))
    (tmp_path / "c.jsonl.gz").write_bytes(raw[: len(raw) // 2])          # truncated archive
    cfg = dedup_only()
    cfg.max_line_bytes = 1024
    report = clean([str(tmp_path / p) for p in ("a.jsonl", "b.jsonl.gz", "c.jsonl.gz")], str(tmp_path / "out"),
                   cfg, workers=1, progress=False)
    probs = {(os.path.basename(x["where"]), x["reason"].split(" ")[0]) for x in report["read"]["problems"]["listed"]}
    assert {("a.jsonl:2", "not"), ("a.jsonl:3", "no"), ("a.jsonl:4", "a"), ("a.jsonl:5", "'text'"),
            ("a.jsonl:6", "not"), ("a.jsonl:7", "line")} <= probs
    assert any(w.startswith("c.jsonl.gz:") and r == "file" for w, r in probs)
    assert report["read"]["problems"]["by_file"][str(tmp_path / "a.jsonl")] == 6
    assert 3 <= report["read"]["docs_in"] < 3 + 200     # a: 2, b: 1, c: the lines before the cut


def test_report_counts_add_up_and_workers_do_not_change_the_output(corpus, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", corpus.docs)
    cfg = load_clean_config(None)
    cfg.batch_docs = 50
    cfg.quality.min_words = 30
    one = clean([str(tmp_path / "in.jsonl")], str(tmp_path / "w1"), cfg, workers=1, progress=False)
    two = clean([str(tmp_path / "in.jsonl")], str(tmp_path / "w2"), cfg, workers=2, progress=False)
    assert read_out(tmp_path / "w1") == read_out(tmp_path / "w2")
    assert one["steps"] == two["steps"]
    prev = one["read"]["kept"]
    for name, s in one["steps"].items():
        if s["enabled"]:
            assert s["docs_in"] == prev and s["kept"] + s["dropped"] == s["docs_in"], name
            assert len(s["samples"]) <= cfg.samples
            prev = s["kept"]
    assert prev == one["output"]["documents"] == len(read_out(tmp_path / "w1"))
    assert one["steps"]["language"]["dropped"] >= 20          # the planted German/French/Russian/Japanese
    out = "\n".join(r["text"] for r in read_out(tmp_path / "w1"))
    for items in corpus.pii.values():                          # no planted personal data survives
        for values in items.values():
            assert not any(v in out for v in values)


def test_interrupt_and_resume_equals_uninterrupted(corpus, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", corpus.docs * 3)
    cfg_path = tmp_path / "clean.yaml"
    cfg_path.write_text("batch_docs: 20\nshard_docs: 100\nquality:\n  min_words: 30\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "naohai.cli", "data", "clean", str(tmp_path / "in.jsonl"), "--config",
           str(cfg_path), "--workers", "1", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=REPO)
    subprocess.run(cmd + ["--out", str(tmp_path / "full")], check=True, env=env, capture_output=True)
    proc = subprocess.Popen(cmd + ["--out", str(tmp_path / "cut")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    work = tmp_path / "cut" / ".work"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if work.is_dir() and len([p for p in os.listdir(work) if p.endswith(".json") and p.startswith("unit")]) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "cut" / "report.json").exists()
    done = len([p for p in os.listdir(work) if p.startswith("unit") and p.endswith(".json")])
    res = subprocess.run(cmd + ["--out", str(tmp_path / "cut")], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert read_out(tmp_path / "cut") == read_out(tmp_path / "full")
    a = json.load(open(tmp_path / "cut" / "report.json"))
    b = json.load(open(tmp_path / "full" / "report.json"))
    assert a["steps"] == b["steps"] and a["output"] == b["output"]
    print(f"interrupted after {done} of {len(corpus.docs) * 3 // 20 + 1} units; resumed output identical")


def test_user_errors(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(UserError, match="near_dedup.bands"):
        clean_config_from_dict({"near_dedup": {"bands": 20, "rows": 20}})
    with pytest.raises(UserError, match="unknown key 'quallity'"):
        clean_config_from_dict({"quallity": {}})
    with pytest.raises(UserError, match="finite"):
        clean_config_from_dict({"classifier": {"threshold": float("inf")}})
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        clean([str(tmp_path / "x.jsonl")], str(tmp_path / "busy"), dedup_only(), workers=1, progress=False)
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine"
    clean([str(tmp_path / "x.jsonl")], str(tmp_path / "o"), dedup_only(), workers=1, progress=False)
    with pytest.raises(UserError, match="--restart"):
        clean([str(tmp_path / "x.jsonl")], str(tmp_path / "o"), dedup_only(threshold=0.5), workers=1,
              progress=False)
    with pytest.raises(UserError, match="input not found"):
        clean([str(tmp_path / "nope.jsonl")], str(tmp_path / "o2"), dedup_only(), workers=1, progress=False)


def test_kept_duplicates_do_not_depend_on_input_order(corpus, tmp_path):
    keep = [i for i, k in enumerate(corpus.kind) if k in ("base-en", "base-zh", "exact", "near")]
    docs = [corpus.docs[i] for i in keep]
    write_jsonl(tmp_path / "fwd.jsonl", docs)
    write_jsonl(tmp_path / "rev.jsonl", docs[::-1])
    a = clean([str(tmp_path / "fwd.jsonl")], str(tmp_path / "a"), dedup_only(), workers=1, progress=False)
    b = clean([str(tmp_path / "rev.jsonl")], str(tmp_path / "b"), dedup_only(), workers=1, progress=False)
    ta, tb = sorted(r["text"] for r in read_out(tmp_path / "a")), sorted(r["text"] for r in read_out(tmp_path / "b"))
    assert ta == tb and len(ta) < len(docs)
    assert a["steps"]["near_dedup"]["dropped"] == b["steps"]["near_dedup"]["dropped"] > 0


def test_components_against_breadth_first_search():
    import random

    from naohai.data.dedup import components
    rng = random.Random(3)
    edges = [(rng.randrange(60), rng.randrange(60)) for _ in range(45)]
    adj = collections.defaultdict(set)
    for a, b in edges:
        adj[a].add(b)
        adj[b].add(a)
    for node in adj:                        # breadth-first search: the component, and its smallest node
        seen, todo = {node}, [node]
        while todo:
            for n in adj[todo.pop()]:
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        assert components(edges)[node] == min(seen)


def test_a_step_dropping_most_of_its_input_warns_naming_the_setting(corpus, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", [d for d, k in zip(corpus.docs, corpus.kind) if k.startswith("base")])
    cfg = dedup_only()
    cfg.quality.enabled = True
    cfg.quality.min_words = 5000
    report = clean([str(tmp_path / "in.jsonl")], str(tmp_path / "o"), cfg, workers=1, progress=False)
    s = report["steps"]["quality"]
    assert 2 * s["dropped"] > s["docs_in"]
    assert [w for w in report["warnings"] if w.startswith("quality:") and "quality.min_words" in w]
    table = report_table(report)
    assert "warning: quality:" in table
    # the rule in words, its count first and its limit from the config (not "min_words 20")
    row = next(line for line in table.splitlines() if line.startswith("quality"))
    assert f"{s['reasons']['min_words']} with fewer than 5000 words (quality.min_words)" in row, table
    cfg.quality.min_words = 10
    report = clean([str(tmp_path / "in.jsonl")], str(tmp_path / "o2"), cfg, workers=1, progress=False)
    assert report["warnings"] == []


def test_report_sizes_have_a_unit_that_fits():
    from naohai.data.clean import human_size
    assert [human_size(n) for n in (0, 999, 1000, 34_567, 999_499, 999_999, 12_345_678, 3_210_000_000)] == \
        ["0 B", "999 B", "1.00 KB", "34.6 KB", "999.5 KB", "1.00 MB", "12.3 MB", "3.21 GB"]


def test_an_output_folder_named_with_glob_characters(corpus, tmp_path):
    write_jsonl(tmp_path / "in.jsonl", corpus.docs[:30])
    out = tmp_path / "out-local[2]"
    report = clean([str(tmp_path / "in.jsonl")], str(out), dedup_only(), workers=1, progress=False)
    shards = sorted(p for p in os.listdir(out) if p.startswith("part-"))
    assert shards and output_files(out) == [str(out / p) for p in shards]
    assert report["output"]["bytes"] == sum(os.path.getsize(out / p) for p in shards) > 0


def _tree(folder):
    """Every file below ``folder`` (hidden ones too) -> its bytes."""
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(folder) for f in fs}


def _clean_argv(inputs, out, tmp_path, *more):
    cfg = tmp_path / "dedup_only.yaml"
    cfg.write_text("batch_docs: 40\nnormalize: {enabled: false}\nlanguage: {enabled: false}\n"
                   "quality: {enabled: false}\npii: {enabled: false}\n", encoding="utf-8")
    return ["data", "clean", *map(str, inputs), "--out", str(out), "--config", str(cfg), "--workers", "1",
            "--no-progress", *more]


def test_a_clean_output_folder_given_as_input_is_read_once(corpus, tmp_path):
    """Its .work/unit-N.jsonl hold copies of the documents: a folder input leaves hidden entries out."""
    write_jsonl(tmp_path / "in.jsonl", corpus.docs[:60])
    first = clean([str(tmp_path / "in.jsonl")], str(tmp_path / "c1"), dedup_only(), workers=1, progress=False)
    assert os.listdir(tmp_path / "c1" / ".work")                    # the copies are there
    n = first["output"]["documents"]
    again = clean([str(tmp_path / "c1")], str(tmp_path / "c2"), dedup_only(), workers=1, progress=False)
    assert again["inputs"] == [str(tmp_path / "c1" / "part-00000.jsonl")]
    assert again["read"]["docs_in"] == n and again["output"]["documents"] == n
    assert again["steps"]["exact_dedup"]["dropped"] == 0


@pytest.mark.parametrize("where", ["equal", "inside", "contains"])
def test_an_out_that_overlaps_the_inputs_is_refused_and_nothing_changes(corpus, tmp_path, capsys, where):
    """--out that is an input folder, lies inside one, or contains an input file: exit 2 naming --out, before
    anything is written or (with --restart) deleted."""
    from naohai.cli import main
    write_jsonl(tmp_path / "in.jsonl", corpus.docs[:60])
    clean([str(tmp_path / "in.jsonl")], str(tmp_path / "c1"), dedup_only(), workers=1, progress=False)
    inputs, out = {"equal": ([tmp_path / "c1"], tmp_path / "c1"),
                   "inside": ([tmp_path / "c1"], tmp_path / "c1" / "clean"),
                   "contains": ([tmp_path / "c1" / "part-00000.jsonl"], tmp_path / "c1")}[where]
    said = {"equal": "is the input folder", "inside": "lies inside the input folder",
            "contains": "contains the input file"}[where]
    for argv in [_clean_argv(inputs, out, tmp_path, *more) for more in (("--restart",), ())]:
        before = _tree(tmp_path)
        assert main(argv) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "'--out'" in err and said in err and "Traceback" not in err, err
        assert _tree(tmp_path) == before
    assert not (tmp_path / "c1" / "clean").exists()


def test_an_out_below_a_hidden_name_inside_the_input_folder_is_not_read_back(corpus, tmp_path, capsys):
    from naohai.cli import main
    (tmp_path / "raw").mkdir()
    write_jsonl(tmp_path / "raw" / "in.jsonl", corpus.docs[:60])
    out = tmp_path / "raw" / ".clean"
    assert main(_clean_argv([tmp_path / "raw"], out, tmp_path)) == 0
    first = json.loads((out / "report.json").read_text())
    assert main(_clean_argv([tmp_path / "raw"], out, tmp_path)) == 0      # the same inputs: the finished run
    assert json.loads((out / "report.json").read_text()) == first and first["read"]["docs_in"] == 60
    capsys.readouterr()
    assert main(_clean_argv([str(tmp_path / "raw" / "**" / "*.jsonl")], tmp_path / "raw" / "sub", tmp_path)) == 2
    assert "would be matched by the input pattern" in " ".join(capsys.readouterr().err.split())
