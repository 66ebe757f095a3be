"""The configurations `naohai bench` measures, and the ``--models`` list that selects them.

``tiny`` is the tiny preset with the tiny recipe's batch (16 x 128); ``27m`` is the same
architecture family (LayerNorm, biases, rotate-half RoPE, SwiGLU, tied head) at hidden
512, 8 layers, 8 heads, FFN 1408, tiny's vocabulary 2048, batch 8 x 256 (26.80M parameters, the
model issue 30 measured); ``42m`` is ``27m`` with vocabulary 32000 (42.1M parameters).
Both run in float32 with dropout 0.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List

from naohai.config import MODEL_PRESETS, ModelConfig
from naohai.errors import UserError, did_you_mean


@dataclass(frozen=True)
class BenchModel:
    name: str
    model: ModelConfig
    batch: int                 # sequences per step (one device, no accumulation)

    @property
    def seq(self) -> int:
        return self.model.seq_length

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.model.seq_length


def _tiny_family(**changes) -> ModelConfig:
    cfg = dataclasses.replace(ModelConfig(**MODEL_PRESETS["tiny"]), **changes)
    cfg.validate(where="naohai bench")
    return cfg


def bench_models() -> Dict[str, BenchModel]:
    return {
        "tiny": BenchModel("tiny", _tiny_family(), 16),
        "27m": BenchModel("27m", _tiny_family(hidden_size=512, num_layers=8, num_heads=8, ffn_hidden_size=1408,
                                              seq_length=256), 8),
        "42m": BenchModel("42m", _tiny_family(hidden_size=512, num_layers=8, num_heads=8, ffn_hidden_size=1408,
                                              vocab_size=32000, seq_length=256), 8),
    }


def parse_models(text: str) -> List[BenchModel]:
    """``tiny,27m,42m`` -> the models, in the order given; unknown or repeated names are UserErrors."""
    known = bench_models()
    names = [n.strip() for n in str(text).split(",")]
    if not text or any(not n for n in names):
        raise UserError(f"'{text}' is not a comma-separated list of model names; choose from "
                        f"{', '.join(known)}", where="command line", key="--models")
    out = []
    for n in names:
        if n not in known:
            raise UserError(f"unknown model '{n}'.{did_you_mean(n, known)} Models: {', '.join(known)}",
                            where="command line", key="--models")
        if known[n] in out:
            raise UserError(f"model '{n}' is listed twice", where="command line", key="--models")
        out.append(known[n])
    return out
