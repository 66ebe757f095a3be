"""One benchmark run, in order: matmul peak, training rows, loader, memory, fine-tuning rows, the peak again,
compile times, downstream scoring, inference (data score, generation).

:func:`run_suite` measures everything on this machine -- each training row in its own
worker process (:mod:`naohai.bench.worker`), each compile probe in a fresh one -- and returns the results dict that :mod:`naohai.bench.report` and
:mod:`naohai.bench.charts` write.  Rounds alternate naohai, PyTorch eager and
``torch.compile`` so that load from other processes falls on all rows alike; each row
keeps its best round.  Beside each model's rows, the train step's model matmuls alone on MindSpore and on PyTorch
(:mod:`naohai.bench.matmul_floor`), in the same rounds.  Each side runs at its own defaults: nothing here sets PyTorch's threads or the
OpenMP wait policy (``--torch-threads`` does, when asked), and the workers get the environment the user
started ``naohai bench`` with.  The load average before and after and the CPU share other processes
used are recorded, and the report warns when the machine was not quiet (:mod:`naohai.bench.quiet`).
The peak is the best of MindSpore's compiled MatMul, NumPy's BLAS (a child without the machine's thread
variables) and PyTorch's matmul (a child, when installed), each measured before and after the training rows
(the best of the two; every MFU is against it), printed beside the CPU's theoretical peak
(:mod:`naohai.bench.peak`); every row's peak RSS is its worker process's ``ru_maxrss``.  The fine-tuning
rows (:mod:`naohai.bench.finetune`: full SFT against LoRA) train the first model of ``--models``; the
downstream-scoring row (:mod:`naohai.bench.lm_eval_rate`) and the inference rows
(:mod:`naohai.bench.inference_rates`) set naohai against transformers on one tiny LLaMA-layout model.
"""
from __future__ import annotations

import datetime
import os
import platform
import tempfile
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Callable, Dict, List, Optional, Sequence

from naohai.bench import arith
from naohai.bench.models import BenchModel
from naohai.bench.naohai_row import CPU_REDUCTIONS_ENV

DEFAULT_STEPS = {"tiny": 20, "27m": 6, "42m": 6}


@dataclass
class Options:
    models: Sequence[BenchModel]
    rounds: int = 3
    steps: Optional[int] = None                    # per round; None = DEFAULT_STEPS per model
    compile_layers: Sequence[int] = (4, 16, 64)
    compile_forms: Sequence[str] = ("loop", "shared", "separate")   # see naohai.bench.compile_time.FORMS
    torch_compile: bool = True
    lm_eval: bool = True                            # the downstream scoring row (naohai.bench.lm_eval_rate)
    inference: bool = True                          # data score and generation rows (naohai.bench.inference_rates)
    finetune: bool = True                           # full SFT against LoRA on the first model (naohai.bench.finetune)
    matmul_floor: bool = True                       # the train step's matmuls alone, both sides (naohai.bench.matmul_floor)
    torch_threads: Optional[int] = None
    cpu_reductions: str = "fused"                   # naohai's train.cpu_reductions in its training rows
    peak_n: int = 2048
    peak_repeats: int = 5
    workdir: Optional[str] = None
    notes: List[str] = field(default_factory=list)


def _load() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def environment() -> Dict[str, Any]:
    import mindspore
    env = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()} "
           f"{platform.processor() or platform.node()}".strip(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "mindspore": mindspore.__version__, "load_before": _load()}
    try:
        with open("/proc/cpuinfo", "r", encoding="utf-8") as fh:
            names = [l.split(":", 1)[1].strip() for l in fh if l.startswith("model name")]
        if names:
            env["machine"] = names[0]
    except OSError:
        pass
    return env


def _row(tps: Optional[float], flops_token: float, peak: float, rounds: List[Optional[float]],
         first_step_s: Optional[float] = None, note: str = "", peak_rss: Optional[int] = None) -> Dict[str, Any]:
    return {"tokens_per_s": tps, "mfu": arith.mfu(tps, flops_token, peak) if tps else None,
            "rounds_tokens_per_s": rounds, "first_step_s": first_step_s, "note": note, "peak_rss": peak_rss}


