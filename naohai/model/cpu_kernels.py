"""Compiled float32 kernels for MindSpore's CPU backend (``cpu_kernels.cc``), exact to MindSpore's own ops.

MindSpore 2.10's CPU kernels are slow or memory-hungry for the elementwise work around the matmuls: a
broadcast operand (a bias, a norm's row statistics or gamma, RoPE's tables, the attention bias; see
:func:`naohai.model.layers.full`), the attention's head transposes (:func:`naohai.model.layers.swap_axes_1_2`),
chains of products that each write a full tensor (SwiGLU, the softmax backward, RoPE's rotation), and the
generation cache's write of a new key or value (:func:`naohai.model.layers.write_column`).  These kernels do
the same IEEE operations on the same values, in the same order for each element, so every result is
MindSpore's bit for bit (checked against MindSpore's ops in ``tests/model/test_cpu_kernels.py``); they write
and keep less memory (on the bench models the peak resident set falls by 10-18%).  Each call splits its rows over
MindSpore's own CPU thread pool (found in the process by its exported symbols; without it the caller does all the
rows), each row whole on one thread with the caller's floating-point mode, so the results do not depend on the
split (tested against the same kernels run in a process without MindSpore).

The *fused reductions* are the exception, used only where a recipe asks for them (``train.cpu_reductions:
fused``): LayerNorm and RMSNorm forward and backward in one kernel each (``layer_norm``, ``rms_norm`` and their
``_grad``), the attention's scale, bias and softmax (``scaled_softmax``) and SwiGLU's sigmoid and products
(``silu_product``) likewise, with an exp of their own (within 2 ulp, not MindSpore's), the head's cross entropy
and its gradient with respect to the logits in one pass over each row (``softmax_cross_entropy``), the
gradients' sums of squares for the global norm, all in one kernel (``square_sums``), and AdamW's update of every
parameter, with the clip's scaling and the step guard's decision, by one kernel that writes the parameters and
moments in place (``adam_all``, marked as a memory side effect).  They sum in an order
of their own (fixed, so runs repeat), not in the order of MindSpore's ``MatMul``, ``ReduceSum`` and ``AddN`` that the
composed graph uses -- which depends on the shapes, and for ``ReduceSum`` above 200,000 elements on which of
its threads finishes first -- so float32 results differ from the composed graph's in the last bits.

They are AOT custom ops (``ops.Custom``, func_type ``"aot"``) built from the C++ source shipped beside this
file, once per machine and source, with the system's C++ compiler (``$CXX``, default ``g++``) into
``<cache>/cpu_kernels`` (:func:`naohai.cache.cache_dir`: ``$NAOHAI_CACHE_DIR``, else ``~/.cache/naohai``;
the temporary directory when that is not writable).  Without a compiler, or with ``NAOHAI_CPU_KERNELS=0``,
the cells use MindSpore's ops: the same numbers, slower.

:func:`primitives` returns the primitives by name (:data:`ENTRY`), or None when the kernels are off or could
not be built (the reason is printed once on stderr and kept in :func:`why_not`).
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, Optional

from naohai.cache import cache_dir
from naohai.errors import UserError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cc")
#: name -> (entry point, output shape and dtype from the inputs')
ENTRY = {"add": ("NaohaiBroadcastAdd", lambda x, b: x),
         "sub": ("NaohaiBroadcastSub", lambda x, b: x),
         "mul": ("NaohaiBroadcastMul", lambda x, b: x),
         "swap_axes_1_2": ("NaohaiSwapAxes12", lambda x: x),
         "swiglu": ("NaohaiSwiGLU", lambda g, s, u: g),
         "swiglu_grad": ("NaohaiSwiGLUGrad", lambda dy, g, s, u: (g, g, g)),
         "sub_mul_rows": ("NaohaiSubMulRows", lambda yd, y, m: yd),
         "write_column": ("NaohaiWriteColumn", lambda past, new, slot: past),
         "rope": ("NaohaiRope", lambda x, cos, sin, code: x),
         "rope_grad": ("NaohaiRopeGrad", lambda dout, cos, sin, code: dout),
         "layer_norm": ("NaohaiLayerNorm", lambda x, g, b, e: x),
         "layer_norm_grad": ("NaohaiLayerNormGrad", lambda dy, x, g, e: (dy, g, g)),
         "rms_norm": ("NaohaiRMSNorm", lambda x, g, e: x),
         "rms_norm_grad": ("NaohaiRMSNormGrad", lambda dy, x, g, e: (dy, g)),
         "scaled_softmax": ("NaohaiScaledSoftmax", lambda x, bias, scale: x),
         "scaled_softmax_grad": ("NaohaiScaledSoftmaxGrad", lambda dy, y, scale: dy),
         "silu_product": ("NaohaiSiluProduct", lambda g, u: g),
         "silu_product_grad": ("NaohaiSiluProductGrad", lambda dy, g, u: (g, g)),
         "square_sums": ("NaohaiSquareSums", lambda *grads: grads[0]),
         "softmax_cross_entropy": ("NaohaiSoftmaxCrossEntropy", lambda x, labels, w: (x, x)),
         "adam_all": ("NaohaiAdamWeightDecayAll", lambda *tensors: tensors[0])}
_SHAPES = {"swap_axes_1_2": lambda x: [x[0], x[2], x[1], x[3]],
           "square_sums": lambda *grads: [1],
           "softmax_cross_entropy": lambda x, labels, w: ([x[0]], x),
           "adam_all": lambda *tensors: [1]}
#: kernels that write their inputs in place (MindSpore orders them as memory side effects)
_WRITES_INPUTS = ("adam_all",)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fopenmp-simd",
         "-std=c++17", "-shared", "-fPIC"]

_STATE: Dict[str, object] = {}


def enabled() -> bool:
    """``NAOHAI_CPU_KERNELS``: unset or 1 builds and uses the kernels, 0 keeps MindSpore's ops."""
    raw = os.environ.get("NAOHAI_CPU_KERNELS", "").strip()
    if raw in ("", "1"):
        return True
    if raw == "0":
        return False
    raise UserError(f"'{raw}' is not 0 or 1: 1 (the default) builds and uses naohai's compiled CPU kernels, "
                    "0 computes the same numbers with MindSpore's Tile and arithmetic ops",
                    where="environment", key="NAOHAI_CPU_KERNELS")


