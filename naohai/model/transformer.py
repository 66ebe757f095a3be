"""The decoder-only language model: pre-norm layers, PanGu query layer, tied head, loss.

``NaohaiLM(cfg).construct(input_ids, labels) -> mean token loss`` is the
network the trainer differentiates; ``NaohaiLM.logits`` gives next-token
logits for generation and evaluation.  Training on MindSpore's CPU backend in float32 computes
head and loss together a block of rows at a time (:mod:`naohai.model.head_loss`: the same numbers,
no whole [tokens, vocab] tensor); every other case runs ``Head`` then ``CrossEntropy``.
The final norm sits after the last layer, or (``final_norm: before_query_layer``, PanGu-alpha's reference order)
right before the top query layer, whose residual then starts from the normed
stream and whose output goes to the head un-normed.  The root cell holds no operations of its
own (only sub-cells), so a pipeline split can assign every op a stage: the
embedding on the first stage, final norm / head / loss on the last.

Parameter names match :func:`naohai.model.params.param_shapes` (under the layer loop through
:func:`naohai.model.stack.per_layer_names`).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor

from naohai.model.config import ModelConfig
from naohai.model.head_loss import ChunkedHeadLoss
from naohai.model.layers import MLP, Attention, DocumentLayout, Embedding, Norm, cpu_backend, make_params, ms_dtype
from naohai.model.spec import head_weight_params
from naohai.model.stack import split_layers, stacked_count


class DecoderLayer(nn.Cell):
    """x + attn(norm(x)); then x + mlp(norm(x)), or with ``block: parallel`` both from the layer input:
    x + attn(n1(x)) + mlp(n2(x)), n2 = n1 with ``parallel_norms: 1``.  The last PanGu layer is a query
    layer."""

    def __init__(self, cfg: ModelConfig, index: int, rng: np.random.RandomState):
        super().__init__()
        self.is_query_layer = bool(cfg.query_layer and index == cfg.num_layers - 1)
        # Each layer derives the packed window's positions / document mask from the input ids itself:
        # they are cheap next to attention, and a layer on another pipeline stage then needs only the
        # graph input, not a [b, 1, s, s] tensor (and its gradient) sent between stages.
        self.layout = DocumentLayout(cfg) if cfg.eod_reset or cfg.eod_reset_positions else None
        self.input_norm = Norm(cfg)
        self.attention = Attention(cfg, rng, query_layer=self.is_query_layer)
        self.parallel = cfg.block == "parallel"
        self.post_attention_norm = None if cfg.shared_block_norm else Norm(cfg)
        self.mlp = MLP(cfg, rng)
        self.attn_residual = ops.Add()
        self.mlp_residual = ops.Add()

    def construct(self, x, input_ids=None, layer=None, positions=None, bias=None, prefix=None):
        """x [b*s, h]; ``input_ids`` [b, s] are needed only with EOD resets, unless the caller passes the
        ``positions`` and ``bias`` they give (a :class:`~naohai.model.stack.LayerStack` derives them once);
        ``layer`` picks the slice of stacked weights (see :func:`~naohai.model.layers.layer_slice`);
        ``prefix``: see :meth:`~naohai.model.layers.Attention.construct`."""
        if self.layout is not None and bias is None:
            positions, bias = self.layout(input_ids)
        normed = self.input_norm(x, layer)
        if self.parallel:
            mlp_in = normed if self.post_attention_norm is None else self.post_attention_norm(x, layer)
            x = self.attn_residual(x, self.attention(normed, positions, bias, layer, prefix))
            return self.mlp_residual(x, self.mlp(mlp_in, layer))
        x = self.attn_residual(x, self.attention(normed, positions, bias, layer, prefix))
        return self.mlp_residual(x, self.mlp(self.post_attention_norm(x, layer), layer))

    def step(self, x, positions, bias, past_k=None, past_v=None, slot=None):
        """One generation step (see Attention.step): returns (x, keys, values)."""
        normed = self.input_norm(x)
        a, k, v = self.attention.step(normed, positions, bias, past_k, past_v, slot)
        if self.parallel:
            mlp_in = normed if self.post_attention_norm is None else self.post_attention_norm(x)
            return self.mlp_residual(self.attn_residual(x, a), self.mlp(mlp_in)), k, v
        x = self.attn_residual(x, a)
        return self.mlp_residual(x, self.mlp(self.post_attention_norm(x))), k, v

    def shardable_ops(self) -> Dict[str, object]:
        out = {f"attention.{k}": v for k, v in self.attention.shardable_ops().items()}
        out.update({f"mlp.{k}": v for k, v in self.mlp.shardable_ops().items()})
        out["attention.residual"] = self.attn_residual
        out["mlp.residual"] = self.mlp_residual
        for name in ("input_norm", "post_attention_norm"):
            prim = getattr(self, name).primitive() if getattr(self, name) is not None else None
            if prim is not None:
                out[name] = prim
        return out


class Head(nn.Cell):
    """Final norm (unless it runs before the query layer) and output projection; the weight is the
    word embedding when tied."""

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState):
        super().__init__()
        self.final_norm = Norm(cfg)
        self.norm_here = cfg.final_norm == "after"
        self.dtype = ms_dtype(cfg.compute_dtype)
        self.logits = ops.MatMul(transpose_b=True)
        self.cast = ops.Cast()
        self.tied = cfg.tie_embeddings
        make_params(self, head_weight_params(cfg), cfg, rng)

    def construct(self, x, weight):
        x, weight = self.inputs(x, weight)
        return self.cast(self.logits(x, weight), ms.float32)                     # [b*s, V]

    def inputs(self, x, weight):
        """The output projection's operands: ``x`` after the final norm (where it runs here) and the head
        weight (the word embedding, given, when tied), both in the compute dtype."""
        if self.norm_here:
            x = self.final_norm(x)
        if not self.tied:
            weight = self.weight
        return self.cast(x, self.dtype), self.cast(weight, self.dtype)


class CrossEntropy(nn.Cell):
    """Next-token cross entropy in float32: the mean over all tokens, or with ``loss_pad_id`` the
    references' sum(nll * m) / (sum(m) + 1e-5), m = 1 where the INPUT token is not the pad id.

    nll = -log_softmax(logits)[label]: a ``LogSoftmax`` and a ``GatherD`` that picks the label's
    column (named ``loss.log_softmax`` and ``loss.pick``).  No one-hot target is built; on CPU this
    pair runs forward and backward on [2048, 32128] logits in a quarter of the time of OneHot +
    SoftmaxCrossEntropyWithLogits (``naohai bench`` measures the whole step).

    ``masked=True`` (fine-tuning on prepared SFT data): a negative label marks a position that is not
    learned, and the loss is the SUM of the NLL of the learned positions; the train step divides it by
    the learned tokens of the global batch (:mod:`naohai.train.step`), so micro-batches and gradient
    accumulation give the same loss and gradients as one batch."""

    def __init__(self, cfg: ModelConfig, masked: bool = False):
        super().__init__()
        self.masked = bool(masked)
        if self.masked:
            self.sum = ops.ReduceSum()
            self.cast = ops.Cast()
            self.relu = ops.ReLU()
        self.pad = cfg.loss_pad_id
        if self.pad is not None:
            self.not_pad = ops.NotEqual()
            self.sum = ops.ReduceSum()
            self.eps = Tensor(1e-5, ms.float32)
            self.cast = ops.Cast()
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.pick = ops.GatherD()
        self.neg = ops.Neg()
        self.mean = ops.ReduceMean()
        self.reshape = ops.Reshape()

    def construct(self, logits, labels, input_ids=None):
        if self.masked:
            flat = self.reshape(labels, (-1,))
            learned = self.cast(flat >= 0, ms.float32)
            picked = self.pick(self.log_softmax(logits), 1, self.reshape(self.relu(flat), (-1, 1)))
            return self.sum(self.neg(self.reshape(picked, (-1,))) * learned)
        picked = self.pick(self.log_softmax(logits), 1, self.reshape(labels, (-1, 1)))
        loss = self.neg(self.reshape(picked, (-1,)))
        if self.pad is None:
            return self.mean(loss)
        mask = self.cast(self.not_pad(self.reshape(input_ids, (-1,)), self.pad), ms.float32)
        return self.sum(loss * mask) / (self.sum(mask) + self.eps)


class NaohaiLM(nn.Cell):
    """PanGu-alpha / PengCheng-Mind decoder LM.  ``construct(input_ids, labels) -> loss``.

    With ``layer_loop`` the equal layers run as one loop over stacked weights
    (:mod:`naohai.model.stack`): the same initial values and math, other parameter names.
    Generation (:meth:`step`) needs the per-layer form."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, layer_loop: bool = False, masked_loss: bool = False):
        super().__init__()
        self.cfg = cfg
        rng = np.random.RandomState(seed)
        self.embedding = Embedding(cfg, rng)
        layers = [DecoderLayer(cfg, i, rng) for i in range(cfg.num_layers)]
        self.layer_loop = bool(layer_loop) and stacked_count(cfg) >= 1
        if self.layer_loop:
            self.stack, self.last_layer = split_layers(cfg, layers)
        else:
            self.layers = nn.CellList(layers)
        self.head = Head(cfg, rng)
        self.loss = CrossEntropy(cfg, masked=masked_loss)
        # CPU training in float32: head and loss a block of rows at a time (naohai.model.head_loss)
        self.chunked_loss = ChunkedHeadLoss(cfg, masked=masked_loss)
        self.fuse_head_loss = cpu_backend() and cfg.compute_dtype == "float32"
        self.vocab = cfg.padded_vocab_size
        self.norm_before_last = cfg.final_norm == "before_query_layer"
        self.last = cfg.num_layers - 1
        # prefix / prompt tuning (naohai.model.finetune.apply_finetune sets it): virtual positions before
        # every sequence, their keys and values given to each layer's attention
        self.virtual = None

    def layer_cells(self) -> List[nn.Cell]:
        """The cell that runs each layer, by layer index (under the loop, the stack's one cell for its
        layers)."""
        if not self.layer_loop:
            return list(self.layers)
        out = [self.stack.layer] * stacked_count(self.cfg)
        return out + ([self.last_layer] if self.last_layer is not None else [])

    def hidden(self, input_ids):
        x = self.embedding(input_ids)
        if self.layer_loop:
            x = self.stack(x, input_ids)
            if self.last_layer is not None:
                if self.norm_before_last:
                    x = self.head.final_norm(x)
                x = self.last_layer(x, input_ids)
            return x
        prefixes = self.virtual_prefixes()
        for i, layer in enumerate(self.layers):
            if self.norm_before_last and i == self.last:
                x = self.head.final_norm(x)
            if prefixes is None:
                x = layer(x, input_ids)
            else:
                x = layer(x, input_ids, None, None, None, prefixes[i])
        return x

    def virtual_prefixes(self):
        """Per layer (keys, values) [1, nkv, n, d] of the virtual positions, or None without them.

        Prefix tuning learns them directly; prompt tuning learns n input vectors and runs them
        through the (frozen) layers first, at positions 0..n-1, causally among themselves -- what a
        model sees when the vectors are prepended to its input (the real tokens follow at n, n+1, ...)."""
        if self.virtual is None:
            return None
        if self.virtual.kind == "prefix":
            return self.virtual()
        x = self.embedding.virtual(self.virtual.embedding, self.virtual.positions)
        out = []
        for i, layer in enumerate(self.layers):
            if self.norm_before_last and i == self.last:
                x = self.head.final_norm(x)
            x, k, v = layer.step(x, self.virtual.positions, self.virtual.bias)
            out.append((k, v))
        return out

    def virtual_count(self) -> int:
        """How many virtual positions prefix / prompt tuning put before every sequence (0 without)."""
        if self.virtual is None:
            return 0
        return int(self.virtual.embedding.shape[0])

    def virtual_cache(self, batch: int):
        """The key/value cache of the virtual positions alone: per layer (keys, values) [batch, nkv, n, d]."""
        out = []
        for k, v in self.virtual_prefixes():
            shape = (batch,) + tuple(k.shape[1:])
            out.append((ops.broadcast_to(k, shape), ops.broadcast_to(v, shape)))
        return out

    def construct(self, input_ids, labels):
        x = self.hidden(input_ids)
        if self.training and self.fuse_head_loss:
            x, weight = self.head.inputs(x, self.embedding.word_embedding)
            loss, dx, dw = self.chunked_loss(x, weight, labels, input_ids)
            return ops.depend(loss, (dx, dw))      # the bprop's outputs, kept (MindSpore warned when it dropped them)
        logits = self.head(x, self.embedding.word_embedding)
        return self.loss(logits, labels, input_ids)

    def step(self, input_ids, positions, bias, cache=None, slot=None):
        """Logits [b, t, vocab] of the t newest tokens given the key/value cache of the earlier ones.

        ``cache`` is None or a list of (keys, values) per layer; returns (logits, new cache).  One call
        costs the new tokens' work plus attention over the cache, not the whole window.  With
        ``slot`` the cache has a fixed size (see :meth:`Attention.step`).

        ``positions`` number the real tokens from 0.  With prefix / prompt tuning (:meth:`virtual_count`
        n > 0) the model numbers them from n, as :meth:`construct` does, and the cache's first n columns
        are the virtual positions: a call without a cache starts one from :meth:`virtual_cache` and puts
        n open columns in front of ``bias``; a call with a cache gets a ``bias`` that covers them.
        """
        if self.layer_loop:
            raise ValueError("generation needs the per-layer model (NaohaiLM(..., layer_loop=False))")
        n = self.virtual_count()
        if n:
            positions = positions + n
            if cache is None:
                cache = self.virtual_cache(input_ids.shape[0])
                bias = ops.concat((ops.zeros(bias.shape[:-1] + (n,), bias.dtype), bias), -1)
        x = self.embedding.step(input_ids, positions)
        new = []
        for i, layer in enumerate(self.layers):
            if self.norm_before_last and i == self.last:
                x = self.head.final_norm(x)
            past_k, past_v = (None, None) if cache is None else cache[i]
            x, k, v = layer.step(x, positions, bias, past_k, past_v, slot)
            new.append((k, v))
        y = self.head(x, self.embedding.word_embedding)
        return y.reshape((input_ids.shape[0], input_ids.shape[1], self.vocab)), new

    def logits(self, input_ids):
        """[b, s] -> [b, s, vocab] float32."""
        x = self.hidden(input_ids)
        y = self.head(x, self.embedding.word_embedding)
        return y.reshape((input_ids.shape[0], input_ids.shape[1], self.vocab))

    def shardable_ops(self) -> Dict[str, object]:
        """Every shardable primitive by its catalog name (see naohai.model.catalog)."""
        out = {f"embedding.{k}": v for k, v in self.embedding.shardable_ops().items()}
        for i, layer in enumerate(self.layer_cells()):
            out.update({f"layers.{i}.{k}": v for k, v in layer.shardable_ops().items()})
        prim = self.head.final_norm.primitive()
        if prim is not None:
            out["final_norm"] = prim
        out["head.logits"] = self.head.logits
        out["loss.log_softmax"] = self.loss.log_softmax
        out["loss.pick"] = self.loss.pick
        return out


