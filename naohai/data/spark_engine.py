"""The Spark engine of `naohai data clean` (``--engine spark``): the same steps and config on Apache Spark.

Same inputs and config give the same ``part-NNNNN.jsonl`` shards and the same
``report.json`` counts as the local engine (:mod:`naohai.data.clean`); only where the
work runs differs.  PySpark is an optional dependency (``pip install -e ".[spark]"``,
plus a Java runtime); ``--master`` is any Spark master URL (``local[N]``, ``yarn``,
``k8s://...``, ``spark://...``).  Local masters bind the driver to 127.0.0.1 and run
without the web UI, so nothing listens beyond loopback.

How it runs (RDD API; every rule is the local engine's own function).  Only the survivors' keys
travel through Spark's shuffles; their output lines are written once, by the task that read them,
to a file per input split in the staging folder, and read back once, to be copied out.
    1. One task per input split reads it with :func:`naohai.data.reader.read_split` (bad
       lines become problems with file and line, as locally), runs
       :func:`naohai.data.clean.filter_documents` on batches of ``batch_docs`` and the
       MinHash signatures of the survivors (:func:`naohai.data.dedup.signatures`), and writes
       the survivors' output lines to ``.work/spark/survivors/`` with, beside them, their keys:
       order key (:func:`~naohai.data.dedup.order_key`), exact key, size, place in that file
       and signature.  Spark gets only the step statistics.  An uncompressed ``.jsonl`` file
       larger than the split size is read as byte ranges, each the lines that start in it, by
       as many tasks: ``--split-mb`` when given, else :func:`split_size` (about TASKS_PER_SLOT
       splits per task slot, 1 to 128 MB), so that no slot idles at the end.  A first, cheap
       job counts each range's newlines so that every line keeps its line number in the whole
       file (``source`` in the output, problems, samples).  ``.txt`` and ``.gz`` files are one
       task each.  Inputs on Hadoop-compatible paths (``hdfs://``, ``obs://``, ``s3a://``...)
       are read through Hadoop by :mod:`naohai.data.hadoop_inputs` (128 MB splits unless
       ``--split-mb``), then the same way.  The per-batch step statistics are merged in input
       order, so the report's counts and samples are those of the local engine.
       Up to DRIVER_DOCS survivors, the driver reads the keys files and runs both dedup steps
       with the local engine's own rules, and 2. and 3. below run only past that size, on the
       keys files read as an RDD.
    2. Exact dedup: a shuffle of (exact key, order key); every member of a group but the
       smallest is dropped.
    3. Near dedup: a shuffle of (band, rows) bucket keys
       (:func:`~naohai.data.dedup.band_keys`); the buckets with two or more members are linked
       by :func:`~naohai.data.dedup.bucket_edges` and clustered.  Up to DRIVER_LINKS bucket
       members, the buckets and their members' signatures go to the driver, which does both;
       past it the signatures are joined to the buckets on the cluster, and past DRIVER_LINKS
       links :func:`connected_components` (alternating large-star / small-star, Kiveris et al.
       2014, "Connected Components in MapReduce and Beyond") labels every linked document with
       the smallest order key of its component, which is kept.  Each step's drops are
       broadcast to the tasks (up to DRIVER_DROPS) or joined.
    4. The kept places go to one task per input split, which reads its survivors' file and
       keeps those records, in input order.  With the ``perplexity`` step on, each such
       partition is scored in chunks by the model the command line's ``lm_factory`` loads,
       once per Python worker (the local engine's :func:`naohai.data.score.score_ids`,
       batched as configured); drops, samples and the report's quantiles are those of the
       local engine (the quantiles from the order statistics on the cluster when there are
       too many scores for the driver).
    5. The output lines, numbered in input order, are cut into shards of ``shard_docs``: each
       split's task writes its kept lines as one piece per shard they fall in, and a task per
       shard joins its pieces in split order (:func:`_write_kept`; no text goes through a
       shuffle); with the ``perplexity`` step the scored lines are numbered and shuffled to a
       task per shard.  Shards are written into ``.work/spark/`` (atomically), then renamed
       into the output folder by the driver, ``report.json`` last.

Local inputs and the output folder must be paths every executor can read and write (the
local filesystem in local mode; a shared mount such as NFS or OBS through obsfs on a
cluster); the staging folder lives in the output folder.  Spark's start and stop are
:mod:`naohai.data.spark_driver`'s: the JVM boots in a thread while the driver checks the steps' models; with a
local master, a forked helper of the driver runs stage 1 on the first splits until Spark's tasks begin (the first
HEAD_BYTES of the input are cut into SMALL_SPLIT_BYTES splits for it, as are the last TAIL_BYTES, so that no
slot idles long at the end; a task skips a split the helper claimed); the
engine uses a SparkContext (the RDD API), not a SparkSession.  A job that fails or is killed
leaves no ``report.json``; running it again with the same inputs and config starts it
afresh and writes the same output (the shards of the broken run are removed first; those
it had renamed into place were complete).
"""
from __future__ import annotations

import functools
import gc
import heapq
import json
import math
import os
import pickle
import posixpath
import re
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence
from urllib.parse import urlparse

import numpy as np

from naohai.data import dedup, quality
from naohai.data.clean import (MAX_PROBLEMS_LISTED, NO_SCORED_TOKENS, STEPS, StepStats, _Models, _nbytes, _plan,
                               _Problems, _Step, filter_documents, make_report, output_record,
                               perplexity_drop_reason, unit_record)
