"""Building blocks of the decoder: norms, position encodings, attention, MLP, embedding.

Every operation a strategy may shard is a MindSpore Primitive held by its cell
and listed by ``shardable_ops()`` under the name the op catalog
(:mod:`naohai.model.catalog`) gives it.  These cells contain no parallel logic:
sharding, stages and recompute are applied from outside by
``naohai/strategy/apply.py``.

Activations between blocks are 2-D ``[tokens, hidden]`` in float32 (the
residual stream); matrix multiplications run in ``compute_dtype``; softmax and
norms run in float32 when the config says so.  Parameters are float32 master
weights, initialised from a numpy RandomState so that initialisation is exact
and independent of MindSpore's RNG.
"""
from __future__ import annotations

import math
from typing import Dict

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from naohai.config import ModelConfig

_DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}


def ms_dtype(name: str):
    return _DTYPES[name]


def _param(rng: np.random.RandomState, shape, std: float, name: str, kind: str = "normal") -> Parameter:
    if kind == "zeros":
        value = np.zeros(shape, np.float32)
    elif kind == "ones":
        value = np.ones(shape, np.float32)
    else:
        value = (rng.standard_normal(shape) * std).astype(np.float32)
    return Parameter(Tensor(value), name=name)


# ------------------------------------------------------------------------------ norms
class Norm(nn.Cell):
    """LayerNorm, RMSNorm or non-parametric LayerNorm over the last axis of [tokens, hidden]."""

    def __init__(self, cfg: ModelConfig, rng=None):
        super().__init__()
        h = cfg.hidden_size
        self.kind = cfg.norm
        self.eps = cfg.norm_eps
        self.fp32 = cfg.norm_fp32
        self.cast = ops.Cast()
        if self.kind == "rmsnorm":
            self.gamma = Parameter(Tensor(np.ones(h, np.float32)), name="gamma")
            self.square = ops.Square()
            self.mean = ops.ReduceMean(keep_dims=True)
            self.rsqrt = ops.Rsqrt()
            self.add_eps = ops.Add()
            self.mul = ops.Mul()
            self.mul_gamma = ops.Mul()
            self.norm = None
        else:
            self.norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=self.eps)
            if self.kind == "layernorm":
                self.gamma = Parameter(Tensor(np.ones(h, np.float32)), name="gamma")
                self.beta = Parameter(Tensor(np.zeros(h, np.float32)), name="beta")
            else:  # non-parametric (OLMo): fixed unit scale, zero shift
                self.gamma = Tensor(np.ones(h, np.float32))
                self.beta = Tensor(np.zeros(h, np.float32))

    def construct(self, x):
        dtype = x.dtype
        if self.fp32:
            x = self.cast(x, ms.float32)
        if self.norm is None:
            var = self.mean(self.square(x), -1)
            y = self.mul_gamma(self.mul(x, self.rsqrt(self.add_eps(var, self.eps))), self.gamma)
        else:
            y, _, _ = self.norm(x, self.gamma, self.beta)
        return self.cast(y, dtype)

    def primitive(self):
        return self.norm


