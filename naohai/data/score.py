"""`naohai data score`: perplexity of each document under a language model, and a filter on it.

A document's token ids (its tokenizer's encoding) are scored as training sees them
after the previous document's EOD: the sequence ``[EOD] + ids + [EOD]``.  Its
predictions are cut into windows of ``seq_length`` (the model's): window k holds
ids ``k*s .. k*s + s`` (``s + 1`` ids, so consecutive windows share one id and every
prediction is made once); a last short window is padded and the padding masked.
A prediction counts unless its input is the model's ``loss_pad_id`` (the references'
mask, as :func:`naohai.evaluate.evaluate` applies it).  The document's mean NLL is
the mean over all its counted predictions across windows, its perplexity
``exp(mean NLL)``.  Windows of many documents go through the model together,
``batch`` at a time (a last batch is filled with padding windows, so every call has
one shape).

The model is an argument (:class:`LM`: an NLL function over id windows plus the token
ids), so this module holds no model code; ``naohai data score`` builds it from a
checkpoint (:func:`naohai.checkpoint.weights.load_model`, :func:`naohai.evaluate.token_nll_fn`).

How it runs, in the manner of :mod:`naohai.data.clean`
    Pass 1 streams the inputs (:mod:`~naohai.data.reader`) in units of ``unit_docs``
    documents and writes each unit's ``[nll sum, counted tokens]`` to
    ``.work/unit-N.npy`` (renamed into place, so a unit is complete or absent).  Pass 2
    derives the threshold (``max_perplexity``, or the perplexity quantile that keeps
    ``keep_fraction`` of the scored documents; neither: keep all), streams the inputs
    again and writes the kept records to ``part-NNNNN.jsonl`` with ``perplexity`` added
    to their ``naohai`` metadata dict, then ``report.json``.  A second run with the same
    plan (inputs, model, settings) skips the units it has and redoes pass 2; a finished
    run is not redone; another plan is refused unless ``restart``; a non-empty directory
    that holds no score run is never written into, nor one that overlaps the inputs
    (:func:`~naohai.data.rundir.input_overlap`).  A folder input leaves hidden entries out, so
    a `data clean` output folder is scored once, not again from its ``.work/`` copies.
    Malformed input lines are counted and listed with file and line, never fatal.
"""
from __future__ import annotations

import glob
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from naohai.data.reader import Problem, fingerprint, read_inputs, resolve_inputs
from naohai.data.rundir import atomic_write, finished_report, prepare_run_dir, remove_outputs, write_report
from naohai.errors import UserError

#: windows per model call (``--batch``): every call is padded to it, so it is allocated whole; 4096 is far above
#: what pays off, and a larger number (1e8 tried to allocate 96 GiB) is a typo
MAX_BATCH = 4096

FORMAT = "naohai-score-v1"
QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)
_EXCERPT = 300
_MAX_PROBLEMS_LISTED = 1000


@dataclass
class LM:
    """What scoring needs of a model: ``nll(windows [b, s + 1]) -> [b, s]`` per-prediction NLL, its
    window length, the token ids, and a text encoder."""
    nll: Callable[[np.ndarray], np.ndarray]
    encode_batch: Callable[[List[str]], List[List[int]]]
    seq_length: int
    eod_id: int
    pad_id: int
    loss_pad_id: Optional[int]
    describe: Dict[str, Any]             # model / tokenizer identity, recorded in the plan and the report


