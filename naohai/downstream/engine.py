"""The scoring engine behind naohai's lm-eval backend and the in-loop evaluator.

:class:`Scorer` answers the two questions every lm-eval request type reduces to, on token ids:

* ``loglikelihood(pairs)``: for each (context, continuation) the summed log-probability of the
  continuation after the context and whether greedy decoding would have produced it.  Requests
  with the same context (a multiple-choice question's choices) share it: the context's tokens
  are placed once, each continuation after them as a branch that attends to the context and to
  itself only (its positions go on from the context's), so a question with four choices costs its
  context once, not four times.  These units are packed, longest first, into rows of the model's
  ``seq_length`` (several share a row: each one's positions start at 0 and the attention bias keeps
  it to its own tokens, EOD resets included where the model has them), ``batch`` rows at a time,
  and scored by ONE compiled graph of fixed shape
  (:class:`naohai.model.transformer.PackedScoreNet` under ``mindspore.jit``, the model's
  explicit-bias step path), so it compiles once and never per example.
* ``generate(prompts, ...)``: greedy continuations through the key/value cache and the one
  compiled decode step of :class:`naohai.generate.CachedDecoder`, a batch at a time, stopping a
  row at the EOD id or when its text contains a stop string.

Inputs longer than the model's window are cut from the LEFT (the newest tokens are kept, as
lm-eval's Hugging Face backend does: the last ``seq_length + 1`` ids of context + continuation);
:attr:`Scorer.truncated` counts them so the caller can report it.

``forward`` may be replaced (see :meth:`Scorer.__init__`) by a graph compiled for another layout
that takes one request per row: ``forward(inputs [B, S] int32, labels [B, S] int32) -> (nll [B, S]
float, argmax [B, S] int)`` as numpy arrays (right padding, the model's own causal mask).  Such a
forward with ``sharded = True`` (the semi-auto scoring graph, :mod:`naohai.strategy.scoring`) runs on
weights no single rank holds whole, so generation goes through it too: greedy, one full forward per
new token (no key/value cache), the most likely id over the padded vocabulary.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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


def padding_id(tok) -> int:
    """The id that fills unused columns: the tokenizer's pad id, or its EOD where it has none (-1 / None)."""
    pad = getattr(tok, "pad_id", None)
    return int(pad) if isinstance(pad, int) and pad >= 0 else int(tok.eod_id)


def packed_forward(model) -> Callable[..., Tuple[np.ndarray, np.ndarray]]:
    """``forward(inputs, labels, positions, bias) -> (nll, argmax)`` of ``model`` on one device: its
    :class:`~naohai.model.transformer.PackedScoreNet` compiled with ``mindspore.jit`` (once per shape)."""
    import mindspore as ms
    from mindspore import Tensor

    from naohai.model.transformer import PackedScoreNet

    net = PackedScoreNet(model)
    net.set_train(False)
    fn = ms.jit(net.construct)

    def forward(inputs, labels, positions, bias):
        nll, top = fn(Tensor(np.asarray(inputs, np.int32)), Tensor(np.asarray(labels, np.int32)),
                      Tensor(np.asarray(positions, np.int32)), Tensor(np.asarray(bias, np.float32)))
        return nll.asnumpy().astype(np.float64), top.asnumpy()
    forward.packs = True
    return forward


def unit_layout(cfg, ids: np.ndarray, units: Sequence[Tuple[int, int, Sequence[int]]]) -> Tuple[np.ndarray, np.ndarray]:
    """(positions [S] int32, bias [1 or heads, S, S] float32) of one packed row holding ``units``
    ``(start, trunk, branches)``: ``trunk`` shared tokens at ``start``, then each branch's tokens
    (``branches`` their lengths), every branch reading the trunk and itself, as if it followed the
    trunk alone in a window of its own -- causal, nothing across units or branches, positions from
    0; with ``eod_reset`` / ``eod_reset_positions`` a path is split after each EOD as the model's
    :class:`~naohai.model.layers.DocumentLayout` splits a packed window; ALiBi distances along the
    path.  A unit with one branch is one ordinary request; unused columns attend to themselves."""
    from naohai.model.layers import alibi_slopes

    s = len(ids)
    allowed = np.eye(s, dtype=np.bool_)
    positions = np.zeros(s, np.int64)
    along = np.arange(s)                        # index along its path (ALiBi's distance)
    for start, trunk, branches in units:
        col = start + trunk
        for length in (list(branches) or [0]):
            path = np.concatenate([np.arange(start, start + trunk), np.arange(col, col + length)])
            col += length
            n = len(path)
            causal = np.tril(np.ones((n, n), np.bool_))
            if cfg.eod_reset or cfg.eod_reset_positions:     # EODs closed before each token of the path
                doc = np.concatenate([[0], np.cumsum(ids[path][:-1] == cfg.eod_id)])
                same_doc = doc[:, None] == doc[None, :]
            else:
                same_doc = np.ones((n, n), np.bool_)
            allowed[np.ix_(path, path)] = causal & same_doc if cfg.eod_reset else causal
            positions[path] = (causal & same_doc).sum(-1) - 1 if cfg.eod_reset_positions else np.arange(n)
            along[path] = np.arange(n)
    bias = np.where(allowed, 0.0, -1e9).astype(np.float32)[None]
    if cfg.position == "alibi":
        distance = (along[None, :] - along[:, None]).astype(np.float32)
        bias = bias + (alibi_slopes(cfg.num_heads)[:, None, None] * distance[None]).astype(np.float32)
    return positions.astype(np.int32), bias


