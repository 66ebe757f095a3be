"""The parameter-efficient methods other than LoRA, on a built model whose base weights are frozen.

The recipe declares one method (``finetune: {method: ..., <its keys>}``, :class:`naohai.config.FinetuneConfig`);
:func:`apply_finetune` adds its parameters to a built :class:`~naohai.model.transformer.NaohaiLM` and
marks every other parameter ``requires_grad=False`` (LoRA: :mod:`naohai.model.lora`).

``prefix`` (prefix tuning, Li & Liang 2021; ``num_virtual_tokens`` n)
    Learned keys and values of n virtual positions in front of every sequence, in every layer; every
    token attends to them, and the real tokens are numbered from n.  One parameter
    ``prefix.embedding`` [n, layers * 2 * kv_heads * head_dim], laid out as Hugging Face PEFT's
    ``PREFIX_TUNING`` (row t, layer i: keys at columns ``[2i * nkv * d, (2i + 1) * nkv * d)``, values
    next), so export and import copy it.  PEFT's default ``prefix_projection: false`` is the one
    built: the prefixes are learned directly, not through a reparameterisation MLP.  The keys are
    taken as given (no RoPE applied to them), as PEFT hands them to the model as its cache.
``prompt`` (prompt tuning, Lester et al. 2021; ``num_virtual_tokens`` n)
    n learned input vectors ``prompt.embedding`` [n, hidden] placed before every sequence in place of
    word embeddings (PEFT's ``PROMPT_TUNING``, ``prompt_embeddings``).  naohai runs them through the
    frozen layers at positions 0..n-1 and hands each layer their keys and values, the real tokens at
    n, n+1, ...: the computation of a model given the longer input, without lengthening it.
``llama_adapter`` (LLaMA-Adapter, Zhang et al. 2023; ``num_virtual_tokens`` L, ``adapter_layers`` m)
    In the top m layers, L learned vectors ``layers.<i>.attention.adaption_prompt`` [L, hidden] (drawn
    from a standard normal) are projected by the layer's own k / v projections (no RoPE) and attended
    by the layer's queries in a separate softmax, scaled by a zero-initialised gate
    ``layers.<i>.attention.adaption_gate`` [1], projected by the output projection and added to the
    attention output -- PEFT's ``ADAPTION_PROMPT`` (``tuners/adaption_prompt/layer.py``).
``adapter`` (Houlsby et al. 2019; ``bottleneck`` r)
    After the attention block's output projection and after the MLP's, before each residual add:
    ``y + up(swish(down(y)))`` with ``down`` [r, hidden] + bias and ``up`` [hidden, r] + bias
    (``layers.<i>.{attention,mlp}.adapter.{down,up}_{weight,bias}``).  ``up`` starts at zero, so the
    adapted model starts equal to the base; ``down`` is drawn uniform in +-1/sqrt(hidden) from
    ``(seed, crc32(name))`` at full shape.  PEFT has no such method; naohai's own (swish as the
    ``adapters`` library's Houlsby configuration).

Every method's initial values are drawn from ``numpy.random.default_rng([seed, crc32(name)])``: the
same whatever the layout.  The generation step (:meth:`NaohaiLM.step`) carries every method: the
llama_adapter and adapter terms in the layers, prefix and prompt tuning's virtual positions as the first
columns of the key/value cache (real tokens numbered from n), so `naohai generate` and downstream scoring
run every method.
"""
from __future__ import annotations

import zlib
from typing import List

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from naohai.errors import UserError

#: parameter names of the methods' trained tensors (besides LoRA's ``.lora_a`` / ``.lora_b``)
_NAMES = ("prefix.embedding", "prompt.embedding")
_SUFFIXES = (".adaption_prompt", ".adaption_gate", ".adapter.down_weight", ".adapter.down_bias",
             ".adapter.up_weight", ".adapter.up_bias")


def is_method_name(name: str) -> bool:
    """Is ``name`` a trained tensor of prefix / prompt / llama_adapter / adapter (not an optimizer moment)?"""
    return name in _NAMES or (name.startswith("layers.") and name.endswith(_SUFFIXES))


def is_trained_name(name: str) -> bool:
    """Is ``name`` a trained tensor of any fine-tuning method, LoRA's factors included?"""
    return is_method_name(name) or (name.startswith("layers.") and name.endswith((".lora_a", ".lora_b")))


def draw(name: str, seed: int, shape, kind: str, scale: float = 1.0) -> np.ndarray:
    """Initial values of tensor ``name``: ``normal`` (std ``scale``) or ``uniform`` (+-``scale``), from
    (seed, crc32(name)) at full shape."""
    rng = np.random.default_rng([int(seed), zlib.crc32(name.encode("utf-8"))])
    if kind == "normal":
        return (rng.standard_normal(size=shape) * scale).astype(np.float32)
    return rng.uniform(-scale, scale, size=shape).astype(np.float32)


