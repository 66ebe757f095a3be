"""`naohai data clean --engine spark` (PySpark in local mode, a real JVM): the same shards and report as the local
engine, the distributed connected components against union-find, and a driver killed mid-job then re-run (the
perplexity step on Spark is tested with its trained model in tests/data/test_score.py)."""
from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from naohai.data import dedup
from naohai.data.clean import clean, output_files
from naohai.data.clean_config import load_clean_config
from naohai.data.reader import Split, byte_ranges
from naohai.data.spark_driver import spark_context, stop_context
from naohai.data.spark_engine import clean_spark, connected_components, local_slots, split_size
from tests.data import planted

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def spark():
    sc = spark_context("local[2]")
    yield sc
    stop_context(sc)


@pytest.fixture(scope="module")
def corpus():
    return planted.build()


def write_inputs(corpus, folder):
    """The planted corpus over three .jsonl files (one gzipped) with malformed lines, and a .txt file."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for k in range(3):
        lines = [json.dumps({"text": t, "id": i}, ensure_ascii=False) for i, t in enumerate(corpus.docs[k::3])]
        lines.insert(5, "{not json")
        lines.insert(9, '{"txt": "no text key"}')
        data = ("\n".join(lines) + "\n").encode()
        path = os.path.join(folder, f"in{k}.jsonl" + (".gz" if k == 2 else ""))
        with (gzip.open(path, "wb") if k == 2 else open(path, "wb")) as fh:
            fh.write(data)
        paths.append(path)
    txt = os.path.join(folder, "more.txt")
    with open(txt, "w", encoding="utf-8") as fh:
        fh.write("\n\n\n".join(corpus.docs[:30:2]))   # documents separated by two blank lines; copies of some above
    return paths + [txt]


def shards(out_dir):
    return [open(p, "rb").read() for p in output_files(out_dir)]


def config():
    cfg = load_clean_config(None)
    cfg.batch_docs = 25
    cfg.shard_docs = 40
    cfg.quality.min_words = 30
    return cfg


def test_spark_engine_writes_what_the_local_engine_writes(spark, corpus, tmp_path, monkeypatch):
    inputs = write_inputs(corpus, tmp_path / "in")
    cfg = config()
    local = clean(inputs, str(tmp_path / "local"), cfg, workers=2, progress=False)
    # the two .jsonl files are read in 16 KB byte ranges by several tasks each (lines cut at range ends, bad
    # lines and line numbers inside later ranges); the .gz and .txt files whole
    split = 16384
    assert sum(len(byte_ranges(p, split)) for p in inputs) >= len(inputs) + 6
    dist = clean_spark(inputs, str(tmp_path / "spark"), cfg, master="local[2]", split_bytes=split)
    assert shards(tmp_path / "local") == shards(tmp_path / "spark")
    assert len(shards(tmp_path / "local")) >= 2
    assert local == dist                     # every count, reason, sample, problem and warning
    steps = local["steps"]
    assert steps["exact_dedup"]["dropped"] >= 20 and steps["near_dedup"]["dropped"] >= 15
    assert steps["language"]["dropped"] >= 20 and steps["quality"]["dropped"] >= 10
    assert local["read"]["problems"]["total"] == 6
    # the same again without the per-document steps: only the dedup shuffles decide
    for step in ("normalize", "language", "quality", "pii"):
        getattr(cfg, step).enabled = False
    local = clean(inputs, str(tmp_path / "local2"), cfg, workers=1, progress=False)
    dist = clean_spark(inputs, str(tmp_path / "spark2"), cfg, master="local[2]")
    assert shards(tmp_path / "local2") == shards(tmp_path / "spark2") and local == dist
    # and with the duplicates found on the cluster (past the driver's limits: drops joined, near links by star
    # rounds, the kept places grouped by split with a shuffle), the ranges' newlines counted by a Spark job as
    # for a cluster master
    from naohai.data import spark_engine
    monkeypatch.setattr(spark_engine, "local_slots", lambda master: None)
    monkeypatch.setattr(spark_engine, "DRIVER_DOCS", 0)
    monkeypatch.setattr(spark_engine, "DRIVER_DROPS", 0)
    monkeypatch.setattr(spark_engine, "DRIVER_LINKS", 0)
    dist = clean_spark(inputs, str(tmp_path / "spark3"), cfg, master="local[2]", split_bytes=split)
    assert shards(tmp_path / "local2") == shards(tmp_path / "spark3") and local == dist
    # near dedup alone on the cluster: the keys RDD goes straight into it
    cfg.exact_dedup.enabled = False
    local = clean(inputs, str(tmp_path / "local4"), cfg, workers=1, progress=False)
    dist = clean_spark(inputs, str(tmp_path / "spark4"), cfg, master="local[2]", split_bytes=split)
    assert shards(tmp_path / "local4") == shards(tmp_path / "spark4") and local == dist
    assert local["steps"]["near_dedup"]["dropped"] >= 15


def test_hadoop_paths_read_like_local_files(spark, corpus, tmp_path):
    """file:// URIs go through Hadoop's FileSystem and TextInputFormat (as hdfs:// or obs:// would, with their
    connectors): the same documents, problems and places as the local files."""
    from naohai.data.hadoop_inputs import resolve_uri
    from naohai.errors import UserError
    inputs = write_inputs(corpus, tmp_path / "in")
    cfg = config()
    local = clean(inputs, str(tmp_path / "local"), cfg, workers=1, progress=False)
    uris = ["file://" + p for p in inputs]
    dist = clean_spark(uris, str(tmp_path / "spark"), cfg, master="local[2]", split_bytes=16384)
    assert [s.replace(b"file://", b"") for s in shards(tmp_path / "spark")] == shards(tmp_path / "local")
    dist, local = json.loads(json.dumps(dist).replace("file://", "")), json.loads(json.dumps(local))
    assert dist["output"].pop("bytes") == local["output"].pop("bytes") + len("file://") * local["output"]["documents"]
    assert dist == local                       # every count, reason, sample (its place), problem and warning
    sc = spark
    listed = resolve_uri(sc, "file://" + str(tmp_path / "in"))
    assert [u.split(":", 1)[1].lstrip("/") for u in listed] == sorted(p.lstrip("/") for p in inputs)
    assert len(resolve_uri(sc, "file://" + str(tmp_path / "in" / "in*.jsonl*"))) == 3
    for bad, words in ((f"file://{tmp_path}/none.jsonl", "input not found"),
                       (f"file://{tmp_path}/in/*.csv", "matches no"),
                       ("nosuchfs://host/x.jsonl", "cannot be listed through Hadoop")):
        with pytest.raises(UserError, match=words):
            resolve_uri(sc, bad)
    with pytest.raises(UserError, match="--engine spark reads hdfs://"):
        clean(uris, str(tmp_path / "local2"), cfg, workers=1, progress=False)


def test_python_workers_are_forked_from_the_preloading_daemon(spark):
    """The workers' parent is naohai's daemon (spark.python.daemon.module), which loaded jieba before forking and
    imported the installed PySpark, not Spark's zip."""
    def origin(_):             # defined here: Spark ships it by value (this test module is not importable there)
        import jieba
        import pyspark
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            parent = fh.read().replace(b"\0", b" ").decode()
        return parent, bool(jieba.dt.initialized), pyspark.__file__
    for parent, loaded, where in spark.parallelize(range(4), 2).map(origin).collect():
        assert "naohai.data.spark_daemon" in parent and loaded and ".zip" not in where


