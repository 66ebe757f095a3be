"""The output projection and the cross entropy in one cell, a few rows at a time: the CPU train form.

Composed as :class:`~naohai.model.transformer.Head` + :class:`~naohai.model.transformer.CrossEntropy`,
a train step on MindSpore's CPU backend holds three [tokens, vocab] float32 tensors at once at its peak:
``LogSoftmax``'s output (kept for the backward), ``GatherD``'s dense gradient and ``LogSoftmaxGrad``'s
output (262 MB each for 2,048 tokens and a 32,000-word vocabulary).  :class:`ChunkedHeadLoss` computes,
for a block of rows at a time, the logits, their ``LogSoftmax``, the picked NLL and right away the
gradient of the loss with respect to that block's hidden states and its share of the head weight's
gradient (``LogSoftmaxGrad`` of a one-hot gradient, then two MatMuls); its custom ``bprop`` only scales
what the forward computed by the loss's incoming gradient.  So at most one block's [rows, vocab]
tensors live at a time, and no MatMul is added: the forward does the head's backward MatMuls that the
backward would have done.

The numbers are the composed form's: the same kernels on the same rows give the same NLL and loss
(bit for bit) and the same gradient of the hidden states; only the head weight's gradient sums the
blocks explicitly (measured on the 42m bench model: the first 20 losses bit-identical to the composed
form's).  Built inside :func:`naohai.model.layers.fused_reductions` (``train.cpu_reductions: fused``), each
block's ``LogSoftmax``, pick, one-hot and ``LogSoftmaxGrad`` are one compiled kernel instead
(``softmax_cross_entropy`` of :mod:`naohai.model.cpu_kernels`: one pass over each row, with its own exp and
summation order, so the numbers differ from the composed form's in the last bits).  The blocks run one after another (each block's input depends on the previous block's dx), so
the memory pool reuses one block's buffers for the next.  With ``weight_grad`` off (fine-tuning, whose
methods freeze the head) the weight's gradient is not computed.

The model uses it where :func:`naohai.model.layers.cpu_backend` holds, in float32 and in training mode
(:class:`~naohai.model.transformer.NaohaiLM`): CPU runs are one-device or plain data-parallel runs, so no
strategy shards these ops (strategies address ``head.logits``, ``loss.log_softmax`` and ``loss.pick`` of
the composed form, which every other backend runs), and inference (``set_train(False)``: evaluation,
scoring, generation) keeps the composed form, which computes no gradient.
"""
from __future__ import annotations

import math

import mindspore as ms
from mindspore import nn, ops, Tensor
from mindspore.ops.operations._grad_ops import LogSoftmaxGrad

from naohai.model.config import ModelConfig
from naohai.model.layers import fused_kernel, repeat

BLOCK_BYTES = 64 * 2 ** 20     # about this many bytes of float32 logits per block


def block_rows(rows: int, vocab: int) -> int:
    """Rows per block: all of them when their logits fit :data:`BLOCK_BYTES`, else an even split that does."""
    blocks = max(1, math.ceil(rows * vocab * 4 / BLOCK_BYTES))
    return math.ceil(rows / blocks)