@dataclass
class ScoreSettings:
    text_key: str = "text"
    max_perplexity: Optional[float] = None
    keep_fraction: Optional[float] = None
    batch: int = 8                       # windows per model call
    unit_docs: int = 1000                # documents per work unit (the resume granularity)
    shard_docs: int = 100_000
    samples: int = 10
    max_line_bytes: int = 16 * 1024 * 1024

    def validate(self, where: str = "command line") -> "ScoreSettings":
        if self.max_perplexity is not None and self.keep_fraction is not None:
            raise UserError("give --max-perplexity or --keep-fraction, not both", where=where)
        if self.max_perplexity is not None and not (math.isfinite(self.max_perplexity)
                                                    and 1.0 <= self.max_perplexity <= 1e12):
            raise UserError(f"must be a finite number in [1, 1e12] (a perplexity is at least 1), got "
                            f"{self.max_perplexity}", where=where, key="--max-perplexity")
        if self.keep_fraction is not None and not (math.isfinite(self.keep_fraction)
                                                   and 0.0 < self.keep_fraction <= 1.0):
            raise UserError(f"must be in (0, 1], got {self.keep_fraction}", where=where, key="--keep-fraction")
        for key, low, high, shown in (("batch", 1, MAX_BATCH, str(MAX_BATCH)), ("unit_docs", 1, 10 ** 9, "1e9"),
                                      ("shard_docs", 1, 10 ** 9, "1e9"), ("samples", 0, 10 ** 9, "1e9")):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or not (low <= value <= high):
                raise UserError(f"must be an integer in [{low}, {shown}], got {value}", where=where,
                                key="--" + key.replace("_", "-"), rule=f"{low} <= {key} <= {shown}")
        return self


