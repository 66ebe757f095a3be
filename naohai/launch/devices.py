"""How many worker processes a strategy file asks for.

A strategy file with a ``mesh:`` is parsed (and so fully checked) by
:func:`naohai.strategy.schema.load_strategy`; its device count is the product of
the mesh sizes.  Without a mesh the count comes from the command line (devices per
node x nodes).
"""
from __future__ import annotations

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