def bench_model(bm: BenchModel, opts: Options, peak: float, workdir: str, with_torch: bool, log) -> Dict[str, Any]:
    from naohai.bench.loader_speed import loader_tokens_per_s
    from naohai.bench.memory import compare, planned_states
    from naohai.bench.randdata import write_random_prepared
    from naohai.bench.process import Worker
    from naohai.model.flops import flops_per_token
    from naohai.model.params import count_params

    steps = int(opts.steps or DEFAULT_STEPS.get(bm.name, 10))
    fpt = flops_per_token(bm.model)
    prepared = write_random_prepared(os.path.join(workdir, f"data-{bm.name}"), bm.model.vocab_size, bm.seq,
                                     train_windows=max(64, 8 * bm.batch))
    log(f"{bm.name}: starting the rows ({count_params(bm.model) / 1e6:.2f}M parameters, batch {bm.batch} x {bm.seq})")
    keys = ["naohai"] + (["eager"] + (["compile"] if opts.torch_compile else []) if with_torch else [])
    products = None
    if opts.matmul_floor:
        from naohai.bench import matmul_floor
        log(f"{bm.name}: reading the train step's matmuls from its compiled graph ...")
        products = matmul_floor.extract_in_child(bm.name, workdir)
        log(f"{bm.name}: {products['count']} matmuls of the model ({products['gflop']:.1f} GFLOP a step) and "
            f"{products['helpers']} helper products")
        keys[1:1] = ["mindspore products"]
        if with_torch:
            keys.insert(keys.index("eager") + 1, "torch products")
    workers: Dict[str, Any] = {}
    per_round: Dict[str, List[float]] = {k: [] for k in keys}
    seconds: Dict[str, List[float]] = {k: [] for k in keys}
    first: Dict[str, Optional[float]] = {}
    rss: Dict[str, Optional[int]] = {}
    try:
        for key in keys:
            if key.endswith(" products"):
                workers[key] = matmul_floor.FloorWorker(key.split()[0], products["path"], workdir, bm.name)
            else:
                workers[key] = Worker(key, bm.name, prepared, workdir, peak)
        for r in range(opts.rounds):
            for key in keys:
                floor = key.endswith(" products")
                ans = workers[key].request(cmd="round", steps=steps if floor else steps + 1)
                seconds[key] += ans["times"]
                if floor:
                    log(f"{bm.name} round {r + 1}/{opts.rounds}: {key} median {median(ans['times']):.3f} s "
                        f"(load {_load()})")
                    continue
                per_round[key].append(arith.tokens_per_second(bm.tokens_per_step, ans["times"]))
                first[key] = ans["first_step_s"]
                rss[key] = ans.get("peak_rss")
                log(f"{bm.name} round {r + 1}/{opts.rounds}: {key} {per_round[key][-1]:,.0f} tokens/s "
                    f"(load {_load()})")
        allocated = workers["naohai"].request(cmd="allocated")
    finally:
        for w in workers.values():
            w.close()
    throughput = {}
    for key in ("naohai", "eager", "compile"):
        if key in keys:
            throughput[key] = _row(arith.best(per_round[key]), fpt, peak, per_round[key], first.get(key),
                                   peak_rss=rss.get(key))
        else:
            throughput[key] = _row(None, fpt, peak, [], note="not measured")
    nao = throughput["naohai"]["tokens_per_s"]
    loader = loader_tokens_per_s(prepared, bm.batch)
    memory = compare(planned_states(bm.model, bm.batch), allocated)
    memory["model"] = bm.name
    return {"name": bm.name, "params": count_params(bm.model), "batch": bm.batch, "seq": bm.seq,
            "flops_per_token": fpt, "steps_per_round": steps, "throughput": throughput,
            "matmul_floor": None if products is None else matmul_floor.summary(products, seconds),
            "ratios": {"naohai_over_eager": arith.ratio(nao, throughput["eager"]["tokens_per_s"]),
                       "naohai_over_compile": arith.ratio(nao, throughput["compile"]["tokens_per_s"]),
                       "rss_naohai_over_eager": arith.ratio(throughput["naohai"]["peak_rss"],
                                                            throughput["eager"]["peak_rss"]),
                       "rss_naohai_over_compile": arith.ratio(throughput["naohai"]["peak_rss"],
                                                              throughput["compile"]["peak_rss"])},
            "loader": {"model": bm.name, "loader_tokens_per_s": loader, "train_tokens_per_s": nao,
                       "ratio": arith.ratio(loader, nao)},
            "memory": memory}


COMPILE_NOTE = ("'loop' is train.layer_loop: always (one layer graph run by a loop over stacked weights); "
                "'shared' is layer_loop: never (one cell per layer, equal layers sharing one graph through "
                "MindSpore's lazy_inline key, policy 'front' on CPU); 'separate' also sets reuse_layer_graphs: false. "
                "naohai's default on CPU (layer_loop: auto) is 'shared' below 12 layers and 'loop' from 12. "
                "Each figure is one fresh process timing train_step.compile(ids, labels).")


def best_sources(*measured: Dict[str, Optional[float]]) -> Dict[str, Optional[float]]:
    """Per source (``mindspore``, ``numpy``, ``pytorch``), the best TFLOP/s of several measurements; None
    where every one failed."""
    out: Dict[str, Optional[float]] = {}
    for found in measured:
        for name, value in found.items():
            out[name] = arith.best([out.get(name), value])
    return out


def restate_peak(results: Dict[str, Any], sources: Dict[str, Optional[float]]) -> float:
    """Set ``results``' peak to the best of ``sources`` and every training row's MFU against it; returns it."""
    peak = arith.best(list(sources.values()))
    results["peak"].update(tflops=peak, sources=sources)
    for m in results["models"]:
        for row in m["throughput"].values():
            row["mfu"] = arith.mfu(row["tokens_per_s"], m["flops_per_token"], peak) if row["tokens_per_s"] else None
    return peak