from naohai.data.score import QUANTILES, perplexities, quantiles, score_ids
from naohai.data.clean_config import CleanConfig, clean_config_from_dict
from naohai.data import hadoop_inputs
from naohai.data.spark_driver import HeadStart, Boot, SPARK, claim, require_pyspark
from naohai.data.spark_zygote import ZYGOTE_ENV
from naohai.data.reader import (SUFFIXES, Problem, Split, byte_ranges, count_newlines, fingerprint, hidden, is_uri,
                                 read_split, resolve_inputs, splittable)
from naohai.data.rundir import atomic_write, finished_report, prepare_run_dir, remove_outputs, write_report
from naohai.errors import UserError

STAGING = "spark"          # below .work: shards being written
DOCS = "survivors"         # below STAGING: the survivors of stage 1, a file per input split
CLAIMS = "claims"        # below STAGING: which splits the driver's head start runs (naohai.data.spark_driver)
KEYS = ".keys"             # beside a split's survivors: their dedup keys (a pickle)
_FAILED = "a step failed on the documents"
DRIVER_LINKS = 1_000_000   # up to this many LSH bucket members / links, near dedup's clusters are found on the driver
DRIVER_DROPS = 1_000_000   # up to this many duplicates of a step, their keys are broadcast (else joined)
SPLIT_BYTES = 128 << 20    # the largest split of a .jsonl file without --split-mb (an HDFS block's size)
MIN_SPLIT_BYTES = 1 << 20  # the smallest split without --split-mb
HEAD_BYTES = 4 << 20       # with a head start, the first bytes of the input are cut into splits of
TAIL_BYTES = 4 << 20       # SMALL_SPLIT_BYTES (about 0.4 s of one core each here), and the last ones
SMALL_SPLIT_BYTES = 256 << 10
TASKS_PER_SLOT = 16        # without --split-mb, the local .jsonl inputs are cut into about this many splits per task slot
SCORE_CHUNK = 1024         # documents a Python worker tokenises and scores at a time (perplexity step)
DRIVER_SCORES = 10_000_000  # up to this many perplexities, the report's quantiles are computed on the driver
DRIVER_DOCS = 200_000      # up to this many survivors of the per-document steps, both dedup steps run on the driver


# --------------------------------------------------------------------------- stage 1 (executors)
_EXECUTOR_MODELS: Dict[str, _Models] = {}
CONFIG_ENV = "NAOHAI_CLEAN_CONFIG"   # the run's config (JSON) in the Python workers' environment: preload()
_FREEZE_LOADS = False      # True in the Python workers of naohai.data.spark_daemon (freeze_loads)


def freeze_loads() -> None:
    """In Spark's Python daemon before it forks the workers, and in the driver's head start once it has loaded
    the models: what is loaded so far, and the models each worker loads later (:func:`_loaded`), are moved out of
    the garbage collector's sight (``gc.freeze``).  PySpark's
    worker runs a full ``gc.collect()`` after every task, which walked the imported modules and the steps'
    models each time: about 45 ms of CPU per task, and as much idle time on its task slot (measured on this
    project's 2-core VM, 100 tasks: 3.9 to 5.0 CPU-seconds in the workers, 0.2 with the objects frozen)."""
    global _FREEZE_LOADS
    _FREEZE_LOADS = True
    gc.collect()
    gc.freeze()


def _loaded(cache: Dict[str, Any], key: str, load: Callable[[], Any]) -> Any:
    """``cache[key]``, loaded once per Python worker process (the others dropped); frozen after loading in a
    worker of the engine's daemon (:func:`freeze_loads`; unfrozen first, so that the dropped ones can go)."""
    if key not in cache:
        if cache and _FREEZE_LOADS:
            gc.unfreeze()
        cache.clear()
        cache[key] = load()
        if _FREEZE_LOADS:
            gc.collect()
            gc.freeze()
    return cache[key]


def _models(cfg: CleanConfig) -> _Models:
    """The per-document steps' models, loaded once per Python worker process (or inherited: :func:`preload`)."""
    return _loaded(_EXECUTOR_MODELS, json.dumps(cfg.to_dict(), sort_keys=True), lambda: _Models(cfg))


def preload(environ: Dict[str, str]) -> None:
    """In Spark's Python daemon, before it forks the workers: the models of the run's config, which the driver
    puts in the workers' environment (``CONFIG_ENV``, through ``spark.executorEnv``), so that each worker
    inherits them instead of loading its own (about 0.8 CPU-seconds a worker with the default steps, measured
    on this project's 2-core VM).  A config that does not load here is left to the workers, whose tasks then
    fail with the error."""
    raw = environ.get(CONFIG_ENV)
    if raw:
        try:
            _models(clean_config_from_dict(json.loads(raw), where=CONFIG_ENV))
        except Exception:      # noqa: BLE001  (each worker meets it again and reports it in its task)
            _EXECUTOR_MODELS.clear()


def _survivors_path(staging: str, fi: int, si: int) -> str:
    return os.path.join(staging, DOCS, f"split-{fi:06d}-{si:06d}.jsonl")


def _survivor_lines(staging: str, split: tuple, keep) -> Iterator[tuple]:
    """(index, output line) of the survivors of one input split (``split`` as listed by :func:`_stage1`) whose
    index in the split's file is in ``keep``, in input order."""
    with open(_survivors_path(staging, *split[:2]), "r", encoding="utf-8") as fh:
        for k, line in enumerate(fh):
            if k in keep:
                yield k, line