def test_daemon_loads_the_runs_models_before_forking_its_workers(spark, corpus, tmp_path, monkeypatch):
    """clean_spark hands its config to the Python workers' environment; the daemon started with it loads that
    config's models, so its workers find them loaded before any task asks; a config that does not load there
    leaves the daemon working (its workers load, and fail, on their own)."""
    from naohai.data import spark_engine
    cfg = config()
    cfg.quality.min_words = 7                # a config no earlier worker of this context has loaded
    seen = {}

    class Recorded(spark_engine.Boot):
        def __init__(self, master, conf=None):
            seen.update(conf or {})
            super().__init__(master, conf)
    monkeypatch.setattr(spark_engine, "Boot", Recorded)
    inputs = write_inputs(corpus, tmp_path / "in")
    clean_spark(inputs, str(tmp_path / "out"), cfg, master="local[2]", progress=False)
    env = seen[f"spark.executorEnv.{spark_engine.CONFIG_ENV}"]
    assert json.loads(env) == json.loads(json.dumps(cfg.to_dict()))

    def loaded_before_asked(_):
        from naohai.data import spark_engine as engine
        return json.dumps(cfg.to_dict(), sort_keys=True) in engine._EXECUTOR_MODELS
    spark.environment[spark_engine.CONFIG_ENV] = env     # a new environment: Spark starts a daemon with it
    try:
        assert spark.parallelize(range(4), 2).map(loaded_before_asked).collect() == [True] * 4
        bad = config()
        bad.language.model = str(tmp_path / "no-such-model.bin")
        spark.environment[spark_engine.CONFIG_ENV] = json.dumps(bad.to_dict())
        assert spark.parallelize(range(4), 2).map(lambda x: x * 2).collect() == [0, 2, 4, 6]
    finally:
        del spark.environment[spark_engine.CONFIG_ENV]


