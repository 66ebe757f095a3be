"""The peak FLOP rate of a device, the denominator of MFU (which device a run uses is
:func:`naohai.devices.resolve_device`).

``peak_tflops(device, ...)`` is the per-device denominator of MFU: the recipe's
``train.device_peak_tflops`` if given, else the planner's device profile on Ascend
(named by ``train.device_profile`` or detected from the chip name), else on CPU a
fp32 matmul peak (MindSpore's compiled MatMul or NumPy's BLAS in a child process without the machine's
thread variables, whichever is faster) measured
once per machine and kept in a cache file (:func:`cached_cpu_peak_tflops`), so MFU compares
between runs; the returned source says which, when it was measured and at what load.
"""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Optional, Tuple

from naohai.cache import cache_dir


_MEASURED: dict = {}


def ascend_profile_name() -> Optional[str]:
    """The planner profile of this host's Ascend chip (910A or 910B class), if it can be told."""
    try:
        import mindspore as ms
        name = str(ms.hal.get_device_name(0))
    except Exception:  # noqa: BLE001
        return None
    if "910B" in name or "910_93" in name:
        return "ascend-910b-64g"
    if "910" in name:
        return "ascend-910a-32g"
    return None


#: the matmul that defines the CPU peak for MFU (the trainer's log and `naohai bench` alike)
PEAK_MATMUL_N = 2048
PEAK_REPEATS = 5


#: prefixes of the thread and BLAS variables a machine may set (OpenBLAS, GotoBLAS, OpenMP, MKL, BLIS,
#: NVPL): the NumPy peak runs in a child without them, so a site's OPENBLAS_NUM_THREADS=1 cannot lower it
BLAS_ENV_PREFIXES = ("OPENBLAS_", "GOTO", "OMP_", "GOMP_", "KMP_", "MKL_", "BLIS_", "NVPL_")

_NUMPY_CHILD = """
import sys, time
import numpy as np
n, repeats = int(sys.argv[1]), int(sys.argv[2])
a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
a @ a
best = float("inf")
for _ in range(repeats):
    t0 = time.perf_counter(); a @ a; best = min(best, time.perf_counter() - t0)
print("@@seconds", best)
"""


def clean_blas_env(env: Optional[dict] = None) -> Tuple[dict, list]:
    """``env`` (default ``os.environ``) without the variables of :data:`BLAS_ENV_PREFIXES`, and their names."""
    env = dict(os.environ if env is None else env)
    dropped = sorted(k for k in env if k.startswith(BLAS_ENV_PREFIXES))
    return {k: v for k, v in env.items() if k not in dropped}, dropped


