"""The bench suite's peak: the best of its measurements before and after the training rows, every row's MFU
restated against it (tokens/s x FLOPs per token / peak, computed here by hand)."""
import pytest

from naohai.bench.suite import best_sources, restate_peak


def test_best_sources_keeps_each_sources_best_and_a_failure_only_when_all_failed():
    before = {"mindspore": 0.20, "numpy": None, "pytorch": 0.30}
    after = {"mindspore": 0.25, "numpy": None, "pytorch": 0.28}
    assert best_sources(before, after) == {"mindspore": 0.25, "numpy": None, "pytorch": 0.30}
    assert best_sources({"numpy": None}, {"numpy": 0.1}) == {"numpy": 0.1}
    assert best_sources({"numpy": 0.1}, {"numpy": None}) == {"numpy": 0.1}


def test_restate_peak_moves_every_rows_mfu_to_the_new_peak():
    row = lambda tps: {"tokens_per_s": tps, "mfu": 9.9}
    results = {"peak": {"tflops": 0.2, "sources": {}},
               "models": [{"flops_per_token": 6e6, "throughput": {"naohai": row(1000.0), "eager": row(2000.0),
                                                                  "compile": row(None)}}]}
    peak = restate_peak(results, {"mindspore": 0.25, "numpy": None, "pytorch": 0.3})
    assert peak == 0.3 and results["peak"]["tflops"] == 0.3
    assert results["peak"]["sources"] == {"mindspore": 0.25, "numpy": None, "pytorch": 0.3}
    rows = results["models"][0]["throughput"]
    assert rows["naohai"]["mfu"] == pytest.approx(1000.0 * 6e6 / 0.3e12, rel=1e-12)
    assert rows["eager"]["mfu"] == pytest.approx(2000.0 * 6e6 / 0.3e12, rel=1e-12)
    assert rows["compile"]["mfu"] is None


def test_run_suite_measures_the_peak_before_and_after_the_rows_and_states_mfu_against_the_best(monkeypatch):
    """The order and the arithmetic of run_suite, with the measurements replaced by recorded figures (the real
    ones are `naohai bench`'s, not a test's)."""
    import naohai.bench.peak as peak_module
    import naohai.bench.suite as suite
    import naohai.train.device as device
    from naohai.bench.models import bench_models
    order, measured = [], iter([{"mindspore": 0.20, "numpy": 0.18}, {"mindspore": 0.24, "numpy": None}])
    torch_rates = iter([0.22, 0.21])

    def sources(n, repeats):
        order.append("peak")
        return dict(next(measured))

    def rows(bm, opts, peak, workdir, with_torch, log):
        order.append(f"rows at {peak}")
        tps = {"naohai": 1000.0, "eager": 1500.0, "compile": None}
        return {"name": bm.name, "flops_per_token": 6e6, "loader": {}, "memory": {},
                "throughput": {k: {"tokens_per_s": v, "mfu": suite.arith.mfu(v, 6e6, peak) if v else None}
                               for k, v in tps.items()}}

    monkeypatch.setattr(device, "cpu_peak_sources", sources)
    monkeypatch.setattr(peak_module, "torch_matmul_tflops", lambda n, r: next(torch_rates))
    monkeypatch.setattr(suite, "bench_model", rows)
    opts = suite.Options(models=[bench_models()["tiny"]], compile_layers=(), lm_eval=False, inference=False,
                         finetune=False)
    said = []
    res = suite.run_suite(opts, log=said.append)
    with_torch = res["environment"].get("torch") is not None
    assert order == ["peak", "rows at 0.22" if with_torch else "rows at 0.2", "peak"]
    assert res["peak"]["before"] == (0.22 if with_torch else 0.20) and res["peak"]["after"] == 0.24
    assert res["peak"]["tflops"] == 0.24
    assert res["peak"]["sources"]["mindspore"] == 0.24 and res["peak"]["sources"]["numpy"] == 0.18
    row = res["models"][0]["throughput"]
    assert row["naohai"]["mfu"] == pytest.approx(1000.0 * 6e6 / 0.24e12) and row["compile"]["mfu"] is None
    assert any("the best of before" in line for line in said)