ZYGOTE_RUN = """
import json, os, sys, time
from naohai.data import spark_engine
from naohai.data.clean_config import load_clean_config
records, inputs, out = sys.argv[1], sys.argv[2:-1], sys.argv[-1]
survive = spark_engine._survive

def traced(*args, **kwargs):    # set in this driver only: a process that runs it was forked from the driver
    with open(os.path.join(records, str(os.getpid())), "w") as fh:
        json.dump({"parent": os.getppid(), "spark": "SPARK_REUSE_WORKER" in os.environ}, fh)
    return survive(*args, **kwargs)
spark_engine._survive = traced
run_split = spark_engine._run_split

def slow_split(*args):          # the head start's function: slowed, so that Spark's tasks run most splits
    time.sleep(0.2)
    return run_split(*args)
spark_engine._run_split = slow_split
cfg = load_clean_config(None)
cfg.batch_docs, cfg.shard_docs, cfg.quality.min_words = 25, 40, 30
spark_engine.clean_spark(inputs, out, cfg, master="local[2]", progress=False, split_bytes=4096)
"""


def test_spark_workers_are_forked_from_the_drivers_zygote_and_end_with_the_run(corpus, tmp_path):
    """A fresh driver with a local master: Spark's Python workers run what the driver had in memory (a function
    the driver replaced runs in them, with Spark's worker environment), so their daemon was forked from the
    driver's zygote, not started anew; the output is the local engine's; when the run has returned, the daemon
    and the workers are gone."""
    inputs = write_inputs(corpus, tmp_path / "in")
    cfg = config()
    clean(inputs, str(tmp_path / "local"), cfg, workers=1, progress=False)
    records = tmp_path / "records"
    records.mkdir()
    res = subprocess.run([sys.executable, "-c", ZYGOTE_RUN, str(records), *map(str, inputs), str(tmp_path / "spark")],
                         env=dict(os.environ, PYTHONPATH=REPO), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert shards(tmp_path / "local") == shards(tmp_path / "spark")
    seen = [json.loads(p.read_text()) for p in records.iterdir()]
    workers = {int(p.name) for p in records.iterdir() if json.loads(p.read_text())["spark"]}
    daemons = {r["parent"] for r in seen if r["spark"]}
    assert workers and len(daemons) == 1
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in workers | daemons):
        time.sleep(0.1)
    assert not any(os.path.exists(f"/proc/{p}") for p in workers | daemons)


def test_a_zygote_that_cannot_be_reached_leaves_the_daemon_to_start_on_its_own(spark, tmp_path):
    """A daemon environment naming a zygote socket that nobody serves (the zygote ended, or never bound it): the
    stand-in gives up and the module starts PySpark's daemon itself, so the tasks run."""
    from naohai.data.spark_zygote import ZYGOTE_ENV

    def parent(_):
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode()
    spark.environment[ZYGOTE_ENV] = str(tmp_path / "gone" / "zygote.sock")
    try:
        assert all("naohai.data.spark_daemon" in p for p in spark.parallelize(range(4), 2).map(parent).collect())
    finally:
        del spark.environment[ZYGOTE_ENV]


