"""Which device MindSpore runs on: ``resolve_device(requested)`` turns ``auto | CPU | GPU | Ascend``
(recipe key ``train.device``, flag ``--device``) into a device MindSpore can use here.

``auto`` picks Ascend where MindSpore can load its Ascend backend, then GPU, then CPU.  An explicit
device that is not usable is a :class:`~naohai.errors.UserError`.  Training, generation, evaluation,
scoring, ``check --compile`` and ``launch``'s pre-flight all ask here.

:func:`runs_on_cpu` tells whether a request ends on this machine's CPU (asking MindSpore only where a
vendor runtime is installed), and :func:`machine_memory` reads the machine's memory (``MemTotal``),
for the check that a CPU run fits in it (:mod:`naohai.strategy.host_memory`).
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

from naohai.config import DEVICES
from naohai.errors import UserError, did_you_mean


def _runtime_present(device: str) -> bool:
    """A cheap look for the vendor runtime before asking MindSpore (which logs loudly when absent)."""
    if device == "Ascend":
        return bool(os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_OPP_PATH")
                    or os.path.isdir("/usr/local/Ascend"))
    return bool(os.environ.get("CUDA_HOME") or shutil.which("nvidia-smi") or os.path.isdir("/usr/local/cuda"))


def runs_on_cpu(requested: Optional[str]) -> bool:
    """Whether ``requested`` (None = auto) ends on this machine's CPU: CPU itself, or auto where MindSpore can
    use neither Ascend nor a GPU (asked only where such a runtime is installed: without one auto is the CPU,
    and MindSpore is not imported).  An explicit GPU or Ascend is not the CPU (usable or not: that is
    :func:`resolve_device`'s to say)."""
    requested = requested or "auto"
    if requested != "auto":
        return requested == "CPU"
    if not any(_runtime_present(d) for d in ("Ascend", "GPU")):
        return True
    return resolve_device("auto") == "CPU"


#: where Linux says how much memory the machine has
MEMINFO = "/proc/meminfo"


def machine_memory(path: str = MEMINFO) -> Optional[int]:
    """This machine's memory in bytes (``MemTotal`` of ``/proc/meminfo``), or None where it cannot be read."""
    try:
        with open(path, "r", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    parts = line.split()
                    value = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
                    return value if value > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    return None


def available(device: str) -> bool:
    """Whether MindSpore can use ``device`` in this process (no device is claimed)."""
    if device == "CPU":
        return True
    if not _runtime_present(device):
        return False
    import logging
    import mindspore as ms
    from mindspore import log as ms_log
    logger = ms_log._get_logger()  # noqa: SLF001 - quiet the probe: "not available" is an answer here
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return bool(ms.hal.is_available(device))
    except Exception:  # noqa: BLE001 - a backend that cannot load is simply not available
        return False
    finally:
        logger.setLevel(level)


def resolve_device(requested: Optional[str], where: str = "recipe", key: str = "train.device") -> str:
    """The MindSpore device target for ``requested`` (None = auto)."""
    requested = requested or "auto"
    if requested not in DEVICES:
        raise UserError(f"'{requested}' is not one of {', '.join(DEVICES)}.{did_you_mean(requested, DEVICES)}",
                        where=where, key=key)
    if requested == "auto":
        for candidate in ("Ascend", "GPU"):
            if available(candidate):
                return candidate
        return "CPU"
    if not available(requested):
        raise UserError(f"{requested} was asked for, but MindSpore cannot use it on this machine (its {requested} "
                        f"backend does not load: no device, driver or CANN/CUDA runtime). Use train.device=auto "
                        f"or CPU here", where=where, key=key)
    return requested
