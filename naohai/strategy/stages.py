"""Layer -> pipeline stage assignment.

Owns the ``auto`` balancer and the mapping from (virtual) stage sizes to the
physical stage and chunk of every layer.

``auto`` treats the embedding (on the first stage) and the output head (on the
last stage) as extra layer-equivalents of cost and splits the layers into
contiguous groups minimising the most loaded stage; ties are broken by the
smallest sum of squared stage loads, then by putting extra layers late.  The
default cost of the embedding and of the head is the parameter count of the
(padded) vocabulary table divided by the parameter count of one decoder layer:
memory, not FLOPs, is what limits the first and last stages.  For
PengCheng-Mind 7B on 4 stages this gives the published 7/9/9/7 split.
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple

from naohai.config import ModelConfig
from naohai.model.params import layer_params


def vocab_table_cost(cfg: ModelConfig) -> float:
    """Parameters of the vocabulary table in units of one decoder layer's parameters."""
    layer = sum(p.size for p in layer_params(cfg, 0))
    table = cfg.padded_vocab_size * cfg.hidden_size
    return table / layer if layer else 0.0


def balance(num_layers: int, stages: int, first_extra: float, last_extra: float) -> List[int]:
    """Contiguous split of ``num_layers`` into ``stages`` non-empty groups (see module docstring)."""
    return list(_balance(num_layers, stages, float(first_extra), float(last_extra)))


@lru_cache(maxsize=256)
def _balance(num_layers: int, stages: int, first_extra: float, last_extra: float) -> Tuple[int, ...]:
    if stages < 1 or num_layers < stages:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")
    if stages == 1:
        return (num_layers,)

    def load(stage: int, n: int) -> float:
        return n + (first_extra if stage == 0 else 0.0) + (last_extra if stage == stages - 1 else 0.0)

    # best[k][i]: (max load, sum of squares, split) for the first i layers on k stages
    inf = (float("inf"), float("inf"), ())
    best = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0.0, ())
    for k in range(1, stages + 1):
        lo, hi = k, num_layers - (stages - k)
        for i in range(lo, hi + 1):
            cand = inf
            for n in range(1, i - (k - 1) + 1):
                prev = best[k - 1][i - n]
                if prev[0] == float("inf"):
                    continue
                w = load(k - 1, n)
                key = (round(max(prev[0], w), 9), round(prev[1] + w * w, 9), prev[2] + (n,))
                if key[:2] < cand[:2] or (key[:2] == cand[:2] and key[2] < cand[2]):
                    cand = key
            best[k][i] = cand
    return best[stages][num_layers][2]


def layer_placement(split: Sequence[int], pp: int, chunks: int) -> Tuple[List[int], List[int], List[int]]:
    """From per-virtual-stage layer counts (model order) to (stage_of_layer, chunk_of_layer, layers_per_stage).

    Virtual stage ``g`` lives on physical stage ``g % pp`` as chunk ``g // pp``
    (the Megatron interleaved layout); with one chunk this is the identity.
    """
    stage_of: List[int] = []
    chunk_of: List[int] = []
    per_stage = [0] * pp
    for g, n in enumerate(split):
        stage_of += [g % pp] * n
        chunk_of += [g // pp] * n
        per_stage[g % pp] += n
    return stage_of, chunk_of, per_stage


def stage_split(cfg: ModelConfig, pp: int, chunks: int, explicit: Optional[Sequence[int]],
                embedding_cost: Optional[float], head_cost: Optional[float]) -> List[int]:
    """Per-virtual-stage layer counts: the explicit list, or the ``auto`` balance."""
    if explicit is not None:
        return list(explicit)
    table = vocab_table_cost(cfg)
    emb = table if embedding_cost is None else embedding_cost
    head = table if head_cost is None else head_cost      # tied or not, the head holds a V x h matrix
    return balance(cfg.num_layers, pp * chunks, emb, head)