class ChunkedHeadLoss(nn.Cell):
    """The loss of :class:`~naohai.model.transformer.CrossEntropy` (each of its three forms) from the head's
    input ``x`` [tokens, hidden] (after the final norm) and weight [vocab, hidden], without a whole
    [tokens, vocab] tensor in memory (see the module docstring).

    ``construct(x, weight, labels, input_ids) -> (loss, dx, dw)``: dx and dw are the loss's gradients with
    respect to ``x`` and ``weight`` for an incoming gradient of 1; the custom ``bprop`` scales them by the
    incoming gradient.  Callers use the loss alone."""

    def __init__(self, cfg: ModelConfig, masked: bool = False):
        super().__init__()
        self.masked = bool(masked)
        self.pad = cfg.loss_pad_id
        self.weight_grad = True           # False: the head is frozen; dw comes out as zeros
        self.eps = Tensor(1e-5, ms.float32)
        self.logits = ops.MatMul(transpose_b=True)
        self.grad_x = ops.MatMul()
        self.grad_w = ops.MatMul(transpose_a=True)
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.log_softmax_grad = LogSoftmaxGrad(axis=-1)
        self.pick = ops.GatherD()
        self.one_hot = ops.OneHot(axis=-1)
        self.neg = ops.Neg()              # the composed form's primitives, for its numbers
        self.mean = ops.ReduceMean()
        self.sum = ops.ReduceSum()
        self.fused = fused_kernel("softmax_cross_entropy")   # None unless train.cpu_reductions: fused

    def construct(self, x, weight, labels, input_ids):
        flat = ops.reshape(labels, (-1,))
        if self.masked:                  # sum of the learned positions' NLL
            coef = ops.cast(flat >= 0, ms.float32)
            nll, dx, dw = self._blocks(x, weight, ops.relu(flat), coef)
            return self.sum(nll * coef), dx, dw
        if self.pad is None:             # mean over every position
            nll, dx, dw = self._blocks(x, weight, flat, None)
            return self.mean(nll), dx, dw
        mask = ops.cast(ops.reshape(input_ids, (-1,)) != self.pad, ms.float32)
        denominator = self.sum(mask) + self.eps
        nll, dx, dw = self._blocks(x, weight, flat, mask / denominator)
        return self.sum(nll * mask) / denominator, dx, dw

    def _blocks(self, x, w, labels, coef):
        """(nll [n], dx, dw) with dx, dw the gradients of ``sum_i coef_i * nll_i`` (``coef`` None: of the
        mean; the one-hot then holds -1/n, as the mean's own backward makes it), a block of rows at a time."""
        n = x.shape[0]
        vocab = w.shape[0]
        step = block_rows(n, vocab)
        off = Tensor(0.0, ms.float32)
        on = Tensor(-1.0 / n, ms.float32) if coef is None else Tensor(1.0, ms.float32)
        mean_weight = Tensor([1.0 / n], ms.float32)     # the fused kernel's weight of every row for the mean
        nlls = []
        dxs = []
        dw = None
        for start in range(0, n, step):
            end = min(start + step, n)
            xb = x[start:end]
            if dxs:
                # one block after another (the pool reuses a block's buffers for the next); chained on
                # dx, not dw, so that MindSpore's runtime may overlap a block's weight-gradient MatMul with
                # the next block (measured on 42m: 3.91 s a step chained on dx, 4.03-4.16 s chained on dw)
                xb = ops.depend(xb, dxs[-1])
            yb = labels[start:end]
            if self.fused is not None:       # the loss's weight of each row: 1/n (the mean) or coef
                rw = mean_weight if coef is None else coef[start:end]
                nll, g = self.fused(self.logits(xb, w), ops.cast(yb, ms.int32), rw)
            else:
                nll, g = self._composed_block(self.logits(xb, w), yb, vocab, on, off, coef, start, end)
            nlls.append(nll)
            dxs.append(self.grad_x(g, w))
            if self.weight_grad:
                part = self.grad_w(g, xb)
                dw = part if dw is None else dw + part
        if dw is None:
            dw = ops.zeros_like(w)
        return ops.concat(nlls, 0), ops.concat(dxs, 0), dw

    def _composed_block(self, logits, yb, vocab, on, off, coef, start, end):
        """One block's (NLL, gradient with respect to its logits) by MindSpore's ops."""
        logp = self.log_softmax(logits)
        nll = self.neg(ops.reshape(self.pick(logp, 1, ops.reshape(yb, (-1, 1))), (-1,)))
        seed = self.one_hot(yb, vocab, on, off)          # d loss / d logp: -coef_i at the label
        if coef is not None:
            seed = seed * repeat(ops.reshape(-coef[start:end], (-1, 1)), seed)
        return nll, self.log_softmax_grad(logp, seed)

    def bprop(self, x, weight, labels, input_ids, out, dout):
        # the scalar broadcast first: MindSpore 2.10's CPU Mul keeps index tables for a broadcasting
        # operand (see naohai.model.layers.full)
        dx, dw, s = out[1], out[2], dout[0]
        return (dx * ops.broadcast_to(s, dx.shape), dw * ops.broadcast_to(s, dw.shape), ops.zeros_like(labels),
                ops.zeros_like(input_ids))