def test_a_missing_model_is_the_local_engines_error(spark, corpus, tmp_path):
    """The driver's head start loads the steps' models for the driver's check; one that is missing gives the
    local engine's message, before any task runs, and nothing is written."""
    from naohai.errors import UserError
    inputs = write_inputs(corpus, tmp_path / "in")
    cfg = config()
    cfg.language.model = str(tmp_path / "no-such-model.bin")
    with pytest.raises(UserError) as local:
        clean(inputs, str(tmp_path / "local"), cfg, workers=1, progress=False)
    with pytest.raises(UserError) as dist:
        clean_spark(inputs, str(tmp_path / "spark"), cfg, master="local[2]", progress=False)
    assert str(dist.value) == str(local.value) and "no-such-model.bin" in str(dist.value)
    assert not output_files(tmp_path / "spark") and not (tmp_path / "spark" / "report.json").exists()


def test_python_workers_freeze_their_models_and_talk_over_unix_sockets(spark):
    """PySpark's worker runs a full garbage collection after every task: the steps' models a worker loads are
    frozen out of it (the loaded models object is not among the objects a collection walks), and the worker's
    connection to the executor is a Unix socket, not loopback TCP."""
    import gc
    cfg = load_clean_config(None)

    def probe(_):
        import socket

        from naohai.data import spark_engine
        models = spark_engine._models(cfg)
        walked = gc.get_objects()
        families = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                    with socket.socket(fileno=os.dup(int(fd))) as s:
                        families.add(s.family.name)
            except OSError:
                continue
        return (not any(o is models for o in walked), gc.get_freeze_count() > len(walked), sorted(families))
    for out_of_sight, mostly_frozen, families in spark.parallelize(range(4), 2).map(probe).collect():
        assert out_of_sight and mostly_frozen
        assert families == ["AF_UNIX"]


def test_distributed_components_equal_union_find(spark):
    rng = random.Random(5)
    edges = [(rng.randrange(300), rng.randrange(300)) for _ in range(260)]
    edges += [(i, i + 1) for i in range(400, 460)]          # a long chain: several star rounds
    got = dict(connected_components(spark.parallelize(edges, 3), 4).collect())
    assert got == dedup.cluster_drops(edges)
    keys = [(f"{rng.getrandbits(64):016x}", 0, i) for i in range(50)]     # order keys, as the engine uses them
    edges = [(rng.choice(keys), rng.choice(keys)) for _ in range(40)]
    got = dict(connected_components(spark.parallelize(edges, 2), 2).collect())
    assert got == dedup.cluster_drops(edges)


def test_quantiles_from_order_statistics_equal_numpy(spark, monkeypatch):
    """Past DRIVER_SCORES values the report's perplexity quantiles come from a sort on the cluster."""
    import numpy as np

    from naohai.data import spark_engine
    from naohai.data.score import quantiles
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 1000):
        values = list(np.exp(rng.normal(3.0, 1.0, n)))
        rdd = spark.parallelize(values, 3)
        monkeypatch.setattr(spark_engine, "DRIVER_SCORES", 0)
        on_cluster = spark_engine.distributed_quantiles(rdd, n)
        monkeypatch.setattr(spark_engine, "DRIVER_SCORES", 10 ** 9)
        assert on_cluster == spark_engine.distributed_quantiles(rdd, n) == quantiles(np.asarray(values))