def _param(value: np.ndarray, name: str) -> Parameter:
    return Parameter(Tensor(np.asarray(value, np.float32)), name=name)


# --------------------------------------------------------------------------- prefix / prompt
class PrefixTuning(nn.Cell):
    """``construct() -> [(keys, values) [1, nkv, n, d] per layer]`` from ``prefix.embedding``."""
    kind = "prefix"

    def __init__(self, cfg, n: int, seed: int):
        super().__init__(auto_prefix=False)
        self.n, self.layers, self.nkv, self.hd = n, cfg.num_layers, cfg.kv_heads, cfg.head_dim
        width = self.layers * 2 * self.nkv * self.hd
        # PEFT draws nn.Embedding's N(0, 1); so does naohai
        self.embedding = _param(draw("prefix.embedding", seed, (n, width), "normal"), "prefix.embedding")
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()

    def construct(self):
        t = self.reshape(self.embedding, (self.n, 2 * self.layers, self.nkv, self.hd))
        t = self.transpose(t, (1, 2, 0, 3))                         # [2L, nkv, n, d]
        out = []
        for i in range(self.layers):
            out.append((t[2 * i:2 * i + 1], t[2 * i + 1:2 * i + 2]))
        return out


class PromptTuning(nn.Cell):
    """Holds ``prompt.embedding`` [n, hidden] and the positions / causal bias of the virtual tokens
    (:meth:`NaohaiLM.virtual_prefixes` runs them)."""
    kind = "prompt"

    def __init__(self, cfg, n: int, seed: int):
        super().__init__(auto_prefix=False)
        # PEFT's RANDOM init is nn.Embedding's N(0, 1); a word-embedding scale suits a trained model better
        self.embedding = _param(draw("prompt.embedding", seed, (n, cfg.hidden_size), "normal", cfg.init_std),
                                "prompt.embedding")
        self.positions = Tensor(np.arange(n, dtype=np.int32)[None])
        causal = np.triu(np.ones((n, n), np.bool_), k=1)
        self.bias = Tensor(np.where(causal, np.float32(-1e9), np.float32(0.0))[None, None])


