"""Benchmark `naohai data clean`: MB/s per step on this machine, and near-dedup time at 1x / 2x / 4x size.

Corpus: the pydoc topics and fortunes-zh entries, with each copy of the corpus lightly
edited (so deduplication has work that grows with size rather than dropping whole
copies), and in each copy one document in ten replaced by a near-duplicate (1% of its
characters changed) of an earlier document of that copy, so the near-dedup figures
include finding and dropping duplicates.  Per-step figures time each step's function
on one core over the same documents; the end-to-end figure is the whole `clean` with
all cores.  With ``--model RUN`` the perplexity step (`naohai data score`) is timed too.

    python run/bench_clean.py [--base-docs 2000] [--workers N] [--model RUN [--score-docs 200]]

``--engine spark`` compares the engines instead: the local engine with ``--workers``
against the Spark engine on each of ``--masters`` (local[1],local[2],local[4]), end to
end over a generated corpus of ``--size-mb`` MB in ``--files`` files (each copy of the
pydoc / fortunes-zh documents lightly edited, 10% near-duplicates at 1% edits and 3% exact
copies with changed case and spacing), with Spark's seconds per phase and shuffle bytes,
and checks that every engine wrote the same shards and report.  ``--near-scale N`` times
near dedup alone (the other steps off) on N generated documents with planted
near-duplicate clusters at 1%, 3% and 5% character edits, both engines, and states
recall and precision against the plan:

    python run/bench_clean.py --engine spark --size-mb 50 [--masters local[2]] [--files 8] [--split-mb MB] [--rounds 3]
    python run/bench_clean.py --engine spark --near-scale 200000
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import string
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from naohai.data import dedup, normalize, pii, quality  # noqa: E402
from naohai.data.clean import clean  # noqa: E402
from naohai.data.clean_config import CleanConfig  # noqa: E402
from naohai.data.corpus import fortunes_documents, pydoc_documents  # noqa: E402
from naohai.data.fasttext_models import LanguageIdentifier  # noqa: E402


def _edit(text: str, every: int, rng: random.Random) -> str:
    chars = list(text)
    for i in rng.sample(range(len(chars)), max(1, len(chars) // every)):
        chars[i] = rng.choice(string.ascii_letters)
    return "".join(chars)


def corpus(n: int, copy: int):
    rng = random.Random(copy)
    base = list(pydoc_documents()) + [d for d in fortunes_documents() if len(d) > 100]
    docs = list(itertools.islice(itertools.cycle(base), n))
    # edit ~5% of characters: distinct from every other copy at J well under 0.8
    out = [_edit(d, 20, rng) for d in docs]
    for i in rng.sample(range(1, n), n // 10):    # planted near-duplicates of earlier documents (J ~ 0.9)
        out[i] = _edit(out[rng.randrange(i)], 100, rng)
    return out


def mbps(nbytes, seconds):
    return nbytes / 1e6 / seconds


def _positive(text: str) -> int:
    n = int(text) if text.strip().lstrip("-").isdigit() else 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-docs", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--model", default=None, help="a naohai run / checkpoint folder: time the perplexity step")
    ap.add_argument("--score-docs", type=int, default=200, help="documents the perplexity step is timed on")
    ap.add_argument("--engine", choices=("local", "spark"), default="local",
                    help="spark: compare the engines end to end (see the docstring)")
    ap.add_argument("--size-mb", type=float, default=50.0, help="--engine spark: corpus size")
    ap.add_argument("--files", type=int, default=8, help="--engine spark: input files (one Spark task each)")
    ap.add_argument("--masters", default="local[1],local[2],local[4]", help="--engine spark: Spark masters")
    ap.add_argument("--split-mb", type=float, default=None,
                    help="--engine spark: byte ranges of this size are read by one task each (default: the engine's)")
    ap.add_argument("--near-scale", type=int, default=0, help="--engine spark: near dedup on N generated documents")
    ap.add_argument("--keep", default=None, help="--engine spark: keep the corpus and outputs in this folder")
    ap.add_argument("--rounds", type=_positive, default=1, help="--engine spark: rounds, the engines alternating in each (in the reverse order every other round)")
    ap.add_argument("--job", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return run_job(args.job)
    if args.engine == "spark":
        return engines(args)
    cfg = CleanConfig()
    docs = corpus(args.base_docs, 0)
    nbytes = sum(len(d.encode()) for d in docs)
    print(f"corpus: {len(docs)} documents, {nbytes / 1e6:.2f} MB; {os.cpu_count()} cores")
    lid = LanguageIdentifier()
    steps = {
        "normalize": lambda d: normalize.normalize(d, cfg.normalize),
        "language": lid.identify,
        "quality": lambda d: quality.quality_reason(d, cfg.quality, None),
        "pii": lambda d: pii.deidentify(d, cfg.pii),
        "exact_dedup (hash)": dedup.exact_key,
    }
    for name, fn in steps.items():
        t = time.perf_counter()
        for d in docs:
            fn(d)
        print(f"  {name:24s} {mbps(nbytes, time.perf_counter() - t):7.2f} MB/s (1 core)")
    t = time.perf_counter()
    sigs = dedup.signatures(docs, cfg.near_dedup)
    print(f"  {'near_dedup (MinHash)':24s} {mbps(nbytes, time.perf_counter() - t):7.2f} MB/s (1 core)")
    t = time.perf_counter()
    dedup.near_duplicates([(i,) for i in range(len(docs))], sigs, cfg.near_dedup)
    print(f"  {'near_dedup (LSH)':24s} {mbps(nbytes, time.perf_counter() - t):7.2f} MB/s (1 core)")

    if args.model:
        from naohai.commands.data import load_scorer
        from naohai.data.score import score_ids
        lm = load_scorer(args.model, device="CPU")
        few = docs[:args.score_docs]
        t = time.perf_counter()
        scores = score_ids(lm.encode_batch(few), lm, 8)
        sec = time.perf_counter() - t
        print(f"  {'perplexity (model)':24s} {mbps(sum(len(d.encode()) for d in few), sec):7.3f} MB/s "
              f"({len(few)} documents, {int(scores[:, 1].sum())} tokens, {scores[:, 1].sum() / sec:.0f} tokens/s, "
              f"seq_length {lm.seq_length}, {lm.describe['model']})")

    print("near dedup (signatures + LSH, 1 core) against corpus size:")
    for k in (1, 2, 4):
        big = [d for c in range(k) for d in corpus(args.base_docs, c)]
        t = time.perf_counter()
        dropped = len(dedup.near_duplicates([(i,) for i in range(len(big))], dedup.signatures(big, cfg.near_dedup),
                                            cfg.near_dedup))
        sec = time.perf_counter() - t
        print(f"  {k}x: {len(big)} documents, {sum(len(d.encode()) for d in big) / 1e6:.2f} MB, {sec:.2f} s "
              f"({sec / k:.2f} s per 1x), {dropped} dropped ({k * (args.base_docs // 10)} planted)")

    tmp = tempfile.mkdtemp()
    try:
        path = os.path.join(tmp, "in.jsonl")
        with open(path, "w", encoding="utf-8") as fh:
            for d in docs:
                fh.write(json.dumps({"text": d}, ensure_ascii=False) + "\n")
        t = time.perf_counter()
        clean([path], os.path.join(tmp, "out"), cfg, workers=args.workers, progress=False)
        sec = time.perf_counter() - t
        print(f"end to end, all steps, {args.workers} workers: {sec:.2f} s, {mbps(nbytes, sec):.2f} MB/s "
              f"(includes loading the models and forking)")
    finally:
        shutil.rmtree(tmp)


# --------------------------------------------------------------------------- --engine spark
def _write_files(docs, folder, files):
    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"in-{k:03d}.jsonl") for k in range(files)]
    handles = [open(p, "w", encoding="utf-8") for p in paths]
    for i, d in enumerate(docs):
        handles[i % files].write(json.dumps({"text": d, "id": i}, ensure_ascii=False) + "\n")
    for h in handles:
        h.close()
    return paths


def _exact_copy(text, rng):
    return text.upper() if text.isascii() else text.replace("\n", "\n\n") + " 。"


def engine_corpus(size_mb: float, base_docs: int):
    """Copies of the bench corpus (each lightly edited) until size_mb, 3% of documents exact copies."""
    docs, total, copy = [], 0, 0
    rng = random.Random(7)
    while total < size_mb * 1e6:
        for d in corpus(base_docs, copy):
            if total >= size_mb * 1e6:
                break
            if docs and rng.random() < 0.03:
                d = _exact_copy(docs[rng.randrange(len(docs))], rng)
            docs.append(d)
            total += len(d.encode())
        copy += 1
    return docs, total


def shuffle_bytes(sc):
    """Bytes written by shuffles over the Spark application so far (its status store)."""
    store = sc._jsc.sc().statusStore()
    defaults = [getattr(store, f"stageList$default${i}")() for i in (2, 3, 4, 5)]
    stages = store.stageList(sc._jvm.java.util.ArrayList(), *defaults)   # no status filter: every stage
    return sum(stages.apply(i).shuffleWriteBytes() for i in range(stages.size()))


def _same(a, b):
    from naohai.data.clean import output_files
    fa, fb = output_files(a), output_files(b)
    return len(fa) == len(fb) and all(open(x, "rb").read() == open(y, "rb").read() for x, y in zip(fa, fb))


def _load():
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_job(spec_path):
    """Child process of :func:`engines`: one engine over the inputs; prints a JSON line (seconds per phase,
    shuffle bytes, and for Spark the CPU seconds of this process tree when the context stops: the driver and what
    it waited for (its head start), the JVM, the Python daemon and its live workers)."""
    with open(spec_path) as fh:
        spec = json.load(fh)
    cfg = CleanConfig()
    if spec.get("dedup_only"):
        for step in ("normalize", "language", "quality", "pii"):
            getattr(cfg, step).enabled = False
    t = time.perf_counter()
    timings, shuffled, cpu = {}, 0, 0.0
    if spec["engine"] == "local":
        clean(spec["inputs"], spec["out"], cfg, workers=spec["workers"], progress=False)
    else:
        from pyspark import SparkContext

        from naohai.data import spark_driver, spark_engine
        from naohai.data.spark_engine import clean_spark
        if "driver_docs" in spec:
            spark_engine.DRIVER_DOCS = spec["driver_docs"]
        boot, stop, seen = spark_driver.spark_context, spark_driver.Boot.stop, {}

        def timed_boot(*args, **kwargs):     # clean_spark starts the JVM beside its own checks: time it there
            t0 = time.perf_counter()
            sc = boot(*args, **kwargs)
            timings["JVM start (beside the driver's checks)"] = time.perf_counter() - t0
            return sc

        def measured_stop(self):             # the shuffle bytes and the CPU of this process tree, then stop
            if self.sc is not None:
                seen.update(shuffle=shuffle_bytes(self.sc), cpu=_process_tree_cpu(os.getpid()),
                            proc=SparkContext._gateway.proc)
            stop(self)
        spark_driver.spark_context, spark_driver.Boot.stop = timed_boot, measured_stop
        _adopt_orphans()
        clean_spark(spec["inputs"], spec["out"], cfg, master=spec["master"], timings=timings,
                    split_bytes=int(spec["split_mb"] * (1 << 20)) if spec.get("split_mb") else None)
        shuffled, cpu = seen["shuffle"], seen["cpu"]
        seen["proc"].stdin.close()                   # the JVM exits when its stdin closes: wait for it
        seen["proc"].wait()
    print(json.dumps({"seconds": time.perf_counter() - t, "timings": timings, "shuffle": shuffled, "cpu": cpu}))


def _adopt_orphans() -> None:
    """Make this process the reaper of its orphaned descendants (Linux), so that the Python daemon the driver's
    zygote forked, whose parent ends after stage 1, stays in this process tree for :func:`_process_tree_cpu`."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)   # PR_SET_CHILD_SUBREAPER


