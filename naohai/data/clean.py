"""`naohai data clean`: raw ``.jsonl`` / ``.txt`` (``.gz``) -> cleaned ``.jsonl`` shards + ``report.json``.

Steps, in order, each switched on or off in the config (:mod:`naohai.data.clean_config`):
``normalize`` (:mod:`~naohai.data.normalize`), ``language``
(:mod:`~naohai.data.fasttext_models`), ``quality`` (:mod:`~naohai.data.quality`),
``pii`` (:mod:`~naohai.data.pii`), ``classifier`` (:mod:`~naohai.data.fasttext_models`,
off by default; a supervised fastText model), ``exact_dedup`` and ``near_dedup`` (:mod:`~naohai.data.dedup`),
``perplexity`` (:mod:`~naohai.data.score`, off by default) -- the order of ``STEPS``.

How it runs
    Stage 1: the main process streams the inputs (:mod:`~naohai.data.reader`; bad
    lines are recorded as problems with file and line) and cuts the documents into
    work units of ``batch_docs``.  Worker processes run the per-document steps and
    the MinHash signatures of a unit and write ``.work/unit-N.jsonl``, ``unit-N.npy``
    and, last, ``unit-N.json`` (its statistics), each renamed into place, so a unit
    is either complete or absent.  Stage 2 goes through the units in order in one
    process for the two deduplication steps (a set of hashes, an LSH index), then
    the optional ``perplexity`` step on each unit's survivors (a naohai model,
    :mod:`~naohai.data.score`; its scores are kept in ``.work/unit-N.ppl-MODELHASH.npy``), and
    writes ``part-NNNNN.jsonl`` shards, then ``report.json``.  The model is loaded
    only then, in the main process, after the workers are gone; the caller passes a
    function that loads it (``lm_factory``), as the data layer holds no model code.

Resuming
    ``.work/plan.json`` records the config and the inputs (path, size, mtime).  A
    second run with the same plan skips every unit whose ``unit-N.json`` exists and
    redoes stage 2, which is deterministic, so the output equals that of an
    uninterrupted run; a finished run (``report.json`` present) is not redone.  A
    different plan is refused unless ``restart=True``.  A non-empty output
    directory that is not a clean run's is never written into, nor one that overlaps the
    inputs (:func:`~naohai.data.rundir.input_overlap`: an input file or folder, inside an input
    folder that would read it back, holding an input file).  A folder input leaves hidden
    entries out (:func:`~naohai.data.reader.resolve_inputs`), so an output folder, whose
    ``.work/`` holds copies of its documents, can be an input and is read once.

Output records are the input object with the cleaned text under ``text_key`` and
``naohai: {source: "file:line", lang, lang_score}`` added (and ``perplexity`` when that step is on).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import gc
import glob
import json
import multiprocessing
import os
import signal
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from naohai.data import dedup, normalize as norm, pii, quality
from naohai.data.clean_config import CleanConfig
from naohai.data.reader import Problem, fingerprint, read_inputs, resolve_inputs
from naohai.data.rundir import atomic_write, finished_report, prepare_run_dir, remove_outputs, write_report
from naohai.data.score import quantiles as _quantiles

FORMAT = "naohai-clean-v1"
STEPS = ("normalize", "language", "quality", "pii", "classifier", "exact_dedup", "near_dedup", "perplexity")
MAX_PROBLEMS_LISTED = 1000
_EXCERPT = 300


@dataclass
class StepStats:
    docs_in: int = 0
    bytes_in: int = 0
    kept: int = 0
    dropped: int = 0
    changed: int = 0
    bytes_out: int = 0
    reasons: Dict[str, int] = field(default_factory=dict)
    samples: List[Dict[str, str]] = field(default_factory=list)

    def merge(self, other: Dict[str, Any], max_samples: int) -> None:
        for k in ("docs_in", "bytes_in", "kept", "dropped", "changed", "bytes_out"):
            setattr(self, k, getattr(self, k) + other[k])
        for r, n in other["reasons"].items():
            self.reasons[r] = self.reasons.get(r, 0) + n
        self.samples.extend(other["samples"][: max(0, max_samples - len(self.samples))])

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


class _Step:
    """Counts for one step over a stream of documents."""

    def __init__(self, max_samples: int):
        self.s = StepStats()
        self.max_samples = max_samples

    def seen(self, text: str) -> None:
        self.s.docs_in += 1
        self.s.bytes_in += _nbytes(text)

    def drop(self, where: str, reason: str, text: str) -> None:
        self.s.dropped += 1
        self.s.reasons[reason] = self.s.reasons.get(reason, 0) + 1
        if len(self.s.samples) < self.max_samples:
            self.s.samples.append({"where": where, "reason": reason, "text": text[:_EXCERPT]})

    def keep(self, before: str, after: str, where: str, reason: str = "changed") -> None:
        self.s.kept += 1
        self.s.bytes_out += _nbytes(after)
        if after != before:
            self.s.changed += 1
            self.s.reasons[reason] = self.s.reasons.get(reason, 0) + 1
            if len(self.s.samples) < self.max_samples:
                self.s.samples.append({"where": where, "reason": reason, "before": before[:_EXCERPT],
                                       "after": after[:_EXCERPT]})


# --------------------------------------------------------------------------- stage 1 (workers)
class _Models:
    """What the per-document steps load once per process (inherited by forked workers)."""

    def __init__(self, cfg: CleanConfig):
        from naohai.data.fasttext_models import Classifier, LanguageIdentifier
        self.cfg = cfg
        self.lid = LanguageIdentifier(cfg.language.model) if cfg.language.enabled else None
        self.classifier = (Classifier(cfg.classifier.model, cfg.classifier.drop_labels)
                           if cfg.classifier.enabled else None)
        self.blocklist = quality.load_blocklist(cfg.quality.blocklist) if cfg.quality.enabled else []
        if cfg.near_dedup.enabled:
            import datasketch  # noqa: F401  (slow to import: once, before the workers fork)


_MODELS: Optional[_Models] = None


def filter_documents(batch: Sequence[tuple], models: "_Models") -> tuple:
    """The per-document steps (normalize .. classifier) over ``batch`` of (text, where, extra).

    Returns (kept, steps): kept is a list of (text, where, extra, lang, lang_score), steps maps each
    of those step names to its :class:`_Step`.  Both engines run this (the local one per work unit in
    its worker processes, the Spark one per partition)."""
    cfg = models.cfg
    steps = {name: _Step(cfg.samples) for name in STEPS[:5]}
    kept = []
    for text, where, extra in batch:
        lang, score = None, None
        if cfg.normalize.enabled:
            st = steps["normalize"]
            st.seen(text)
            new = norm.normalize(text, cfg.normalize)
            if not new.strip():
                st.drop(where, "empty", text)
                continue
            st.keep(text, new, where)
            text = new
        if models.lid is not None:
            st = steps["language"]
            st.seen(text)
            lang, score = models.lid.identify(text)
            if lang not in cfg.language.keep:
                st.drop(where, f"language {lang}", text)
                continue
            if score < cfg.language.min_score:
                st.drop(where, f"score < {cfg.language.min_score}", text)
                continue
            st.keep(text, text, where)
        if cfg.quality.enabled:
            st = steps["quality"]
            st.seen(text)
            reason = quality.quality_reason(text, cfg.quality, lang, models.blocklist)
            if reason:
                st.drop(where, reason, text)
                continue
            st.keep(text, text, where)
        if cfg.pii.enabled:
            st = steps["pii"]
            st.seen(text)
            new, counts = pii.deidentify(text, cfg.pii)
            st.keep(text, new, where, reason="+".join(sorted(counts)) or "changed")
            for kind, n in counts.items():
                st.s.reasons[f"{kind} replaced"] = st.s.reasons.get(f"{kind} replaced", 0) + n
            text = new
        if models.classifier is not None:
            st = steps["classifier"]
            st.seen(text)
            p = models.classifier.drop_probability(text)
            if p >= cfg.classifier.threshold:
                st.drop(where, f"p={p:.2f}", text)
                continue
            st.keep(text, text, where)
        kept.append((text, where, extra, lang, score))
    return kept, steps


def unit_record(text: str, where: str, extra, lang, score, cfg: CleanConfig) -> Dict[str, Any]:
    """What stage 1 keeps of a surviving document (a line of ``unit-N.jsonl``)."""
    return {"text": text, "where": where, "extra": extra, "lang": lang,
            "score": None if score is None else round(score, 4),
            "key": dedup.exact_key(text) if cfg.exact_dedup.enabled else None}


def output_record(d: Dict[str, Any], cfg: CleanConfig, perplexity: Optional[float] = None) -> str:
    """The output line of a kept :func:`unit_record` (the input object, cleaned text, ``naohai`` metadata)."""
    meta = {"source": d["where"], "lang": d["lang"], "lang_score": d["score"]}
    if perplexity is not None:
        meta["perplexity"] = round(perplexity, 4)
    rec = dict(d["extra"] or {})
    rec[cfg.text_key] = d["text"]
    rec["naohai"] = meta
    return json.dumps(rec, ensure_ascii=False) + "\n"


def position(where: str, file_index: Dict[str, int]) -> tuple:
    """(input file number, line) of a document's ``path:line``: its place in the input."""
    path, line = where.rsplit(":", 1)
    return file_index[path], int(line)


