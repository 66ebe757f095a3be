"""Stub CUDA-family libraries that let MindSpore's GPU plugin load on a CPU-only host.

This module owns the *simulated device* layer: it inspects the installed MindSpore
wheel's GPU plugin, lists the CUDA / cuDNN / cuBLAS / NCCL / ... symbols it imports
(with their symbol versions), writes one small C source per library soname whose
functions pretend to succeed, compiles them with ``gcc`` into a cache directory and
lays out a fake ``CUDA_HOME`` (an ``nvcc`` script that reports CUDA 11.6 and a
``libcudart.so.11.6.55`` file name).  Nothing here runs on a device: the stubs only
have to survive MindSpore's start-up, communicator set-up and graph compilation.

Public API: :func:`ensure_stubs` returning a :class:`StubEnv`, whose
:meth:`StubEnv.env` gives the environment variables for a worker process.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from naohai.cache import cache_dir
from naohai.errors import UserError

#: bump when the generated C changes, so caches are rebuilt
GENERATOR_VERSION = "4"
#: environment variable the stub ``cudaGetDeviceCount`` reads
DEVICE_COUNT_VAR = "NAOHAI_SIM_DEVICE_COUNT"
#: CUDA version the fake toolkit claims (MindSpore picks ``plugin/gpu11.6``)
CUDA_VERSION = "11.6"
CUDART_FILE_NAME = "libcudart.so.11.6.55"

# soname for every CUDA-family library prefix (longest prefix first).
_PREFIX_SONAME: List[Tuple[str, str]] = [
    ("cublasLt", "libcublasLt.so.11"),
    ("cublas", "libcublas.so.11"),
    ("cudnn", "libcudnn.so.8"),
    ("cufft", "libcufft.so.10"),
    ("curand", "libcurand.so.10"),
    ("cusolver", "libcusolver.so.11"),
    ("cusparse", "libcusparse.so.11"),
    ("nvrtc", "libnvrtc.so.11.2"),
    ("nccl", "libnccl.so.2"),
    ("cuda", "libcudart.so.11.0"),
    ("cu", "libcuda.so.1"),
]
# libraries that the real CUDA ships without symbol versions
_UNVERSIONED = {"libcuda.so.1", "libnccl.so.2"}
# symbols some code paths look up dynamically; defined even if nm does not list them
_EXTRA_SYMBOLS = [
    "cudaRuntimeGetVersion", "cudaDriverGetVersion", "cudaGetDevice", "cudaMallocHost",
    "cudaPeekAtLastError", "cudaDeviceReset", "cudaDeviceGetAttribute",
    "cudaPointerGetAttributes", "cudnnGetVersion", "cudnnGetCudartVersion",
    "ncclGetVersion", "ncclGetErrorString", "ncclCommDestroy", "ncclCommInitRankConfig",
    "cuInit", "cuDriverGetVersion", "cuGetErrorString", "cuDeviceGet", "cuDeviceGetCount",
    "cublasGetVersion_v2", "nvrtcGetErrorString", "cusparseGetErrorString",
    "cublasLtCreate", "cublasLtDestroy",
]
_FAMILY_RE = re.compile(r"^(cu[A-Za-z]|nccl|nvrtc)")
_STRING_RETURNING = re.compile(
    r"^(cudaGetErrorString|cudaGetErrorName|cudnnGetErrorString|ncclGetErrorString|"
    r"nvrtcGetErrorString|cusparseGetErrorString|cublasGetStatusString|cublasGetStatusName|"
    r"ncclGetLastError)$")


@dataclasses.dataclass(frozen=True)
class StubEnv:
    """A built stub set.  ``lib_dir`` holds the stub sonames, ``cuda_home`` the fake toolkit."""

    root: Path
    lib_dir: Path
    cuda_home: Path
    sonames: Tuple[str, ...]
    symbol_count: int

    def env(self, num_devices: int, precompile_only: bool = True,
            base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """Environment variables (overrides) for a worker that sees ``num_devices`` GPUs."""
        base = dict(os.environ if base is None else base)
        out = {
            "CUDA_HOME": str(self.cuda_home),
            "CUDA_PATH": str(self.cuda_home),
            "PATH": os.pathsep.join(p for p in [str(self.cuda_home / "bin"), base.get("PATH", "")] if p),
            "LD_LIBRARY_PATH": os.pathsep.join(
                p for p in [str(self.lib_dir), base.get("LD_LIBRARY_PATH", "")] if p),
            "LD_PRELOAD": " ".join(
                p for p in [str(self.lib_dir / "libnccl.so.2"), base.get("LD_PRELOAD", "")] if p),
            DEVICE_COUNT_VAR: str(int(num_devices)),
        }
        if precompile_only:
            out["MS_DEV_PRECOMPILE_ONLY"] = "1"
        return out


def mindspore_plugin_dir() -> Path:
    """The ``mindspore/lib/plugin`` folder of the installed wheel."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("mindspore")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise UserError("MindSpore is not installed in this Python environment",
                        where="naohai.simulate", rule="simulate needs mindspore")
    plugin = Path(spec.origin).parent / "lib" / "plugin"
    if not (plugin / f"libmindspore_gpu.so.{CUDA_VERSION}").exists():
        raise UserError(f"this MindSpore wheel has no GPU {CUDA_VERSION} plugin "
                        f"(looked in {plugin})", where="naohai.simulate",
                        rule="simulated devices need the GPU plugin of the wheel")
    return plugin