# ------------------------------------------------------------------------------ positions
def rope_tables(seq_length: int, head_dim: int, base: float):
    """cos/sin tables [seq, head_dim] for rotate-half RoPE (pairs (i, i + d/2))."""
    inv = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    ang = np.outer(np.arange(seq_length, dtype=np.float64), inv)          # [s, d/2]
    ang = np.concatenate([ang, ang], axis=-1)                             # [s, d]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R with x @ R == concat(-x[d/2:], x[:d/2])."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    for i in range(half):
        r[i + half, i] = -1.0   # out[i] = -x[i + half]
        r[i, i + half] = 1.0    # out[i + half] = x[i]
    return r


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Head slopes from the ALiBi paper (geometric; extended for non powers of two)."""
    def pow2(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * (start ** i) for i in range(n)]
    if math.log2(num_heads).is_integer():
        return np.array(pow2(num_heads), np.float32)
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    extra = pow2(2 * closest)[0::2][: num_heads - closest]
    return np.array(pow2(closest) + extra, np.float32)


def attention_bias(cfg: ModelConfig) -> np.ndarray:
    """Additive bias on the scores: causal mask, plus ALiBi distances when configured."""
    s = cfg.seq_length
    causal = np.triu(np.ones((s, s), np.bool_), k=1)
    neg = np.float32(-1e9)
    if cfg.position == "alibi":
        slopes = alibi_slopes(cfg.num_heads)
        dist = (np.arange(s)[None, :] - np.arange(s)[:, None]).astype(np.float32)  # j - i (<= 0 below diag)
        bias = slopes[:, None, None] * dist[None]
        return np.where(causal[None], neg, bias).astype(np.float32)              # [heads, s, s]
    return np.where(causal, neg, np.float32(0.0))[None].astype(np.float32)        # [1, s, s]


# ------------------------------------------------------------------------------ attention
class Attention(nn.Cell):
    """Multi-head (optionally grouped-query) causal self-attention on [tokens, hidden].

    With ``query_layer`` (PanGu-alpha's top query layer) the queries are projected
    from a learned per-position embedding instead of the hidden state.
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState, out_std: float, query_layer: bool = False):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.cfg = cfg
        self.nh, self.nkv, self.hd, self.s = nh, nkv, hd, cfg.seq_length
        self.group = nh // nkv
        self.dtype = ms_dtype(cfg.compute_dtype)
        self.softmax_dtype = ms.float32 if cfg.softmax_fp32 else self.dtype
        std = cfg.init_std
        self.q_weight = _param(rng, (nh * hd, h), std, "q_weight")
        self.k_weight = _param(rng, (nkv * hd, h), std, "k_weight")
        self.v_weight = _param(rng, (nkv * hd, h), std, "v_weight")
        self.out_weight = _param(rng, (h, nh * hd), out_std, "out_weight")
        self.use_bias = cfg.bias
        self.q_bias = self.k_bias = self.v_bias = self.out_bias = None
        if cfg.bias:
            self.q_bias = _param(rng, (nh * hd,), 0, "q_bias", "zeros")
            self.k_bias = _param(rng, (nkv * hd,), 0, "k_bias", "zeros")
            self.v_bias = _param(rng, (nkv * hd,), 0, "v_bias", "zeros")
            self.out_bias = _param(rng, (h,), 0, "out_bias", "zeros")
        self.query_layer = query_layer
        if query_layer:
            self.query_embedding = _param(rng, (cfg.positions, h), std, "query_embedding")
            self.query_lookup = ops.Gather()
            self.position_ids = Tensor(np.arange(cfg.seq_length, dtype=np.int32)[None])
        self.q = ops.MatMul(transpose_b=True)
        self.k = ops.MatMul(transpose_b=True)
        self.v = ops.MatMul(transpose_b=True)
        self.q_add = ops.Add()
        self.k_add = ops.Add()
        self.v_add = ops.Add()
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.scale = ops.Mul()
        self.scale_value = Tensor(1.0 / math.sqrt(hd), ms.float32)
        self.mask = ops.Add()
        self.bias_table = Tensor(attention_bias(cfg))
        self.softmax = ops.Softmax(axis=-1)
        self.context = ops.BatchMatMul()
        self.out = ops.MatMul(transpose_b=True)
        self.out_add = ops.Add()
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.cast = ops.Cast()
        self.rope = cfg.position == "rope"
        if self.rope:
            cos, sin = rope_tables(cfg.seq_length, hd, cfg.rope_base)
            self.cos = Tensor(cos[None, None])          # [1, 1, s, d]
            self.sin = Tensor(sin[None, None])
            self.rot = Tensor(rotate_half_matrix(hd))   # [d, d]
            self.rot_mm = ops.MatMul()
            self.rope_mul_cos = ops.Mul()
            self.rope_mul_sin = ops.Mul()
            self.rope_add = ops.Add()
        if self.group > 1:
            self.expand = ops.Tile()

    def _proj(self, mm, add, x, w, b):
        y = mm(self.cast(x, self.dtype), self.cast(w, self.dtype))
        if b is not None:
            y = add(y, self.cast(b, self.dtype))
        return y

    def _heads(self, y, n):
        """[b*s, n*d] -> [b, n, s, d]"""
        y = self.reshape(y, (-1, self.s, n, self.hd))
        return self.transpose(y, (0, 2, 1, 3))

    def _apply_rope(self, x):
        b = x.shape[0]
        n = x.shape[1]
        flat = self.reshape(x, (-1, self.hd))
        rot = self.reshape(self.rot_mm(flat, self.cast(self.rot, x.dtype)), (b, n, self.s, self.hd))
        return self.rope_add(self.rope_mul_cos(x, self.cast(self.cos, x.dtype)),
                             self.rope_mul_sin(rot, self.cast(self.sin, x.dtype)))

    def _expand_kv(self, x):
        """[b, nkv, s, d] -> [b, nh, s, d] by repeating each kv head for its query group."""
        if self.group == 1:
            return x
        b = x.shape[0]
        x = self.reshape(x, (b, self.nkv, 1, self.s, self.hd))
        x = self.expand(x, (1, 1, self.group, 1, 1))
        return self.reshape(x, (b, self.nh, self.s, self.hd))

    def construct(self, x):
        """x: [b*s, h] normalised hidden states -> [b*s, h]."""
        if self.query_layer:
            qe = self.query_lookup(self.query_embedding, self.position_ids, 0)    # [1, s, h]
            batch = x.shape[0] // self.s
            q_src = self.reshape(ops.tile(qe, (batch, 1, 1)), (-1, qe.shape[-1]))
        else:
            q_src = x
        q = self._heads(self._proj(self.q, self.q_add, q_src, self.q_weight, self.q_bias), self.nh)
        k = self._heads(self._proj(self.k, self.k_add, x, self.k_weight, self.k_bias), self.nkv)
        v = self._heads(self._proj(self.v, self.v_add, x, self.v_weight, self.v_bias), self.nkv)
        if self.rope:
            q = self._apply_rope(q)
            k = self._apply_rope(k)
        k = self._expand_kv(k)
        v = self._expand_kv(v)
        scores = self.scores(q, k)                                             # [b, nh, s, s]
        scores = self.cast(scores, self.softmax_dtype)
        scores = self.scale(scores, self.cast(self.scale_value, self.softmax_dtype))
        scores = self.mask(scores, self.cast(self.bias_table, self.softmax_dtype))
        probs = self.cast(self.softmax(scores), self.dtype)
        ctx = self.context(probs, v)                                           # [b, nh, s, d]
        ctx = self.reshape(self.transpose(ctx, (0, 2, 1, 3)), (-1, self.nh * self.hd))
        out = self._proj(self.out, self.out_add, ctx, self.out_weight, self.out_bias)
        return self.cast(out, ms.float32)

    def shardable_ops(self) -> Dict[str, object]:
        out = {"q": self.q, "k": self.k, "v": self.v, "scores": self.scores, "scale": self.scale,
               "mask": self.mask, "softmax": self.softmax, "context": self.context, "out": self.out}
        if self.use_bias:
            out.update({"q_bias": self.q_add, "k_bias": self.k_add, "v_bias": self.v_add, "out_bias": self.out_add})
        if self.query_layer:
            out["query_lookup"] = self.query_lookup
        return out