class Scorer:
    """Log-likelihoods and greedy generations of a naohai model (see the module docstring).

    ``model`` is a :class:`~naohai.model.transformer.NaohaiLM` (either layer form; generation copies a
    layer-loop model's weights into a per-layer twin), ``cfg`` its ModelConfig; ``pad_id`` fills
    padding, ``eod_id`` stands for an empty prompt, a generation ends before any of ``stop_ids``
    (default: EOD; the tokenizer's ``stop_ids``); ``prefix_id`` (default EOD) is what the evaluation puts
    before a text that has no context, and ``special_tokens`` says that texts are encoded with the tokens the
    tokenizer adds (both from :func:`text_encoding`); ``repetition_penalty`` is transformers' (the model folder's
    generation_config.json asks for it, and lm-eval's ``hf`` model applies it there: :func:`greedy_settings`), for
    greedy generation with the KV cache (the sharded forward picks its argmax in the graph and applies none).
    ``forward`` defaults to :func:`packed_forward` of ``model``.
    """

    def __init__(self, model, cfg, *, pad_id: int, eod_id: int, batch: int = 16,
                 forward: Optional[Callable] = None, stop_ids: Optional[Sequence[int]] = None,
                 prefix_id: Optional[int] = None, special_tokens: bool = False, repetition_penalty: float = 1.0):
        """``forward``: None = :func:`packed_forward` of ``model``; else a one-request-per-row forward
        (see the module docstring) or one with ``packs = True`` taking positions and bias too."""
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch}")
        self.model = model
        self.cfg = cfg
        self.pad_id = int(pad_id)
        self.eod_id = int(eod_id)
        self.stop_ids = frozenset(int(i) for i in (stop_ids if stop_ids is not None else (eod_id,)))
        self.prefix_id = int(eod_id if prefix_id is None else prefix_id)
        self.special_tokens = bool(special_tokens)
        self.repetition_penalty = float(repetition_penalty)
        self.batch = int(batch)
        self.max_length = int(cfg.seq_length)
        self._forward = forward
        self._decoder = None
        self._twin = None
        self.truncated = Truncations()
        self.shapes: set = set()       # (rows, width) of every scoring call made
        self.graph_seconds = 0.0       # time inside the compiled scoring graph (compiles included)

    # ------------------------------------------------------------------ log-likelihood
    def warm_up(self) -> float:
        """Score one padding-sized request, so the scoring graph is compiled before any evaluation is
        timed; returns the seconds it took (not counted in :attr:`graph_seconds`)."""
        graph, t0 = self.graph_seconds, time.perf_counter()
        self.loglikelihood([([self.eod_id], [self.eod_id])])
        self.graph_seconds = graph
        return time.perf_counter() - t0

    @property
    def forward(self):
        if self._forward is None:
            self._forward = packed_forward(self.model)
        return self._forward

    def loglikelihood(self, pairs: Sequence[Tuple[Sequence[int], Sequence[int]]]) -> List[Tuple[float, bool]]:
        """(sum of log p(continuation | context), continuation is the greedy one) per pair."""
        if not pairs:
            return []
        width = self.max_length
        seqs = []
        for ctx, cont in pairs:
            if not cont:
                raise ValueError("a loglikelihood request needs at least one continuation token")
            ids = list(ctx) + list(cont)
            if len(ids) > width + 1:
                self.truncated.note("loglikelihood", len(ids) - 1, width)
            ids = ids[-(width + 1):]
            seqs.append((ids, min(len(cont), len(ids) - 1)))
        packs = getattr(self.forward, "packs", False)
        units = self._units(seqs, share=packs)
        lengths = [len(t_in) + sum(len(b_in) for _, b_in, _ in branches) for t_in, _, branches in units]
        rows = self._pack(lengths, width) if packs else [[u] for u in range(len(units))]
        out: List[Optional[Tuple[float, bool]]] = [None] * len(seqs)
        for start in range(0, len(rows), self.batch):
            chunk = rows[start:start + self.batch]
            inputs = np.full((self.batch, width), self.pad_id, np.int32)
            labels = np.full((self.batch, width), self.pad_id, np.int32)
            places = []                                    # (request, row, first column, tokens scored)
            layouts: List[List[Tuple[int, int, List[int]]]] = [[] for _ in range(self.batch)]
            for r, members in enumerate(chunk):
                col = 0
                for u in members:
                    t_in, t_lab, branches = units[u]
                    layouts[r].append((col, len(t_in), [len(b_in) for _, b_in, _ in branches]))
                    inputs[r, col:col + len(t_in)] = t_in
                    labels[r, col:col + len(t_in)] = t_lab
                    col += len(t_in)
                    for i, b_in, b_lab in branches:
                        inputs[r, col:col + len(b_in)] = b_in
                        labels[r, col:col + len(b_in)] = b_lab
                        places.append((i, r, col, len(b_in)))
                        col += len(b_in)
            self.shapes.add(inputs.shape)
            if packs:
                positions = np.zeros_like(inputs)
                bias = []
                for r in range(self.batch):
                    pos, b = unit_layout(self.cfg, inputs[r], layouts[r])
                    positions[r] = pos
                    bias.append(b)
                t0 = time.perf_counter()
                nll, top = self.forward(inputs, labels, positions, np.stack(bias))
            else:
                t0 = time.perf_counter()
                nll, top = self.forward(inputs, labels)
            self.graph_seconds += time.perf_counter() - t0
            for i, r, col, n in places:
                span = slice(col, col + n)
                out[i] = (-float(nll[r, span].sum()), bool((top[r, span] == labels[r, span]).all()))
        return out

    def _units(self, seqs, share: bool) -> List[Tuple[List[int], List[int], List[Tuple[int, List[int], List[int]]]]]:
        """Scoring units ``(trunk inputs, trunk labels, [(request, branch inputs, branch labels)])`` of
        ``seqs`` (``(ids, tokens scored)`` per request): a request's trunk is the part of its window that
        is not scored.  With ``share``, requests whose trunks (and the id after them) are equal become
        branches of one unit, as many as fit in ``seq_length``; else one unit per request."""
        width = self.max_length
        groups: Dict[Tuple[int, ...], List[int]] = {}
        for i, (ids, n) in enumerate(seqs):
            key = tuple(ids[:len(ids) - n]) if share else (i,)
            groups.setdefault(key, []).append(i)
        units = []
        for members in groups.values():
            ids, n = seqs[members[0]]
            t = len(ids) - 1 - n
            trunk_in, trunk_lab = list(ids[:t]), list(ids[1:t + 1])
            current: List[Tuple[int, List[int], List[int]]] = []
            used = t
            for i in members:
                ids, n = seqs[i]
                branch = (i, list(ids[t:-1]), list(ids[t + 1:]))
                if current and used + n > width:
                    units.append((trunk_in, trunk_lab, current))
                    current, used = [], t
                current.append(branch)
                used += n
            units.append((trunk_in, trunk_lab, current))
        return units

    @staticmethod
    def _pack(lengths: Sequence[int], width: int) -> List[List[int]]:
        """Rows of request indices, first fit by decreasing length, each row's lengths summing to <= width."""
        rows: List[List[int]] = []
        room: List[int] = []
        for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
            for r, free in enumerate(room):
                if lengths[i] <= free:
                    rows[r].append(i)
                    room[r] -= lengths[i]
                    break
            else:
                rows.append([i])
                room.append(width - lengths[i])
        return rows

    # ------------------------------------------------------------------ generation
    def _decoding_model(self):
        """A per-layer model with the current weights (the model itself unless it runs the layer loop)."""
        if not getattr(self.model, "layer_loop", False):
            return self.model
        from naohai.model.transformer import NaohaiLM
        from naohai.checkpoint.entries import file_view

        if self._twin is None:
            self._twin = NaohaiLM(self.cfg, seed=0, layer_loop=False)
            self._twin.set_train(False)
        twin_params = {p.name: p for p in self._twin.get_parameters()}
        for entry in file_view(self.cfg, list(self.model.get_parameters())):
            twin_params[entry.name].set_data(_tensor(entry.asnumpy()))
        return self._twin

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 stop: Optional[Callable[[List[int]], bool]] = None) -> List[List[int]]:
        """Greedy new ids per prompt, ``batch`` prompts at a time (a short last batch is filled with dummy
        rows, so the decode step keeps one shape); a row ends at a stop id, at ``max_new_tokens`` or when
        ``stop(ids so far)`` says so."""
        if getattr(self._forward, "sharded", False):
            return self._generate_by_forward(prompts, max_new_tokens, stop)
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
        sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0,
                                  repetition_penalty=self.repetition_penalty)
        out: List[List[int]] = []
        for start in range(0, len(cut), self.batch):
            chunk = cut[start:start + self.batch]
            filled = chunk + [[self.eod_id]] * (self.batch - len(chunk))
            row_stop = None if stop is None else (lambda r, ids: r < len(chunk) and stop(ids))
            new = self._decoder.generate_ids(filled, sampling, self.cfg.vocab_size, self.stop_ids, stop=row_stop)
            out.extend(new[:len(chunk)])
        return out


    def _generate_by_forward(self, prompts, max_new_tokens: int, stop) -> List[List[int]]:
        """:meth:`generate` through the one-request-per-row ``forward``: each step scores the rows as they
        stand and appends the most likely id after each row's last token (prompts cut from the left to
        leave room for ``max_new_tokens`` in the window)."""
        width = self.max_length
        keep = max(1, width - max_new_tokens)
        out: List[List[int]] = []
        for start in range(0, len(prompts), self.batch):
            rows = []
            for p in prompts[start:start + self.batch]:
                p = list(p) or [self.eod_id]
                if len(p) > keep:
                    self.truncated.note("generate", len(p), keep)
                    p = p[-keep:]
                rows.append(p)
            new: List[List[int]] = [[] for _ in rows]
            done = [False] * len(rows)
            for _ in range(max_new_tokens):
                inputs = np.full((self.batch, width), self.pad_id, np.int32)
                for r, ids in enumerate(rows):
                    inputs[r, :len(ids)] = ids
                self.shapes.add(inputs.shape)
                t0 = time.perf_counter()
                _, top = self.forward(inputs, inputs)
                self.graph_seconds += time.perf_counter() - t0
                for r, ids in enumerate(rows):
                    if done[r]:
                        continue
                    tok = int(top[r, len(ids) - 1])
                    if tok in self.stop_ids:
                        done[r] = True
                        continue
                    new[r].append(tok)
                    ids.append(tok)
                    if len(ids) >= width or (stop is not None and stop(new[r])):
                        done[r] = True
                if all(done):
                    break
            out.extend(new)
        return out