def _survivors(staging: str, split: tuple, keep, cfg: CleanConfig) -> Iterator[tuple]:
    """(index, record) of those survivors: their text, place (``where``) and parsed output line (``out``)."""
    for k, line in _survivor_lines(staging, split, keep):
        out = json.loads(line)
        yield k, {"text": out[cfg.text_key], "where": out["naohai"]["source"], "out": out}


def _scored_line(rec: Dict[str, Any], perplexity: float) -> str:
    """A survivor's output line with its perplexity: :func:`~naohai.data.clean.output_record`'s, byte for byte
    (the parsed line keeps its keys' order; the perplexity comes last in ``naohai``)."""
    out = rec["out"]
    out["naohai"]["perplexity"] = round(perplexity, 4)
    return json.dumps(out, ensure_ascii=False) + "\n"


def _line(where: str) -> int:
    """The line number of a document's ``path:line`` place."""
    return int(where.rsplit(":", 1)[1])


def _read_split(cfg: CleanConfig, staging: str, item, claims: Optional[str] = None) -> Iterator[tuple]:
    """:func:`_survive` on a local file's split: item = (split, (file, split in file, path, :class:`Split`));
    nothing when ``claims`` (the head start's folder) shows that the driver's head start runs it."""
    split, (fi, si, path, part) = item
    if claims is not None and not claim(claims, split, SPARK):
        return iter(())
    return _survive(cfg, staging, split, fi, si, read_split(path, part, cfg.text_key, cfg.max_line_bytes))


def _run_split(cfg: CleanConfig, staging: str, item) -> List[tuple]:
    """:func:`_read_split` run to its end (the driver's head start)."""
    return list(_read_split(cfg, staging, item))


def _prepare(cfg: CleanConfig) -> None:
    """What the driver's head start (a forked process of its own) loads before its first split: the steps'
    models and jieba's dictionary, then frozen out of the garbage collector's sight (:func:`freeze_loads`)."""
    _models(cfg)
    if cfg.quality.enabled:
        quality.load_segmenter()
    freeze_loads()


def _survive(cfg: CleanConfig, staging: str, split: int, fi: int, si: int, records) -> Iterator[tuple]:
    """One input split (its records and problems) through the per-document steps.  The survivors' output lines
    (:func:`~naohai.data.clean.output_record`'s: the last stage copies the kept ones without parsing them) go to
    the split's file in the staging folder (:func:`_survivors_path`, in input order) and their keys, (order key,
    exact key, bytes, (split, index in its file), signature) per survivor, to the keys file beside it
    (:func:`_keys`); Spark gets only ('steps', ((file, split, batch), stats)) per batch and one ('read', ((file,
    split), docs, bytes, problems, survivors)) at the end."""
    models = _models(cfg)
    problems = _Problems()
    docs_in = bytes_in = 0
    batch: List[tuple] = []
    nbatch = 0
    keys: List[tuple] = []

    def run(fh, batch, nbatch):
        try:
            kept, steps = filter_documents(batch, models)
            texts = [k[0] for k in kept]
            sigs = ([s.tobytes() for s in dedup.signatures(texts, cfg.near_dedup)] if cfg.near_dedup.enabled
                    else [None] * len(kept))
        except Exception as exc:
            raise RuntimeError(f"{_FAILED} {batch[0][1]} .. {batch[-1][1]}: {type(exc).__name__}: {exc}") from exc
        for k, sig in zip(kept, sigs):
            rec = unit_record(*k, cfg)
            fh.write(output_record(rec, cfg))
            keys.append((dedup.order_key(k[0], fi, _line(k[1])), rec["key"], _nbytes(k[0]), (split, len(keys)), sig))
        return "steps", ((fi, si, nbatch), {name: st.s.as_dict() for name, st in steps.items()})

    out = _survivors_path(staging, fi, si)
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            for rec in records:
                if isinstance(rec, Problem):
                    problems.add(rec)
                    continue
                docs_in += 1
                bytes_in += _nbytes(rec.text)
                batch.append((rec.text, rec.where, rec.extra))
                if len(batch) == cfg.batch_docs:
                    yield run(fh, batch, nbatch)
                    batch, nbatch = [], nbatch + 1
            if batch:
                yield run(fh, batch, nbatch)

        def write_keys(path):
            with open(path, "wb") as kf:
                pickle.dump(keys, kf, protocol=pickle.HIGHEST_PROTOCOL)
        atomic_write(out + KEYS, write_keys)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    yield "read", ((fi, si), docs_in, bytes_in, problems, len(keys))


def _keys(staging: str, split: tuple) -> List[tuple]:
    """The survivors' keys of one input split, as :func:`_survive` wrote them."""
    with open(_survivors_path(staging, *split[:2]) + KEYS, "rb") as fh:
        return pickle.load(fh)


def split_size(files: Sequence[str], slots: int) -> int:
    """The split size of the local ``.jsonl`` inputs when none is given: their bytes over ``TASKS_PER_SLOT`` splits
    per task slot, within [MIN_SPLIT_BYTES, SPLIT_BYTES].  Small splits keep every slot busy to the end of stage 1:
    with one 6 MB file a task (50 MB in 8 files, local[2]), one slot sat idle for the last 2 of 45 s; Spark SQL
    sizes its file splits from the bytes per core too, at one split per core."""
    total = sum(os.path.getsize(f) for f in files if not is_uri(f) and splittable(f))
    return int(min(SPLIT_BYTES, max(MIN_SPLIT_BYTES, total // max(1, slots * TASKS_PER_SLOT))))


def local_slots(master: str) -> Optional[int]:
    """The task slots of a local master (``local`` 1, ``local[N]`` and ``local[N,F]`` N, ``local[*]`` the cores);
    None for any other master."""
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\s*\d+)?\])?", master.strip())
    if m is None:
        return None
    return (os.cpu_count() or 1) if m.group(1) == "*" else int(m.group(1) or 1)


