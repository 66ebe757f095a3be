"""Bench workers start with Python's environment, not the C environment MindSpore altered."""
import os
import subprocess
import sys

from naohai.bench.process import worker_env

CHILD = "import os, sys; sys.stdout.write(os.environ.get('OMP_NUM_THREADS', 'unset'))"


def test_workers_do_not_inherit_mindspores_omp_num_threads():
    code = (
        "import os, subprocess, sys\n"
        "import mindspore as ms\n"
        "ms.set_device('CPU')\n"
        "from naohai.bench.process import worker_env\n"
        f"child = {CHILD!r}\n"
        "inherited = subprocess.run([sys.executable, '-c', child], capture_output=True, text=True).stdout\n"
        "explicit = subprocess.run([sys.executable, '-c', child], capture_output=True, text=True,\n"
        "                          env=worker_env()).stdout\n"
        "print(inherited, explicit, os.environ.get('OMP_NUM_THREADS', 'unset'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    inherited, explicit, seen = out.stdout.split()[-3:]
    # MindSpore 2.10 sets OMP_NUM_THREADS=1 behind os.environ's back: the inherited environment shows it ...
    assert inherited == "1", out.stdout + out.stderr
    # ... and the workers' explicit environment is what Python sees (unset here).
    assert explicit == seen == "unset"


def test_worker_env_is_a_copy_of_os_environ():
    env = worker_env()
    assert env == dict(os.environ) and env is not os.environ


def test_peak_rss_is_getrusage_maxrss_in_bytes():
    from naohai.bench.naohai_row import rss_bytes
    from naohai.bench.worker import peak_rss_bytes
    block = bytearray(64 * 1024 * 1024)                  # touch 64 MiB: the peak is at least that above 0
    block[::4096] = b"\x01" * len(block[::4096])
    peak, hwm = peak_rss_bytes(), rss_bytes("VmHWM")
    assert peak >= 64 * 1024 * 1024 and abs(peak - hwm) <= 8 * 1024 * 1024   # the kernel's two views of one figure
