"""`naohai bench`'s writers: bench.json holds the results, bench.md the tables, charts are PNGs;
the random-token folder is one naohai's loader reads; the planner/allocated comparison."""
import json

import numpy as np
import pytest

from naohai.bench.charts import write_charts
from naohai.bench.memory import compare, planned_states
from naohai.bench.models import bench_models
from naohai.bench.randdata import write_random_prepared
from naohai.bench.report import render_markdown, write_report


def _results():
    row = lambda tps, mfu, rss=None: {"tokens_per_s": tps, "mfu": mfu, "rounds_tokens_per_s": [tps],
                                      "first_step_s": 1.0, "note": "", "peak_rss": rss}
    return {
        "environment": {"date": "2026-01-02 03:04", "machine": "test cpu", "cpus": 2, "mindspore": "2.10.0",
                        "torch": "2.13.0", "torch_threads": 2, "load_before": "1.00", "load_after": "2.00", "omp_wait_policy": "unset (each library's default)", "cpu_reductions": "fused",
                        "quiet": {"other_cpu_share": 0.2, "warning": "WARNING: the machine was not quiet -- x."}},
        "rounds": 3, "steps": {"tiny": 20},
        "peak": {"n": 2048, "repeats": 5, "tflops": 0.16,
                 "sources": {"mindspore": 0.1, "numpy": 0.16, "pytorch": None},
                 "blas_env_cleared": ["OPENBLAS_NUM_THREADS"],
                 "theoretical": {"tflops": 0.32, "cpu": "test cpu", "assumptions": "2 cores x 2.5 GHz x 64"}},
        "torch_note": None,
        "models": [{"name": "tiny", "params": 1072640, "batch": 16, "seq": 128, "flops_per_token": 7222272.0,
                    "steps_per_round": 20,
                    "throughput": {"naohai": row(8858.0, 0.4, 3 * 2 ** 30), "eager": row(13357.0, 0.6, 2 ** 30),
                                   "compile": row(None, None)},
                    "ratios": {"naohai_over_eager": 8858.0 / 13357.0, "naohai_over_compile": None,
                               "rss_naohai_over_eager": 3.0, "rss_naohai_over_compile": None}}],
        "loader": [{"model": "tiny", "loader_tokens_per_s": 1e6, "train_tokens_per_s": 8858.0,
                    "ratio": 1e6 / 8858.0}],
        "memory": [{"model": "tiny", "planned": {"parameters": 4 * 2 ** 20, "optimizer_state": 8 * 2 ** 20,
                                                 "gradients": 4 * 2 ** 20, "activations": 2 ** 20},
                    "allocated": {"parameters": 4 * 2 ** 20, "optimizer_state": 8 * 2 ** 20,
                                  "rss_before_build": 0, "rss_after_build": 2 ** 20,
                                  "rss_after_first_round": 10 * 2 ** 20}}],
        "compile": {"runs": [{"layers": 4, "form": "separate", "compile_s": 2.0},
                             {"layers": 16, "form": "separate", "compile_s": 8.0,
                              "phases": {"type_inference": 2.0, "graph_passes": 4.0, "kernel_build": 1.5}},
                             {"layers": 64, "form": "separate", "compile_s": None, "error": "timed out"}],
                    "note": "n"},
    }


def test_markdown_tables_hold_the_figures():
    md = render_markdown(_results())
    assert ("| tiny (1.07M, 16 x 128) | 8,858 | 40.0% | 13,357 | 60.0% | \u2014 | \u2014 | 0.66 | \u2014 | 0.66 | \u2014 |"
            in md)
    assert "**0.160 TFLOP/s**, the best of MindSpore compiled MatMul 0.100, NumPy BLAS (child, thread " in md
    assert "PyTorch matmul (child, defaults) failed" in md and "Cleared for NumPy: OPENBLAS_NUM_THREADS." in md
    assert "**0.320 TFLOP/s** = 2 cores x 2.5 GHz x 64" in md and "the measured peak is 50% of it" in md
    assert "load average 1.00 before, 2.00 after; other processes used 20.0% of the cores" in md
    assert md.split("\n")[2] == "**WARNING: the machine was not quiet -- x.**"
    assert "OMP_WAIT_POLICY=unset (each library's default)" in md
    assert "(naohai's `train.cpu_reductions: fused`)" in md
    assert "| tiny | 3.00 GiB | 1.00 GiB | \u2014 | 3.00 | \u2014 |" in md
    assert "| 16 | separate | 8.0 s | 4.00 | 2.0 s | 4.0 s | 1.5 s |  |" in md
    assert "| 64 | separate | \u2014 | \u2014 | \u2014 | \u2014 | \u2014 | timed out |" in md
    assert "| tiny | 1,000,000 | 8,858 | 113 |" in md
    assert "| tiny | 4.0 MiB | 4.0 MiB | 8.0 MiB | 8.0 MiB | 4.0 MiB | 1.0 MiB | 1.0 MiB | 10.0 MiB |" in md


