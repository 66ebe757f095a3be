"""The MFU denominator on CPU: measured once per machine, then read from the cache file."""
import json

from naohai.train import device


def test_peak_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NAOHAI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(device.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    calls = []

    def fake_measure(n=device.PEAK_MATMUL_N, repeats=device.PEAK_REPEATS):
        calls.append(n)
        return 0.125 if n == device.PEAK_MATMUL_N else 0.5

    monkeypatch.setattr(device, "measured_cpu_peak_tflops", fake_measure)
    first, source1 = device.peak_tflops("CPU", "float32")
    second, source2 = device.peak_tflops("CPU", "float32")
    assert (first, second) == (0.125, 0.125) and calls == [device.PEAK_MATMUL_N]
    path = tmp_path / "cache" / "peak_tflops.json"
    assert "measured now" in source1 and "cached:" in source2 and str(path) in source2
    stored = json.loads(path.read_text())
    assert list(stored) == [device.machine_key()]
    assert stored[device.machine_key()]["tflops"] == 0.125
    # another size is another entry; the first stays
    assert device.cached_cpu_peak_tflops(n=64)[0] == 0.5
    assert calls == [device.PEAK_MATMUL_N, 64] and len(json.loads(path.read_text())) == 2
    # a damaged cache file is measured over, not an error
    path.write_text("{not json")
    assert device.peak_tflops("CPU", "float32")[0] == 0.125 and len(calls) == 3
    # the recipe's own figure wins, without measuring
    assert device.peak_tflops("CPU", "float32", explicit=2.0) == (2.0, "train.device_peak_tflops")
    assert len(calls) == 3


def test_unwritable_cache_still_gives_a_peak(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NAOHAI_CACHE_DIR", str(blocker / "sub"))     # a folder under a file: cannot exist
    monkeypatch.setattr(device, "measured_cpu_peak_tflops", lambda n=0, repeats=0: 0.25)
    monkeypatch.setattr(device.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    peak, source = device.peak_tflops("CPU", "float32")
    assert peak == 0.25 and "not cached" in source


def test_busy_machine_measurement_is_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("NAOHAI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(device, "measured_cpu_peak_tflops", lambda n=0, repeats=0: 0.02)
    monkeypatch.setattr(device.os, "getloadavg", lambda: (9.5, 9.0, 8.0))
    peak, source = device.peak_tflops("CPU", "float32")
    assert peak == 0.02 and "load average 9.50" in source and "not cached (a busy machine" in source
    assert not (tmp_path / "cache" / "peak_tflops.json").exists()
