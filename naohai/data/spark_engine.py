"""The Spark engine of `naohai data clean` (``--engine spark``): the same steps and config on Apache Spark.

Same inputs and config give the same ``part-NNNNN.jsonl`` shards and the same
``report.json`` counts as the local engine (:mod:`naohai.data.clean`); only where the
work runs differs.  PySpark is an optional dependency (``pip install -e ".[spark]"``,
plus a Java runtime); ``--master`` is any Spark master URL (``local[N]``, ``yarn``,
``k8s://...``, ``spark://...``).  Local masters bind the driver to 127.0.0.1 and run
without the web UI, so nothing listens beyond loopback.

How it runs (RDD API; every rule is the local engine's own function)
    1. One task per input split reads it with :func:`naohai.data.reader.read_split` (bad
       lines become problems with file and line, as locally), runs
       :func:`naohai.data.clean.filter_documents` on batches of ``batch_docs`` and the
       MinHash signatures of the survivors (:func:`naohai.data.dedup.signatures`).  An
       uncompressed ``.jsonl`` file larger than ``split_bytes`` (default 128 MB, ``--split-mb``)
       is read as byte ranges, each the lines that start in it, by as many tasks: one large
       file keeps every core busy.  A first, cheap job counts each range's newlines so that
       every line keeps its line number in the whole file (``source`` in the output, problems,
       samples).  ``.txt`` and ``.gz`` files are one task each.  The per-batch step statistics
       are merged in input order, so the report's counts and samples are those of the local
       engine.
    2. Exact dedup: a shuffle on the exact key; each group keeps its smallest
       :func:`~naohai.data.dedup.order_key`.
    3. Near dedup: a shuffle of (band, rows) bucket keys
       (:func:`~naohai.data.dedup.band_keys`); buckets with two or more members get their
       signatures by a join and are linked by :func:`~naohai.data.dedup.bucket_edges`;
       :func:`connected_components` (alternating large-star / small-star, Kiveris et al.
       2014, "Connected Components in MapReduce and Beyond") labels every linked document
       with the smallest order key of its component, which is kept.
    4. With the ``perplexity`` step on, each partition of the survivors is scored in chunks
       by the model the command line's ``lm_factory`` loads, once per Python worker (the
       local engine's :func:`naohai.data.score.score_ids`, batched as configured); drops,
       samples and the report's quantiles are those of the local engine (the quantiles from
       the order statistics on the cluster when there are too many scores for the driver).
    5. The survivors are sorted by their place in the input and cut into shards of
       ``shard_docs``, each written by a task into ``.work/spark/`` (atomically), then
       renamed into the output folder by the driver, ``report.json`` last.

Inputs and the output folder must be paths every executor can read and write (the
local filesystem in local mode; a shared mount such as NFS or OBS through obsfs on a
cluster).  A job that fails or is killed leaves no ``report.json``; running it again
with the same inputs and config starts it afresh and writes the same output (the
shards of the broken run are removed first; those it had renamed into place were
complete).
"""
from __future__ import annotations

import json
import math
import operator
import os
import shutil
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np

from naohai.data import dedup
from naohai.data.clean import (MAX_PROBLEMS_LISTED, NO_SCORED_TOKENS, STEPS, StepStats, _Models, _nbytes, _plan,
                               _Problems, _Step, filter_documents, make_report, output_record,
                               perplexity_drop_reason, unit_record)
from naohai.data.score import QUANTILES, perplexities, quantiles, score_ids
from naohai.data.clean_config import CleanConfig
from naohai.data.reader import Problem, Split, byte_ranges, count_newlines, read_split, resolve_inputs
from naohai.data.rundir import REPORT, atomic_write, atomic_write_text, prepare_run_dir, remove_outputs
from naohai.errors import UserError

STAGING = "spark"          # below .work: shards being written
_FAILED = "a step failed on the documents"
DRIVER_LINKS = 1_000_000   # up to this many near-duplicate links, their components are found on the driver
SPLIT_BYTES = 128 << 20    # a .jsonl file larger than this is read by several tasks (an HDFS block's size)
SCORE_CHUNK = 1024         # documents a Python worker tokenises and scores at a time (perplexity step)
DRIVER_SCORES = 10_000_000  # up to this many perplexities, the report's quantiles are computed on the driver