# ------------------------------------------------------------------------------ MLP
class MLP(nn.Cell):
    """(fast_)GeLU or SwiGLU feed-forward on [tokens, hidden]."""

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState, out_std: float):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.dtype = ms_dtype(cfg.compute_dtype)
        self.use_bias = cfg.bias
        self.swiglu = cfg.activation == "swiglu"
        self.up_bias = self.gate_bias = self.down_bias = None
        self.up_weight = _param(rng, (f, h), cfg.init_std, "up_weight")
        if self.swiglu:
            self.gate_weight = _param(rng, (f, h), cfg.init_std, "gate_weight")
        self.down_weight = _param(rng, (h, f), out_std, "down_weight")
        if cfg.bias:
            self.up_bias = _param(rng, (f,), 0, "up_bias", "zeros")
            if self.swiglu:
                self.gate_bias = _param(rng, (f,), 0, "gate_bias", "zeros")
            self.down_bias = _param(rng, (h,), 0, "down_bias", "zeros")
        self.up = ops.MatMul(transpose_b=True)
        self.gate = ops.MatMul(transpose_b=True)
        self.down = ops.MatMul(transpose_b=True)
        self.up_add = ops.Add()
        self.gate_add = ops.Add()
        self.down_add = ops.Add()
        self.mul = ops.Mul()
        self.act_mul = ops.Mul()          # SiLU(g) = g * sigmoid(g): 2.10 has no SiLU primitive
        if cfg.activation == "swiglu":
            self.act = ops.Sigmoid()
        elif cfg.activation == "fast_gelu":
            self.act = ops.FastGeLU()
        else:
            # exact GeLU x * Phi(x) = x * (1 + erf(x / sqrt 2)) / 2; ops.GeLU on CPU in 2.10 is the
            # tanh approximation (measured up to 4.7e-4 off on [-4, 4])
            self.act = ops.Erf()
        self.exact_gelu = cfg.activation == "gelu"
        self.cast = ops.Cast()

    def construct(self, x):
        x = self.cast(x, self.dtype)
        up = self.up(x, self.cast(self.up_weight, self.dtype))
        if self.use_bias:
            up = self.up_add(up, self.cast(self.up_bias, self.dtype))
        if self.swiglu:
            gate = self.gate(x, self.cast(self.gate_weight, self.dtype))
            if self.use_bias:
                gate = self.gate_add(gate, self.cast(self.gate_bias, self.dtype))
            hidden = self.mul(self.act_mul(gate, self.act(gate)), up)
        else:
            hidden = self.activation(up)
        out = self.down(hidden, self.cast(self.down_weight, self.dtype))
        if self.use_bias:
            out = self.down_add(out, self.cast(self.down_bias, self.dtype))
        return self.cast(out, ms.float32)

    def activation(self, x):
        """GeLU (exact) or FastGeLU of x (the non-gated activations)."""
        if self.exact_gelu:
            return self.act_mul(x, (self.act(x * 0.7071067811865476) + 1.0) * 0.5)
        return self.act(x)

    def shardable_ops(self) -> Dict[str, object]:
        out = {"up": self.up, "act": self.act, "down": self.down}
        if self.exact_gelu:
            out["act_mul"] = self.act_mul
        if self.swiglu:
            out.update({"gate": self.gate, "mul": self.mul, "act_mul": self.act_mul})
        if self.use_bias:
            out.update({"up_bias": self.up_add, "down_bias": self.down_add})
            if self.swiglu:
                out["gate_bias"] = self.gate_add
        return out