def run_suite(opts: Options, log: Callable[[str], None] = print) -> Dict[str, Any]:
    from naohai.bench.compile_time import measure
    from naohai.bench.peak import this_machine_theoretical_peak, torch_matmul_tflops
    from naohai.bench.quiet import Watch
    from naohai.bench.torch_row import peer_module
    import mindspore as ms
    from naohai.train.device import clean_blas_env, cpu_peak_sources

    ms.set_device("CPU")           # before the first kernel (the peak's MatMul); the trainer sets it again
    watch = Watch()
    env = environment()
    env["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "unset (each library's default)")
    if opts.torch_threads:
        os.environ["NAOHAI_BENCH_TORCH_THREADS"] = str(int(opts.torch_threads))
    os.environ[CPU_REDUCTIONS_ENV] = env["cpu_reductions"] = opts.cpu_reductions
    peer, why = peer_module()      # imports torch here only to say whether the rows can run
    if peer is not None:
        import torch
        env["torch"] = torch.__version__
        env["torch_threads"] = int(opts.torch_threads) if opts.torch_threads else torch.get_num_threads()
    else:
        log(f"PyTorch rows skipped: {why}")
    log(f"load average before: {env['load_before']}")
    def measure_peak(when: str) -> Dict[str, Optional[float]]:
        log(f"measuring the fp32 matmul peak {when} ({opts.peak_n}^3, best of {opts.peak_repeats}) ...")
        found = cpu_peak_sources(opts.peak_n, opts.peak_repeats)
        if peer is not None:
            found["pytorch"] = torch_matmul_tflops(opts.peak_n, opts.peak_repeats)
        return found

    sources = measure_peak("before the rows")
    peak = arith.best(list(sources.values()))
    theory = this_machine_theoretical_peak()
    log(f"peak {peak:.3f} TFLOP/s (" + ", ".join(f"{k} {v:.3f}" if v else f"{k} failed" for k, v in sources.items())
        + f"); theoretical {theory['tflops'] or 0:.3f}: {theory['assumptions']}")
    results: Dict[str, Any] = {"environment": env, "rounds": opts.rounds, "steps": opts.steps or dict(DEFAULT_STEPS),
                               "peak": {"n": opts.peak_n, "repeats": opts.peak_repeats, "tflops": peak,
                                        "sources": sources, "blas_env_cleared": clean_blas_env()[1],
                                        "theoretical": theory},
                               "torch_note": why if peer is None else
                               ("torch.compile not run (--no-torch-compile)" if not opts.torch_compile else None),
                               "models": [], "loader": [], "memory": []}
    with tempfile.TemporaryDirectory(prefix="naohai-bench-", dir=opts.workdir) as workdir:
        for bm in opts.models:
            m = bench_model(bm, opts, peak, workdir, peer is not None, log)
            results["loader"].append(m.pop("loader"))
            results["memory"].append(m.pop("memory"))
            results["models"].append(m)
        if opts.finetune and opts.models:
            from naohai.bench.finetune import bench_finetune
            bm = opts.models[0]
            log(f"{bm.name}: fine-tuning rows, full SFT against LoRA on random SFT windows ...")
            results["finetune"] = bench_finetune(bm, opts.rounds, int(opts.steps or DEFAULT_STEPS.get(bm.name, 10)),
                                                 workdir, peak, log)
    if results["models"]:
        # this VM's matmul rate drifts by 10-20% between minutes: a peak taken once, before the rows, was
        # below what a row then reached (an MFU over 100%), so the peak is the best of before and after
        after = measure_peak("after the training rows")
        results["peak"].update(before=peak, after=arith.best(list(after.values())))
        peak = restate_peak(results, best_sources(sources, after))
        log(f"peak {peak:.3f} TFLOP/s, the best of before ({results['peak']['before']:.3f}) and after "
            f"({results['peak']['after'] or 0:.3f}); every row's MFU is against it")
    runs = []
    for layers in opts.compile_layers:
        for form in opts.compile_forms:
            log(f"compile time: {layers} layers, {form} ...")
            runs.append(measure(layers, form))
            log(f"  {runs[-1].get('compile_s') or runs[-1].get('error')}")
    if runs:
        results["compile"] = {"runs": runs, "note": COMPILE_NOTE}
    if opts.lm_eval:
        from naohai.bench.lm_eval_rate import measure as lm_eval_rate
        log("downstream scoring: lm-eval loglikelihood requests/s, naohai against hf ...")
        with tempfile.TemporaryDirectory(prefix="naohai-bench-lm-", dir=opts.workdir) as lm_dir:
            results["lm_eval"] = lm_eval_rate(lm_dir, rounds=opts.rounds, log=log)
    if opts.inference:
        from naohai.bench.inference_rates import measure as inference_rates
        log("inference: data score documents/s and generation tokens/s, naohai against transformers ...")
        with tempfile.TemporaryDirectory(prefix="naohai-bench-inf-", dir=opts.workdir) as inf_dir:
            results["inference"] = inference_rates(inf_dir, rounds=opts.rounds, log=log)
    env["load_after"] = _load()
    env["quiet"] = watch.stop(env["cpus"] or 1)
    log(f"load average after: {env['load_after']}")
    if env["quiet"]["warning"]:
        log(env["quiet"]["warning"])
    return results