# --------------------------------------------------------------------------- LLaMA-Adapter
class AdaptionPromptAttention(nn.Cell):
    """An attention cell plus the gated adaption-prompt term (see the module docstring)."""

    def __init__(self, inner, name: str, length: int, hidden: int, seed: int):
        super().__init__(auto_prefix=False)
        self.inner = inner
        self.length = length
        self.adaption_prompt = _param(draw(f"{name}.adaption_prompt", seed, (length, hidden), "normal"),
                                      f"{name}.adaption_prompt")
        self.adaption_gate = _param(np.zeros((1,), np.float32), f"{name}.adaption_gate")
        self.scores = ops.BatchMatMul(transpose_b=True)
        self.context = ops.BatchMatMul()
        self.softmax = ops.Softmax(axis=-1)
        self.q = ops.MatMul(transpose_b=True)
        self.q_add = ops.Add()
        self.out = ops.MatMul(transpose_b=True)
        self.out_add = ops.Add()

    def term(self, x, positions, t: int):
        """The adapter's addition to the attention output of rows x [b*t, h] at ``positions``."""
        a = self.inner
        q = a._proj(self.q, self.q_add, a.query_source(x, positions, x.shape[0] // t), a.q_weight, a.q_bias)
        q = a._heads(q, a.nh, t)
        if a.rope:
            cos, sin = a.rope_angles(positions)
            q = a.apply_rope(q, cos, sin)
        k, v = a.project_kv(self.adaption_prompt, self.length)                    # [1, nkv, L, d]
        k, v = a._expand_kv(k), a._expand_kv(v)
        b = q.shape[0]
        shape = (b, a.nh, self.length, a.hd)
        scores = self.scores(q, ops.broadcast_to(k, shape))
        scores = a.cast(scores, ms.float32) * a.scale_value
        probs = a.cast(self.softmax(scores) * a.cast(self.adaption_gate, ms.float32), a.dtype)
        ctx = self.context(probs, ops.broadcast_to(v, shape))                     # [b, nh, t, d]
        ctx = a.reshape(a.transpose(ctx, (0, 2, 1, 3)), (-1, a.nh * a.hd))
        return a.cast(a._proj(self.out, self.out_add, ctx, a.out_weight, a.out_bias), ms.float32)

    def construct(self, x, positions=None, bias=None, layer=None, prefix=None):
        out = self.inner(x, positions, bias, layer, prefix)
        return out + self.term(x, self.inner.own_positions(positions), self.inner.s)

    def step(self, x, positions, bias, past_k=None, past_v=None, slot=None):
        out, k, v = self.inner.step(x, positions, bias, past_k, past_v, slot)
        return out + self.term(x, positions, positions.shape[1]), k, v

    def shardable_ops(self):
        return self.inner.shardable_ops()


# --------------------------------------------------------------------------- Houlsby adapter
class Bottleneck(nn.Cell):
    """``y + up(swish(down(y)))`` on rows y [tokens, hidden] (float32 out)."""

    def __init__(self, name: str, hidden: int, size: int, seed: int):
        super().__init__(auto_prefix=False)
        bound = 1.0 / np.sqrt(hidden)
        self.down_weight = _param(draw(f"{name}.down_weight", seed, (size, hidden), "uniform", bound),
                                  f"{name}.down_weight")
        self.down_bias = _param(np.zeros((size,), np.float32), f"{name}.down_bias")
        self.up_weight = _param(np.zeros((hidden, size), np.float32), f"{name}.up_weight")
        self.up_bias = _param(np.zeros((hidden,), np.float32), f"{name}.up_bias")
        self.down = ops.MatMul(transpose_b=True)
        self.up = ops.MatMul(transpose_b=True)
        self.sigmoid = ops.Sigmoid()
        self.cast = ops.Cast()

    def construct(self, y):
        y = self.cast(y, ms.float32)
        z = self.down(y, self.down_weight) + self.down_bias
        z = z * self.sigmoid(z)
        return y + self.up(z, self.up_weight) + self.up_bias


class AdaptedAttention(nn.Cell):
    """An attention cell whose output goes through a :class:`Bottleneck`."""

    def __init__(self, inner, adapter):
        super().__init__(auto_prefix=False)
        self.inner, self.adapter = inner, adapter

    def construct(self, x, positions=None, bias=None, layer=None, prefix=None):
        return self.adapter(self.inner(x, positions, bias, layer, prefix))

    def step(self, x, positions, bias, past_k=None, past_v=None, slot=None):
        out, k, v = self.inner.step(x, positions, bias, past_k, past_v, slot)
        return self.adapter(out), k, v

    def shardable_ops(self):
        return self.inner.shardable_ops()


class AdaptedMLP(nn.Cell):
    """An MLP cell whose output goes through a :class:`Bottleneck`."""

    def __init__(self, inner, adapter):
        super().__init__(auto_prefix=False)
        self.inner, self.adapter = inner, adapter

    def construct(self, x, layer=None):
        return self.adapter(self.inner(x, layer))

    def shardable_ops(self):
        return self.inner.shardable_ops()


# --------------------------------------------------------------------------- applying
def _attach(owner, attr: str, cell) -> None:
    """``setattr(owner, attr, cell)`` keeping every parameter's full name (a cell set as an attribute
    would otherwise prefix its parameters' names)."""
    names = {id(p): p.name for p in cell.get_parameters()}
    setattr(owner, attr, cell)
    for p in cell.get_parameters():
        p.name = names[id(p)]


def apply_finetune(model, ft, seed: int, where: str = "recipe") -> List[str]:
    """Add method ``ft.method``'s parameters to ``model`` (per-layer form) and freeze the rest; returns the
    names of the trained parameters."""
    model.chunked_loss.weight_grad = False    # every method freezes the head: its weight needs no gradient
    if ft.method == "lora":
        from naohai.model.lora import apply_lora
        return apply_lora(model, ft, seed, where)
    if getattr(model, "layer_loop", False):
        raise UserError(f"{ft.method} needs one cell per layer; set train.layer_loop: never", where=where,
                        key="train.layer_loop")
    cfg = model.cfg
    ft.fits(cfg, where)
    for p in model.get_parameters():
        p.requires_grad = False
    if ft.method in ("prefix", "prompt"):
        n = int(ft.num_virtual_tokens)
        _attach(model, "virtual", (PrefixTuning if ft.method == "prefix" else PromptTuning)(cfg, n, seed))
        model.embedding.shift_positions(n)
        for layer in model.layers:
            layer.attention.shift_positions(n)
    elif ft.method == "llama_adapter":
        for i in range(cfg.num_layers - int(ft.adapter_layers), cfg.num_layers):
            layer = model.layers[i]
            _attach(layer, "attention", AdaptionPromptAttention(layer.attention, f"layers.{i}.attention",
                                                                int(ft.num_virtual_tokens), cfg.hidden_size, seed))
    elif ft.method == "adapter":
        for i, layer in enumerate(model.layers):
            for part in ("attention", "mlp"):
                name = f"layers.{i}.{part}.adapter"
                wrap = AdaptedAttention if part == "attention" else AdaptedMLP
                _attach(layer, part, wrap(getattr(layer, part), Bottleneck(name, cfg.hidden_size,
                                                                           int(ft.bottleneck), seed)))
    else:
        raise UserError(f"'{ft.method}' is not a fine-tuning method", where=where, key="finetune.method")
    return [p.name for p in method_params(model)]


def method_params(model) -> List[Parameter]:
    """The trained parameters of ``model``'s method (LoRA's factors included), in model order."""
    return [p for p in model.get_parameters() if is_trained_name(p.name)]