class DecodeStep(nn.Cell):
    """One compiled generation step over a fixed-size key/value cache (graph mode, also when called
    from PyNative): ``construct(ids [b, 1], positions [b, 1], bias [b, 1, 1, S], slot [1, 1, S, 1],
    keys, values)`` with ``keys``/``values`` tuples of [b, nkv, S, d] per layer -> (logits [b, 1,
    vocab], keys, values).  Its shapes do not change from step to step, so it compiles once."""

    def __init__(self, lm: NaohaiLM):
        super().__init__(auto_prefix=False)
        self.lm = lm

    @ms.jit
    def construct(self, ids, positions, bias, slot, keys, values):
        logits, cache = self.lm.step(ids, positions, bias, [(k, v) for k, v in zip(keys, values)], slot)
        return logits, tuple(k for k, _ in cache), tuple(v for _, v in cache)


class PromptStep(nn.Cell):
    """The prompt pass of cached generation, compiled (graph mode, also when called from PyNative):
    ``construct(ids [b, t], positions [b, t], bias [b, 1, t, t])`` -> (logits of the last position [b, vocab],
    keys, values) with ``keys``/``values`` tuples of [b, nkv, n + t, d] per layer (n virtual columns first with
    prefix / prompt tuning, as :meth:`NaohaiLM.step` makes them).  It compiles once per shape: the caller pads
    prompts to a few lengths."""

    def __init__(self, lm: NaohaiLM):
        super().__init__(auto_prefix=False)
        self.lm = lm

    @ms.jit
    def construct(self, ids, positions, bias):
        logits, cache = self.lm.step(ids, positions, bias)
        return logits[:, -1], tuple(k for k, _ in cache), tuple(v for _, v in cache)