def _require_pyspark():
    try:
        import pyspark  # noqa: F401
    except ImportError:
        raise UserError("the Spark engine needs PySpark and a Java runtime: pip install -e \".[spark]\" and a JRE "
                        "(e.g. apt-get install openjdk-17-jre-headless)", where="command line",
                        key="--engine") from None


def spark_session(master: str, conf: Optional[Dict[str, str]] = None):
    """A SparkSession for ``master`` (an existing one is reused): local masters on loopback, no web UI."""
    _require_pyspark()
    from pyspark.sql import SparkSession
    builder = SparkSession.builder.appName("naohai data clean").master(master)
    settings = {"spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false", "spark.driver.memory": "1g",
                "spark.python.worker.reuse": "true"}
    if master.startswith("local"):
        settings.update({"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"})
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)      # executors: this interpreter
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    settings.update(conf or {})
    for k, v in settings.items():
        builder = builder.config(k, v)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:   # no Java, a bad master URL: say so in one paragraph
        first = (str(exc).strip().splitlines() or [""])[0]
        raise UserError(f"Spark did not start ({type(exc).__name__}: {first}); the Spark engine needs a Java "
                        "runtime (JAVA_HOME or java on PATH) and a valid master URL",
                        where="command line", key="--master") from None
    spark.sparkContext.setLogLevel("ERROR")
    return spark


# --------------------------------------------------------------------------- stage 1 (executors)
_EXECUTOR_MODELS: Dict[str, _Models] = {}


def _models(cfg: CleanConfig) -> _Models:
    """The per-document steps' models, loaded once per Python worker process."""
    key = json.dumps(cfg.to_dict(), sort_keys=True)
    if key not in _EXECUTOR_MODELS:
        _EXECUTOR_MODELS.clear()
        _EXECUTOR_MODELS[key] = _Models(cfg)
    return _EXECUTOR_MODELS[key]


def _read_split(cfg: CleanConfig, item) -> Iterator[tuple]:
    """One input split through the per-document steps: ('doc', (pos, record, sig)) per survivor, ('steps',
    ((file, split, batch), stats)) per batch, and one ('read', ((file, split), docs, bytes, problems)) at the
    end."""
    fi, si, path, part = item
    models = _models(cfg)
    problems = _Problems()
    docs_in = bytes_in = 0
    batch: List[tuple] = []
    nbatch = 0

    def run(batch, nbatch):
        try:
            kept, steps = filter_documents(batch, models)
            texts = [k[0] for k in kept]
            sigs = dedup.signatures(texts, cfg.near_dedup) if cfg.near_dedup.enabled else [None] * len(kept)
        except Exception as exc:
            raise RuntimeError(f"{_FAILED} {batch[0][1]} .. {batch[-1][1]}: {type(exc).__name__}: {exc}") from exc
        for k, sig in zip(kept, sigs):
            yield "doc", (_line_pos(fi, k[1]), unit_record(*k, cfg), sig)
        yield "steps", ((fi, si, nbatch), {name: st.s.as_dict() for name, st in steps.items()})

    for rec in read_split(path, part, cfg.text_key, cfg.max_line_bytes):
        if isinstance(rec, Problem):
            problems.add(rec)
            continue
        docs_in += 1
        bytes_in += _nbytes(rec.text)
        batch.append((rec.text, rec.where, rec.extra))
        if len(batch) == cfg.batch_docs:
            yield from run(batch, nbatch)
            batch, nbatch = [], nbatch + 1
    if batch:
        yield from run(batch, nbatch)
    yield "read", ((fi, si), docs_in, bytes_in, problems)