def process_unit(unit: int, batch: List[tuple], work_dir: str) -> int:
    """Run the per-document steps on one unit and write its three files; returns the unit index."""
    cfg = _MODELS.cfg
    kept, steps = filter_documents(batch, _MODELS)

    base = os.path.join(work_dir, f"unit-{unit:06d}")
    texts = [k[0] for k in kept]

    def write_docs(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            for k in kept:
                fh.write(json.dumps(unit_record(*k, cfg), ensure_ascii=False) + "\n")

    def write_sigs(tmp):
        sigs = dedup.signatures(texts, cfg.near_dedup) if cfg.near_dedup.enabled else np.zeros((len(texts), 0),
                                                                                                np.uint32)
        with open(tmp, "wb") as fh:
            np.save(fh, sigs)

    def write_stats(tmp):
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({"docs": len(batch), "kept": len(kept),
                       "steps": {k: v.s.as_dict() for k, v in steps.items()}}, fh, ensure_ascii=False)

    atomic_write(base + ".jsonl", write_docs)
    atomic_write(base + ".npy", write_sigs)
    atomic_write(base + ".json", write_stats)
    return unit


# --------------------------------------------------------------------------- the run
def _plan(files: Sequence[str], cfg: CleanConfig, stamps: Optional[List[list]] = None) -> Dict[str, Any]:
    """What a run folder was made for; ``stamps`` the inputs' fingerprints where they are not local files."""
    return {"format": FORMAT, "config": cfg.to_dict(), "inputs": fingerprint(files) if stamps is None else stamps}


class _Problems:
    def __init__(self):
        self.total = 0
        self.by_file: Dict[str, int] = collections.Counter()
        self.listed: List[Dict[str, str]] = []

    def add(self, p: Problem) -> None:
        self.total += 1
        self.by_file[p.where.rsplit(":", 1)[0]] += 1
        if len(self.listed) < MAX_PROBLEMS_LISTED:
            self.listed.append({"where": p.where, "reason": p.reason})

    def as_dict(self) -> Dict[str, Any]:
        return {"total": self.total, "by_file": dict(self.by_file), "listed": self.listed}


def _bar(total, desc, enabled, unit="doc"):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _stage1(files, cfg: CleanConfig, work: str, workers: int, progress: bool):
    global _MODELS
    _MODELS = _Models(cfg)   # loaded before forking: workers inherit them; bad paths fail here
    if cfg.quality.enabled and workers > 1:
        quality.load_segmenter()     # jieba's dictionary, once for all workers
    problems = _Problems()
    read = StepStats()
    units = 0
    pool = None
    if workers > 1:
        from naohai.interrupt import die_with_parent     # workers end with this process, however it ends
        pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                      initializer=die_with_parent, initargs=(signal.SIGTERM, os.getpid()))
    pending: collections.deque = collections.deque()

    def submit(unit, batch):
        if os.path.exists(os.path.join(work, f"unit-{unit:06d}.json")):
            return
        if pool is None:
            process_unit(unit, batch, work)
            return
        pending.append(pool.submit(process_unit, unit, batch, work))
        while len(pending) > 2 * workers:
            pending.popleft().result()

    # the models out of the garbage collector's sight while the documents go through (the pool forks its workers
    # on the first submit): the collections of the oldest generation that the steps' allocations set off walked
    # them each time (2 workers, the 50 MB corpus of run/bench_clean.py: 3 to 5% of the run's CPU and wall time,
    # measured on this project's 2-core VM)
    gc.collect()
    gc.freeze()
    try:
        with _bar(None, "clean: read + filter", progress) as bar:
            batch: List[tuple] = []
            for item in read_inputs(files, cfg.text_key, cfg.max_line_bytes):
                if isinstance(item, Problem):
                    problems.add(item)
                    continue
                read.docs_in += 1
                read.bytes_in += _nbytes(item.text)
                batch.append((item.text, item.where, item.extra))
                if len(batch) == cfg.batch_docs:
                    submit(units, batch)
                    units += 1
                    batch = []
                    bar.update(cfg.batch_docs)
            if batch:
                submit(units, batch)
                units += 1
                bar.update(len(batch))
            while pending:
                pending.popleft().result()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        gc.unfreeze()
    read.kept = read.docs_in
    read.bytes_out = read.bytes_in
    return units, problems, read