@pytest.mark.slow
def test_driver_killed_mid_job_then_rerun_gives_the_same_output(corpus, tmp_path):
    inputs = write_inputs(corpus, tmp_path / "in")
    inputs = inputs + write_inputs(corpus, tmp_path / "in2")
    cfg_path = tmp_path / "clean.yaml"
    cfg_path.write_text("batch_docs: 25\nshard_docs: 10\nquality:\n  min_words: 30\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "naohai.cli", "data", "clean", *inputs, "--config", str(cfg_path),
           "--engine", "spark", "--master", "local[2]", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=REPO)
    ref = subprocess.run(cmd + ["--out", str(tmp_path / "full")], env=env, capture_output=True, text=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    full = shards(tmp_path / "full")
    out = tmp_path / "cut"
    proc = subprocess.Popen(cmd + ["--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    staging = out / ".work" / "spark"
    seen_partial = []
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        # whatever shard is visible in the output folder is complete, at every moment
        for p in output_files(out):
            try:
                data = open(p, "rb").read()
            except FileNotFoundError:
                continue
            if data not in full:
                seen_partial.append(p)
        if staging.is_dir() and [p for p in os.listdir(staging) if p.endswith(".jsonl")]:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    os.kill(proc.pid, signal.SIGKILL)         # the driver; its JVM ends with it (it exits when its stdin closes)
    proc.wait()
    assert not seen_partial
    assert not (out / "report.json").exists()
    for p in output_files(out):
        assert open(p, "rb").read() in full
    res = subprocess.run(cmd + ["--out", str(out)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert shards(out) == full
    a, b = (json.load(open(d / "report.json")) for d in (out, tmp_path / "full"))
    assert a == b
    assert not staging.exists()


@pytest.mark.slow
def test_a_step_crashing_on_a_document_is_named_and_nothing_is_written(corpus, tmp_path):
    """A fault injected into the executors' Python (a sitecustomize that makes the quality rules raise on one
    document): the run exits 2 naming the documents by file and line, with no shard and no report."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import naohai.data.quality as q\n"
        "_orig = q.quality_reason\n"
        "def quality_reason(text, *a, **k):\n"
        "    if 'CRASH-ME' in text:\n"
        "        raise MemoryError('injected')\n"
        "    return _orig(text, *a, **k)\n"
        "q.quality_reason = quality_reason\n", encoding="utf-8")
    docs = [d for d, k in zip(corpus.docs, corpus.kind) if k.startswith("base")][:40]
    docs[7] = "CRASH-ME " + docs[7]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=f"{inject}{os.pathsep}{REPO}")
    res = subprocess.run([sys.executable, "-m", "naohai.cli", "data", "clean", str(path), "--out", str(out),
                          "--engine", "spark", "--master", "local[2]", "--no-progress"], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "naohai: error:" in res.stderr              # naohai's paragraph comes after Spark's own task log
    last = " ".join(res.stderr.rsplit("naohai: error:", 1)[1].split())
    assert f"{path}:1 .. {path}:40" in last and "MemoryError: injected" in last and "--out" in last
    assert "Py4JJavaError" not in res.stderr        # no driver traceback
    assert not (out / "report.json").exists() and not output_files(out)


def test_head_start_runs_the_first_splits_while_spark_starts(spark, corpus, tmp_path, monkeypatch):
    """A JVM slow to boot (up until the helper has claimed 3 splits) and a helper slowed to a split in 0.2 s: the
    driver's forked helper runs the first splits meanwhile, Spark's tasks the others, and the output is the local
    engine's."""
    from naohai.data import spark_driver, spark_engine
    inputs = write_inputs(corpus, tmp_path / "in")
    cfg = config()
    local = clean(inputs, str(tmp_path / "local"), cfg, workers=1, progress=False)
    real = spark_driver.spark_context
    claims = tmp_path / "spark" / ".work" / "spark" / "claims"

    def slow(*args, **kwargs):
        deadline = time.time() + 60
        while time.time() < deadline and not (claims.is_dir() and len(os.listdir(claims)) >= 3):
            time.sleep(0.01)
        return real(*args, **kwargs)
    monkeypatch.setattr(spark_driver, "spark_context", slow)
    run_split = spark_engine._run_split

    def slow_split(*args):                   # the helper's function (Spark's tasks run _read_split)
        time.sleep(0.2)
        return run_split(*args)
    monkeypatch.setattr(spark_engine, "_run_split", slow_split)
    timings = {}
    dist = clean_spark(inputs, str(tmp_path / "spark"), cfg, master="local[2]", split_bytes=4096, timings=timings)
    splits = sum(len(byte_ranges(p, 4096)) for p in inputs)
    assert 3 <= timings["splits run by the driver's head start"] < splits
    assert shards(tmp_path / "local") == shards(tmp_path / "spark") and local == dist


def test_claims_give_each_split_to_one_runner(tmp_path):
    from naohai.data.spark_driver import HEAD, SPARK, claim
    assert claim(str(tmp_path), 0, HEAD) and not claim(str(tmp_path), 0, SPARK)     # the helper's: tasks skip it
    assert claim(str(tmp_path), 1, SPARK) and not claim(str(tmp_path), 1, HEAD)     # Spark's: the helper stops
    assert claim(str(tmp_path), 1, SPARK)                                           # a retried task runs it again


def test_class_archive_written_by_the_first_jvm_and_used_by_the_next(tmp_path):
    """A fresh process (so a JVM of its own) with an empty cache: its first local context's JVM writes the class
    archive when the driver ends it; the next JVM maps it and runs jobs as before."""
    script = (
        "from naohai.data.spark_driver import spark_context, stop_context\n"
        "for _ in range(2):\n"
        "    sc = spark_context('local[2]')\n"
        "    print(sc.getConf().get('spark.driver.extraJavaOptions'), sc.parallelize(range(10), 2).sum(), flush=True)\n"
        "    stop_context(sc)\n")
    env = dict(os.environ, PYTHONPATH=REPO, NAOHAI_CACHE_DIR=str(tmp_path / "naohai"))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = res.stdout.strip().splitlines()[-2:]
    folder = tmp_path / "naohai" / "spark-cds"
    archives = [p for p in os.listdir(folder) if p.endswith(".jsa")]
    assert len(archives) == 1 and sorted(os.listdir(folder)) == [archives[0], archives[0] + ".size"]
    path = folder / archives[0]
    assert "-XX:ArchiveClassesAtExit=" in first and first.endswith(" 45")
    assert f"-XX:SharedArchiveFile={path}" in second and second.endswith(" 45")
    assert int((folder / (archives[0] + ".size")).read_text()) == os.path.getsize(path) > 10 << 20


def test_class_archive_of_another_size_is_written_again(tmp_path, monkeypatch):
    """A truncated archive would crash the JVM (SIGBUS in Java 17): one whose size is not the recorded one is not
    used; it is written again instead."""
    from naohai.data.spark_driver import ClassArchive
    monkeypatch.setenv("NAOHAI_CACHE_DIR", str(tmp_path))
    archive = ClassArchive.of_this_spark("-XX:TieredStopAtLevel=1")
    assert archive.dumping and archive.options()[0].startswith("-XX:ArchiveClassesAtExit=")
    with open(archive.path, "wb") as fh:
        fh.write(b"x" * 1000)
    with open(archive.path + ".size", "w") as fh:
        fh.write("2000")
    assert ClassArchive(archive.path).dumping
    with open(archive.path + ".size", "w") as fh:
        fh.write("1000")
    again = ClassArchive.of_this_spark("-XX:TieredStopAtLevel=1")
    assert again.path == archive.path and not again.dumping
    assert again.options()[0] == f"-XX:SharedArchiveFile={archive.path}"
    assert ClassArchive.of_this_spark("-Xmx1g").path != archive.path        # other options, another archive
    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-java"))
    assert ClassArchive.of_this_spark("-XX:TieredStopAtLevel=1") is None     # no release file: no archive


def test_daemon_imports_the_installed_pyspark_instead_of_sparks_zips(tmp_path):
    """Spark's zips go first on the workers' path; the daemon drops them only for the same versions installed."""
    import zipfile

    import py4j
    import pyspark

    from naohai.data.spark_daemon import without_spark_zips

    def zipped(name, pkg, version_py):
        path = str(tmp_path / name)
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"{pkg}/version.py", version_py)
        return path
    same = {pkg: open(os.path.join(os.path.dirname(mod.__file__), "version.py"), "rb").read()
            for pkg, mod in (("pyspark", pyspark), ("py4j", py4j))}
    zips = [zipped("pyspark.zip", "pyspark", same["pyspark"]), zipped("py4j-0-src.zip", "py4j", same["py4j"])]
    site = os.path.dirname(os.path.dirname(pyspark.__file__))
    assert without_spark_zips(zips + ["/elsewhere", site]) == ["/elsewhere", site]
    other = zipped("pyspark-old.zip", "pyspark", b"__version__ = '0.1'\n")
    assert without_spark_zips([other, zips[1], site]) == [other, zips[1], site]
    assert without_spark_zips(zips + ["/elsewhere"]) == zips + ["/elsewhere"]      # not installed: the zips stay


def test_local_splits_cut_the_head_and_the_tail_of_the_input_small(tmp_path):
    """Three 1.5 MB files in 1 MB splits, the ranges that hold the first 600 KB or the last 300 KB of the input
    in SMALL_SPLIT_BYTES ones: every line read once, with its line number in its file, whatever split it falls
    in."""
    from naohai.data import spark_engine
    from naohai.data.reader import read_inputs, read_split
    files, rng = [], random.Random(3)
    for k in range(3):
        path = tmp_path / f"in{k}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            while fh.tell() < 1_500_000:
                fh.write(json.dumps({"text": "x" * rng.randint(10, 3000)}) + "\n")
        files.append(str(path))
    small = spark_engine.SMALL_SPLIT_BYTES
    local = spark_engine._local_splits(files, 1 << 20, spark_engine._count_here, 600 << 10, 300 << 10)
    sizes = {fi: [(s[3].end or os.path.getsize(files[fi])) - s[3].start for s in splits]
             for fi, splits in local.items()}
    assert sizes[0][:4] == [small] * 4 and sizes[0][4] > small            # the first MB cut small, the rest not
    assert sizes[1] == [1 << 20, os.path.getsize(files[1]) - (1 << 20)]  # the middle file untouched
    assert all(n <= small for n in sizes[2][1:]) and sizes[2][0] == 1 << 20
    got = [(r.where, r.text) for fi in range(3) for s in local[fi] for r in read_split(files[fi], s[3])]
    assert got == [(r.where, r.text) for r in read_inputs(files)]
    empty = tmp_path / "empty.jsonl"                      # an empty input inside the small head: one whole split
    empty.write_bytes(b"")
    local = spark_engine._local_splits([str(empty)] + files, 1 << 20, spark_engine._count_here, 600 << 10, 0)
    assert [s[3] for s in local[0]] == [Split(0, None, 0)]
    assert [s[3].end - s[3].start for s in local[1][:4]] == [small] * 4


def test_split_size_cuts_the_local_jsonl_bytes_into_many_splits_per_slot(tmp_path):
    """Without --split-mb: 16 splits per task slot over the splittable (.jsonl) bytes only, from 1 MB to 128 MB."""
    def sparse(name, size):
        path = tmp_path / name
        with open(path, "wb") as fh:
            fh.truncate(size)
        return str(path)
    mb = 1 << 20
    jsonl = [sparse(f"in{k}.jsonl", 20 * mb) for k in range(3)]
    others = [sparse("big.jsonl.gz", 900 * mb), sparse("big.txt", 900 * mb), "hdfs://nn/corpus/big.jsonl"]
    assert split_size(jsonl + others, 2) == (60 * mb) // 32
    assert all(len(byte_ranges(p, split_size(jsonl, 2))) == 11 for p in jsonl)     # 32 splits and change
    assert split_size(jsonl, 1000) == mb                                           # floor
    assert split_size([sparse("huge.jsonl", 300 << 30)], 4) == 128 * mb              # an HDFS block at most
    assert split_size(others, 2) == mb


def test_local_slots_of_master_urls():
    assert [local_slots(m) for m in ("local", "local[3]", "local[2,4]", "local[*]")] == [1, 3, 2, os.cpu_count()]
    assert [local_slots(m) for m in ("yarn", "spark://h:7077", "k8s://https://h:6443", "local-cluster[2,1,1024]")] \
        == [None] * 4


def test_a_clean_output_folder_given_as_input_is_read_once_and_out_apart_from_it(spark, corpus, tmp_path):
    """A local folder and a file:// folder leave hidden entries (the .work/ copies of the documents) out, as the
    local engine does; an --out inside an input folder is refused before Spark starts or anything is written."""
    from naohai.errors import UserError
    cfg = config()
    for step in ("normalize", "language", "quality", "pii"):
        getattr(cfg, step).enabled = False
    (tmp_path / "raw").mkdir()
    with open(tmp_path / "raw" / "in.jsonl", "w", encoding="utf-8") as fh:
        for i, t in enumerate(corpus.docs[:80]):
            fh.write(json.dumps({"text": t, "id": i}, ensure_ascii=False) + "\n")
    first = clean([str(tmp_path / "raw")], str(tmp_path / "c1"), cfg, workers=1, progress=False)
    n = first["output"]["documents"]
    assert os.listdir(tmp_path / "c1" / ".work")
    for source, out in ((str(tmp_path / "c1"), "s1"), ("file://" + str(tmp_path / "c1"), "s2")):
        report = clean_spark([source], str(tmp_path / out), cfg, master="local[2]")
        assert report["read"]["docs_in"] == n and report["output"]["documents"] == n, source
        assert report["inputs"] and all("/c1/part-0000" in f for f in report["inputs"]), report["inputs"]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for out in (tmp_path / "raw" / "clean", tmp_path / "c1"):
        with pytest.raises(UserError, match="'--out'"):
            clean_spark([str(out.parent if out.name == "clean" else out)], str(out), cfg, master="local[2]",
                        restart=True)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