def _phases(timings: dict, unit: str = "") -> str:
    """The Spark engine's phases: seconds, and the count of splits its head start ran."""
    return ", ".join(f"{k} {v:g}" if "splits" in k else f"{k} {v:.1f}{unit}" for k, v in timings.items())


def _process_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system, with their waited-for children) of ``pid`` and every live process below it,
    from /proc (0 where it cannot be read)."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict = {}
    stats: dict = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            kids.setdefault(int(f[1]), []).append(int(p))
            stats[int(p)] = sum(int(x) for x in f[11:15]) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, 0.0)
        todo += kids.get(p, [])
    return total


def _timed_job(spec, tmp):
    """Wall seconds, CPU seconds (the child and every process it waited for) and the child's JSON line."""
    import resource
    import subprocess
    path = os.path.join(tmp, "job.json")
    with open(path, "w") as fh:
        json.dump(spec, fh)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    res = subprocess.run([sys.executable, os.path.abspath(__file__), "--job", path], capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(res.stdout.strip().splitlines()[-1])


def engines(args):
    from naohai.data.spark_engine import local_slots
    tmp = args.keep or tempfile.mkdtemp()
    os.makedirs(tmp, exist_ok=True)
    try:
        if args.near_scale:
            return near_scale(args, tmp)
        docs, nbytes = engine_corpus(args.size_mb, args.base_docs)
        inputs = _write_files(docs, os.path.join(tmp, "in"), args.files)
        print(f"corpus: {len(docs)} documents, {nbytes / 1e6:.2f} MB in {args.files} files; {os.cpu_count()} cores; "
              f"{_load()}; {args.rounds} round(s), the engines alternating within each, in the reverse order every "
              "other round")
        print("| round | engine | wall s | MB/s | MB/s per core | CPU s (all processes) | MB per CPU-second | "
              "shuffle written | output | phases (s) | load average after |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        ref = os.path.join(tmp, "out-local")
        runs = [("local", None)] + [("spark", m) for m in args.masters.split(",")]
        walls: dict = {}
        local = None
        for r in range(args.rounds):
            # the order flips every round (ABBA...): the VM's speed drifts within a pair too, so neither engine
            # always gets the first slot; the local engine's first round makes the reference
            for engine, master in (runs if r % 2 == 0 else runs[::-1]):
                name = f"local, {args.workers} workers" if engine == "local" else f"Spark {master}"
                cores = args.workers if engine == "local" else (local_slots(master) or 1)
                out = ref if engine == "local" else os.path.join(tmp, "out-" + master.replace("[", "").replace("]", ""))
                shutil.rmtree(out, ignore_errors=True)
                spec = {"engine": engine, "master": master, "inputs": inputs, "out": out, "workers": args.workers,
                        "split_mb": args.split_mb}
                wall, cpu, job = _timed_job(spec, tmp)
                cpu = cpu if engine == "local" else job["cpu"]
                with open(os.path.join(out, "report.json")) as fh:
                    report = json.load(fh)
                if engine == "local":
                    local, verdict = local or report, "reference"
                else:
                    verdict = "identical" if _same(ref, out) and report == local else "DIFFERENT"
                walls.setdefault(name, []).append((wall, cores))
                phases = _phases(job["timings"]) or "-"
                shuffled = f"{job['shuffle'] / 1e6:.1f} MB" if engine == "spark" else "-"
                print(f"| {r + 1} | {name} | {wall:.1f} | {mbps(nbytes, wall):.3f} | {mbps(nbytes, wall) / cores:.3f} | "
                      f"{cpu:.1f} | {mbps(nbytes, cpu):.3f} | {shuffled} | {verdict} | {phases} | {_load()} |",
                      flush=True)
        print("best of the rounds, MB/s per core:",
              "; ".join(f"{k} {mbps(nbytes, min(w for w, _ in v)) / v[0][1]:.3f}" for k, v in walls.items()))
        print(f"kept {local['output']['documents']} of {local['read']['docs_in']} documents; exact dropped "
              f"{local['steps']['exact_dedup']['dropped']}, near dropped {local['steps']['near_dedup']['dropped']}")
    finally:
        if not args.keep:
            shutil.rmtree(tmp)


def _random_doc(rng, words, hanzi):
    """Half English-like (40-80 words of a 20,000-word vocabulary), half Chinese-like (150-300 of 3,500
    characters, a comma in twelve)."""
    if rng.random() < 0.5:
        return " ".join(rng.choices(words, k=rng.randint(40, 80)))
    return "".join(rng.choices(hanzi, k=rng.randint(150, 300)))


def near_scale(args, tmp):
    """N documents: originals, and clusters of 1-3 near copies (1%, 3%, 5% of the letters changed)."""
    from tests.data.planted import edit_chars
    rng = random.Random(11)
    words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(20000)]
    hanzi = [chr(c) for c in range(0x4E00, 0x4E00 + 3500)] * 11 + ["，"] * 3500
    docs, cluster, rate = [], [], []
    while len(docs) < args.near_scale:
        base = _random_doc(rng, words, hanzi)
        c = len(docs)
        docs.append(base)
        cluster.append(c)
        rate.append(0.0)
        if rng.random() < 0.2:
            for _ in range(rng.randint(1, 3)):
                if len(docs) >= args.near_scale:
                    break
                r = rng.choice((0.01, 0.03, 0.05))
                docs.append(edit_chars(base, r, rng))
                cluster.append(c)
                rate.append(r)
    nbytes = sum(len(d.encode()) for d in docs)
    inputs = _write_files(docs, os.path.join(tmp, "near-in"), args.files)
    print(f"near-scale corpus: {len(docs)} documents, {nbytes / 1e6:.1f} MB, {len(set(cluster))} clusters, "
          f"{sum(r > 0 for r in rate)} planted near copies; {_load()}", flush=True)
    master = args.masters.split(",")[0]
    outs = {}
    # Spark twice: as configured (both dedup steps on the driver up to DRIVER_DOCS survivors), and with the dedup
    # on the cluster (the path past that size: shuffles of the band keys)
    for run, engine, extra in (("local", "local", {}), ("spark", "spark", {}),
                               ("spark-cluster", "spark", {"driver_docs": 0})):
        out = outs[run] = os.path.join(tmp, f"near-{run}")
        shutil.rmtree(out, ignore_errors=True)
        wall, cpu, job = _timed_job({"engine": engine, "master": master, "inputs": inputs, "out": out,
                                     "workers": args.workers, "dedup_only": True, **extra}, tmp)
        phases = _phases(job["timings"], " s")
        print(f"{engine if engine == 'local' else 'Spark ' + master}"
              + (" (dedup on the cluster)" if extra else "") + f": wall {wall:.1f} s"
              + (f", CPU {cpu:.1f} s" if engine == "local" else "")
              + (f", shuffle written {job['shuffle'] / 1e6:.1f} MB ({phases})" if engine == "spark" else "")
              + f"; {_load()}", flush=True)
    from naohai.data.clean import output_files
    reports = [json.load(open(os.path.join(outs[e], "report.json"))) for e in outs]
    same = all(_same(outs["local"], outs[e]) and reports[0] == r for e, r in zip(outs, reports))
    print(f"shards and report {'identical' if same else 'DIFFERENT'}; near dedup dropped "
          f"{reports[0]['steps']['near_dedup']['dropped']}, exact {reports[0]['steps']['exact_dedup']['dropped']}")
    kept = {json.loads(line)["id"] for p in output_files(outs["spark"]) for line in open(p)}
    members = {}
    for i, c in enumerate(cluster):
        members.setdefault(c, []).append(i)
    dropped = [i for i in range(len(docs)) if i not in kept]
    right = sum(1 for i in dropped if len(members[cluster[i]]) > 1 and any(j in kept for j in members[cluster[i]]))
    print(f"precision {right / max(1, len(dropped)):.4f} ({right} of {len(dropped)} drops are planted copies "
          f"of a kept document)")
    for r in (0.01, 0.03, 0.05):   # a planted copy is found when it is not kept beside another member of its cluster
        copies = [i for i in range(len(docs)) if rate[i] == r]
        found = sum(1 for i in copies if i not in kept or not any(j in kept for j in members[cluster[i]] if j != i))
        print(f"recall at {r:.0%} character edits: {found / max(1, len(copies)):.3f} ({found} of {len(copies)})")


if __name__ == "__main__":
    main()