def _cpu_identity() -> str:
    """The CPU model and flags: a library built with -march=native runs only where they match."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _cache_dirs():
    yield os.path.join(cache_dir(), "cpu_kernels")
    yield os.path.join(tempfile.gettempdir(), f"naohai-cpu-kernels-{os.getuid() if hasattr(os, 'getuid') else 0}")


def build(cxx: Optional[str] = None) -> str:
    """The path of the built library (built now unless cached); raises RuntimeError saying why not."""
    cxx = cxx or os.environ.get("CXX") or "g++"
    compiler = shutil.which(cxx)
    if compiler is None:
        raise RuntimeError(f"no C++ compiler '{cxx}' on PATH")
    with open(SOURCE, "rb") as f:
        source = f.read()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"'{compiler} --version' failed: {e}") from e
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS).encode(), version.encode(),
                                     _cpu_identity().encode()])).hexdigest()[:20]
    errors = []
    for folder in _cache_dirs():
        lib = os.path.join(folder, f"naohai_cpu_kernels_{key}.so")
        if os.path.isfile(lib):
            return lib
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            errors.append(f"{folder}: {e}")
            continue
        try:
            done = subprocess.run([compiler, *FLAGS, SOURCE, "-o", tmp], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-800:]}")
            os.replace(tmp, lib)           # atomic: concurrent builders (ranks, test workers) are safe
            return lib
        except (OSError, subprocess.SubprocessError) as e:
            errors.append(f"{folder}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise RuntimeError("; ".join(errors))


def why_not() -> Optional[str]:
    """Why :func:`primitives` returned None (None when it did not, or was not asked yet)."""
    return _STATE.get("why")


def primitives():
    """:data:`ENTRY`'s names -> their ``ops.Custom`` primitives, built on first call; None when disabled or not
    buildable."""
    if "prims" in _STATE:
        return _STATE["prims"]
    prims = None
    if not enabled():
        _STATE["why"] = "NAOHAI_CPU_KERNELS=0"
    else:
        try:
            lib = build()
        except RuntimeError as e:
            _STATE["why"] = str(e)
            print(f"naohai: the compiled CPU kernels are not used ({e}); the Tile form computes the same "
                  "numbers, slower", file=sys.stderr)
        else:
            from mindspore import ops
            prims = {name: ops.Custom(f"{lib}:{entry}", out_shape=_SHAPES.get(name, like), out_dtype=like,
                                      func_type="aot")
                     for name, (entry, like) in ENTRY.items()}
            for name in _WRITES_INPUTS:
                prims[name].add_prim_attr("side_effect_mem", True)
    _STATE["prims"] = prims
    return prims