def _local_splits(files: Sequence[str], split_bytes: int, count: Callable[[List[tuple]], List[int]],
                  head_bytes: int = 0, tail_bytes: int = 0):
    """{file number: [(file number, split number, path, :class:`Split`)]} of the local files in ``split_bytes``
    ranges, those that hold some of the first ``head_bytes`` or of the last ``tail_bytes`` of the splittable input
    cut into ranges of SMALL_SPLIT_BYTES (the head start's, which ends with the split it runs when Spark's tasks
    begin; the last tasks', so that no slot idles long at the end); ``count(ranges)`` gives the newline counts of
    the ranges that end before their file does (they number the lines of the ranges after them)."""
    local_files = [(fi, path) for fi, path in enumerate(files) if not is_uri(path)]
    total = sum(os.path.getsize(path) for _, path in local_files if splittable(path))
    ranges, at = [], 0
    for fi, path in local_files:
        size, cut = os.path.getsize(path), []
        for a, b in byte_ranges(path, split_bytes):
            end = size if b is None else b
            if splittable(path) and end - a > SMALL_SPLIT_BYTES and (at + a < head_bytes
                                                                     or at + end > total - tail_bytes):
                cut += [(x, min(x + SMALL_SPLIT_BYTES, end)) for x in range(a, end, SMALL_SPLIT_BYTES)]
                cut[-1] = (cut[-1][0], b)
            else:
                cut.append((a, b))
        at += size if splittable(path) else 0
        ranges += [(fi, si, path, a, b) for si, (a, b) in enumerate(cut)]
    counted = [r for r in ranges if r[4] is not None]          # the last range of a file numbers nothing
    counts = dict(zip([r[:2] for r in counted], count(counted))) if counted else {}
    local: Dict[int, List[tuple]] = {}
    before: Dict[int, int] = {}
    for fi, si, path, a, b in ranges:
        n = before.get(fi, 0)
        local.setdefault(fi, []).append((fi, si, path, Split(a, b, n)))
        before[fi] = n + counts.get((fi, si), 0)
    return local


def _count_here(ranges: List[tuple]) -> List[int]:
    return [count_newlines(path, a, b) for _, _, path, a, b in ranges]


def _stage1(sc, files: Sequence[str], cfg: CleanConfig, staging: str, split_bytes: Optional[int],
            local: Optional[Dict[int, List[tuple]]] = None, claims: Optional[str] = None):
    """Every input split, in input order, as (file number, split number, path, :class:`Split`, or None for a
    Hadoop path's), and stage 1's RDD over them.  ``local``: the local files' splits as :func:`_local_splits`
    gives them, when the driver has cut and counted them already (a local master); else their newline counts
    are taken by one Spark task per range.  A Hadoop path's lines are numbered by its own counting job.
    ``split_bytes`` None: :func:`split_size` for the local files, SPLIT_BYTES for Hadoop paths.  ``claims``: the
    claims folder of the driver's head start (the tasks skip the splits it claimed)."""
    if local is None:
        local = _local_splits(files, split_bytes or split_size(files, sc.defaultParallelism),
                              lambda ranges: sc.parallelize(ranges, len(ranges))
                              .map(lambda r: count_newlines(r[2], r[3], r[4])).collect())
    split_bytes = split_bytes or SPLIT_BYTES
    lines = {fi: hadoop_inputs.numbered_lines(sc, path, split_bytes) for fi, path in enumerate(files) if is_uri(path)}
    splits = []
    for fi, path in enumerate(files):
        splits += ([(fi, si, path, None) for si in range(lines[fi].getNumPartitions())] if fi in lines
                   else local[fi])
    rdds = []
    items = [(n, s) for n, s in enumerate(splits) if s[3] is not None]
    if items:
        rdds.append(sc.parallelize(items, len(items)).flatMap(lambda item: _read_split(cfg, staging, item, claims)))
    for fi, rdd in lines.items():
        first = next(n for n, s in enumerate(splits) if s[0] == fi)

        def survive(si, it, fi=fi, first=first, uri=files[fi]):
            return _survive(cfg, staging, first + si, fi, si,
                            hadoop_inputs.records(uri, it, cfg.text_key, cfg.max_line_bytes))
        rdds.append(rdd.mapPartitionsWithIndex(survive))
    return splits, (rdds[0] if len(rdds) == 1 else sc.union(rdds))


def _position(doc) -> tuple:
    """(file number, line): a document's place in the input, from its order key."""
    return doc[0][1:]


def _records_at(staging: str, splits: Sequence[tuple], locs: Sequence[tuple], cfg: CleanConfig
                ) -> List[Dict[str, Any]]:
    """The records of the survivors at ``locs`` ((split, index in its file), as in stage 1's keys), read on the
    driver from the staging folder (the report's samples: a few documents)."""
    wanted: Dict[int, set] = {}
    for split, k in locs:
        wanted.setdefault(split, set()).add(k)
    found = {(split, k): rec for split, ks in wanted.items()
             for k, rec in _survivors(staging, splits[split], ks, cfg)}
    return [found[tuple(loc)] for loc in locs]