def test_the_median_rounds_ratio_is_beside_the_best_rounds():
    """Best rounds 30 against 40 (0.75); median rounds 20 against 20 (1.00): both are in the table."""
    res = _results()
    t = res["models"][0]["throughput"]
    t["naohai"].update(tokens_per_s=30.0, rounds_tokens_per_s=[10.0, 30.0, 20.0])
    t["eager"].update(tokens_per_s=40.0, rounds_tokens_per_s=[40.0, 20.0, 10.0])
    res["models"][0]["ratios"]["naohai_over_eager"] = 0.75
    md = render_markdown(res)
    assert "| 30 | 40.0% | 40 | 60.0% | \u2014 | \u2014 | 0.75 | \u2014 | 1.00 | \u2014 |" in md
    assert "| naohai / eager | naohai / compile | median rounds: / eager | / compile |" in md


def test_peak_measured_before_and_after_the_rows_is_told():
    res = _results()
    assert "Measured before the training rows" not in render_markdown(res)
    res["peak"].update(before=0.12, after=0.16)
    md = " ".join(render_markdown(res).split())
    assert ("**0.160 TFLOP/s**" in md and "Measured before the training rows (0.120) and after them (0.160): the "
            "best of the two" in md)
    res["peak"]["after"] = None
    assert "(0.120; after them it failed)" in " ".join(render_markdown(res).split())


def test_matmul_floor_table():
    """The floor's row: medians of each step and of its side's matmuls alone, and the differences; no table
    without a floor (the run above has none)."""
    from naohai.bench.matmul_floor import Product, summary
    res = _results()
    assert "matmuls alone" not in render_markdown(res)
    products = {"products": [Product(False, (4, 6), (5, 6), False, True)] * 3, "gflop": 358.84, "count": 3,
                "helpers": 100}
    seconds = {"naohai": [2.9, 2.5, 2.7], "mindspore products": [1.7, 1.6, 1.8], "eager": [2.0, 1.9, 1.95],
               "torch products": [1.69, 1.65, 1.7], "compile": [1.9, 1.95, 1.8]}
    res["models"][0]["matmul_floor"] = summary(products, seconds)
    md = render_markdown(res)
    assert "| tiny | 3 (358.8); 100 | 2.700 | 1.700 | 1.000 | 1.950 | 1.690 | 0.260 | 1.900 | 0.210 |" in md
    assert res["models"][0]["matmul_floor"]["fastest_s"]["naohai"] == 2.5


def test_write_report_round_trips_json(tmp_path):
    res = _results()
    paths = write_report(res, str(tmp_path / "out"))
    assert json.loads(open(paths["json"], encoding="utf-8").read()) == json.loads(json.dumps(res))
    assert open(paths["markdown"], encoding="utf-8").read() == render_markdown(res)


def test_charts_are_pngs(tmp_path):
    from PIL import Image
    paths = write_charts(_results(), str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["compile.png", "throughput.png"]
    for p in paths:
        with Image.open(p) as img:
            assert img.format == "PNG" and img.size == (820, 460)


def test_random_prepared_folder_feeds_the_loader(tmp_path):
    from naohai.data.loader import TokenWindowLoader
    from naohai.data.prepare import load_prepared
    path = write_random_prepared(str(tmp_path / "d"), 32000, 16, train_windows=10)
    prep = load_prepared(path, verify=True)          # meta, dtypes and every id < vocab
    assert prep.num_windows("train") == 10 and prep.dtype == np.uint16
    batch = TokenWindowLoader(path, "train", 4).next_batch()
    assert batch.shape == (4, 17) and batch.max() < 32000


def test_planned_states_of_one_device_are_4_4_8_bytes_per_parameter():
    cfg = bench_models()["tiny"].model
    p = planned_states(cfg, 16)
    n = 1072640
    assert p["parameters_count"] == n
    assert (p["parameters"], p["gradients"], p["optimizer_state"]) == (4 * n, 4 * n, 8 * n)
    c = compare(p, {"parameters": 4 * n, "optimizer_state": 8 * n})
    assert c["parameters_ratio"] == 1.0 and c["optimizer_state_ratio"] == 1.0