def greedy_settings(tok) -> Dict[str, Any]:
    """The Scorer's greedy-generation keywords for a model whose tokenizer is ``tok``: the ``repetition_penalty``
    of the generation_config.json beside it (1 without one), as transformers' ``generate`` -- and so lm-eval's
    ``hf`` model -- applies it to a greedy search too."""
    from naohai.generate import repetition_penalty_of
    return {"repetition_penalty": repetition_penalty_of(tok)}


def text_encoding(tok, recipe) -> Dict[str, Any]:
    """How the evaluation encodes text, as the model's own data did: ``{"prefix_id", "special_tokens"}``.
    With ``data.add_special_tokens`` (a published Llama's imported recipe) a text is ``tokenizer(text)``,
    BOS first, and BOS stands before an empty context: lm-eval's ``hf`` model does the same by default
    for such a tokenizer.  Else a text is its tokens alone and EOD, which joins documents, the prefix."""
    from naohai.data.pipeline import encodes_special_tokens

    if encodes_special_tokens(recipe, tok):
        head = tok.encode_documents([""])[0]
        return {"prefix_id": int(head[0]) if head else int(tok.eod_id), "special_tokens": True}
    return {"prefix_id": int(tok.eod_id), "special_tokens": False}


def _tensor(array: np.ndarray):
    from mindspore import Tensor
    return Tensor(array)
