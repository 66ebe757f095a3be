"""Model FLOPs per token: the one definition the trainer's MFU and the planner share.

PaLM (Chowdhery et al. 2022, appendix B): training FLOPs per token = 6N + 12*L*h*s,
where N counts the parameters that take part in matrix multiplications and the
second term is the attention score and context matmuls.  Lookup tables that only
feed a Gather (learned position tables, PanGu's top-query position table) do no
matmul work and are left out; a tied word embedding counts once, as the head.
"""
from __future__ import annotations

from naohai.model.config import ModelConfig
from naohai.model.params import param_shapes

#: parameters read by a lookup only (no matmul FLOPs)
LOOKUP_ONLY = ("position_embedding", "query_embedding")


def matmul_params(cfg: ModelConfig) -> int:
    return sum(p.size for p in param_shapes(cfg) if not p.name.endswith(LOOKUP_ONLY))


def flops_per_token(cfg: ModelConfig) -> float:
    """Training (forward + backward) model FLOPs per token, without recompute."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.num_layers * cfg.hidden_size * cfg.seq_length
