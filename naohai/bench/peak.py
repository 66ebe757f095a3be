"""The CPU's theoretical fp32 peak, beside the measured matmul peaks, and PyTorch's matmul peak.

Theoretical peak = usable cores x clock x fp32 FLOPs per cycle per core, where FLOPs per cycle =
2 (a fused multiply-add is two FLOPs) x fp32 lanes per FMA x FMA units per core:

- lanes: 16 when ``/proc/cpuinfo`` lists ``avx512f``, else 8 with ``avx2`` and ``fma``, else 4 (SSE,
  no FMA: counted as 2 FLOPs per lane per unit all the same, an upper bound);
- FMA units per core: 2 -- Intel server cores from Skylake-SP (two 512-bit FMA ports on Xeon Gold 6xxx /
  Platinum; some Silver / Bronze parts have one, which this rule overstates) and AMD Zen 1-5 (two FMA
  pipes); AMD Zen 4 lists ``avx512f`` but executes 512-bit FMAs as two 256-bit halves, so on AMD family
  0x19 (Zen 3 / Zen 4) the lanes are 8 whatever the flags say.  Sources: the per-core FLOPs/cycle table of
  Wikipedia's "FLOPS" article (Zen 2-4: 32 fp32 FLOPs/cycle; Skylake-SP / Ice Lake-SP with two AVX-512
  FMA units: 64; Haswell-Zen with AVX2: 32) and AMD's Software Optimization Guide for family 19h
  ("two 256-bit FMA units");
- clock: ``/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq`` when the kernel exposes it (the
  highest, boost included), else ``cpu MHz`` of ``/proc/cpuinfo`` (in a VM often the nominal clock: boost
  would make the true peak higher).

The figure is an upper bound for what any library's fp32 matmul can reach; the ``assumptions`` string
says which rule gave it.  :func:`torch_matmul_tflops` times PyTorch's matmul (at its default threads) in
a child process, as :func:`naohai.train.device.cpu_peak_sources` does NumPy's.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Optional

TORCH_CHILD = """
import sys, time
import torch
n, repeats = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
a = torch.randn(n, n, generator=g, dtype=torch.float32)
a @ a
best = float("inf")
for _ in range(repeats):
    t0 = time.perf_counter(); a @ a; best = min(best, time.perf_counter() - t0)
print("@@seconds", best)
"""


def cpuinfo_fields(text: str) -> Dict[str, str]:
    """The first processor's ``key: value`` pairs of a ``/proc/cpuinfo`` text."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if out:
                break
            continue
        if ":" in line:
            k, v = line.split(":", 1)
            out.setdefault(k.strip(), v.strip())
    return out


def flops_per_cycle(fields: Dict[str, str]) -> Dict[str, Any]:
    """fp32 FLOPs per cycle per core of the CPU ``fields`` describes, with lanes, units and the rule used."""
    flags = set(fields.get("flags", "").split())
    vendor = fields.get("vendor_id", "")
    family = fields.get("cpu family", "")
    if "avx512f" in flags and not (vendor == "AuthenticAMD" and family == "25"):
        lanes, rule = 16, "avx512f: 16 fp32 lanes"
    elif "avx512f" in flags:
        lanes, rule = 8, "AMD family 25 (Zen 4) with avx512f: 512-bit FMAs run as two 256-bit halves, 8 lanes"
    elif "avx2" in flags and "fma" in flags:
        lanes, rule = 8, "avx2 + fma: 8 fp32 lanes"
    else:
        lanes, rule = 4, "no avx2/fma flags: 4 fp32 lanes (SSE; an upper bound)"
    units = 2
    return {"lanes": lanes, "fma_units": units, "flops_per_cycle": 2 * lanes * units,
            "rule": f"{rule} x {units} FMA units x 2 FLOPs per FMA"}


def clock_ghz(fields: Dict[str, str], max_freq_khz: Optional[str] = None) -> Dict[str, Any]:
    """The clock the peak assumes: cpufreq's maximum (kHz text) when given, else cpuinfo's ``cpu MHz``."""
    if max_freq_khz and max_freq_khz.strip().isdigit() and int(max_freq_khz) > 0:
        return {"ghz": int(max_freq_khz) / 1e6, "source": "cpufreq cpuinfo_max_freq"}
    try:
        return {"ghz": float(fields["cpu MHz"]) / 1e3, "source": "/proc/cpuinfo cpu MHz (no cpufreq; boost not "
                                                                 "counted)"}
    except (KeyError, ValueError):
        return {"ghz": None, "source": "unknown (no cpufreq, no cpu MHz)"}


def theoretical_peak(cpuinfo_text: str, cores: int, max_freq_khz: Optional[str] = None) -> Dict[str, Any]:
    """``{"tflops", "cores", "ghz", "flops_per_cycle", "assumptions"}``; tflops None without a clock."""
    fields = cpuinfo_fields(cpuinfo_text)
    fpc = flops_per_cycle(fields)
    clk = clock_ghz(fields, max_freq_khz)
    tflops = cores * clk["ghz"] * fpc["flops_per_cycle"] / 1e3 if clk["ghz"] else None
    ghz = "?" if clk["ghz"] is None else f"{clk['ghz']:.3g}"
    return {"tflops": tflops, "cores": int(cores), "ghz": clk["ghz"], "flops_per_cycle": fpc["flops_per_cycle"],
            "cpu": fields.get("model name", "unknown"),
            "assumptions": f"{cores} cores x {ghz} GHz "
                           f"({clk['source']}) x {fpc['flops_per_cycle']} "
                           f"fp32 FLOPs/cycle ({fpc['rule']})"}


def this_machine_theoretical_peak() -> Dict[str, Any]:
    """:func:`theoretical_peak` of this host (usable cores from the affinity mask)."""
    try:
        with open("/proc/cpuinfo", "r", encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        text = ""
    freq = None
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq", "r", encoding="ascii") as fh:
            freq = fh.read()
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return theoretical_peak(text, cores, freq)


def torch_matmul_tflops(n: int, repeats: int) -> Optional[float]:
    """PyTorch's n x n fp32 matmul rate in a child process at PyTorch's defaults (the environment as Python
    sees it, as the peer rows get); None without PyTorch."""
    from naohai.bench.process import worker_env
    from naohai.train.device import child_matmul_seconds
    sec = child_matmul_seconds(TORCH_CHILD, n, repeats, worker_env())
    return 2.0 * n ** 3 / sec / 1e12 if sec else None
