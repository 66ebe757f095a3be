"""Independent float64 numpy references for the model tests.

Everything here is written from the published math (pre-LN decoder, rotate-half
RoPE, ALiBi, SwiGLU / GeLU, LayerNorm / RMSNorm, PanGu's top query layer); it
does not call any helper of ``naohai.model``.  Parameters are looked up by the
names MindSpore gives the cells' parameters.
"""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


# ----------------------------------------------------------------------------- helpers
def params_of(cell) -> dict:
    """name -> float64 copy of every parameter of a cell."""
    return {p.name: p.asnumpy().astype(np.float64) for p in cell.get_parameters()}


def randomize(cell, rng: np.random.RandomState, scale: float = 0.2) -> dict:
    """Give every parameter a random value (gammas around 1, biases non-zero) and return them."""
    from mindspore import Tensor
    for p in cell.get_parameters():
        shape = p.shape
        if p.name.endswith("gamma"):
            value = 1.0 + 0.2 * rng.standard_normal(shape)
        else:
            value = scale * rng.standard_normal(shape)
        p.set_data(Tensor(value.astype(np.float32)))
    return params_of(cell)


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


# ----------------------------------------------------------------------------- norms
def layernorm(x, gamma=None, beta=None, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)   # biased variance
    y = (x - mu) / np.sqrt(var + eps)
    if gamma is not None:
        y = y * gamma
    if beta is not None:
        y = y + beta
    return y


def rmsnorm(x, gamma, eps=1e-5):
    return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + eps) * gamma


def norm(kind, x, p, prefix, eps):
    if kind == "rmsnorm":
        return rmsnorm(x, p[f"{prefix}.gamma"], eps)
    if kind == "layernorm":
        return layernorm(x, p[f"{prefix}.gamma"], p[f"{prefix}.beta"], eps)
    assert kind == "nonparam_layernorm", kind
    return layernorm(x, None, None, eps)