def _splits(sc, files: Sequence[str], split_bytes: int) -> List[tuple]:
    """(file number, split number, path, :class:`Split`) of every input split, in input order; the newline
    counts that number the lines of later ranges are taken by one Spark task per range."""
    ranges = [(fi, si, path, a, b) for fi, path in enumerate(files)
              for si, (a, b) in enumerate(byte_ranges(path, split_bytes))]
    counted = [r for r in ranges if r[4] is not None]          # the last range of a file numbers nothing
    counts = (dict(zip([r[:2] for r in counted],
                       sc.parallelize(counted, len(counted)).map(lambda r: count_newlines(r[2], r[3], r[4]))
                       .collect())) if counted else {})
    out, before = [], {}
    for fi, si, path, a, b in ranges:
        n = before.get(fi, 0)
        out.append((fi, si, path, Split(a, b, n)))
        before[fi] = n + counts.get((fi, si), 0)
    return out


def _line_pos(fi: int, where: str) -> tuple:
    return fi, int(where.rsplit(":", 1)[1])


def _order(doc) -> tuple:
    pos, rec, _ = doc
    return dedup.order_key(rec["text"], *pos)


# --------------------------------------------------------------------------- dedup
def _keep_smallest(group) -> Iterator[tuple]:
    """(kept?, doc) for each document of one exact-key group."""
    docs = list(group[1])
    best = min(range(len(docs)), key=lambda i: _order(docs[i]))
    for i, d in enumerate(docs):
        yield i == best, d


def _step_stats(tagged, reason: str, samples: int) -> StepStats:
    """A dedup step's statistics from an RDD of (kept?, doc), the samples the first drops in input order."""
    def counts(t):
        kept, (pos, rec, _) = t
        n = _nbytes(rec["text"])
        return 1, n, int(kept), int(not kept), n if kept else 0
    tot = tagged.map(counts).fold((0, 0, 0, 0, 0), lambda a, b: tuple(map(operator.add, a, b)))
    s = StepStats(docs_in=tot[0], bytes_in=tot[1], kept=tot[2], dropped=tot[3], bytes_out=tot[4])
    if s.dropped:
        s.reasons = {reason: s.dropped}
    if samples and s.dropped:
        first = tagged.filter(lambda t: not t[0]).map(lambda t: (t[1][0], t[1][1])).takeOrdered(samples,
                                                                                             key=lambda x: x[0])
        step = _Step(samples)
        for _, rec in first:
            step.drop(rec["where"], reason, rec["text"])
        s.samples = step.s.samples
    return s


def _bucket_entries(doc, bands: int, rows: int):
    order = _order(doc)
    return [((b, k), order) for b, k in enumerate(dedup.band_keys(doc[2][None, :], bands, rows)[0])]


def _large_star(item):
    u, ns = item
    ns = set(ns)
    m = min(ns | {u})
    return [(v, m) for v in ns if v > u]


def _small_star(item):
    u, ns = item
    ns = set(ns)
    m = min(ns | {u})
    return [(v, m) for v in ns if v != m] + ([(u, m)] if u != m else [])


def connected_components(edges, partitions: int):
    """An RDD of links (a, b) between comparable nodes -> an RDD of (node, smallest node of its component) for
    every linked node that is not the smallest of its component.  Alternating large-star and small-star
    rounds until a round changes nothing (O(log n) rounds, Kiveris et al. 2014)."""
    e = (edges.filter(lambda ab: ab[0] != ab[1]).map(lambda ab: (max(ab), min(ab)))
         .distinct(partitions).persist())
    while True:
        large = (e.flatMap(lambda ab: [ab, (ab[1], ab[0])]).groupByKey(partitions).flatMap(_large_star)
                 .distinct(partitions))
        small = large.groupByKey(partitions).flatMap(_small_star).distinct(partitions).persist()
        same = small.subtract(e, partitions).isEmpty() and e.subtract(small, partitions).isEmpty()
        e.unpersist()
        e = small
        if same:
            return e


def _with_sig(item):
    _, (bucket, sig) = item
    return bucket, (item[0], sig)


def _near_links(docs, cfg, partitions: int):
    """Verified links between the documents that share an LSH bucket (order keys)."""
    bands, rows = dedup.lsh_params(cfg)
    accept = dedup.accept_agreement(cfg)
    buckets = (docs.flatMap(lambda d: _bucket_entries(d, bands, rows)).groupByKey(partitions)
               .mapValues(list).filter(lambda kv: len(kv[1]) > 1))
    member_of = buckets.flatMap(lambda kv: [(o, kv[0]) for o in kv[1]])
    sigs = docs.map(lambda d: (_order(d), d[2]))
    return (member_of.join(sigs, partitions).map(_with_sig).groupByKey(partitions)
            .flatMap(lambda kv: dedup.bucket_edges(list(kv[1]), accept)))