def child_matmul_seconds(code: str, n: int, repeats: int, env: dict, timeout: float = 600) -> Optional[float]:
    """The fastest of ``repeats`` n x n matmuls timed by ``code`` in a fresh Python process (it prints
    ``@@seconds S``); None when the child fails (a missing package, a crash)."""
    import subprocess
    import sys
    try:
        out = subprocess.run([sys.executable, "-c", code, str(int(n)), str(int(repeats))], capture_output=True,
                             text=True, env=env, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.stdout.splitlines():
        if line.startswith("@@seconds "):
            return float(line.split()[1])
    return None


def mindspore_matmul_seconds(n: int, repeats: int) -> float:
    """The fastest of ``repeats`` n x n MatMuls compiled by ``ms.jit`` in this process (one warm-up).

    The MatMul runs inside ``ms.jit``, as training's do: a PyNative MatMul measured 0.114-0.129 TFLOP/s on
    the 2-core dev VM where the compiled one and NumPy measured 0.20-0.21, and the 42M benchmark model
    trained at 0.136, so a PyNative figure would put MFU above 100%."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, ops

    @ms.jit
    def square(x):
        return ops.matmul(x, x)

    a = Tensor(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    square(a).asnumpy()                   # warm-up (compile, kernel selection, thread pool)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        square(a).asnumpy()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_peak_sources(n: int = PEAK_MATMUL_N, repeats: int = PEAK_REPEATS) -> dict:
    """TFLOP/s of an n x n fp32 matmul by each library the trainer can compare with: ``mindspore`` (compiled
    MatMul, this process) and ``numpy`` (its BLAS in a child process whose environment lacks the machine's
    thread/BLAS variables, :func:`clean_blas_env`); a source that failed is None."""
    flops = 2.0 * n ** 3
    out = {"mindspore": flops / mindspore_matmul_seconds(n, repeats) / 1e12}
    sec = child_matmul_seconds(_NUMPY_CHILD, n, repeats, clean_blas_env()[0])
    out["numpy"] = flops / sec / 1e12 if sec else None
    return out


def measured_cpu_peak_tflops(n: int = PEAK_MATMUL_N, repeats: int = PEAK_REPEATS) -> float:
    """This host's fp32 matmul peak (TFLOP/s): the best of :func:`cpu_peak_sources`; measured once per
    process and size."""
    key = ("cpu", int(n), int(repeats))
    if key not in _MEASURED:
        _MEASURED[key] = max(v for v in cpu_peak_sources(n, repeats).values() if v)
    return _MEASURED[key]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", "r", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_key(n: int = PEAK_MATMUL_N) -> str:
    """What a cached CPU peak belongs to: host name, CPU model, usable cores, MindSpore version, size."""
    import mindspore as ms
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{platform.node()} | {_cpu_model()} | {cores} cores | MindSpore {ms.__version__} | {n}^3 fp32"


def cached_cpu_peak_tflops(n: int = PEAK_MATMUL_N, repeats: int = PEAK_REPEATS) -> Tuple[float, str]:
    """(peak TFLOP/s, source) of this machine: read from ``<cache_dir>/peak_tflops.json`` when this
    :func:`machine_key` is there, else measured now (:func:`measured_cpu_peak_tflops`) and stored if the
    machine was not busy (1-minute load average below the usable cores; a busy one's figure is used once).
    The source names the file, the date and the load average of the measurement; delete the entry
    (or the file) to measure again, or set ``train.device_peak_tflops``."""
    path = os.path.join(cache_dir(), "peak_tflops.json")
    key = machine_key(n)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            entries = json.load(fh)
        if not isinstance(entries, dict):
            entries = {}
    except (OSError, ValueError):
        entries = {}
    entry = entries.get(key)
    how = "cached"
    if not (isinstance(entry, dict) and isinstance(entry.get("tflops"), (int, float)) and entry["tflops"] > 0):
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        entry = {"tflops": measured_cpu_peak_tflops(n, repeats), "measured": time.strftime("%Y-%m-%d %H:%M"),
                 "load_average": round(load, 2)}
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        how = "measured now"
        if not load < cores:      # other work held the cores: a figure to use once, not to keep
            return entry["tflops"], (f"fp32 matmul peak of this machine ({n}^3, compiled MindSpore MatMul or "
                                     f"NumPy BLAS, best of {repeats}), measured now at load average {load:.2f} on "
                                     f"{cores} cores: not cached (a busy machine; the next run measures again)")
        entries[key] = entry
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(entries, fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            how = f"measured now, not cached ({exc.strerror or exc})"
    source = (f"fp32 matmul peak of this machine ({n}^3, compiled MindSpore MatMul or NumPy BLAS in a clean child, best of "
              f"{repeats}), {how}: measured {entry.get('measured', '?')} at load average "
              f"{entry.get('load_average', '?')}, kept in {path} (delete it to measure again)")
    return float(entry["tflops"]), source


def peak_tflops(device: str, compute_dtype: str, explicit: Optional[float] = None,
                profile: Optional[str] = None) -> Tuple[float, str]:
    """(per-device peak TFLOP/s, where it comes from) for MFU."""
    if explicit:
        return float(explicit), "train.device_peak_tflops"
    if device == "CPU":
        return cached_cpu_peak_tflops()
    name = profile or (ascend_profile_name() if device == "Ascend" else None)
    if name:
        from naohai.strategy.profiles import load_profile
        prof = load_profile(name)
        return prof.peak_tflops(compute_dtype), f"device profile {prof.name}"
    return 0.0, "unknown (set train.device_peak_tflops or train.device_profile for MFU)"
