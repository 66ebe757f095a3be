"""Float64 numpy forward of the reference networks, on tensors named and laid out as they store them.

Written from the reference code, not from naohai:
  PanGu-alpha   mindspore-ai/models official/nlp/Pangu_alpha/src/pangu_alpha.py
                (EmbeddingLayer; PanguAlpha_Model.construct, non-pipeline branch: blocks,
                backbone.layernorm, then QueryLayer.construct on the normed stream, no norm after;
                PanGUAlphaWithLoss: tokens = ids[:, :-1], labels = ids[:, 1:], mask = tokens != pad),
                src/dataset.py get_input_data_batch_slice_map (EOD reset of positions and mask);
  MindSpore transformer attention (dense1/2/3 weights [out, in]; q and k each divided by
                d^(1/4); masked scores + (1 - mask) * -10000; projection [in, out]),
                FeedForward (mapping [in, out] + activation, projection [in, out]);
  PengCheng-Mind src/pengcheng_mind_pipeline_layer_7B.py (rotate-half RoPE on q and k after
                the head split, tables sliced 0..s-1; SwiGLU: mapping to 2f, silu(first half) *
                second half), src/pengcheng_mind_pipeline_layer.py (200B: interleaved RoPE),
                src/pengcheng_mind.py (200B: blocks, top query layer, then backbone.layernorm),
                src/loss.py CrossEntropyLoss: sum(nll * mask) / (sum(mask) + 1e-5).
"""
from __future__ import annotations

import math

import numpy as np