def _tag_near(item):
    _, (doc, rep) = item
    return rep is None, doc


# --------------------------------------------------------------------------- perplexity
_EXECUTOR_LM: Dict[str, Any] = {}


def _executor_lm(cfg: CleanConfig, lm_factory: Callable[[], Any]):
    """The perplexity step's model (a :class:`naohai.data.score.LM`), loaded once per Python worker."""
    key = json.dumps(cfg.to_dict().get("perplexity"), sort_keys=True, default=str)
    if key not in _EXECUTOR_LM:
        _EXECUTOR_LM.clear()
        _EXECUTOR_LM[key] = lm_factory()
    return _EXECUTOR_LM[key]


def _score_partition(cfg: CleanConfig, lm_factory: Callable[[], Any]):
    """(pos, record) -> (pos, record, perplexity) for a partition, scored SCORE_CHUNK documents at a time."""
    def score(chunk):
        lm = _executor_lm(cfg, lm_factory)
        ppl = perplexities(score_ids(lm.encode_batch([rec["text"] for _, rec in chunk]), lm, cfg.perplexity.batch))
        return [(pos, rec, float(p)) for (pos, rec), p in zip(chunk, ppl)]

    def run(items):
        chunk = []
        for item in items:
            chunk.append(item)
            if len(chunk) == SCORE_CHUNK:
                yield from score(chunk)
                chunk = []
        if chunk:
            yield from score(chunk)
    return run


def _perplexity_stats(scored, cfg: CleanConfig) -> StepStats:
    """The perplexity step's statistics (the local engine's: every survivor seen, drops with their reason,
    samples the first drops in input order with their perplexity), in one pass for the counts."""
    limit = cfg.perplexity.max

    def add(acc, t):            # aggregate's functions may change and return their first argument
        _, rec, p = t
        n, reason = _nbytes(rec["text"]), perplexity_drop_reason(p, limit)
        acc[0] += 1
        acc[1] += n
        if reason is None:
            acc[2] += 1
            acc[3] += n
        else:
            acc[4][reason] = acc[4].get(reason, 0) + 1
        return acc

    def merge(a, b):
        for reason, k in b[4].items():
            a[4][reason] = a[4].get(reason, 0) + k
        return [a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3], a[4]]
    docs, nbytes, kept, kept_bytes, reasons = scored.aggregate([0, 0, 0, 0, {}], add, merge)
    s = StepStats(docs_in=docs, bytes_in=nbytes, kept=kept, dropped=docs - kept, bytes_out=kept_bytes)
    s.reasons = reasons
    if cfg.samples and s.dropped:
        step = _Step(cfg.samples)
        for _, rec, p in scored.filter(lambda t: perplexity_drop_reason(t[2], limit) is not None).takeOrdered(
                cfg.samples, key=lambda t: t[0]):
            step.drop(rec["where"], perplexity_drop_reason(p, limit), rec["text"])
            if math.isfinite(p):
                step.s.samples[-1]["perplexity"] = round(p, 4)
        s.samples = step.s.samples
    return s


def distributed_quantiles(values, count: int) -> Dict[str, float]:
    """:func:`naohai.data.score.quantiles` of an RDD of ``count`` finite floats: on the driver up to
    DRIVER_SCORES values, else from the two order statistics around each quantile (sorted on the cluster)
    with numpy's own interpolation, which gives the same numbers."""
    if count <= DRIVER_SCORES:
        return quantiles(np.asarray(values.collect(), np.float64))
    wanted = {}
    for q in QUANTILES:
        at = q * (count - 1)
        lo = math.floor(at)
        wanted[q] = (lo, min(lo + 1, count - 1), at - lo)
    need = {i for lo, hi, _ in wanted.values() for i in (lo, hi)}
    stats = dict(values.sortBy(lambda v: v).zipWithIndex().filter(lambda vi: vi[1] in need)
                 .map(lambda vi: (vi[1], vi[0])).collect())
    return {f"p{round(q * 100):g}": round(float(np.quantile(np.array([stats[lo], stats[hi]]), frac)), 4)
            for q, (lo, hi, frac) in wanted.items()}


