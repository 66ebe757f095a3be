"""Which device MindSpore runs on: ``resolve_device(requested)`` turns ``auto | CPU | GPU | Ascend``
(recipe key ``train.device``, flag ``--device``) into a device MindSpore can use here.

``auto`` picks Ascend where MindSpore can load its Ascend backend, then GPU, then CPU.  An explicit
device that is not usable is a :class:`~naohai.errors.UserError`.  Training, generation, evaluation,
scoring, ``check --compile`` and ``launch``'s pre-flight all ask here.
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
