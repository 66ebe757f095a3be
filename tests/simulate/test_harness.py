"""Simulated-device compiles under msrun: real MindSpore verdicts per rank."""
import json
from pathlib import Path

import pytest

from naohai.simulate.harness import run_compile

ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_two_rank_matmul_model_parallel(tmp_path):
    rep = run_compile("tests.simulate.targets:matmul_mp", 2, tmp_path, timeout=600,
                      sys_path=[ROOT])
    assert rep.ok, rep.render()
    for r in rep.per_rank:
        w = r.parameters["w"]
        # strategy ((1,1),(1,2)): w [64,128] is split on its 2nd axis over 2 devices
        assert w["full_shape"] == [64, 128]
        assert w["slice_shape"] == [64, 64] and w["local_shape"] == [64, 64]
        assert w["dev_matrix"] == [2] and w["tensor_map"] == [-1, 0]
        assert r.parameters["moments.w"]["slice_shape"] == [64, 64]
        # MatMul output split on columns -> the ReduceSum needs an AllReduce
        assert r.comm_ops.get("AllReduce", 0) >= 1
        assert r.result["peak_rss_mb"] > 100
        assert Path(r.result["strategy_file"]).stat().st_size > 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["failed_ranks"] == []
    assert "ok" in rep.render()


@pytest.mark.slow
def test_strategy_wider_than_device_count_is_named(tmp_path):
    rep = run_compile("tests.simulate.targets:matmul_too_wide", 2, tmp_path, timeout=600,
                      sys_path=[ROOT])
    assert not rep.ok and rep.failed_ranks == [0, 1]
    err = rep.rank(1).error
    assert err["type"] == "RuntimeError"
    assert err["op"] == "MatMul"
    assert any("requires 4 devices" in line for line in err["log_errors"])
    assert err["source"].endswith("targets.py:22")
    text = rep.render()
    assert "rank 0,1: RuntimeError op=MatMul" in text


@pytest.mark.slow
def test_unknown_target_reported_per_rank_not_hung(tmp_path):
    rep = run_compile("tests.simulate.targets:no_such_target", 2, tmp_path, timeout=300,
                      sys_path=[ROOT])
    assert not rep.timed_out
    assert rep.failed_ranks == [0, 1]
    assert rep.rank(0).error["type"] == "AttributeError"


@pytest.mark.slow
def test_a_killed_worker_is_reported_with_its_signal(tmp_path):
    """A rank that leaves no result says how it ended (msrun's exit code for its pid), not just a log tail."""
    rep = run_compile("tests.simulate.targets:killed_on_rank_1", 2, tmp_path, timeout=300,
                      sys_path=[ROOT])
    assert not rep.timed_out and 1 in rep.failed_ranks
    assert rep.rank(1).result is None
    assert rep.rank(1).log_tail.startswith("(killed by signal 9 (SIGKILL)")
    if rep.rank(0).result is None:  # msrun stops the others when one worker fails
        assert rep.rank(0).log_tail.startswith("(stopped by msrun after another rank's worker failed)")
    assert "rank 1: no result.json (killed by signal 9 (SIGKILL): killed from outside" in rep.render()
