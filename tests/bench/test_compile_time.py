"""The compile probe: MindSpore's own compile profile, split into phases, accounts for the compile."""
from naohai.bench.compile_time import measure


def test_probe_phases_come_from_mindspores_profile():
    r = measure(2, "shared", timeout=600)
    assert r.get("compile_s"), r
    ph = r["phases"]
    assert set(ph) >= {"type_inference", "graph_passes", "kernel_build", "profiled_total"}
    parts = sum(v for k, v in ph.items() if k != "profiled_total")
    # MindSpore's TotalTime is the sum of its top-level actions, and the whole compile call includes it.
    assert abs(parts - ph["profiled_total"]) <= 0.02 * ph["profiled_total"] + 0.01
    assert ph["profiled_total"] <= r["compile_s"]
    assert all(v > 0 for v in ph.values())