def mindspore_version() -> str:
    plugin = mindspore_plugin_dir()
    version_file = plugin.parent.parent / "version.py"
    text = version_file.read_text() if version_file.exists() else ""
    m = re.search(r"""version\s*=\s*['"]([^'"]+)""", text)
    return m.group(1) if m else "unknown"


def plugin_libraries(plugin: Path) -> List[Path]:
    """Plugin files whose undefined CUDA symbols must be provided (real bundled libs excluded)."""
    libs = [plugin / f"libmindspore_gpu.so.{CUDA_VERSION}"]
    libs += sorted(p for p in (plugin / "gpu").glob("*.so*") if p.is_file())
    libs += sorted(p for p in (plugin / f"gpu{CUDA_VERSION}").glob("libnvidia_collective.so*"))
    return libs


def _require_tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        raise UserError(f"'{name}' is not on PATH; it is needed to build the simulated-device "
                        "stub libraries", where="naohai.simulate", rule="simulate needs gcc and nm")
    return path


def undefined_symbols(libs: Iterable[Path]) -> Dict[str, Optional[str]]:
    """Map CUDA-family undefined symbol -> symbol version (None when unversioned)."""
    nm = _require_tool("nm")
    found: Dict[str, Optional[str]] = {}
    for lib in libs:
        out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            if len(parts) < 2 or parts[-2] != "U":
                continue
            name, _, version = parts[-1].partition("@")
            version = version.lstrip("@") or None
            if not _FAMILY_RE.match(name):
                continue
            if found.get(name) is None:
                found[name] = version
    return found


def soname_for(name: str) -> str:
    for prefix, soname in _PREFIX_SONAME:
        if name.startswith(prefix):
            return soname
    raise ValueError(f"not a CUDA-family symbol: {name}")


def group_by_soname(symbols: Dict[str, Optional[str]]) -> Dict[str, List[str]]:
    """Versioned symbols go to the library named by their version; others by prefix."""
    groups: Dict[str, set] = {soname: set() for _, soname in _PREFIX_SONAME}
    for name, version in symbols.items():
        groups.setdefault(version or soname_for(name), set()).add(name)
    for name in _EXTRA_SYMBOLS:
        if name not in symbols:
            groups[soname_for(name)].add(name)
    return {k: sorted(v) for k, v in groups.items()}


_C_PRELUDE = r"""/* generated by naohai.simulate.stubs: simulated CUDA library, nothing runs */
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <stddef.h>
static const char naohai_msg[] = "naohai simulated device (no real GPU)";
static void *naohai_handle(void) { return calloc(1, 4096); }
static uintptr_t naohai_next_addr = (uintptr_t)0x7e0000000000ULL;
static int naohai_device = 0;
static int naohai_count(void) {
  const char *s = getenv("%(count_var)s");
  int n = s ? atoi(s) : 0;
  return n > 0 ? n : 8;
}
static int naohai_attr(int attr) {
  switch (attr) {
    case 16: return 80;            /* multiProcessorCount */
    case 75: return 7;             /* compute capability major */
    case 76: return 0;             /* compute capability minor */
    case 1: return 1024;           /* max threads per block */
    case 10: return 32;            /* warp size */
    default: return 1;
  }
}
"""

