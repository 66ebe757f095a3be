"""The scoring engine behind naohai's lm-eval backend and the in-loop evaluator.

:class:`Scorer` answers the two questions every lm-eval request type reduces to, on token ids:

* ``loglikelihood(pairs)``: for each (context, continuation) the summed log-probability of the
  continuation after the context and whether greedy decoding would have produced it.  Requests
  are packed into batches of ``batch`` rows of the model's ``seq_length`` (the width its graphs
  are built for), right-padded, and scored by ONE compiled graph (:class:`naohai.model.transformer.TokenScoreNet` under ``mindspore.jit``): the
  same shape for every batch of a call, so it compiles once and never per example.  The causal
  mask makes the right padding invisible to the real tokens.
* ``generate(prompts, ...)``: greedy continuations through the key/value cache and the one
  compiled decode step of :class:`naohai.generate.CachedDecoder`, a batch at a time, stopping a
  row at the EOD id or when its text contains a stop string.

Inputs longer than the model's window are cut from the LEFT (the newest tokens are kept, as
lm-eval's Hugging Face backend does: the last ``seq_length + 1`` ids of context + continuation);
:attr:`Scorer.truncated` counts them so the caller can report it.

``forward`` may be replaced (see :meth:`Scorer.__init__`) by a graph compiled for another layout;
the engine only needs ``forward(inputs [B, W] int32, labels [B, W] int32) -> (nll [B, W] float,
argmax [B, W] int)`` as numpy arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

@dataclass
class Truncations:
    """Requests whose ids were cut from the left to fit the model's window, by request type."""

    loglikelihood: int = 0
    generate: int = 0
    examples: List[str] = field(default_factory=list)    # a few "kind: n ids -> m ids" lines

    def total(self) -> int:
        return self.loglikelihood + self.generate

    def note(self, kind: str, before: int, after: int) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.examples) < 5:
            self.examples.append(f"{kind}: {before} ids -> {after}")

    def to_dict(self) -> Dict[str, object]:
        return {"loglikelihood": self.loglikelihood, "generate": self.generate, "examples": list(self.examples)}


def score_forward(model) -> Callable[[np.ndarray, np.ndarray], Tuple[np.ndarray, np.ndarray]]:
    """``forward(inputs, labels) -> (nll, argmax)`` of ``model`` on one device: the model's
    :class:`~naohai.model.transformer.TokenScoreNet` compiled with ``mindspore.jit`` (once per shape)."""
    import mindspore as ms
    from mindspore import Tensor

    from naohai.model.transformer import TokenScoreNet

    net = TokenScoreNet(model)
    net.set_train(False)
    fn = ms.jit(net.construct)

    def forward(inputs: np.ndarray, labels: np.ndarray):
        nll, top = fn(Tensor(np.asarray(inputs, np.int32)), Tensor(np.asarray(labels, np.int32)))
        return nll.asnumpy().astype(np.float64), top.asnumpy()
    return forward


class Scorer:
    """Log-likelihoods and greedy generations of a naohai model (see the module docstring).

    ``model`` is a :class:`~naohai.model.transformer.NaohaiLM` (either layer form; generation copies a
    layer-loop model's weights into a per-layer twin), ``cfg`` its ModelConfig; ``pad_id`` fills
    padding, ``eod_id`` ends a generation.  ``forward`` defaults to :func:`score_forward` of ``model``.
    """

    def __init__(self, model, cfg, *, pad_id: int, eod_id: int, batch: int = 16,
                 forward: Optional[Callable] = None):
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        self.model = model
        self.cfg = cfg
        self.pad_id = int(pad_id)
        self.eod_id = int(eod_id)
        self.batch = int(batch)
        self.max_length = int(cfg.seq_length)
        self._forward = forward
        self._decoder = None
        self._twin = None
        self.truncated = Truncations()
        self.shapes: set = set()       # (rows, width) of every scoring call made

    # ------------------------------------------------------------------ log-likelihood
    @property
    def forward(self):
        if self._forward is None:
            self._forward = score_forward(self.model)
        return self._forward

    def loglikelihood(self, pairs: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> List[Tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is the greedy one) per pair."""
        if not pairs:
            return []
        width = self.max_length
        rows = []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("a loglikelihood request needs at least one continuation token")
            ids = list(ctx) + list(cont)
            if len(ids) > width + 1:
                self.truncated.note("loglikelihood", len(ids) - 1, width)
            ids = ids[-(width + 1):]
            rows.append((ids, min(len(cont), len(ids) - 1)))
        out: List[Tuple[float, bool]] = []
        for start in range(0, len(rows), self.batch):
            chunk = rows[start:start + self.batch]
            inputs = np.full((self.batch, width), self.pad_id, np.int32)
            labels = np.full((self.batch, width), self.pad_id, np.int32)
            for r, (ids, _) in enumerate(chunk):
                inputs[r, :len(ids) - 1] = ids[:-1]
                labels[r, :len(ids) - 1] = ids[1:]
            self.shapes.add(inputs.shape)
            nll, top = self.forward(inputs, labels)
            for r, (ids, n) in enumerate(chunk):
                end = len(ids) - 1
                span = slice(end - n, end)
                out.append((-float(nll[r, span].sum()), bool((top[r, span] == labels[r, span]).all())))
        return out

    # ------------------------------------------------------------------ generation
    def _decoding_model(self):
        """A per-layer model with the current weights (the model itself unless it runs the layer loop)."""
        if not getattr(self.model, "layer_loop", False):
            return self.model
        from naohai.model.transformer import NaohaiLM
        from naohai.train.state import file_view

        if self._twin is None:
            self._twin = NaohaiLM(self.cfg, seed=0, layer_loop=False)
            self._twin.set_train(False)
        mine = {p.name: p for p in self._twin.get_parameters()}
        for entry in file_view(self.cfg, list(self.model.get_parameters())):
            mine[entry.name].set_data(_tensor(entry.asnumpy()))
        return self._twin

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop: Optional[Callable[[List[int]], bool]] = None) -> List[List[int]]:
        """Greedy new ids per prompt, ``batch`` prompts at a time (a short last batch is filled with dummy
        rows, so the decode step keeps one shape); a row ends at EOD, at ``max_new_tokens`` or when
        ``stop(ids so far)`` says so."""
        from naohai.generate import CachedDecoder, SamplingConfig

        model = self._decoding_model()
        if self._decoder is None or self._decoder.model is not model:
            self._decoder = CachedDecoder(model, self.cfg, pad_id=self.pad_id)
        keep = max(1, self.cfg.positions - max_new_tokens)
        cut = []
        for p in prompts:
            p = list(p) or [self.eod_id]
            if len(p) > keep:
                self.truncated.note("generate", len(p), keep)
                p = p[-keep:]
            cut.append(p)
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
        out: List[List[int]] = []
        for start in range(0, len(cut), self.batch):
            chunk = cut[start:start + self.batch]
            filled = chunk + [[self.eod_id]] * (self.batch - len(chunk))
            row_stop = None if stop is None else (lambda r, ids: r < len(chunk) and stop(ids))
            new = self._decoder.generate_ids(filled, sampling, self.cfg.vocab_size, self.eod_id, stop=row_stop)
            out.extend(new[:len(chunk)])
        return out


def _tensor(array: np.ndarray):
    from mindspore import Tensor
    return Tensor(array)