def layernorm(x, g, b, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * g + b


def fast_gelu(x):
    return x / (1.0 + np.exp(-1.702 * np.abs(x))) * np.exp(0.851 * (x - np.abs(x)))


def silu(x):
    return x / (1.0 + np.exp(-x))


def eod_layout(tokens, eod_id):
    """dataset.py: positions restart after every EOD, and later rows stop seeing it and before."""
    b, s = tokens.shape
    pos = np.ones((b, s), np.int64)
    mask = np.ones((b, s, s), np.int8)
    for r in range(b):
        mask[r] = np.tril(np.ones((s, s), np.int8))
        pos[r] = np.arange(s)
        eod_index = pos[r, tokens[r] == eod_id].astype(np.int64)
        prev = 0
        for index in eod_index:
            mask[r, index + 1:, :index + 1] = 0
            pos[r, index + 1:] -= index + 1 - prev
            prev = index + 1
    return pos, mask


def rope_tables(s, d, style):
    """RoPE.__init__: inv = 1 / 10000^(2i/d); tables concatenated (7B) or repeated (200B)."""
    i = np.arange(0, d // 2, dtype=np.float64)
    inv = 1.0 / np.power(10000.0, 2 * i / d)
    emb = np.einsum("n,d->nd", np.arange(s, dtype=np.float64), inv)
    emb = np.repeat(emb, 2, axis=-1) if style == "interleaved" else np.concatenate([emb, emb], -1)
    return np.cos(emb), np.sin(emb)


def rope(x, style):
    """RoPE.construct on [b, n, s, d]: x * cos + rotate(x) * sin."""
    s, d = x.shape[2], x.shape[3]
    cos, sin = rope_tables(s, d, style)
    if style == "interleaved":                        # rotate on (.., d/2, 2) pairs: (-x1, x0)
        pairs = x.reshape(x.shape[:-1] + (d // 2, 2))
        rot = np.stack([-pairs[..., 1], pairs[..., 0]], -1).reshape(x.shape)
    else:                                             # concat(-x1, x0) of the two halves
        rot = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def attention(w, p, query_in, kv_in, mask, heads, rope_style):
    """MultiHeadAttention: [b*s, h] inputs, mask [b, s, s] of 1 (attend) / 0."""
    b, s = mask.shape[0], mask.shape[1]
    h = kv_in.shape[-1]
    d = h // heads

    def split(y):
        return y.reshape(b, s, heads, d).transpose(0, 2, 1, 3)

    q = split(query_in @ w[f"{p}.dense1.weight"].T + w[f"{p}.dense1.bias"])
    k = split(kv_in @ w[f"{p}.dense2.weight"].T + w[f"{p}.dense2.bias"])
    v = split(kv_in @ w[f"{p}.dense3.weight"].T + w[f"{p}.dense3.bias"])
    if rope_style:
        q, k = rope(q, rope_style), rope(k, rope_style)
    factor = math.sqrt(math.sqrt(d))
    score = (q / factor) @ (k / factor).transpose(0, 1, 3, 2)
    score = score + (1.0 - mask[:, None].astype(np.float64)) * -10000.0
    score = score - score.max(-1, keepdims=True)
    probs = np.exp(score)
    probs = probs / probs.sum(-1, keepdims=True)
    ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b * s, h)
    return ctx @ w[f"{p}.projection.weight"] + w[f"{p}.projection.bias"]


def feed_forward(w, p, x, act):
    hidden = x @ w[f"{p}.mapping.weight"] + w[f"{p}.mapping.bias"]
    if act == "swiglu":
        f = hidden.shape[-1] // 2
        hidden = silu(hidden[:, :f]) * hidden[:, f:]
    else:
        hidden = fast_gelu(hidden)
    return hidden @ w[f"{p}.projection.weight"] + w[f"{p}.projection.bias"]


def block(w, p, x, mask, heads, act, rope_style, query=None):
    """TransformerEncoderLayer (pre-LN); with ``query`` the QueryLayer (queries from the table)."""
    y = layernorm(x, w[f"{p}.layernorm1.gamma"], w[f"{p}.layernorm1.beta"])
    x = x + attention(w, f"{p}.attention", y if query is None else query, y, mask, heads, rope_style)
    y = layernorm(x, w[f"{p}.layernorm2.gamma"], w[f"{p}.layernorm2.beta"])
    return x + feed_forward(w, f"{p}.output", y, act)


def loss(w, ids, *, family, heads, layers, eod_id, pad_id, eod_reset=True, reset_positions=True):
    """Mean masked next-token loss of ``ids`` [b, s + 1] (the reference slices inputs and labels).

    family: 'pangu' (learned positions, FastGeLU, LN before the query layer),
            'pcm7b' (rotate-half RoPE, SwiGLU, LN at the end),
            'pcm200b' (interleaved RoPE, FastGeLU, query layer, LN at the end).
    """
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    tokens, labels = ids[:, :-1], ids[:, 1:]
    b, s = tokens.shape
    pos, mask = eod_layout(tokens, eod_id)
    if not eod_reset:
        mask = np.tile(np.tril(np.ones((s, s), np.int8)), (b, 1, 1))
    if not reset_positions:
        pos = np.tile(np.arange(s), (b, 1))
    x = w["backbone.embedding.word_embedding.embedding_table"][tokens]
    if family == "pangu":
        x = x + w["backbone.embedding.position_embedding.embedding_table"][pos]
    x = x.reshape(b * s, -1)
    act = "swiglu" if family == "pcm7b" else "fast_gelu"
    rope_style = {"pangu": None, "pcm7b": "rotate_half", "pcm200b": "interleaved"}[family]
    n_blocks = layers if family == "pcm7b" else layers - 1
    for i in range(n_blocks):
        x = block(w, f"backbone.blocks.{i}", x, mask, heads, act, rope_style)
    final = (w["backbone.layernorm.gamma"], w["backbone.layernorm.beta"])
    if family == "pangu":
        x = layernorm(x, *final)
    if family != "pcm7b":
        query = w["backbone.top_query_embedding.embedding_table"][pos].reshape(b * s, -1)
        x = block(w, "backbone.top_query_layer", x, mask, heads, act, rope_style, query=query)
    if family != "pangu":
        x = layernorm(x, *final)
    logits = x @ w["backbone.embedding.word_embedding.embedding_table"].T
    m = logits.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    lab = labels.reshape(-1)
    nll = logz - logits[np.arange(lab.size), lab]
    input_mask = (tokens.reshape(-1) != pad_id).astype(np.float64)
    return float((nll * input_mask).sum() / (input_mask.sum() + 1e-5))


def make_weights(rng, *, family, vocab, hidden, ffn, layers, seq):
    """Random tensors with the names and shapes the reference code creates (float32)."""
    def n(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    w = {"backbone.embedding.word_embedding.embedding_table": n(vocab, hidden)}
    if family == "pangu":
        w["backbone.embedding.position_embedding.embedding_table"] = n(seq, hidden)
    blocks = [f"backbone.blocks.{i}" for i in range(layers if family == "pcm7b" else layers - 1)]
    if family != "pcm7b":
        blocks.append("backbone.top_query_layer")
        w["backbone.top_query_embedding.embedding_table"] = n(seq, hidden)
    width = 2 * ffn if family == "pcm7b" else ffn
    for p in blocks:
        for ln in ("layernorm1", "layernorm2"):
            w[f"{p}.{ln}.gamma"] = (1.0 + n(hidden, scale=0.2)).astype(np.float32)
            w[f"{p}.{ln}.beta"] = n(hidden, scale=0.2)
        for dense in ("dense1", "dense2", "dense3"):
            w[f"{p}.attention.{dense}.weight"] = n(hidden, hidden)        # [out, in]
            w[f"{p}.attention.{dense}.bias"] = n(hidden)
        w[f"{p}.attention.projection.weight"] = n(hidden, hidden)         # [in, out]
        w[f"{p}.attention.projection.bias"] = n(hidden)
        w[f"{p}.output.mapping.weight"] = n(hidden, width)                # [in, out]
        w[f"{p}.output.mapping.bias"] = n(width)
        w[f"{p}.output.projection.weight"] = n(ffn, hidden)               # [in, out]
        w[f"{p}.output.projection.bias"] = n(hidden)
    w["backbone.layernorm.gamma"] = (1.0 + n(hidden, scale=0.2)).astype(np.float32)
    w["backbone.layernorm.beta"] = n(hidden, scale=0.2)
    return w
