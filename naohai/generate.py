"""Text generation from a checkpoint: greedy, temperature, top-k and top-p sampling.

The model runs on a fixed ``[1, seq_length]`` window (padded on the right; the
causal mask makes padding invisible), so one compiled graph serves every step.
Sampling happens on the host with numpy from a seeded generator.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from naohai.errors import UserError


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.8     # 0 = greedy
    top_k: int = 0               # 0 = off
    top_p: float = 1.0           # 1 = off
    seed: int = 0

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise UserError("must be a positive integer", where="command line", key="--max-new-tokens")
        if self.temperature < 0:
            raise UserError("must be >= 0 (0 = greedy)", where="command line", key="--temperature")
        if self.top_k < 0:
            raise UserError("must be >= 0 (0 = off)", where="command line", key="--top-k")
        if not 0.0 < self.top_p <= 1.0:
            raise UserError("must be in (0, 1]", where="command line", key="--top-p")


def sample_next(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, vocab: int) -> int:
    """Pick the next id from 1-D logits (only the first ``vocab`` entries are real pieces)."""
    logits = np.asarray(logits[:vocab], np.float64)
    if cfg.temperature == 0:
        return int(np.argmax(logits))
    logits = logits / cfg.temperature
    if cfg.top_k > 0 and cfg.top_k < vocab:
        kth = np.partition(logits, -cfg.top_k)[-cfg.top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - np.max(logits))
    probs /= probs.sum()
    if cfg.top_p < 1.0:
        order = np.argsort(-probs)
        cum = np.cumsum(probs[order])
        keep = order[: int(np.searchsorted(cum, cfg.top_p) + 1)]
        mask = np.zeros_like(probs)
        mask[keep] = probs[keep]
        probs = mask / mask.sum()
    return int(rng.choice(len(probs), p=probs))


class Generator:
    def __init__(self, checkpoint: str, device: Optional[str] = None):
        import mindspore as ms
        from mindspore import Tensor

        from naohai.config import recipe_from_dict
        from naohai.data.pipeline import default_tokenizer_path
        from naohai.data.tokenizer import Tokenizer
        from naohai.model.transformer import LogitsNet, NaohaiLM
        from naohai.checkpoint import store as ckpt

        path = ckpt.resolve_checkpoint(checkpoint)
        state = ckpt.read_manifest(path)
        recipe = recipe_from_dict(state["recipe"], where=os.path.join(path, ckpt.MANIFEST))
        run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        tok_path = recipe.data.tokenizer or os.path.join(run_dir, "tokenizer.model")
        if not os.path.exists(tok_path):
            tok_path = default_tokenizer_path(recipe)
        self.tokenizer = Tokenizer.load(tok_path)
        ms.set_context(mode=ms.GRAPH_MODE)
        from naohai.train.device import resolve_device
        ms.set_device(resolve_device(device or "auto", where="command line", key="--device"))
        self.cfg = recipe.model
        self.model = NaohaiLM(self.cfg, seed=0)
        ckpt.load_weights(path, list(self.model.get_parameters()))
        self.net = LogitsNet(self.model)
        self.net.set_train(False)
        self._tensor = Tensor
        self.step = int(state["step"])

    def generate(self, prompt: str, cfg: SamplingConfig) -> str:
        cfg.validate()
        s = self.cfg.seq_length
        ids: List[int] = self.tokenizer.encode(prompt) if prompt else []
        if not ids:
            ids = [self.tokenizer.eod_id]
        rng = np.random.default_rng(cfg.seed)
        new: List[int] = []
        for _ in range(cfg.max_new_tokens):
            window = ids[-s:]
            arr = np.full((1, s), self.tokenizer.pad_id, np.int32)
            arr[0, : len(window)] = window
            logits = self.net(self._tensor(arr)).asnumpy()[0, len(window) - 1]
            nxt = sample_next(logits, cfg, rng, self.tokenizer.vocab_size)
            if nxt == self.tokenizer.eod_id:
                break
            ids.append(nxt)
            new.append(nxt)
        return self.tokenizer.decode(new)