# --------------------------------------------------------------------------- output
def _write_shard(out_tmp: str, cfg: CleanConfig):
    def write(index, items):
        lines = sorted(items, key=lambda kv: kv[1][0])
        if not lines:
            return iter(())
        shard = lines[0][0]
        path = os.path.join(out_tmp, f"part-{shard:05d}.jsonl")

        def w(tmp):
            with open(tmp, "w", encoding="utf-8") as fh:
                for _, (_, line) in lines:
                    fh.write(line)
        atomic_write(path, w)
        return iter([(shard, len(lines))])
    return write


def _out_line(cfg: CleanConfig):
    return lambda doc: (doc[0], output_record(doc[1][0], cfg, doc[1][1]))


# --------------------------------------------------------------------------- the run
def clean_spark(inputs: Sequence[str], out_dir: str, cfg: CleanConfig, *, master: str = "local[*]",
                conf: Optional[Dict[str, str]] = None, restart: bool = False, progress: bool = True,
                timings: Optional[Dict[str, float]] = None, split_bytes: int = SPLIT_BYTES,
                lm_factory: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """:func:`naohai.data.clean.clean` on Spark: the same output shards and report, whatever ``split_bytes``.

    ``lm_factory() -> naohai.data.score.LM`` loads the perplexity step's model (needed when the step is on);
    it is sent to the executors, each Python worker calls it once.  ``timings``, when given, receives the
    seconds of each phase (``run/bench_clean.py``)."""
    if cfg.perplexity.enabled and lm_factory is None:
        raise ValueError("the perplexity step is enabled: pass lm_factory")
    if isinstance(split_bytes, bool) or not isinstance(split_bytes, int) or split_bytes < 1:
        raise UserError(f"must be a positive size, got {split_bytes!r} bytes", where="command line",
                        key="--split-mb")
    _require_pyspark()
    files = resolve_inputs(inputs)
    out_dir = os.path.abspath(out_dir)
    work = prepare_run_dir(out_dir, _plan(files, cfg), restart, "naohai data clean",
                           "a clean run with another config or other inputs (changed files?)")
    report_path = os.path.join(out_dir, REPORT)
    if os.path.exists(report_path):
        with open(report_path, "r", encoding="utf-8") as fh:
            return json.load(fh)
    staging = os.path.join(work, STAGING)
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    _Models(cfg)               # a missing language / classifier model or blocklist: one message, before Spark starts
    had = _active_session()
    spark = spark_session(master, conf)
    try:
        report = _run(spark.sparkContext, files, out_dir, staging, cfg, timings if timings is not None else {},
                      split_bytes, lm_factory)
    except Exception as exc:   # a step failed on a document: name the documents, keep nothing half-written
        said = [ln.strip() for ln in str(exc).splitlines() if _FAILED in ln]
        if not said:
            raise
        raise UserError(said[-1][said[-1].index(_FAILED):] + "; nothing was written to --out, and running again "
                        "starts afresh", where=out_dir, key="--out") from None
    finally:
        if not had:
            spark.stop()
    atomic_write_text(report_path, json.dumps(report, ensure_ascii=False, indent=1))
    shutil.rmtree(staging, ignore_errors=True)
    return report


def _active_session() -> bool:
    from pyspark.sql import SparkSession
    return SparkSession.getActiveSession() is not None


def _run(sc, files: List[str], out_dir: str, staging: str, cfg: CleanConfig, timings: Dict[str, float],
         split_bytes: int, lm_factory: Optional[Callable[[], Any]]) -> Dict[str, Any]:
    from pyspark import StorageLevel
    clock = [time.perf_counter()]

    def phase(name):
        now = time.perf_counter()
        timings[name] = now - clock[0]
        clock[0] = now
    parts = max(2, sc.defaultParallelism * 2)
    splits = _splits(sc, files, split_bytes)
    stage1 = (sc.parallelize(splits, len(splits))
              .flatMap(lambda item: _read_split(cfg, item)).persist(StorageLevel.MEMORY_AND_DISK))
    meta = stage1.filter(lambda kv: kv[0] != "doc").collect()
    phase("read + per-document steps + signatures")
    docs = stage1.filter(lambda kv: kv[0] == "doc").map(lambda kv: kv[1])

    read, problems = StepStats(), _Problems()
    for _, (fi, n, nbytes, probs) in sorted((m for m in meta if m[0] == "read"), key=lambda m: m[1][0]):
        read.docs_in += n
        read.bytes_in += nbytes
        problems.total += probs.total
        problems.by_file.update(probs.by_file)
        problems.listed.extend(probs.listed[:MAX_PROBLEMS_LISTED - len(problems.listed)])
    read.kept, read.bytes_out = read.docs_in, read.bytes_in
    steps = {name: StepStats() for name in STEPS}
    for _, (_, stats) in sorted((m for m in meta if m[0] == "steps"), key=lambda m: m[1][0]):
        for name, st in stats.items():
            steps[name].merge(st, cfg.samples)

    if cfg.exact_dedup.enabled:
        tagged = docs.map(lambda d: (d[1]["key"], d)).groupByKey(parts).flatMap(_keep_smallest).persist()
        steps["exact_dedup"] = _step_stats(tagged, "exact duplicate", cfg.samples)
        docs = tagged.filter(lambda t: t[0]).map(lambda t: t[1])
        phase("exact dedup")
    if cfg.near_dedup.enabled:
        docs = docs.persist()
        links = _near_links(docs, cfg.near_dedup, parts).persist()
        if links.count() <= DRIVER_LINKS:      # few links: their components on the driver, the drops broadcast
            drop = sc.broadcast(frozenset(dedup.cluster_drops(links.collect())))
            tagged = docs.map(lambda d: (_order(d) not in drop.value, d)).persist()
        else:
            dropped = connected_components(links, parts)
            tagged = docs.map(lambda d: (_order(d), d)).leftOuterJoin(dropped, parts).map(_tag_near).persist()
        steps["near_dedup"] = _step_stats(tagged, "near duplicate", cfg.samples)
        docs = tagged.filter(lambda t: t[0]).map(lambda t: t[1])
        phase("near dedup")

    model = scored_quantiles = None
    final = docs.map(lambda d: (d[0], (d[1], None)))
    if cfg.perplexity.enabled:
        scored = (docs.map(lambda d: (d[0], d[1])).mapPartitions(_score_partition(cfg, lm_factory))
                  .persist(StorageLevel.MEMORY_AND_DISK))
        per = steps["perplexity"] = _perplexity_stats(scored, cfg)
        scored_quantiles = distributed_quantiles(scored.map(lambda t: t[2]).filter(math.isfinite),
                                                 per.docs_in - per.reasons.get(NO_SCORED_TOKENS, 0))
        model = sc.parallelize([0], 1).map(lambda _: _executor_lm(cfg, lm_factory).describe).first()
        limit = cfg.perplexity.max
        final = (scored.filter(lambda t: perplexity_drop_reason(t[2], limit) is None)
                 .map(lambda t: (t[0], (t[1], t[2]))))
        phase("perplexity")

    ordered = (final.sortByKey(numPartitions=parts).map(_out_line(cfg)).zipWithIndex()
               .persist(StorageLevel.MEMORY_AND_DISK))
    n = cfg.shard_docs
    written = ordered.count()
    shards = -(-written // n)
    if shards:
        (ordered.map(lambda t: (t[1] // n, (t[1], t[0][1]))).partitionBy(shards, lambda k: k)
         .mapPartitionsWithIndex(_write_shard(staging, cfg)).collect())
    stage1.unpersist()
    remove_outputs(out_dir)            # shards of an earlier, broken run (no report)
    for s in range(shards):            # each shard is complete; the report, last, marks the run finished
        name = f"part-{s:05d}.jsonl"
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    phase("sort + write shards")
    return make_report(files, cfg, read, problems, steps, written, shards, out_dir, model,
                       quantiles=scored_quantiles)
