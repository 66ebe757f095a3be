"""Stub CUDA libraries: generated from the wheel's real imports, built once, cached."""
import ctypes
import os
import subprocess
import time

import pytest

from naohai.simulate import stubs


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("simstubs")
    t0 = time.time()
    env = stubs.ensure_stubs(cache)
    return cache, env, time.time() - t0


def test_every_imported_cuda_symbol_is_defined(built):
    _, env, _ = built
    wanted = stubs.undefined_symbols(stubs.plugin_libraries(stubs.mindspore_plugin_dir()))
    assert len(wanted) > 200  # the GPU plugin really imports cudnn/cublas/nccl/...
    defined = {}
    for soname in env.sonames:
        out = subprocess.run(["nm", "-D", "--defined-only", str(env.lib_dir / soname)],
                             capture_output=True, text=True, check=True).stdout
        for line in out.split("\n"):
            parts = line.split()
            if len(parts) == 3 and parts[1] == "T":
                name, _, version = parts[2].partition("@")
                defined[name] = (soname, version.lstrip("@") or None)
    missing = [n for n in wanted if n not in defined]
    assert missing == []
    for name, version in wanted.items():
        if version is not None:  # versioned import must be found under that version node
            assert defined[name] == (version, version), name


def test_second_call_is_cached_and_fast(built):
    cache, env, _ = built
    t0 = time.time()
    again = stubs.ensure_stubs(cache)
    assert again == env
    assert time.time() - t0 < 1.0
    assert len([p for p in cache.iterdir() if not p.name.startswith(".")]) == 1


def test_fake_toolkit_reports_cuda_11_6(built):
    _, env, _ = built
    out = subprocess.run([str(env.cuda_home / "bin" / "nvcc"), "--version | grep release"],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "Cuda compilation tools, release 11.6, V11.6.124"
    assert (env.cuda_home / "lib64" / stubs.CUDART_FILE_NAME).exists()
    assert not list(env.lib_dir.glob("*.c"))  # sources stay out of the library folder


def test_stub_semantics(built, monkeypatch):
    _, env, _ = built
    monkeypatch.setenv(stubs.DEVICE_COUNT_VAR, "6")
    rt = ctypes.CDLL(str(env.lib_dir / "libcudart.so.11.0"))
    n = ctypes.c_int(0)
    assert rt.cudaGetDeviceCount(ctypes.byref(n)) == 0 and n.value == 6
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert rt.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0
    assert 0 < free.value < total.value
    a, b = ctypes.c_void_p(), ctypes.c_void_p()
    rt.cudaMalloc(ctypes.byref(a), ctypes.c_size_t(1000))
    rt.cudaMalloc(ctypes.byref(b), ctypes.c_size_t(1000))
    assert a.value and b.value and a.value != b.value
    prop = ctypes.create_string_buffer(1024)
    assert rt.cudaGetDeviceProperties(prop, 0) == 0
    assert int.from_bytes(prop.raw[388:392], "little") > 0  # multiProcessorCount
    rt.cudaGetErrorString.restype = ctypes.c_char_p
    assert b"simulated" in rt.cudaGetErrorString(1)
    nccl = ctypes.CDLL(str(env.lib_dir / "libnccl.so.2"))
    comm = ctypes.c_void_p()
    assert nccl.ncclCommInitRank(ctypes.byref(comm), 2, 0) == 0 and comm.value


def test_env_points_at_stubs(built):
    _, env, _ = built
    e = env.env(4, base={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/x"})
    assert e[stubs.DEVICE_COUNT_VAR] == "4"
    assert e["MS_DEV_PRECOMPILE_ONLY"] == "1"
    assert e["CUDA_HOME"] == str(env.cuda_home)
    assert e["PATH"].split(os.pathsep)[0] == str(env.cuda_home / "bin")
    assert e["LD_LIBRARY_PATH"].split(os.pathsep) == [str(env.lib_dir), "/x"]
    assert e["LD_PRELOAD"].endswith("libnccl.so.2")
    assert "MS_DEV_PRECOMPILE_ONLY" not in env.env(4, precompile_only=False, base={})


def test_stub_cache_follows_naohai_cache_dir(tmp_path, monkeypatch):
    """The stubs live in naohai's per-machine cache: ``$NAOHAI_CACHE_DIR`` first, then ``$XDG_CACHE_HOME/naohai``."""
    monkeypatch.setenv("NAOHAI_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert stubs.default_cache_dir() == tmp_path / "mine" / "simstubs"
    monkeypatch.delenv("NAOHAI_CACHE_DIR")
    assert stubs.default_cache_dir() == tmp_path / "xdg" / "naohai" / "simstubs"