# --------------------------------------------------------------------------- dedup (on the survivors' keys)
def _exact_drops(docs, partitions: int):
    """(order key, the kept one's) of every document that is not the smallest of its exact-key group (a
    shuffle of the keys only)."""
    def drops(group):
        orders = sorted(group[1])
        return [(o, orders[0]) for o in orders[1:]]
    return docs.map(lambda d: (d[1], d[0])).groupByKey(partitions).flatMap(drops)


def _tag_dropped(sc, docs, drops, partitions: int):
    """(kept?, doc) for every document; ``drops`` holds (order key, anything) of those dropped: broadcast when
    there are up to DRIVER_DROPS of them, else joined."""
    drops = drops.persist()
    if drops.count() <= DRIVER_DROPS:
        return _tag_by_set(sc, docs, drops.keys().collect())
    return docs.map(lambda d: (d[0], d)).leftOuterJoin(drops, partitions).map(_tag_joined).persist()


def _tag_by_set(sc, docs, dropped):
    gone = sc.broadcast(frozenset(dropped))
    return docs.map(lambda d: (d[0] not in gone.value, d))


def _step_stats(tagged, reason: str, samples: int, records) -> StepStats:
    """A dedup step's statistics from an RDD of (kept?, doc) in one pass, the samples the first drops in input
    order (``records(locs)`` reads their texts)."""
    def part(items):
        n, first = [0, 0, 0, 0, 0], []
        for kept, doc in items:
            n[0] += 1
            n[1] += doc[2]
            if kept:
                n[2] += 1
                n[4] += doc[2]
            else:
                n[3] += 1
                if samples:
                    first.append((_position(doc), doc[3]))
                    if len(first) > 64 + 4 * samples:
                        first = heapq.nsmallest(samples, first)
        yield n, heapq.nsmallest(samples, first)
    parts = tagged.mapPartitions(part).collect()
    return _stats([sum(p[0][i] for p in parts) for i in range(5)], (f for p in parts for f in p[1]), reason,
                  samples, records)


def _stats(tot: Sequence[int], first, reason: str, samples: int, records) -> StepStats:
    """A dedup step's statistics from its totals (documents, bytes, kept, dropped, kept bytes) and (position,
    place) of (at least the first ``samples`` of) its drops."""
    s = StepStats(docs_in=tot[0], bytes_in=tot[1], kept=tot[2], dropped=tot[3], bytes_out=tot[4])
    if s.dropped:
        s.reasons = {reason: s.dropped}
    if samples and s.dropped:
        step = _Step(samples)
        for rec in records([loc for _, loc in heapq.nsmallest(samples, first)]):
            step.drop(rec["where"], reason, rec["text"])
        s.samples = step.s.samples
    return s


def _driver_dedup(docs: List[tuple], cfg: CleanConfig, records) -> tuple:
    """Both dedup steps on the driver, over every survivor's keys (up to DRIVER_DOCS of them): the local engine's
    rules (smallest order key of an exact-key group; :func:`~naohai.data.dedup.near_duplicates`) -> ({step:
    StepStats}, the documents kept)."""
    steps = {}

    def step(name, kept, reason):
        dropped = [(_position(d), d[3]) for d, k in zip(docs, kept) if not k]
        tot = [len(docs), sum(d[2] for d in docs), len(docs) - len(dropped), len(dropped),
               sum(d[2] for d, k in zip(docs, kept) if k)]
        steps[name] = _stats(tot, dropped, reason, cfg.samples, records)
        return [d for d, k in zip(docs, kept) if k]
    if cfg.exact_dedup.enabled:
        best = dedup.exact_keepers((d[1], d[0]) for d in docs)
        docs = step("exact_dedup", [best[d[1]] == d[0] for d in docs], "exact duplicate")
    if cfg.near_dedup.enabled:
        sigs = (np.frombuffer(b"".join(d[4] for d in docs), np.uint32).reshape(len(docs), -1) if docs
                else np.zeros((0, cfg.near_dedup.num_perm), np.uint32))
        dropped = dedup.near_duplicates([d[0] for d in docs], sigs, cfg.near_dedup)
        docs = step("near_dedup", [d[0] not in dropped for d in docs], "near duplicate")
    return steps, docs


def _bucket_entries(doc, bands: int, rows: int):
    """(band + that band's rows, order key) per band: the bytes of :func:`~naohai.data.dedup.band_keys`, sliced
    from the signature's bytes."""
    sig, w = doc[4], 4 * rows
    return [(b.to_bytes(2, "little") + sig[b * w:(b + 1) * w], doc[0]) for b in range(bands)]


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


