"""ModelArts job environment -> `naohai launch` flags for this node.

On a ModelArts training node the platform sets:

* ``MA_NUM_HOSTS`` (or ``VC_WORKER_NUM``): number of nodes;
* ``VC_TASK_INDEX``: this node's 0-based index (absent or 0 on one node);
* ``MA_NUM_GPUS``: accelerators per node (default 8);
* ``VC_WORKER_HOSTS``: comma-separated node host names, the first is the master.

:func:`flags_from_env` turns these into ``--nodes --node-rank --devices-per-node
--master-addr`` (the master host resolved to an IP when possible).  Run as
``python -m naohai.launch.modelarts_env`` it prints the flags one per line, which
``run/modelarts_boot.sh`` reads; an error prints one paragraph and exits 2.
"""
from __future__ import annotations

import socket
import sys
from typing import Callable, List, Mapping, Optional

from naohai.errors import UserError

WHERE = "ModelArts environment"
DEFAULT_DEVICES = 8


def _int_var(environ: Mapping[str, str], name: str, minimum: int) -> Optional[int]:
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise UserError(f"variable {name}={raw!r} is not an integer", where=WHERE, key=name) from None
    if value < minimum:
        raise UserError(f"variable {name}={value} must be at least {minimum}", where=WHERE, key=name)
    return value


def resolve_host(host: str) -> str:
    """The IPv4 address of ``host`` (like ``getent hosts``), or ``host`` unchanged."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError, UnicodeError):
        return host


def flags_from_env(environ: Mapping[str, str], resolve: Callable[[str], str] = resolve_host) -> List[str]:
    """`naohai launch` flags for this node from the platform's variables.

    Raises UserError naming the missing or bad variable.
    """
    nodes = _int_var(environ, "MA_NUM_HOSTS", 1)
    if nodes is None:
        nodes = _int_var(environ, "VC_WORKER_NUM", 1)
    if nodes is None:
        raise UserError("neither MA_NUM_HOSTS nor VC_WORKER_NUM is set, so the node count is unknown; "
                        "is this running inside a ModelArts training job?", where=WHERE, key="MA_NUM_HOSTS")
    devices = _int_var(environ, "MA_NUM_GPUS", 1)
    devices = DEFAULT_DEVICES if devices is None else devices
    rank = _int_var(environ, "VC_TASK_INDEX", 0)
    if rank is None:
        if nodes > 1:
            raise UserError(f"VC_TASK_INDEX is not set but the job has {nodes} nodes", where=WHERE,
                            key="VC_TASK_INDEX")
        rank = 0
    if rank >= nodes:
        raise UserError(f"variable VC_TASK_INDEX={rank} is out of range for {nodes} node(s)", where=WHERE,
                        key="VC_TASK_INDEX", rule="0 <= VC_TASK_INDEX < node count")
    flags = ["--nodes", str(nodes), "--node-rank", str(rank), "--devices-per-node", str(devices)]
    hosts = [h.strip() for h in environ.get("VC_WORKER_HOSTS", "").split(",") if h.strip()]
    if nodes > 1:
        if not hosts:
            raise UserError(f"VC_WORKER_HOSTS is not set but the job has {nodes} nodes; the first host "
                            "is the master address", where=WHERE, key="VC_WORKER_HOSTS")
        if len(hosts) != nodes:
            raise UserError(f"variable VC_WORKER_HOSTS lists {len(hosts)} host(s) but the job has {nodes} "
                            "nodes", where=WHERE, key="VC_WORKER_HOSTS")
        flags += ["--master-addr", resolve(hosts[0])]
    return flags  # one node: msrun's scheduler listens on 127.0.0.1


def main(argv: Optional[List[str]] = None) -> int:
    import os
    try:
        flags = flags_from_env(os.environ)
    except UserError as err:
        print(f"naohai: error: {err}", file=sys.stderr)
        return err.exit_code
    print("\n".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