# ----------------------------------------------------------------------------- activations
def gelu_exact(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def fast_gelu(x):
    """MindSpore FastGeLU: x / (1 + exp(-1.702|x|)) * exp(0.851 (x - |x|))."""
    a = np.abs(x)
    return x / (1.0 + np.exp(-1.702 * a)) * np.exp(0.851 * (x - a))


def silu(x):
    return x * sigmoid(x)


# ----------------------------------------------------------------------------- positions
def rope(x, positions, base, style="rotate_half"):
    """RoPE on the last axis of x [..., s, d], theta_i = base^(-2i/d).  rotate_half pairs (i, i + d/2);
    interleaved pairs (2i, 2i + 1).  ``positions`` is [s] or broadcastable to x[..., 0]."""
    d = x.shape[-1]
    half = d // 2
    i = np.arange(half, dtype=np.float64)
    theta = base ** (-2.0 * i / d)
    ang = np.asarray(positions, np.float64)[..., None] * theta          # [..., s, d/2]
    c, s = np.cos(ang), np.sin(ang)
    if style == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x2 * c + x1 * s
        return out
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def document_layout(ids, eod):
    """Position ids and allowed-attention matrix of packed rows, the way PanGu-alpha's dataset.py
    (get_input_data_batch_slice_map) builds them: after each EOD at index e, positions restart
    and rows > e stop seeing columns <= e."""
    b, s = ids.shape
    pos = np.tile(np.arange(s), (b, 1))
    allowed = np.tile(np.tril(np.ones((s, s), bool)), (b, 1, 1))
    for r in range(b):
        prev = 0
        for e in np.nonzero(ids[r] == eod)[0]:
            allowed[r, e + 1:, :e + 1] = False
            pos[r, e + 1:] -= e + 1 - prev
            prev = e + 1
    return pos, allowed


def alibi_slopes(n):
    """ALiBi (Press et al. 2022): 2^(-8i/n), i = 1..n for n a power of two; otherwise the slopes of
    the closest smaller power of two m, then every other slope of 2m (starting with the first)."""
    def geo(m):
        return [2.0 ** (-8.0 * i / m) for i in range(1, m + 1)]
    if n & (n - 1) == 0:
        return np.array(geo(n))
    m = 1 << (n.bit_length() - 1)
    return np.array(geo(m) + geo(2 * m)[0::2][: n - m])


# ----------------------------------------------------------------------------- blocks
def attention(x, p, prefix, cfg, q_src=None, positions=None, allowed=None):
    """x: [b*s, h] normed hidden states. Returns [b*s, h].  positions [b, s] (RoPE), allowed [b, s, s]."""
    s, nh, nkv = cfg.seq_length, cfg.num_heads, cfg.num_kv_heads or cfg.num_heads
    hd = cfg.hidden_size // nh
    b = x.shape[0] // s

    def lin(inp, name):
        y = inp @ p[f"{prefix}.{name}_weight"].T
        if cfg.bias:
            y = y + p[f"{prefix}.{name}_bias"]
        return y

    def heads(y, n):
        return y.reshape(b, s, n, hd).transpose(0, 2, 1, 3)

    q = heads(lin(x if q_src is None else q_src, "q"), nh)
    k = heads(lin(x, "k"), nkv)
    v = heads(lin(x, "v"), nkv)
    if cfg.position == "rope":
        pos = np.arange(s) if positions is None else positions[:, None, :]
        q = rope(q, pos, cfg.rope_base, getattr(cfg, "rope_style", "rotate_half"))
        k = rope(k, pos, cfg.rope_base, getattr(cfg, "rope_style", "rotate_half"))
    group = nh // nkv
    kv_of_head = [j // group for j in range(nh)]
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    scores = np.einsum("bnid,bnjd->bnij", q, k) / math.sqrt(hd)
    i = np.arange(s)[:, None]
    j = np.arange(s)[None, :]
    if cfg.position == "alibi":
        scores = scores + alibi_slopes(nh)[None, :, None, None] * (j - i)[None, None]
    blocked = (j > i)[None, None] if allowed is None else ~allowed[:, None]
    scores = np.where(blocked, -np.inf, scores)
    probs = softmax(scores)
    ctx = np.einsum("bnij,bnjd->bnid", probs, v).transpose(0, 2, 1, 3).reshape(b * s, nh * hd)
    return lin(ctx, "out")


def mlp(x, p, prefix, cfg):
    def lin(inp, name):
        y = inp @ p[f"{prefix}.{name}_weight"].T
        if cfg.bias:
            y = y + p[f"{prefix}.{name}_bias"]
        return y

    up = lin(x, "up")
    if cfg.activation == "swiglu":
        hidden = silu(lin(x, "gate")) * up
    elif cfg.activation == "gelu":
        hidden = gelu_exact(up)
    else:
        hidden = fast_gelu(up)
    return lin(hidden, "down")


def decoder_layer(x, p, prefix, cfg, is_query_layer=False, positions=None, allowed=None):
    h = norm(cfg.norm, x, p, f"{prefix}.input_norm", cfg.norm_eps)
    q_src = None
    b = x.shape[0] // cfg.seq_length
    pos = np.tile(np.arange(cfg.seq_length), (b, 1)) if positions is None else positions
    if is_query_layer:
        q_src = p[f"{prefix}.attention.query_embedding"][pos].reshape(b * cfg.seq_length, -1)
    x = x + attention(h, p, f"{prefix}.attention", cfg, q_src=q_src, positions=positions, allowed=allowed)
    return x + mlp(norm(cfg.norm, x, p, f"{prefix}.post_attention_norm", cfg.norm_eps), p, f"{prefix}.mlp", cfg)


def lm_logits(p, cfg, ids):
    ids = np.asarray(ids)
    b, s = ids.shape
    positions, allowed = None, None
    if getattr(cfg, "eod_reset", False) or getattr(cfg, "eod_reset_positions", False):
        pos, allow = document_layout(ids, cfg.eod_id)
        allowed = allow if cfg.eod_reset else None
        positions = pos if cfg.eod_reset_positions else None
    x = p["embedding.word_embedding"][ids]                      # [b, s, h]
    if cfg.position == "learned":
        x = x + p["embedding.position_embedding"][np.arange(s)[None] if positions is None else positions]
    x = x.reshape(b * s, -1)
    if cfg.embedding_norm:
        x = norm(cfg.norm, x, p, "embedding.norm", cfg.norm_eps)
    before = getattr(cfg, "final_norm", "after") == "before_query_layer"
    for i in range(cfg.num_layers):
        if before and i == cfg.num_layers - 1:
            x = norm(cfg.norm, x, p, "head.final_norm", cfg.norm_eps)
        x = decoder_layer(x, p, f"layers.{i}", cfg, cfg.query_layer and i == cfg.num_layers - 1,
                          positions, allowed)
    if not before:
        x = norm(cfg.norm, x, p, "head.final_norm", cfg.norm_eps)
    w = p["embedding.word_embedding"] if cfg.tie_embeddings else p["head.weight"]
    return x @ w.T                                              # [b*s, padded vocab]


def lm_loss(p, cfg, ids, labels):
    logits = lm_logits(p, cfg, ids)
    m = logits.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    lab = np.asarray(labels).reshape(-1)
    nll = logz - logits[np.arange(lab.size), lab]
    pad = getattr(cfg, "loss_pad_id", None)
    if pad is None:
        return float(np.mean(nll))
    m = (np.asarray(ids).reshape(-1) != pad).astype(np.float64)     # the references' input mask
    return float((nll * m).sum() / (m.sum() + 1e-5))