def _near_tagged(sc, docs, cfg, partitions: int):
    """(kept?, doc) for every document of the near-dedup step.  The LSH buckets are a shuffle of band keys;
    when their members number up to DRIVER_LINKS, the buckets and their members' signatures come to the
    driver, which links and clusters them; else the signatures are joined to the buckets, the links verified
    on the cluster and clustered there (or on the driver, up to DRIVER_LINKS links)."""
    bands, rows = dedup.lsh_params(cfg)
    accept = dedup.accept_agreement(cfg)

    def edges(members):
        return dedup.bucket_edges([(o, np.frombuffer(s, np.uint32)) for o, s in members], accept)
    buckets = (docs.flatMap(lambda d: _bucket_entries(d, bands, rows)).groupByKey(partitions)
               .mapValues(list).filter(lambda kv: len(kv[1]) > 1)).persist()
    if buckets.map(lambda kv: len(kv[1])).sum() <= DRIVER_LINKS:
        groups = buckets.values().collect()
        wanted = sc.broadcast(frozenset(o for g in groups for o in g))
        sig = dict(docs.filter(lambda d: d[0] in wanted.value).map(lambda d: (d[0], d[4])).collect())
        links = [e for g in groups for e in edges([(o, sig[o]) for o in g])]
        return _tag_by_set(sc, docs, dedup.cluster_drops(links))
    member_of = buckets.flatMap(lambda kv: [(o, kv[0]) for o in kv[1]])
    sigs = docs.map(lambda d: (d[0], d[4]))
    links = (member_of.join(sigs, partitions).map(_with_sig).groupByKey(partitions)
             .flatMap(lambda kv: edges(kv[1]))).persist()
    if links.count() <= DRIVER_LINKS:
        return _tag_by_set(sc, docs, dedup.cluster_drops(links.collect()))
    return _tag_dropped(sc, docs, connected_components(links, partitions), partitions)


def _tag_joined(item):
    _, (doc, rep) = item
    return rep is None, doc


# --------------------------------------------------------------------------- perplexity
_EXECUTOR_LM: Dict[str, Any] = {}


def _executor_lm(cfg: CleanConfig, lm_factory: Callable[[], Any]):
    """The perplexity step's model (a :class:`naohai.data.score.LM`), loaded once per Python worker."""
    return _loaded(_EXECUTOR_LM, json.dumps(cfg.to_dict().get("perplexity"), sort_keys=True, default=str),
                   lm_factory)


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
def _kept_records(staging: str, splits: Sequence[tuple], cfg: CleanConfig):
    """Partition ``s`` of (split, index) pairs of the kept survivors -> (position, record) of each, read from
    split ``s``'s file of stage 1, in input order."""
    def read(s, items):
        keep = {k for _, k in items}
        if keep:
            for _, rec in _survivors(staging, splits[s], keep, cfg):
                yield (splits[s][0], _line(rec["where"])), rec
    return read


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