# ------------------------------------------------------------------------------ embedding
class Embedding(nn.Cell):
    """Word embedding (+ learned positions, + BLOOM's embedding LayerNorm) -> [b*s, h] float32."""

    def __init__(self, cfg: ModelConfig, rng: np.random.RandomState):
        super().__init__()
        h = cfg.hidden_size
        self.h = h
        self.word_embedding = _param(rng, (cfg.padded_vocab_size, h), cfg.init_std, "word_embedding")
        self.lookup = ops.Gather()
        self.learned = cfg.position == "learned"
        if self.learned:
            self.position_embedding = _param(rng, (cfg.positions, h), cfg.init_std, "position_embedding")
            self.position = ops.Gather()
            self.position_ids = Tensor(np.arange(cfg.seq_length, dtype=np.int32)[None])
            self.add_pos = ops.Add()
        self.use_norm = cfg.embedding_norm
        if self.use_norm:
            self.norm = Norm(cfg)
        self.reshape = ops.Reshape()

    def construct(self, input_ids):
        x = self.lookup(self.word_embedding, input_ids, 0)                        # [b, s, h]
        if self.learned:
            x = self.add_pos(x, self.position(self.position_embedding, self.position_ids, 0))
        x = self.reshape(x, (-1, self.h))
        if self.use_norm:
            x = self.norm(x)
        return x

    def shardable_ops(self) -> Dict[str, object]:
        out = {"lookup": self.lookup}
        if self.learned:
            out["position"] = self.position
        return out
