"""The folder of naohai's per-machine cache: the measured CPU matmul peak (:mod:`naohai.train.device`) and
the compiled CPU kernels (:mod:`naohai.model.cpu_kernels`)."""
from __future__ import annotations

import os

#: environment variable naming the folder of naohai's per-machine cache (default ~/.cache/naohai)
CACHE_DIR_VAR = "NAOHAI_CACHE_DIR"


def cache_dir() -> str:
    """``$NAOHAI_CACHE_DIR``, else ``$XDG_CACHE_HOME/naohai``, else ``~/.cache/naohai``."""
    if os.environ.get(CACHE_DIR_VAR):
        return os.environ[CACHE_DIR_VAR]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "naohai")
