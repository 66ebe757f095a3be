"""The theoretical CPU peak: cores x clock x FLOPs/cycle from /proc/cpuinfo text, checked by hand;
the NumPy child's environment has no thread/BLAS variables; a child's matmul time is read back."""
import os
import sys

import pytest

from naohai.bench import peak
from naohai.train import device


def _cpuinfo(flags, vendor="GenuineIntel", family="6", mhz="2000.000", name="Test CPU"):
    one = (f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel name\t: {name}\n"
           f"cpu MHz\t\t: {mhz}\nflags\t\t: fpu sse sse2 {flags}\n")
    return one + "\n" + one.replace("processor\t: 0", "processor\t: 1") + "\n"


def test_avx512_intel_two_cores():
    th = peak.theoretical_peak(_cpuinfo("avx avx2 fma avx512f avx512bw"), cores=2)
    # 2 cores x 2.0 GHz x (16 lanes x 2 FMA units x 2 FLOPs) = 256 GFLOP/s
    assert th["flops_per_cycle"] == 64 and th["ghz"] == 2.0
    assert th["tflops"] == pytest.approx(2 * 2.0 * 64 / 1000)
    assert "avx512f" in th["assumptions"] and "cpu MHz" in th["assumptions"] and th["cpu"] == "Test CPU"


def test_avx2_zen3_and_zen4_are_32_flops_per_cycle():
    zen3 = peak.theoretical_peak(_cpuinfo("avx avx2 fma", "AuthenticAMD", "25", "2445.404"), cores=2)
    assert zen3["flops_per_cycle"] == 32
    assert zen3["tflops"] == pytest.approx(2 * 2.445404 * 32 / 1000)
    assert zen3["assumptions"].startswith("2 cores x 2.45 GHz (")     # the clock to 3 digits, not float noise
    zen4 = peak.flops_per_cycle(peak.cpuinfo_fields(_cpuinfo("avx2 fma avx512f", "AuthenticAMD", "25")))
    assert zen4["lanes"] == 8 and zen4["flops_per_cycle"] == 32 and "Zen 4" in zen4["rule"]
    old = peak.flops_per_cycle(peak.cpuinfo_fields(_cpuinfo("avx")))
    assert old["flops_per_cycle"] == 16


def test_cpufreq_maximum_wins_over_cpu_mhz():
    th = peak.theoretical_peak(_cpuinfo("avx2 fma", mhz="1500.0"), cores=4, max_freq_khz="3500000\n")
    assert th["ghz"] == 3.5 and th["tflops"] == pytest.approx(4 * 3.5 * 32 / 1000)
    assert "cpufreq" in th["assumptions"]
    none = peak.theoretical_peak("flags : avx2 fma\n", cores=1)
    assert none["tflops"] is None and none["ghz"] is None


def test_clean_blas_env_drops_thread_variables_only():
    env, dropped = device.clean_blas_env({"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1",
                                          "OMP_WAIT_POLICY": "PASSIVE", "MKL_NUM_THREADS": "1",
                                          "NVPL_BLAS_DEBUG_CPU_TYPE": "1", "PATH": "/bin", "HOME": "/root"})
    assert env == {"PATH": "/bin", "HOME": "/root"}
    assert dropped == ["MKL_NUM_THREADS", "NVPL_BLAS_DEBUG_CPU_TYPE", "OMP_NUM_THREADS", "OMP_WAIT_POLICY",
                       "OPENBLAS_NUM_THREADS"]


def test_child_matmul_reads_the_childs_answer_and_sees_the_given_environment():
    code = ("import os, sys\n"
            "assert 'OPENBLAS_NUM_THREADS' not in os.environ, 'not cleared'\n"
            "print('noise'); print('@@seconds', float(sys.argv[1]) / int(sys.argv[2]))\n")
    env, _ = device.clean_blas_env(dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert device.child_matmul_seconds(code, 3, 4, env) == 0.75
    assert device.child_matmul_seconds("raise SystemExit(3)", 3, 4, env) is None


def test_numpy_child_measures_a_real_matmul():
    sec = device.child_matmul_seconds(device._NUMPY_CHILD, 64, 2, device.clean_blas_env()[0])
    assert sec is not None and 0 < sec < 10