class TokenNLLNet(nn.Cell):
    """Wraps a model for scoring: ``construct(input_ids [b, s], labels [b, s]) -> [b, s]`` float32
    ``-log p(label | inputs up to it)``, the softmax over the padded vocabulary as in the model's loss."""

    def __init__(self, lm: NaohaiLM):
        super().__init__(auto_prefix=False)
        self.lm = lm
        self.log_softmax = ops.LogSoftmax(-1)
        self.gather = ops.GatherD()
        self.expand = ops.ExpandDims()
        self.squeeze = ops.Squeeze(-1)

    def label_nll(self, logp, labels):
        """``-logp`` at ``labels`` ([b, s, v] log-probabilities, [b, s] ids -> [b, s])."""
        return -self.squeeze(self.gather(logp, 2, self.expand(labels, -1)))

    def construct(self, input_ids, labels):
        return self.label_nll(self.log_softmax(self.lm.logits(input_ids)), labels)


class PackedScoreNet(TokenNLLNet):
    """Downstream scoring of packed rows through the explicit-bias step path: ``construct(input_ids [b, s],
    labels [b, s], positions [b, s], bias [b, 1 or heads, s, s]) -> (nll [b, s], argmax [b, s])`` as
    ``-log p(label | inputs up to it)`` (softmax over the padded vocabulary, as the model's loss) and the
    most likely next id at each position; positions and attention come from the caller, so several requests can
    share a row (block-diagonal ``bias``), each with its own positions."""

    def __init__(self, lm: NaohaiLM):
        super().__init__(lm)
        self.argmax = ops.Argmax(-1, ms.int32)

    def construct(self, input_ids, labels, positions, bias):
        logits, _ = self.lm.step(input_ids, positions, bias)
        logp = self.log_softmax(logits)
        return self.label_nll(logp, labels), self.argmax(logp)


