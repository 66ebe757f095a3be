"""The quiet-machine rule of `naohai bench`: load before, other processes' CPU share, by hand."""
import os

from naohai.bench import quiet

STAT = ("cpu  1000 50 200 90000 30 7 8 5 0 0\n"
        "cpu0 500 25 100 45000 15 3 4 2 0 0\n"
        "intr 1 2 3\n")


def test_busy_seconds_count_user_nice_system_irq_softirq_steal():
    hz = os.sysconf("SC_CLK_TCK")
    assert quiet.busy_seconds(STAT) == (1000 + 50 + 200 + 7 + 8 + 5) / hz
    assert quiet.busy_seconds("intr 1\n") is None


def test_other_share_is_machine_busy_minus_own_over_cores_times_wall():
    # 30 s busy on the machine, 20 s of it the benchmark's, 2 cores x 50 s: 10 / 100
    assert quiet.other_share(30.0, 20.0, 50.0, 2) == 0.1
    assert quiet.other_share(10.0, 12.0, 50.0, 2) == 0.0      # clock granularity: never negative


def test_verdict():
    assert quiet.verdict(0.1, 0.01) == (True, "")
    # the share of the cores others used decides where it was read: a high load average left by work
    # that ended before the run does not make the run loud, a low one does not make a shared run quiet
    assert quiet.verdict(1.27, 0.007) == (True, "")
    ok, text = quiet.verdict(0.2, 0.25)
    assert ok is False and "used 25% of the cores" in text and "load average" not in text
    # without the share, the load before judges
    ok, text = quiet.verdict(0.8, None)
    assert ok is False and "load average was 0.80" in text and text.startswith("WARNING")
    assert quiet.verdict(0.3, None) == (True, "")
    assert quiet.verdict(None, None)[0] is None
    assert quiet.verdict(quiet.MAX_LOAD_BEFORE, quiet.MAX_OTHER_SHARE) == (True, "")


def test_watch_reports_its_figures():
    w = quiet.Watch()
    sum(i * i for i in range(200000))
    out = w.stop(os.cpu_count())
    assert out["wall_s"] > 0 and out["own_cpu_s"] >= 0 and len(out["load_before"]) == 3
    assert out["quiet"] in (True, False) and (out["warning"] == "") == out["quiet"]