# --------------------------------------------------------------------------- the arithmetic
def doc_windows(ids: Sequence[int], lm: LM) -> Tuple[np.ndarray, np.ndarray]:
    """(windows [n, s + 1] int64, counted [n, s] bool) for one document's ids (without EODs)."""
    seq = np.concatenate([[lm.eod_id], np.asarray(ids, np.int64), [lm.eod_id]]).astype(np.int64)
    s = lm.seq_length
    preds = len(seq) - 1
    n = -(-preds // s)
    windows = np.full((n, s + 1), lm.pad_id, np.int64)
    counted = np.zeros((n, s), bool)
    for k in range(n):
        part = seq[k * s: k * s + s + 1]
        windows[k, :len(part)] = part
        counted[k, :len(part) - 1] = True
    if lm.loss_pad_id is not None:
        counted &= windows[:, :-1] != lm.loss_pad_id
    return windows, counted


def score_ids(docs: Sequence[Sequence[int]], lm: LM, batch: int) -> np.ndarray:
    """[len(docs), 2] float64: each document's summed NLL over its counted predictions, and their number."""
    out = np.zeros((len(docs), 2), np.float64)
    pending: List[Tuple[int, np.ndarray, np.ndarray]] = []

    def flush():
        w = np.stack([p[1] for p in pending])
        if len(w) < batch:                      # one shape per call: fill with padding windows
            w = np.concatenate([w, np.full((batch - len(w), w.shape[1]), lm.pad_id, np.int64)])
        nll = np.asarray(lm.nll(w), np.float64)
        for row, (d, _, counted) in enumerate(pending):
            out[d, 0] += float(nll[row][counted].sum())
            out[d, 1] += int(counted.sum())
        pending.clear()

    for d, ids in enumerate(docs):
        windows, counted = doc_windows(ids, lm)
        for w, c in zip(windows, counted):
            if not c.any():
                continue
            pending.append((d, w, c))
            if len(pending) == batch:
                flush()
    if pending:
        flush()
    return out


def perplexities(scores: np.ndarray) -> np.ndarray:
    """exp(mean NLL) per row of :func:`score_ids`; NaN where nothing was counted."""
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = scores[:, 0] / scores[:, 1]
    return np.where(scores[:, 1] > 0, np.exp(np.minimum(mean, 700.0)), np.nan)


def threshold_for(ppl: np.ndarray, settings: ScoreSettings) -> Optional[float]:
    """The largest perplexity kept: ``max_perplexity``, or the smallest value at or under which
    ``keep_fraction`` of the scored documents lie; None = keep every scored document."""
    if settings.max_perplexity is not None:
        return float(settings.max_perplexity)
    if settings.keep_fraction is None:
        return None
    finite = np.sort(ppl[np.isfinite(ppl)])
    if not len(finite):
        return None
    k = max(1, int(math.ceil(settings.keep_fraction * len(finite) - 1e-9)))
    return float(finite[k - 1])


# --------------------------------------------------------------------------- the run
def _bar(total, desc, enabled, unit="doc"):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def _plan(files: Sequence[str], lm: LM, settings: ScoreSettings) -> Dict[str, Any]:
    return {"format": FORMAT, "inputs": fingerprint(files), "model": lm.describe,
            "settings": {k: v for k, v in asdict(settings).items() if k not in ("samples",)}}


def _records(files, settings) -> Iterator[Any]:
    return read_inputs(files, settings.text_key, settings.max_line_bytes)


def _pass1(files, lm: LM, settings: ScoreSettings, work: str, progress: bool) -> int:
    units = 0
    texts: List[str] = []

    def run_unit(u, batch_texts):
        path = os.path.join(work, f"unit-{u:06d}.npy")
        if os.path.exists(path):
            return
        scores = score_ids(lm.encode_batch(batch_texts), lm, settings.batch)

        def write(tmp):
            with open(tmp, "wb") as fh:
                np.save(fh, scores)
        atomic_write(path, write)

    with _bar(None, "score: model", progress) as bar:
        for item in _records(files, settings):
            if isinstance(item, Problem):
                continue
            texts.append(item.text)
            if len(texts) == settings.unit_docs:
                run_unit(units, texts)
                units, texts = units + 1, []
                bar.update(settings.unit_docs)
        if texts:
            run_unit(units, texts)
            units += 1
            bar.update(len(texts))
    return units


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8"))


def quantiles(ppl: np.ndarray) -> Dict[str, float]:
    """{'p0': min, 'p1', ..., 'p50': median, ..., 'p100': max} of the finite values."""
    finite = ppl[np.isfinite(ppl)]
    if not len(finite):
        return {}
    return {f"p{round(q * 100):g}": round(float(np.quantile(finite, q)), 4) for q in QUANTILES}


def score(inputs: Sequence[str], out_dir: str, lm: LM, settings: ScoreSettings, *, progress: bool = True,
          restart: bool = False) -> Dict[str, Any]:
    """Score ``inputs`` with ``lm`` and write the kept documents to ``out_dir``; returns the report."""
    settings.validate()
    files = resolve_inputs(inputs)
    out_dir = os.path.abspath(out_dir)
    work = prepare_run_dir(out_dir, _plan(files, lm, settings), restart, "naohai data score",
                           "a score run with other inputs, another model or other settings", inputs, files)
    done = finished_report(out_dir)
    if done is not None:
        return done
    units = _pass1(files, lm, settings, work, progress)
    scores = (np.concatenate([np.load(os.path.join(work, f"unit-{u:06d}.npy")) for u in range(units)])
              if units else np.zeros((0, 2)))
    ppl = perplexities(scores)
    limit = threshold_for(ppl, settings)

    remove_outputs(out_dir)
    problems = {"total": 0, "by_file": {}, "listed": []}
    stats = {"docs_in": 0, "bytes_in": 0, "kept": 0, "dropped": 0, "bytes_out": 0, "reasons": {}, "samples": []}
    shard, in_shard, fh = 0, 0, None

    def close():
        if fh is not None:
            fh.close()
            os.replace(os.path.join(out_dir, f"part-{shard:05d}.jsonl.tmp"),
                       os.path.join(out_dir, f"part-{shard:05d}.jsonl"))

    def drop(reason, item, p):
        stats["dropped"] += 1
        stats["reasons"][reason] = stats["reasons"].get(reason, 0) + 1
        if len(stats["samples"]) < settings.samples:
            stats["samples"].append({"where": item.where, "perplexity": None if not math.isfinite(p) else
                                     round(p, 4), "text": item.text[:_EXCERPT]})

    doc = 0
    with _bar(len(ppl), "score: write", progress) as bar:
        for item in _records(files, settings):
            if isinstance(item, Problem):
                problems["total"] += 1
                f = item.where.rsplit(":", 1)[0]
                problems["by_file"][f] = problems["by_file"].get(f, 0) + 1
                if len(problems["listed"]) < _MAX_PROBLEMS_LISTED:
                    problems["listed"].append({"where": item.where, "reason": item.reason})
                continue
            if doc >= len(ppl):
                raise UserError("changed while it was being scored (more documents than in pass 1); run again",
                                where=item.where.rsplit(":", 1)[0])
            p = float(ppl[doc])
            doc += 1
            bar.update(1)
            stats["docs_in"] += 1
            stats["bytes_in"] += _nbytes(item.text)
            if not math.isfinite(p):
                drop("no scored tokens", item, p)
                continue
            if limit is not None and p > limit:
                drop(f"perplexity > {limit:.4g}", item, p)
                continue
            rec = {k: v for k, v in (item.extra or {}).items() if k != "naohai"}
            rec[settings.text_key] = item.text
            meta = (item.extra or {}).get("naohai")
            rec["naohai"] = {**(meta if isinstance(meta, dict) else {}), "perplexity": round(p, 4)}
            if fh is None:
                fh = open(os.path.join(out_dir, f"part-{shard:05d}.jsonl.tmp"), "w", encoding="utf-8")
            fh.write(json.dumps(rec, ensure_ascii=False) + "\n")
            stats["kept"] += 1
            stats["bytes_out"] += _nbytes(item.text)
            in_shard += 1
            if in_shard == settings.shard_docs:
                close()
                fh, shard, in_shard = None, shard + 1, 0
    close()
    shards = shard + (1 if in_shard else 0)
    report = {
        "format": FORMAT,
        "inputs": list(files),
        "model": lm.describe,
        "settings": asdict(settings),
        "threshold": limit,
        "read": {"problems": problems},
        "score": {**stats, "tokens": int(scores[:, 1].sum()) if len(scores) else 0,
                  "perplexity": quantiles(ppl),
                  "kept_perplexity": quantiles(ppl[np.isfinite(ppl) & (ppl <= (limit if limit is not None
                                                                                   else np.inf))])},
        "output": {"documents": stats["kept"], "shards": shards,
                   "bytes": sum(os.path.getsize(p)
                                for p in glob.glob(os.path.join(glob.escape(out_dir), "part-*.jsonl")))},
    }
    write_report(out_dir, report)
    return report


def report_table(report: Dict[str, Any]) -> str:
    """The report as a few printed lines: counts, threshold, perplexity quantiles, dropped samples."""
    s = report["score"]
    mb = lambda n: f"{n / 1e6:.2f}"  # noqa: E731
    rows = [("docs in", "MB in", "kept", "dropped", "MB out", "malformed lines"),
            (s["docs_in"], mb(s["bytes_in"]), s["kept"], s["dropped"], mb(s["bytes_out"]),
             report["read"]["problems"]["total"])]
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in rows]
    t = report["threshold"]
    lines.append("threshold: " + ("none (every scored document kept)" if t is None else f"perplexity <= {t:.4g}"))
    for name in ("perplexity", "kept_perplexity"):
        q = s[name]
        if q:
            lines.append(f"{name.replace('_', ' ')}: " + "  ".join(f"{k} {v:.4g}" for k, v in q.items()))
    for k, v in sorted(s["reasons"].items(), key=lambda kv: -kv[1]):
        lines.append(f"dropped: {k}: {v}")
    for smp in s["samples"][:3]:
        text = " ".join(smp["text"].split())[:80]
        lines.append(f"  e.g. {smp['where']} (perplexity {smp['perplexity']}): {text}")
    o = report["output"]
    lines.append(f"output: {o['documents']} documents in {o['shards']} shards, {mb(o['bytes'])} MB")
    return "\n".join(lines)
