"""Held-out exact match of a fine-tuning run (``train.exact_match``): are the answers reproduced exactly?

An *answer* is a maximal run of learned tokens in a window of the prepared held-out split
(:mod:`naohai.data.sft`): an assistant turn's text, its end-of-turn newline and, closing the
conversation, the EOD.  It is *matched* when at every one of its tokens the model's most likely
next token, given the window up to there, is that token.  Greedy decoding from the prompt
reproduces an answer -- and then stops at EOD -- exactly when this holds (each greedy choice
sees the same prefix as the teacher-forced row), so the score is that of greedy generation
with the answer compared token for token, computed by one forward pass per batch of windows
instead of one decode step per token.  (A different tokenisation of the same text counts as a
miss; ties between logits are not counted as matches.)

:class:`ExactMatch` is a training-loop callback: before step 1 of a fresh run, every
``train.eval_every`` steps and at the last step it scores the held-out split with the live
weights (one compiled graph of ``train.micro_batch_size`` windows) and hands one row --
``{"split": "downstream", "task": "sft_heldout", "exact_match": ..., "n": answers}`` -- to the
other callbacks (``metrics.jsonl``, TensorBoard, the console, ``downstream.png``); at the end it
prints the first and last score.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from naohai.train.callbacks import Callback

TASK = "sft_heldout"


def answer_spans(mask_row: np.ndarray) -> List[Tuple[int, int]]:
    """``[(start, end), ...]``: the maximal runs of 1 in a window's mask (token positions, end exclusive)."""
    m = np.concatenate([[0], (np.asarray(mask_row) != 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(m))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]


def count_exact(tokens: np.ndarray, mask: np.ndarray, predicted: np.ndarray) -> Tuple[int, int]:
    """(matched answers, answers) of windows ``tokens`` / ``mask`` ``[w, s + 1]`` given ``predicted``
    ``[w, s]``, the model's most likely token after each input position (``predicted[:, j - 1]`` is its
    guess for token ``j``)."""
    hits = total = 0
    for row in range(tokens.shape[0]):
        for a, b in answer_spans(mask[row]):
            total += 1
            hits += int(np.array_equal(predicted[row, a - 1:b - 1], tokens[row, a:b]))
    return hits, total


def _logits_net(model):
    from mindspore import nn

    class Logits(nn.Cell):
        def __init__(self, lm):
            super().__init__(auto_prefix=False)
            self.lm = lm

        def construct(self, input_ids):
            return self.lm.logits(input_ids)

    return Logits(model)


def predictions(net, tokens: np.ndarray, rows: int, vocab: int) -> np.ndarray:
    """The most likely next token (among the tokenizer's ``vocab``) after every input position of
    ``tokens`` ``[w, s + 1]``, ``rows`` windows per call of ``net`` (the last call padded)."""
    from mindspore import Tensor
    out = []
    for lo in range(0, len(tokens), rows):
        chunk = np.asarray(tokens[lo:lo + rows, :-1], np.int32)
        n = len(chunk)
        if n < rows:
            chunk = np.concatenate([chunk, np.zeros((rows - n, chunk.shape[1]), np.int32)])
        logits = net(Tensor(chunk)).asnumpy()[:n, :, :vocab]
        out.append(logits.argmax(-1))
    return np.concatenate(out)


def refuse_sharded(recipe, mode: str) -> None:
    """``train.exact_match`` scores with the whole model on each rank, which a layout that shards the model
    (``mode`` semi_auto) does not hold: a :class:`naohai.errors.UserError` before anything is prepared."""
    if recipe.train.exact_match and mode == "semi_auto":
        from naohai.errors import UserError
        raise UserError("train.exact_match scores the held-out answers with the whole model on each rank, and this "
                        "strategy shards the model over ranks (op / pipeline parallel); turn train.exact_match off "
                        "for this layout (the held-out loss of the learned tokens is still reported) or fine-tune "
                        "on one device or plain data parallel", where=recipe.source or "recipe",
                        key="train.exact_match", rule="exact_match needs one device or plain data parallel")


class ExactMatch(Callback):
    """The ``train.exact_match`` callback (see the module docstring)."""

    def __init__(self, recipe, log=print):
        self.recipe = recipe
        self.enabled = bool(recipe.train.exact_match)
        self.log = log
        self.net = None
        self.first: Optional[Tuple[int, float]] = None
        self.last: Optional[Tuple[int, float]] = None
        self.last_step = None

    def on_start(self, trainer) -> None:
        if not self.enabled:
            return
        from naohai.data.sft import load_sft
        prepared = load_sft(trainer.prepared_dir)
        self.tokens = np.asarray(prepared.tokens("valid"))
        self.mask = np.asarray(prepared.mask("valid"))
        self.vocab = int(prepared.meta["tokenizer"]["vocab_size"])
        self.net = _logits_net(trainer.built.model)
        if trainer.step == 0:
            self.evaluate(trainer)

    def on_step(self, trainer, rec: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.due(trainer, self.recipe.train.held_out.eval_every):
            self.evaluate(trainer)

    def on_end(self, trainer) -> None:
        if self.enabled and self.first is not None and trainer.writer:
            self.log(f"held-out exact match ({TASK}): {self.first[1]:.3f} at step {self.first[0]} -> "
                     f"{self.last[1]:.3f} at step {self.last[0]}")

    def evaluate(self, trainer) -> Optional[Dict[str, Any]]:
        if self.last_step == trainer.step:
            return None
        t0 = time.time()
        predicted = predictions(self.net, self.tokens, self.recipe.train.micro_batch_size, self.vocab)
        hits, total = count_exact(self.tokens, self.mask, predicted)
        score = hits / total if total else float("nan")
        self.last_step = trainer.step
        self.last = (trainer.step, score)
        self.first = self.first or self.last
        row = {"split": "downstream", "step": trainer.step, "task": TASK, "n": total, "num_fewshot": 0,
               "exact_match": score, "matched": hits, "seconds": time.time() - t0, "graph_seconds": 0.0,
               "truncated": 0}
        trainer.callbacks.on_downstream(trainer, trainer.step, [row])
        return row
