"""Copy named float32 weights into a built model and read them back out."""
from __future__ import annotations

from typing import Dict

import numpy as np

from naohai.errors import UserError


def assign_weights(net, weights: Dict[str, np.ndarray], where: str = "checkpoint") -> None:
    """Set every parameter of ``net`` from ``weights`` (same names and shapes, nothing left over)."""
    from mindspore import Tensor

    params = {p.name: p for p in net.get_parameters()}
    missing = sorted(set(params) - set(weights))
    extra = sorted(set(weights) - set(params))
    if missing or extra:
        raise UserError(f"does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}", where=where)
    for name, p in params.items():
        value = np.asarray(weights[name], np.float32)
        if tuple(value.shape) != tuple(p.shape):
            raise UserError(f"'{name}' has shape {value.shape}, the model needs {tuple(p.shape)}", where=where)
        p.set_data(Tensor(value))


def read_weights(net) -> Dict[str, np.ndarray]:
    return {p.name: p.asnumpy().astype(np.float32) for p in net.get_parameters()}
