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
def rope(x, positions, base):
    """Rotate-half RoPE on the last axis of x [..., s, d]: pairs (i, i + d/2), theta_i = base^(-2i/d)."""
    d = x.shape[-1]
    half = d // 2
    i = np.arange(half, dtype=np.float64)
    theta = base ** (-2.0 * i / d)
    ang = np.asarray(positions, np.float64)[:, None] * theta[None, :]   # [s, d/2]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


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
def attention(x, p, prefix, cfg, q_src=None):
    """x: [b*s, h] normed hidden states. Returns [b*s, h]."""
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
        q = rope(q, np.arange(s), cfg.rope_base)
        k = rope(k, np.arange(s), cfg.rope_base)
    group = nh // nkv
    kv_of_head = [j // group for j in range(nh)]
    k, v = k[:, kv_of_head], v[:, kv_of_head]
    scores = np.einsum("bnid,bnjd->bnij", q, k) / math.sqrt(hd)
    i = np.arange(s)[:, None]
    j = np.arange(s)[None, :]
    if cfg.position == "alibi":
        scores = scores + alibi_slopes(nh)[None, :, None, None] * (j - i)[None, None]
    scores = np.where((j > i)[None, None], -np.inf, scores)
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


def decoder_layer(x, p, prefix, cfg, is_query_layer=False):
    h = norm(cfg.norm, x, p, f"{prefix}.input_norm", cfg.norm_eps)
    q_src = None
    if is_query_layer:
        b = x.shape[0] // cfg.seq_length
        q_src = np.tile(p[f"{prefix}.attention.query_embedding"][: cfg.seq_length], (b, 1))
    x = x + attention(h, p, f"{prefix}.attention", cfg, q_src=q_src)
    return x + mlp(norm(cfg.norm, x, p, f"{prefix}.post_attention_norm", cfg.norm_eps), p, f"{prefix}.mlp", cfg)


def lm_logits(p, cfg, ids):
    ids = np.asarray(ids)
    b, s = ids.shape
    x = p["embedding.word_embedding"][ids]                      # [b, s, h]
    if cfg.position == "learned":
        x = x + p["embedding.position_embedding"][:s][None]
    x = x.reshape(b * s, -1)
    if cfg.embedding_norm:
        x = norm(cfg.norm, x, p, "embedding.norm", cfg.norm_eps)
    for i in range(cfg.num_layers):
        x = decoder_layer(x, p, f"layers.{i}", cfg, cfg.query_layer and i == cfg.num_layers - 1)
    x = norm(cfg.norm, x, p, "head.final_norm", cfg.norm_eps)
    w = p["embedding.word_embedding"] if cfg.tie_embeddings else p["head.weight"]
    return x @ w.T                                              # [b*s, padded vocab]


def lm_loss(p, cfg, ids, labels):
    logits = lm_logits(p, cfg, ids)
    m = logits.max(-1, keepdims=True)
    logz = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    lab = np.asarray(labels).reshape(-1)
    return float(np.mean(logz - logits[np.arange(lab.size), lab]))
