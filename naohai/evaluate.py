"""Mean loss and perplexity of a model on given token ids, with the reference masking.

Windows are ``seq_length + 1`` ids (inputs and their next tokens); a 1-D stream
is cut into consecutive windows (a last partial window is dropped).  Each window
counts the tokens the model's loss counts (all, or those whose input is not
``loss_pad_id``), so the overall mean is the token-weighted mean of the
per-window losses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict

import numpy as np

from naohai.config import ModelConfig
from naohai.errors import UserError


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int
    windows: int

    def to_dict(self) -> Dict[str, float]:
        return {"loss": self.loss, "perplexity": self.perplexity, "tokens": self.tokens, "windows": self.windows}


def windows_of(ids: np.ndarray, cfg: ModelConfig, where: str) -> np.ndarray:
    """[n, s + 1] int32 windows from a 1-D stream or 2-D array of token ids."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise UserError(f"token ids must be integers, got {ids.dtype}", where=where)
    s = cfg.seq_length + 1
    if ids.ndim == 1:
        n = ids.size // s
        if n == 0:
            raise UserError(f"the text has {ids.size} tokens; {s} needed (one window: the model's seq_length "
                            f"{s - 1} + 1 for the last label; a last partial window is not scored)", where=where)
        ids = ids[: n * s].reshape(n, s)
    if ids.ndim != 2 or ids.shape[1] != s or ids.shape[0] == 0:
        raise UserError(f"needs at least one window of seq_length + 1 = {s} ids (a 1-D stream or [n, {s}]), "
                        f"got shape {tuple(ids.shape)}", where=where)
    if ids.min() < 0 or ids.max() >= cfg.padded_vocab_size:
        raise UserError(f"token ids must be in [0, {cfg.padded_vocab_size}), got {ids.min()}..{ids.max()}",
                        where=where)
    return ids.astype(np.int32)


def evaluate(model, cfg: ModelConfig, windows: np.ndarray, batch: int = 8) -> EvalResult:
    """Token-weighted mean loss of ``model(inputs, labels)`` over the windows."""
    from mindspore import Tensor

    total, count = 0.0, 0
    for start in range(0, len(windows), batch):
        w = windows[start:start + batch]
        inputs, labels = w[:, :-1], w[:, 1:]
        n = int((inputs != cfg.loss_pad_id).sum()) if cfg.loss_pad_id is not None else int(inputs.size)
        loss = float(model(Tensor(inputs), Tensor(labels)).asnumpy())
        if cfg.loss_pad_id is not None:
            loss = loss * (n + 1e-5) / max(n, 1)      # undo the + 1e-5 of the reference denominator
        total += loss * n
        count += n
    mean = total / max(count, 1)
    return EvalResult(mean, math.exp(min(mean, 700.0)), count, len(windows))


def token_nll_fn(model):
    """``nll(windows [b, s + 1] ids) -> [b, s]`` float64 next-token negative log-likelihoods under ``model``.

    Entry (r, t) is ``-log p(windows[r, t + 1] | windows[r, :t + 1])`` with the softmax over the padded
    vocabulary, as the model's own loss takes it (:class:`naohai.model.transformer.TokenNLLNet`, compiled
    with ``mindspore.jit`` on the first call, once per shape: about 80x PyNative's op-by-op speed on the
    micro model on CPU).  No position is masked: the caller decides which predictions count (e.g. not
    those made from ``loss_pad_id``).
    """
    import mindspore as ms
    from mindspore import Tensor

    from naohai.model.transformer import TokenNLLNet

    net = TokenNLLNet(model)
    net.set_train(False)
    fn = ms.jit(net.construct)

    def nll(windows: np.ndarray) -> np.ndarray:
        x = np.asarray(windows, np.int32)
        return fn(Tensor(x[:, :-1]), Tensor(x[:, 1:])).asnumpy().astype(np.float64)
    return nll