_SPECIAL = {
    "cudaMalloc": "long {n}(void **p, size_t size) {{ size = (size + 0xFFFFF) & ~(size_t)0xFFFFF;"
                  " if (p) *p = (void *)naohai_next_addr; naohai_next_addr += size + 0x100000; return 0; }}",
    "cudaHostAlloc": "long {n}(void **p, size_t size, unsigned f) {{ if (p) *p = malloc(size ? size : 1); return 0; }}",
    "cudaMallocHost": "long {n}(void **p, size_t size) {{ if (p) *p = malloc(size ? size : 1); return 0; }}",
    "cudaMemGetInfo": "long {n}(size_t *fr, size_t *tot) {{ if (fr) *fr = (size_t)30 << 30;"
                      " if (tot) *tot = (size_t)32 << 30; return 0; }}",
    "cudaGetDeviceCount": "long {n}(int *c) {{ if (c) *c = naohai_count(); return 0; }}",
    "cuDeviceGetCount": "long {n}(int *c) {{ if (c) *c = naohai_count(); return 0; }}",
    "cudaSetDevice": "long {n}(int d) {{ naohai_device = d; return 0; }}",
    "cudaGetDevice": "long {n}(int *d) {{ if (d) *d = naohai_device; return 0; }}",
    "cuDeviceGet": "long {n}(int *d, int o) {{ if (d) *d = o; return 0; }}",
    "cudaRuntimeGetVersion": "long {n}(int *v) {{ if (v) *v = 11060; return 0; }}",
    "cudaDriverGetVersion": "long {n}(int *v) {{ if (v) *v = 11060; return 0; }}",
    "cuDriverGetVersion": "long {n}(int *v) {{ if (v) *v = 11060; return 0; }}",
    "cudnnGetVersion": "size_t {n}(void) {{ return 8500; }}",
    "cudnnGetCudartVersion": "size_t {n}(void) {{ return 11060; }}",
    "ncclGetVersion": "long {n}(int *v) {{ if (v) *v = 21104; return 0; }}",
    "cublasGetVersion_v2": "long {n}(void *h, int *v) {{ if (v) *v = 11800; return 0; }}",
    "nvrtcVersion": "long {n}(int *a, int *b) {{ if (a) *a = 11; if (b) *b = 6; return 0; }}",
    "ncclGetUniqueId": "long {n}(void *id) {{ if (id) memset(id, 7, 128); return 0; }}",
    "cuGetErrorName": "long {n}(int e, const char **s) {{ if (s) *s = naohai_msg; return 0; }}",
    "cuGetErrorString": "long {n}(int e, const char **s) {{ if (s) *s = naohai_msg; return 0; }}",
    "cudaDeviceGetAttribute": "long {n}(int *v, int a, int d) {{ if (v) *v = naohai_attr(a); return 0; }}",
    "cuDeviceGetAttribute": "long {n}(int *v, int a, int d) {{ if (v) *v = naohai_attr(a); return 0; }}",
    "cufftCreate": "long {n}(int *plan) {{ if (plan) *plan = 1; return 0; }}",
    "cufftPlanMany": "long {n}(int *plan) {{ if (plan) *plan = 1; return 0; }}",
    "cudaGetDeviceProperties": (
        "long {n}(void *prop, int d) {{ char *p = (char *)prop; if (!p) return 1;"
        " memset(p, 0, 700); strcpy(p, \"Naohai Simulated GPU\");"
        " *(size_t *)(p + 288) = (size_t)32 << 30; *(size_t *)(p + 296) = 49152;"
        " *(int *)(p + 304) = 65536; *(int *)(p + 308) = 32; *(int *)(p + 320) = 1024;"
        " ((int *)(p + 324))[0] = 1024; ((int *)(p + 324))[1] = 1024; ((int *)(p + 324))[2] = 64;"
        " ((int *)(p + 336))[0] = 2147483647; ((int *)(p + 336))[1] = 65535;"
        " ((int *)(p + 336))[2] = 65535; *(int *)(p + 348) = 1410000;"
        " *(size_t *)(p + 352) = 65536; *(int *)(p + 360) = 7; *(int *)(p + 364) = 0;"
        " *(int *)(p + 388) = 80; return 0; }}"),
}


def _function_source(name: str) -> str:
    if name in _SPECIAL:
        return _SPECIAL[name].format(n=name)
    if _STRING_RETURNING.match(name):
        return f"const char *{name}(void) {{ return naohai_msg; }}"
    if "Create" in name or name.startswith("ncclCommInitRank"):
        # every *Create* / ncclCommInitRank* of these libraries takes the handle pointer first;
        # the fake handle is real (leaked) memory so a stray write through it is harmless.
        return f"long {name}(void **h) {{ if (h) *h = naohai_handle(); return 0; }}"
    return f"long {name}(void) {{ return 0; }}"


