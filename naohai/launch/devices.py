"""How many worker processes a strategy file asks for.

A strategy file with a ``mesh:`` is parsed (and so fully checked) by
:func:`naohai.strategy.schema.load_strategy`; its device count is the product of
the mesh sizes.  Without a mesh the count comes from the command line (devices per
node x nodes).
"""
from __future__ import annotations

import os
from typing import Optional

from naohai.config import read_yaml
from naohai.errors import UserError
from naohai.strategy.schema import is_strategy_mapping, parse_strategy


def mesh_device_count(strategy_path: Optional[str]) -> Optional[int]:
    """Product of ``mesh:`` sizes in the strategy file, or None if it has no mesh."""
    if not strategy_path:
        return None
    data = read_yaml(strategy_path, "strategy file")
    if not is_strategy_mapping(data):
        return None
    return parse_strategy(data, where=strategy_path).device_count


def worker_count(strategy_path: Optional[str], devices_per_node: Optional[int], nodes: int) -> int:
    """Workers for the job: the strategy's mesh if present, else devices_per_node x nodes.

    When both are given they must agree, so a typo in either is caught before launch.
    """
    mesh = mesh_device_count(strategy_path)
    if mesh is None:
        return (devices_per_node if devices_per_node is not None else 1) * nodes
    if devices_per_node is not None and devices_per_node * nodes != mesh:
        raise UserError(f"the strategy's mesh needs {mesh} devices but --devices-per-node "
                        f"{devices_per_node} x --nodes {nodes} = {devices_per_node * nodes}",
                        where=strategy_path, key="mesh", rule="product of mesh sizes == nodes x devices per node")
    return mesh


#: resident memory of one MindSpore CPU worker, a floor: the two data-parallel workers of the tiny recipe
#: held 1.3-1.5 GB each, a one-device `naohai train tiny` 2.2 GB (ps, this 2-core VM, 2026-11-25)
CPU_WORKER_MIN_BYTES = 1.2 * 2 ** 30
#: beyond this many CPU workers per core a launch is refused without --oversubscribe
MAX_WORKERS_PER_CORE = 2


def machine_resources() -> tuple:
    """(usable cores, available memory in bytes or None) of this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    available = None
    try:
        with open("/proc/meminfo", "r", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return cores, available


def check_machine(local_workers: int, device: str, oversubscribe: bool, warn,
                  resources: Optional[tuple] = None) -> None:
    """Before CPU workers start: warn when they outnumber the cores; refuse (UserError, unless
    ``oversubscribe``) when there are more than :data:`MAX_WORKERS_PER_CORE` per core or their memory
    floor (:data:`CPU_WORKER_MIN_BYTES` each) exceeds the available memory."""
    if device != "CPU":
        return
    cores, available = resources or machine_resources()
    gib = 2 ** 30
    problems = []
    if local_workers > MAX_WORKERS_PER_CORE * cores:
        problems.append(f"{local_workers} CPU workers on {cores} cores (more than {MAX_WORKERS_PER_CORE} per core)")
    if available is not None and local_workers * CPU_WORKER_MIN_BYTES > available:
        problems.append(f"{local_workers} CPU workers need at least {local_workers * CPU_WORKER_MIN_BYTES / gib:.1f} "
                        f"GiB ({CPU_WORKER_MIN_BYTES / gib:.1f} GiB each, the tiny recipe's floor) and "
                        f"{available / gib:.1f} GiB is available")
    if problems and not oversubscribe:
        raise UserError("this machine cannot hold the job: " + "; ".join(problems) + ". Use a strategy with "
                        "fewer devices (its mesh sets the worker count), or --oversubscribe to start them anyway",
                        where="launch", key="workers")
    if problems:
        warn("naohai launch: WARNING (--oversubscribe): " + "; ".join(problems))
    elif local_workers > cores:
        warn(f"naohai launch: WARNING: {local_workers} CPU workers share {cores} cores; each step will be slower "
             f"than on one worker per core")