def _unit_perplexities(work: str, u: int, texts: List[str], lm, batch: int) -> np.ndarray:
    """Perplexities of a unit's dedup survivors, computed once and kept in ``unit-N.ppl-MODELHASH.npy`` (the
    survivors of a unit are the same on every run of the same plan; the file name carries a hash of the
    model's identity, so a run folder with a newer checkpoint is scored anew)."""
    import hashlib

    from naohai.data.score import perplexities, score_ids
    key = hashlib.blake2b(json.dumps(lm.describe, sort_keys=True).encode(), digest_size=6).hexdigest()
    path = os.path.join(work, f"unit-{u:06d}.ppl-{key}.npy")
    if os.path.exists(path):
        ppl = np.load(path)
        if len(ppl) == len(texts):
            return ppl
    ppl = perplexities(score_ids(lm.encode_batch(texts), lm, batch)) if texts else np.zeros(0)

    def write(tmp):
        with open(tmp, "wb") as fh:
            np.save(fh, ppl)
    atomic_write(path, write)
    return ppl


def _load_unit(work: str, u: int):
    base = os.path.join(work, f"unit-{u:06d}")
    with open(base + ".jsonl", "r", encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    return docs, np.load(base + ".npy")


def _duplicates(work: str, units: int, cfg: CleanConfig, file_index: Dict[str, int]):
    """The documents the two dedup steps drop, by (unit, index): (exact, near) -- each the set of those that are
    not their group's representative (:mod:`~naohai.data.dedup`: the smallest order key)."""
    where: List[tuple] = []                      # (unit, i, exact key, order key) per document
    for u in range(units):
        docs, _ = _load_unit(work, u)
        for i, d in enumerate(docs):
            where.append((u, i, d["key"], dedup.order_key(d["text"], *position(d["where"], file_index))))
    best = dedup.exact_keepers((key, order) for _, _, key, order in where) if cfg.exact_dedup.enabled else {}
    exact = {(u, i) for u, i, key, order in where if cfg.exact_dedup.enabled and best[key] != order}
    near: set = set()
    if cfg.near_dedup.enabled:
        keys, sigs, ids = [], [], []
        for u in range(units):
            _, unit_sigs = _load_unit(work, u)
            for i, sig in enumerate(unit_sigs):
                if (u, i) not in exact:
                    sigs.append(sig)
                    ids.append((u, i))
        keys = [order for u, i, key, order in where if (u, i) not in exact]
        dropped = dedup.near_duplicates(keys, np.stack(sigs) if sigs else np.zeros((0, cfg.near_dedup.num_perm),
                                                                                      np.uint32), cfg.near_dedup)
        near = {ids[j] for j, k in enumerate(keys) if k in dropped}
    return exact, near


def _dedup_drops(doc, key, dedups) -> bool:
    """Whether a deduplication step drops ``doc`` (its place ``key`` is in that step's duplicates); each
    step that sees it counts it, the first that drops it records why."""
    text, where = doc["text"], doc["where"]
    for step, dups, reason in dedups:
        step.seen(text)
        if key in dups:
            step.drop(where, reason, text)
            return True
        step.keep(text, text, where)
    return False


NO_SCORED_TOKENS = "no scored tokens"


def perplexity_drop_reason(p: float, limit: float) -> Optional[str]:
    """Why the perplexity step drops a document of perplexity ``p`` (None: it is kept); both engines'."""
    if not np.isfinite(p):
        return NO_SCORED_TOKENS
    return f"perplexity > {limit:g}" if p > limit else None


def _stage2(out_dir: str, work: str, units: int, cfg: CleanConfig, files: Sequence[str], progress: bool, lm=None):
    steps = {name: StepStats() for name in STEPS}
    ex, near, per = _Step(cfg.samples), _Step(cfg.samples), _Step(cfg.samples)
    exact_dups, near_dups = _duplicates(work, units, cfg, {f: i for i, f in enumerate(files)})
    dedups = [(step, dups, reason) for on, step, dups, reason in (
        (cfg.exact_dedup.enabled, ex, exact_dups, "exact duplicate"),
        (cfg.near_dedup.enabled, near, near_dups, "near duplicate")) if on]
    scored: List[float] = []
    remove_outputs(out_dir)                 # shards of an interrupted stage 2 (no report yet)
    shard, in_shard, written, fh = 0, 0, 0, None

    def close():
        if fh is not None:
            fh.close()
            os.replace(os.path.join(out_dir, f"part-{shard:05d}.jsonl.tmp"), os.path.join(out_dir,
                                                                                      f"part-{shard:05d}.jsonl"))
    with _bar(units, "clean: deduplicate + write", progress, unit="unit") as bar:
        for u in range(units):
            with open(os.path.join(work, f"unit-{u:06d}.json"), "r", encoding="utf-8") as f:
                stats = json.load(f)
            for name, st in stats["steps"].items():
                steps[name].merge(st, cfg.samples)
            docs, _ = _load_unit(work, u)
            survivors = [d for i, d in enumerate(docs) if not _dedup_drops(d, (u, i), dedups)]
            ppl = (_unit_perplexities(work, u, [d["text"] for d in survivors], lm, cfg.perplexity.batch)
                   if lm is not None else None)
            for i, d in enumerate(survivors):
                text, where = d["text"], d["where"]
                p = None
                if ppl is not None:
                    p = float(ppl[i])
                    per.seen(text)
                    if np.isfinite(p):
                        scored.append(p)
                    reason = perplexity_drop_reason(p, cfg.perplexity.max)
                    if reason is not None:
                        n = len(per.s.samples)
                        per.drop(where, reason, text)
                        if len(per.s.samples) > n and np.isfinite(p):
                            per.s.samples[-1]["perplexity"] = round(p, 4)
                        continue
                    per.keep(text, text, where)
                if fh is None:
                    fh = open(os.path.join(out_dir, f"part-{shard:05d}.jsonl.tmp"), "w", encoding="utf-8")
                fh.write(output_record(d, cfg, p))
                written += 1
                in_shard += 1
                if in_shard == cfg.shard_docs:
                    close()
                    fh, shard, in_shard = None, shard + 1, 0
            bar.update(1)
    close()
    steps["exact_dedup"] = ex.s
    steps["near_dedup"] = near.s
    steps["perplexity"] = per.s
    return steps, written, shard + (1 if in_shard else 0), np.asarray(scored)


def clean(inputs: Sequence[str], out_dir: str, cfg: CleanConfig, *, workers: Optional[int] = None,
          progress: bool = True, restart: bool = False, lm_factory: Optional[Callable[[], Any]] = None
          ) -> Dict[str, Any]:
    """Clean ``inputs`` into ``out_dir`` (resuming an interrupted run); returns the report.

    ``lm_factory() -> naohai.data.score.LM`` loads the model of the ``perplexity`` step (needed when it is
    enabled; ``naohai.commands.data.load_scorer`` builds one from a checkpoint)."""
    if cfg.perplexity.enabled and lm_factory is None:
        raise ValueError("the perplexity step is enabled: pass lm_factory")
    files = resolve_inputs(inputs)
    out_dir = os.path.abspath(out_dir)
    plan = _plan(files, cfg)
    work = prepare_run_dir(out_dir, plan, restart, "naohai data clean",
                           "a clean run with another config or other inputs (changed files?)", inputs, files)
    done = finished_report(out_dir)
    if done is not None:
        return done
    workers = max(1, int(workers or os.cpu_count() or 1))
    units, problems, read = _stage1(files, cfg, work, workers, progress)
    lm = lm_factory() if cfg.perplexity.enabled else None   # after the workers: no model in forked processes
    steps, written, shards, scored = _stage2(out_dir, work, units, cfg, files, progress, lm)
    report = make_report(files, cfg, read, problems, steps, written, shards, out_dir,
                         lm.describe if lm is not None else None, _quantiles(scored) if lm is not None else None)
    write_report(out_dir, report)
    return report


def make_report(files, cfg: CleanConfig, read: StepStats, problems: "_Problems", steps: Dict[str, StepStats],
                written: int, shards: int, out_dir: str, model=None,
                quantiles: Optional[Dict[str, float]] = None) -> Dict[str, Any]:
    """``report.json`` of a finished run (both engines); ``model`` and ``quantiles`` describe the perplexity
    step when it ran."""
    enabled = {name: getattr(cfg, name).enabled for name in STEPS}
    report = {
        "format": FORMAT,
        "inputs": [f for f in files],
        "config": cfg.to_dict(),
        "read": {**read.as_dict(), "problems": problems.as_dict()},
        "steps": {name: ({**steps[name].as_dict(), "enabled": True} if enabled[name] else {"enabled": False})
                  for name in STEPS},
        "output": {"documents": written, "shards": shards,
                   "bytes": sum(os.path.getsize(p) for p in output_files(out_dir))},
        "perplexity": ({"model": model, "max": cfg.perplexity.max, "quantiles": quantiles}
                       if model is not None else None),
        "lsh": ({"bands": dedup.lsh_params(cfg.near_dedup)[0], "rows": dedup.lsh_params(cfg.near_dedup)[1]}
                if cfg.near_dedup.enabled else None),
    }
    report["warnings"] = drop_warnings(report)
    return report


def _setting(step: str, reason: str) -> str:
    """The config key behind a drop reason of ``step``."""
    if step == "quality":
        if reason == "mean_word_length":
            return "quality.min_mean_word_length / quality.max_mean_word_length"
        if reason.startswith("top_"):
            return "quality.max_top_ngram_chars"
        if reason.startswith("duplicate_") and reason.endswith("gram_chars"):
            return "quality.max_duplicate_ngram_chars"
        if reason == "blocklist":
            return "quality.blocklist / quality.max_blocklist_hits"
        return f"quality.{reason}"
    if step == "language":
        return "language.min_score" if reason.startswith("score") else "language.keep"
    return {"normalize": "normalize (the documents are empty once normalised)",
            "classifier": "classifier.threshold / classifier.drop_labels",
            "exact_dedup": "exact_dedup.enabled", "near_dedup": "near_dedup.threshold",
            "perplexity": "perplexity.max"}.get(step, step)


def drop_warnings(report: Dict[str, Any]) -> List[str]:
    """One line per step that dropped more than half of its input, naming the setting behind its main reason
    (and one when most input lines were malformed)."""
    out = []
    r = report["read"]
    bad = r["problems"]["total"]
    if bad > r["docs_in"]:
        out.append(f"read: {bad} of {bad + r['docs_in']} input lines are malformed (see report.json "
                   f"read.problems); is text_key ({report['config']['text_key']!r}) the key of the text?")
    for name, s in report["steps"].items():
        if not s.get("enabled") or not s["docs_in"] or 2 * s["dropped"] <= s["docs_in"]:
            continue
        drops = {k: v for k, v in s["reasons"].items() if not k.endswith(" replaced") and k != "changed"}
        top = max(sorted(drops), key=lambda k: drops[k]) if drops else ""
        share = 100 * s["dropped"] / s["docs_in"]
        said = reason_words(name, top, drops[top], report.get("config", {})) if top else ""
        out.append(f"{name}: dropped {s['dropped']} of {s['docs_in']} documents ({share:.0f}%)"
                   + (f", {said}" if top else "")
                   + (f"; check {_setting(name, top)}" if top and f"({_setting(name, top)})" not in said else ""))
    return out


def output_files(out_dir: str) -> List[str]:
    """The cleaned shards of a finished run, in order."""
    return sorted(glob.glob(os.path.join(glob.escape(out_dir), "part-*.jsonl")))


def human_size(n: float) -> str:
    """Bytes with the unit that fits (decimal: 1 KB = 1000 B): '512 B', '3.4 KB', '12.0 MB', '1.25 GB'."""
    if n < 1000:
        return f"{int(n)} B"
    for unit, scale in (("KB", 1e3), ("MB", 1e6), ("GB", 1e9)):
        value = n / scale
        text = f"{value:.2f}" if value < 10 else f"{value:.1f}"
        if float(text) < 1000 or unit == "GB":
            return f"{text} {unit}"
    raise AssertionError("unreachable")


# quality rules in words: (what a dropped document was, the config key(s) holding its limit)
_QUALITY_WORDS = {
    "min_chars": ("shorter than {min_chars} characters", "quality.min_chars"),
    "max_chars": ("longer than {max_chars} characters", "quality.max_chars"),
    "min_words": ("with fewer than {min_words} words", "quality.min_words"),
    "max_words": ("with more than {max_words} words", "quality.max_words"),
    "mean_word_length": ("with mean word length outside {min_mean_word_length}-{max_mean_word_length} characters",
                         "quality.min_mean_word_length / max_mean_word_length"),
    "min_alpha_words": ("with under {min_alpha_words:.0%} of words with a letter", "quality.min_alpha_words"),
    "min_stop_words": ("with fewer than {min_stop_words} English stop words", "quality.min_stop_words"),
    "max_digit_ratio": ("with over {max_digit_ratio:.0%} digits", "quality.max_digit_ratio"),
    "max_garbage_ratio": ("with over {max_garbage_ratio:.0%} unreadable characters", "quality.max_garbage_ratio"),
    "zh_min_cjk_ratio": ("with under {zh_min_cjk_ratio:.0%} Chinese characters", "quality.zh_min_cjk_ratio"),
    "max_symbol_word_ratio": ("with over {max_symbol_word_ratio} '#' or '...' per word", "quality.max_symbol_word_ratio"),
    "max_bullet_lines": ("with over {max_bullet_lines:.0%} of lines bulleted", "quality.max_bullet_lines"),
    "max_ellipsis_lines": ("with over {max_ellipsis_lines:.0%} of lines ending in '...'", "quality.max_ellipsis_lines"),
    "max_duplicate_lines": ("with over {max_duplicate_lines:.0%} of lines repeated", "quality.max_duplicate_lines"),
    "max_duplicate_paragraphs": ("with over {max_duplicate_paragraphs:.0%} of paragraphs repeated",
                                 "quality.max_duplicate_paragraphs"),
    "max_duplicate_line_chars": ("with over {max_duplicate_line_chars:.0%} of characters in repeated lines",
                                 "quality.max_duplicate_line_chars"),
    "max_duplicate_paragraph_chars": ("with over {max_duplicate_paragraph_chars:.0%} of characters in repeated "
                                      "paragraphs", "quality.max_duplicate_paragraph_chars"),
    "blocklist": ("with more than {max_blocklist_hits} blocklist hits", "quality.blocklist / max_blocklist_hits"),
}


def reason_words(step: str, reason: str, count: int, config: Dict[str, Any]) -> str:
    """One reason of the report in words, its document (or replacement) count first: a quality rule
    says what the documents had and the setting that holds the limit, e.g. '20 with fewer than 50 words
    (quality.min_words)'."""
    q = config.get("quality", {})
    if step == "quality" and reason in _QUALITY_WORDS:
        text, key = _QUALITY_WORDS[reason]
        try:
            return f"{count} {text.format(**q)} ({key})"
        except (KeyError, ValueError, TypeError):
            return f"{count} broke {key}"
    gram = re.fullmatch(r"(top|duplicate)_(\d+)gram_chars", reason) if step == "quality" else None
    if gram:
        kind, n = gram.group(1), int(gram.group(2))
        key = f"max_{kind}_ngram_chars"
        limit = {int(k): v for k, v in (q.get(key) or {}).items()}.get(n)
        what = "the most frequent" if kind == "top" else "repeated"
        share = f"over {limit:.0%}" if isinstance(limit, (int, float)) else "too many"
        return f"{count} with {share} of characters in {what} {n}-word sequences (quality.{key})"
    return f"{count} {reason}"


def report_table(report: Dict[str, Any]) -> str:
    """The report as a fixed-width table, one row per step; sizes with a unit that fits, reasons in
    words with their counts first."""
    config = report.get("config", {})
    rows = [("step", "docs in", "size in", "kept", "dropped", "changed", "size out", "top reasons (documents)")]
    r = report["read"]
    rows.append(("read", r["docs_in"], human_size(r["bytes_in"]), r["kept"], r["problems"]["total"], 0,
                 human_size(r["bytes_out"]), f"{r['problems']['total']} malformed lines"))
    for name, s in report["steps"].items():
        if not s.get("enabled"):
            rows.append((name, "-", "-", "-", "-", "-", "-", "off"))
            continue
        top = "; ".join(reason_words(name, k, v, config)
                        for k, v in sorted(s["reasons"].items(), key=lambda kv: -kv[1])[:3])
        rows.append((name, s["docs_in"], human_size(s["bytes_in"]), s["kept"], s["dropped"], s["changed"],
                     human_size(s["bytes_out"]), top))
    widths = [max(len(str(row[i])) for row in rows) for i in range(7)]
    lines = ["  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(row[:7], widths)))
             + "  " + str(row[7]) for row in rows]
    o = report["output"]
    lines.append(f"output: {o['documents']} documents in {o['shards']} shards, {human_size(o['bytes'])}")
    lines.extend(f"warning: {w}" for w in report.get("warnings", []))
    return "\n".join(lines)