def library_source(names: Iterable[str]) -> str:
    body = [_C_PRELUDE % {"count_var": DEVICE_COUNT_VAR}]
    body += [_function_source(n) for n in names]
    return "\n".join(body) + "\n"


def _cache_key(plugin: Path, version: str) -> str:
    h = hashlib.sha256()
    h.update(f"{version}|{GENERATOR_VERSION}|{plugin}".encode())
    for lib in plugin_libraries(plugin):
        st = lib.stat()
        h.update(f"{lib.name}:{st.st_size}".encode())
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    """``simstubs`` in naohai's per-machine cache (:func:`naohai.cache.cache_dir`: ``$NAOHAI_CACHE_DIR`` first)."""
    return Path(cache_dir()) / "simstubs"


def _stub_env(root: Path) -> StubEnv:
    lib_dir = root / "cuda" / "lib64"
    sonames = tuple(sorted(p.name for p in lib_dir.iterdir() if not p.is_symlink()))
    count = int((root / "SYMBOL_COUNT").read_text())
    return StubEnv(root=root, lib_dir=lib_dir, cuda_home=root / "cuda",
                   sonames=sonames, symbol_count=count)


def _build(root: Path, plugin: Path, version: str) -> None:
    gcc = _require_tool("gcc")
    symbols = undefined_symbols(plugin_libraries(plugin))
    groups = group_by_soname(symbols)
    # MindSpore's import check finds libcudart via ldd, goes one folder up and globs
    # lib*/libcudart.so.X.Y.Z there: so the stubs live in the fake CUDA_HOME/lib64 itself.
    src, lib = root / "src", root / "cuda" / "lib64"
    cuda_bin = root / "cuda" / "bin"
    for d in (src, lib, cuda_bin):
        d.mkdir(parents=True, exist_ok=True)
    for soname, names in sorted(groups.items()):
        c_file = src / f"{soname}.c"
        c_file.write_text(library_source(names))
        cmd = [gcc, "-shared", "-fPIC", "-O1", "-w", "-o", str(lib / soname),
               f"-Wl,-soname,{soname}", str(c_file)]
        if soname not in _UNVERSIONED:
            vmap = src / f"{soname}.map"
            vmap.write_text(f"{soname} {{ global: *; }};\n")
            cmd.insert(-1, f"-Wl,--version-script={vmap}")
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"gcc failed for {soname}:\n{res.stderr[-2000:]}")
    for link, target in (("libcuda.so", "libcuda.so.1"), ("libcudnn.so", "libcudnn.so.8"),
                         ("libcudart.so", "libcudart.so.11.0"), ("libnccl.so", "libnccl.so.2")):
        os.symlink(target, lib / link)
    os.symlink("libcudart.so.11.0", lib / CUDART_FILE_NAME)
    nvcc = cuda_bin / "nvcc"
    nvcc.write_text(
        # MindSpore runs ["nvcc", "--version | grep release"] and parses the first line
        "#!/bin/sh\n# fake nvcc of the naohai simulated-device toolkit\n"
        f'echo "Cuda compilation tools, release {CUDA_VERSION}, V{CUDA_VERSION}.124"\n')
    nvcc.chmod(0o755)
    (root / "SYMBOL_COUNT").write_text(str(sum(len(v) for v in groups.values())))
    (root / "MINDSPORE_VERSION").write_text(version)


def ensure_stubs(folder: Optional[os.PathLike] = None) -> StubEnv:
    """Build (once) and return the stub libraries for the installed MindSpore.

    The result is cached under ``folder`` (default :func:`default_cache_dir`) in a
    folder keyed by the MindSpore version, the plugin files and :data:`GENERATOR_VERSION`;
    later calls only check that folder.  Builds are atomic (temp dir + rename), so
    concurrent callers are safe.
    """
    plugin = mindspore_plugin_dir()
    version = mindspore_version()
    base = Path(folder) if folder is not None else default_cache_dir()
    root = base / _cache_key(plugin, version)
    if (root / "SYMBOL_COUNT").exists():
        return _stub_env(root)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=base))
    try:
        _build(tmp, plugin, version)
        try:
            os.rename(tmp, root)
        except OSError:
            if not (root / "SYMBOL_COUNT").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _stub_env(root)