class RowScores(nn.Cell):
    """The scoring head of :class:`RowScoreNet`: ``construct(logits [b*s, V], labels [b, s], rows [b, n])
    -> [n, 2*s]`` float32, where row ``j`` of the result holds, for the input row whose one-hot ``rows``
    entry is ``j``, the pairs (``-log p(label)``, most likely next id) of its ``s`` positions
    interleaved (``out.reshape(n, s, 2)``).  Rows with an all-zero ``rows`` entry contribute nothing.

    Every value is placed by multiplying with 1.0 or 0.0 and summing over the input rows, so ids
    (below 2**24) and log-probabilities come out exact; the sum is also what makes the result
    independent of how the rows are split into micro-batches or data-parallel shards (each input row
    carries its own result row)."""

    def __init__(self):
        super().__init__()
        self.log_softmax = ops.LogSoftmax(-1)
        self.pick = ops.GatherD()
        self.neg = ops.Neg()
        self.argmax = ops.Argmax(-1, ms.int32)
        self.cast = ops.Cast()
        self.stack = ops.Stack(-1)
        self.place = ops.Mul()
        self.sum = ops.ReduceSum(keep_dims=False)
        self.expand = ops.ExpandDims()
        self.reshape = ops.Reshape()

    def construct(self, logits, labels, rows):
        b, s = labels.shape
        logp = self.log_softmax(logits)
        nll = self.reshape(self.neg(self.reshape(self.pick(logp, 1, self.reshape(labels, (-1, 1))), (-1,))), (b, s))
        top = self.reshape(self.cast(self.argmax(logp), ms.float32), (b, s))
        values = self.reshape(self.stack((nll, top)), (b, 1, s * 2))
        return self.sum(self.place(self.expand(rows, -1), values), 0)

    def shardable_ops(self) -> Dict[str, object]:
        return {"log_softmax": self.log_softmax, "pick": self.pick, "neg": self.neg, "argmax": self.argmax,
                "cast": self.cast, "stack": self.stack, "place": self.place, "sum": self.sum}


class RowScoreNet(nn.Cell):
    """Downstream scoring through the model's own training-time forward, for layouts that shard it:
    ``construct(input_ids [b, s], labels [b, s], rows [b, n]) -> [n, 2*s]`` (see :class:`RowScores`;
    one request per row, right padding, the model's causal mask).  Unlike :class:`PackedScoreNet` it
    needs no explicit positions or bias, so it runs the same cells (and stages) as the loss."""

    def __init__(self, lm: NaohaiLM):
        super().__init__(auto_prefix=False)
        self.lm = lm
        self.scores = RowScores()

    def construct(self, input_ids, labels, rows):
        x = self.lm.hidden(input_ids)
        logits = self.lm.head(x, self.lm.embedding.word_embedding)
        return self.scores(logits, labels, rows)