def _write_kept(sc, docs, kept_at: Optional[Dict[int, List[int]]], splits: Sequence[tuple], staging: str,
                cfg: CleanConfig, parts: int) -> tuple:
    """The kept survivors written as shards into the staging folder without moving their texts through a shuffle:
    one task per input split (``kept_at[s]``, the indexes of split ``s``'s kept survivors, or the survivors' keys
    ``docs`` grouped by split on the cluster) reads its survivors' file and writes its output lines, numbered in
    input order from its split's first number, as one piece per shard it touches; a task per shard then joins
    its pieces in split order.  -> (documents written, shards)."""
    if kept_at is None:
        places = docs.map(lambda d: d[3])
        counts = places.map(lambda loc: loc[0]).countByValue()
        items = places.groupByKey(max(1, min(len(splits), parts)))
    else:
        counts = {s: len(ks) for s, ks in kept_at.items()}
        todo = sorted(kept_at.items())
        items = sc.parallelize(todo, max(1, min(len(todo), parts * 4))) if todo else None
    first = np.concatenate([[0], np.cumsum([counts.get(s, 0) for s in range(len(splits))])]).tolist()
    written, n = first[-1], cfg.shard_docs
    shards = -(-written // n)
    if not shards:
        return 0, 0

    def pieces(item):
        s, ks = item
        made, shard, fh, tmp = [], None, None, None
        try:
            for j, (_, line) in enumerate(_survivor_lines(staging, splits[s], set(ks))):
                k = (first[s] + j) // n
                if k != shard:
                    if fh is not None:
                        fh.close()
                        os.replace(tmp, made[-1][2])
                    shard = k
                    made.append((k, s, os.path.join(staging, f"piece-{k:05d}-{s:06d}.jsonl")))
                    tmp = f"{made[-1][2]}.tmp-{os.getpid()}"
                    fh = open(tmp, "w", encoding="utf-8")
                fh.write(line)
            if fh is not None:
                fh.close()
                os.replace(tmp, made[-1][2])
        finally:
            if tmp is not None and os.path.exists(tmp):
                os.remove(tmp)
        return made

    by_shard: Dict[int, List[str]] = {}
    for k, _, path in sorted(items.flatMap(pieces).collect()):
        by_shard.setdefault(k, []).append(path)

    def join(item):
        k, paths = item

        def w(tmp):
            with open(tmp, "wb") as out:
                for path in paths:
                    with open(path, "rb") as fh:
                        shutil.copyfileobj(fh, out, 1 << 20)
        atomic_write(os.path.join(staging, f"part-{k:05d}.jsonl"), w)
        return k
    sc.parallelize(sorted(by_shard.items()), max(1, min(shards, parts * 4))).map(join).collect()
    return written, shards


# --------------------------------------------------------------------------- the run
def clean_spark(inputs: Sequence[str], out_dir: str, cfg: CleanConfig, *, master: str = "local[*]",
                conf: Optional[Dict[str, str]] = None, restart: bool = False, progress: bool = True,
                timings: Optional[Dict[str, float]] = None, split_bytes: Optional[int] = None,
                lm_factory: Optional[Callable[[], Any]] = None) -> Dict[str, Any]:
    """:func:`naohai.data.clean.clean` on Spark: the same output shards and report, whatever ``split_bytes``.

    ``lm_factory() -> naohai.data.score.LM`` loads the perplexity step's model (needed when the step is on);
    it is sent to the executors, each Python worker calls it once.  ``timings``, when given, receives the
    seconds of each phase (``run/bench_clean.py``)."""
    if cfg.perplexity.enabled and lm_factory is None:
        raise ValueError("the perplexity step is enabled: pass lm_factory")
    if split_bytes is not None and (isinstance(split_bytes, bool) or not isinstance(split_bytes, int)
                                    or split_bytes < 1):
        raise UserError(f"must be a positive size, got {split_bytes!r} bytes", where="command line",
                        key="--split-mb")
    require_pyspark()
    if not inputs:
        resolve_inputs(inputs)  # its one message for no input at all
    local = {i: resolve_inputs([item]) for i, item in enumerate(inputs) if not is_uri(item)}  # before Spark starts
    out_dir = os.path.abspath(out_dir)
    # started once needed (a finished run of local inputs needs no JVM); the config goes to the Python daemon, and
    # with a local master, the socket of the zygote that forks it (the head start's process).  Not with the
    # perplexity step: its workers run MindSpore, which hangs in a fork of a process that has run it (a driver
    # that trained or scored in-process): they get a daemon started afresh
    zygote = (tempfile.mkdtemp(prefix="naohai-spark-") if local_slots(master) is not None
              and not cfg.perplexity.enabled else None)
    env = {CONFIG_ENV: json.dumps(cfg.to_dict())}
    if zygote is not None:
        env[ZYGOTE_ENV] = os.path.join(zygote, "zygote.sock")
    boot = Boot(master, {**{f"spark.executorEnv.{k}": v for k, v in env.items()}, **(conf or {})})
    head = None
    try:
        files, stamps = _inputs(inputs, local, boot.context)
        work = prepare_run_dir(out_dir, _plan(files, cfg, stamps), restart, "naohai data clean",
                               "a clean run with another config or other inputs (changed files?)", inputs, files)
        done = finished_report(out_dir)
        if done is not None:
            return done
        staging = os.path.join(work, STAGING)
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(os.path.join(staging, DOCS))
        if local_slots(master) is not None and boot.thread is None:   # forked before the boot thread starts
            head = HeadStart(functools.partial(_prepare, cfg), functools.partial(_run_split, cfg, staging),
                             os.path.join(staging, CLAIMS), env.get(ZYGOTE_ENV))
        boot.start()           # the JVM boots while the driver checks the steps' models and lists the splits
        if head is None:       # else the head start loads them (_run)
            _Models(cfg)       # a missing language / classifier model or blocklist: the local engine's message
        report = _run(boot.context, master, files, out_dir, staging, cfg, timings if timings is not None else {},
                      split_bytes, lm_factory, head)
    except Exception as exc:   # a step failed on a document: name the documents, keep nothing half-written
        said = [ln.strip() for ln in str(exc).splitlines() if _FAILED in ln]
        if not said:
            raise
        raise UserError(said[-1][said[-1].index(_FAILED):] + "; nothing was written to --out, and running again "
                        "starts afresh", where=out_dir, key="--out") from None
    finally:
        if head is not None:
            head.end()
        boot.stop()
        if zygote is not None:
            shutil.rmtree(zygote, ignore_errors=True)
    write_report(out_dir, report)
    shutil.rmtree(staging, ignore_errors=True)
    return report


def _inputs(inputs: Sequence[str], local: Dict[int, List[str]], context) -> tuple:
    """The input files in order and their fingerprints: ``local[i]`` the files of local input ``i`` (already
    resolved), the others Hadoop paths listed through ``context()``'s filesystem."""
    files, stamps = [], []
    for i, item in enumerate(inputs):
        if i in local:
            found = local[i]
            stamps += fingerprint(found)
        else:
            found = _visible(item, hadoop_inputs.resolve_uri(context(), item))
            stamps += [hadoop_inputs.stamp(context(), f) for f in found]
        files += found
    return files, stamps


def _visible(item: str, found: List[str]) -> List[str]:
    """The files of a Hadoop-path input less those below a hidden entry of the folder it names (a name starting
    with '.', e.g. a clean output's ``.work/``): the rule :func:`naohai.data.reader.resolve_inputs` applies to a
    local folder.  A file or a glob is left as it is.  Hadoop lists ``file:///x`` as ``file:/x``, which would pass
    for a local path: such names are given back as ``file:///x``, as a ``file://`` file input is named."""
    found = ["file://" + f[len("file:"):] if f.startswith("file:/") and not f.startswith("file://") else f
             for f in found]
    if found == [item] or any(ch in item.split("://", 1)[1] for ch in "*?["):
        return found
    depth = len([p for p in posixpath.normpath(urlparse(item).path).split("/") if p])
    kept = [f for f in found if not hidden("/".join([p for p in urlparse(f).path.split("/") if p][depth:]))]
    if not kept:
        raise UserError(f"the directory holds no {'/'.join(SUFFIXES)} files (hidden entries, whose names start "
                        "with '.', are not read)", where=item)
    return kept


def _run(context, master: str, files: List[str], out_dir: str, staging: str, cfg: CleanConfig,
         timings: Dict[str, float], split_bytes: Optional[int], lm_factory: Optional[Callable[[], Any]],
         head: Optional[HeadStart] = None) -> Dict[str, Any]:
    from pyspark import StorageLevel
    slots = local_slots(master)
    local = None
    if slots is not None:      # the executors read this machine's disks: the driver cuts and counts while the JVM boots
        local = _local_splits(files, split_bytes or split_size(files, slots), _count_here,
                              HEAD_BYTES if head is not None else 0, TAIL_BYTES)
        if head is not None:   # all inputs are local: the splits in _stage1's order and numbers
            head.begin(list(enumerate(s for fi in range(len(files)) for s in local[fi])))
            if head.failed() is not None:   # it could not load the steps' models: the local engine's message
                _Models(cfg)                # (else its error fails the run after the stage)
    sc = context()
    clock = [time.perf_counter()]

    def phase(name):
        now = time.perf_counter()
        timings[name] = now - clock[0]
        clock[0] = now
    parts = max(2, sc.defaultParallelism * 2)
    splits, stage1 = _stage1(sc, files, cfg, staging, split_bytes, local, head and head.claims)
    meta = stage1.collect()
    if head is not None:       # what the driver's head start ran while Spark started
        ran = head.results()
        meta += [m for ms in ran.values() for m in ms]
        timings["splits run by the driver's head start"] = len(ran)
    phase("read + per-document steps + signatures")

    read, problems, survivors = StepStats(), _Problems(), 0
    for _, (fi, n, nbytes, probs, left) in sorted((m for m in meta if m[0] == "read"), key=lambda m: m[1][0]):
        survivors += left
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

    def records(locs):
        return _records_at(staging, splits, locs, cfg)
    kept_at = None                      # split -> the indexes of its kept survivors, when known on the driver
    docs = held = None                  # the survivors' keys as an RDD, when the dedup runs on the cluster
    if (cfg.exact_dedup.enabled or cfg.near_dedup.enabled) and survivors <= DRIVER_DOCS:
        found, left = _driver_dedup([d for split in splits for d in _keys(staging, split)], cfg, records)
        steps.update(found)
        kept_at = {}
        for d in left:
            kept_at.setdefault(d[3][0], []).append(d[3][1])
        phase("exact + near dedup on the driver")
    else:
        docs = held = (sc.parallelize(range(len(splits)), len(splits))
                       .flatMap(lambda si: _keys(staging, splits[si])).persist(StorageLevel.MEMORY_AND_DISK))
        if cfg.exact_dedup.enabled:
            tagged = _tag_dropped(sc, docs, _exact_drops(docs, parts), parts)
            steps["exact_dedup"] = _step_stats(tagged, "exact duplicate", cfg.samples, records)
            docs = tagged.filter(lambda t: t[0]).map(lambda t: t[1])
            phase("exact dedup")
        if cfg.near_dedup.enabled:
            docs = docs if docs is held else docs.persist()
            tagged = _near_tagged(sc, docs, cfg.near_dedup, parts)
            steps["near_dedup"] = _step_stats(tagged, "near duplicate", cfg.samples, records)
            docs = tagged.filter(lambda t: t[0]).map(lambda t: t[1])
            phase("near dedup")

    n = cfg.shard_docs
    if not cfg.perplexity.enabled:
        written, shards = _write_kept(sc, docs, kept_at, splits, staging, cfg, parts)
        return _finish(files, out_dir, staging, cfg, read, problems, steps, written, shards, held, phase)
    # the perplexity step: the survivors' records, once (partition s holds split s's kept documents in input
    # order), scored, then numbered and cut into shards
    kept = (docs.map(lambda d: d[3]) if kept_at is None
            else sc.parallelize([(s, k) for s, ks in sorted(kept_at.items()) for k in ks], len(splits)))
    survivors = kept.partitionBy(len(splits), lambda s: s).mapPartitionsWithIndex(_kept_records(staging, splits, cfg))
    scored = survivors.mapPartitions(_score_partition(cfg, lm_factory)).persist(StorageLevel.MEMORY_AND_DISK)
    per = steps["perplexity"] = _perplexity_stats(scored, cfg)
    scored_quantiles = distributed_quantiles(scored.map(lambda t: t[2]).filter(math.isfinite),
                                             per.docs_in - per.reasons.get(NO_SCORED_TOKENS, 0))
    model = sc.parallelize([0], 1).map(lambda _: _executor_lm(cfg, lm_factory).describe).first()
    limit = cfg.perplexity.max
    written = per.kept
    numbered = (scored.filter(lambda t: perplexity_drop_reason(t[2], limit) is None)
                .map(lambda t: _scored_line(t[1], t[2])).zipWithIndex().map(lambda li: (li[1], li[0])))
    phase("perplexity")
    shards = -(-written // n)
    if shards:
        (numbered.map(lambda il: (il[0] // n, il)).partitionBy(shards, lambda k: k)
         .mapPartitionsWithIndex(_write_shard(staging, cfg)).collect())
    return _finish(files, out_dir, staging, cfg, read, problems, steps, written, shards, held, phase, model,
                   scored_quantiles)


def _finish(files, out_dir, staging, cfg, read, problems, steps, written, shards, held, phase, model=None,
            scored_quantiles=None) -> Dict[str, Any]:
    """Move the finished shards from the staging folder into ``out_dir`` (those of an earlier, broken run removed
    first) and give the report."""
    if held is not None:
        held.unpersist()
    remove_outputs(out_dir)            # shards of an earlier, broken run (no report)
    for s in range(shards):            # each shard is complete; the report, last, marks the run finished
        name = f"part-{s:05d}.jsonl"
        os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    phase("write shards")
    return make_report(files, cfg, read, problems, steps, written, shards, out_dir, model,
                       quantiles=scored_quantiles)
