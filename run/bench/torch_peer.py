"""A plain PyTorch implementation of naohai's decoder, the peer `naohai bench` times naohai against.

Written from the math of ``naohai/model/layers.py`` and ``transformer.py`` for the
configurations the benchmark uses (the ``tiny`` preset family): pre-norm decoder,
LayerNorm (gain and shift, eps from the config) or RMSNorm, q/k/v/out projections
with biases, rotate-half RoPE on q and k (theta_i = base^(-2i/d)), causal softmax
attention scaled by 1/sqrt(head_dim) with a -1e9 additive mask, SwiGLU MLP
(``silu(x W_gate^T + b_gate) * (x W_up^T + b_up)`` then the down projection), final
norm after the last layer, head tied to the word embedding (padded vocabulary), mean
token cross entropy.  Dropout is not implemented (the benchmark runs with 0, as naohai).

Parameter names equal naohai's (``layers.3.attention.q_weight`` ...), so
``load_numpy(dict)`` takes naohai's initial weights one to one (the equivalence test does).
Only PyTorch is imported here; naohai never imports this file from training code.

``make_peer(cfg)`` builds the module from any object with ModelConfig's fields;
``unsupported(cfg)`` says why a configuration is outside what this peer implements.
``make_train_step(model, ...)`` returns ``step(input_ids, labels) -> loss`` doing AdamW
with naohai's decay groups and global-norm clipping (eager, or ``torch.compile``'d).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import numpy as np
import torch
from torch import nn


def unsupported(cfg) -> Optional[str]:
    """None when the peer implements ``cfg``'s architecture, else the reason it does not."""
    checks = [
        (cfg.position == "rope" and getattr(cfg, "rope_style", "rotate_half") == "rotate_half",
         "position must be rope (rotate_half)"),
        (cfg.activation == "swiglu", "activation must be swiglu"),
        (cfg.norm in ("layernorm", "rmsnorm"), "norm must be layernorm or rmsnorm"),
        (not cfg.query_layer, "no PanGu query layer"),
        (not cfg.embedding_norm, "no embedding norm"),
        (cfg.tie_embeddings, "head tied to the word embedding"),
        (getattr(cfg, "final_norm", "after") == "after", "final norm after the last layer"),
        (not cfg.eod_reset and not cfg.eod_reset_positions, "no EOD resets"),
        (cfg.loss_pad_id is None, "no loss pad mask"),
        (float(cfg.dropout) == 0.0, "dropout 0"),
        (cfg.compute_dtype == "float32", "float32 compute"),
        ((cfg.num_kv_heads or cfg.num_heads) == cfg.num_heads, "no grouped-query attention"),
    ]
    bad = [why for ok, why in checks if not ok]
    return "; ".join(bad) if bad else None


def _padded_vocab(cfg) -> int:
    m = max(1, int(cfg.vocab_pad_multiple))
    return int(math.ceil(cfg.vocab_size / m) * m)


class Norm(nn.Module):
    def __init__(self, h: int, kind: str, eps: float):
        super().__init__()
        self.kind, self.eps = kind, float(eps)
        self.gamma = nn.Parameter(torch.ones(h))
        if kind == "layernorm":
            self.beta = nn.Parameter(torch.zeros(h))

    def forward(self, x):
        if self.kind == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.gamma
        return nn.functional.layer_norm(x, x.shape[-1:], self.gamma, self.beta, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.nh, self.hd, self.s = cfg.num_heads, h // cfg.num_heads, cfg.seq_length
        for name in ("q", "k", "v", "out"):
            setattr(self, f"{name}_weight", nn.Parameter(torch.empty(h, h)))
            setattr(self, f"{name}_bias", nn.Parameter(torch.zeros(h)))
        inv = 1.0 / (cfg.rope_base ** (np.arange(0, self.hd, 2, dtype=np.float64) / self.hd))
        ang = np.outer(np.arange(self.s, dtype=np.float64), inv)
        ang = np.concatenate([ang, ang], axis=-1)                                   # rotate-half layout
        self.register_buffer("cos", torch.tensor(np.cos(ang), dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.tensor(np.sin(ang), dtype=torch.float32), persistent=False)
        mask = np.where(np.triu(np.ones((self.s, self.s), bool), k=1), -1e9, 0.0).astype(np.float32)
        self.register_buffer("mask", torch.tensor(mask), persistent=False)

    def _rope(self, x):
        half = self.hd // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rot * self.sin

    def forward(self, x):                                                  # x [b, s, h]
        b, s, h = x.shape
        def heads(w, bias):
            return nn.functional.linear(x, w, bias).view(b, s, self.nh, self.hd).transpose(1, 2)
        q = self._rope(heads(self.q_weight, self.q_bias))
        k = self._rope(heads(self.k_weight, self.k_bias))
        v = heads(self.v_weight, self.v_bias)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(self.hd)) + self.mask
        ctx = torch.matmul(torch.softmax(scores, dim=-1), v)
        ctx = ctx.transpose(1, 2).reshape(b, s, h)
        return nn.functional.linear(ctx, self.out_weight, self.out_bias)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        self.up_weight = nn.Parameter(torch.empty(f, h))
        self.gate_weight = nn.Parameter(torch.empty(f, h))
        self.down_weight = nn.Parameter(torch.empty(h, f))
        self.up_bias = nn.Parameter(torch.zeros(f))
        self.gate_bias = nn.Parameter(torch.zeros(f))
        self.down_bias = nn.Parameter(torch.zeros(h))

    def forward(self, x):
        gate = nn.functional.linear(x, self.gate_weight, self.gate_bias)
        up = nn.functional.linear(x, self.up_weight, self.up_bias)
        return nn.functional.linear(nn.functional.silu(gate) * up, self.down_weight, self.down_bias)


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class Embedding(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.word_embedding = nn.Parameter(torch.empty(_padded_vocab(cfg), cfg.hidden_size))


class Head(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.final_norm = Norm(cfg.hidden_size, cfg.norm, cfg.norm_eps)


class PeerLM(nn.Module):
    """``forward(input_ids [b, s], labels [b, s]) -> mean next-token cross entropy``."""

    def __init__(self, cfg, seed: int = 0):
        super().__init__()
        why = unsupported(cfg)
        if why:
            raise ValueError(f"the PyTorch peer does not implement this model: {why}")
        self.embedding = Embedding(cfg)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)
        gen = torch.Generator().manual_seed(seed)
        scaled = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith(("out_weight", "down_weight")):
                    p.normal_(0.0, scaled, generator=gen)
                elif name.endswith("_weight") or name.endswith("word_embedding"):
                    p.normal_(0.0, cfg.init_std, generator=gen)

    def forward(self, input_ids, labels):
        table = self.embedding.word_embedding
        x = table[input_ids]
        for layer in self.layers:
            x = layer(x)
        logits = self.head.final_norm(x) @ table.t()
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    def load_numpy(self, weights: Dict[str, np.ndarray]) -> None:
        """Copy tensors by naohai's parameter names; every peer parameter must be given."""
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(weights))
        if missing:
            raise KeyError(f"no value for {missing[:5]}")
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(torch.from_numpy(np.asarray(weights[name], np.float32)))


def make_peer(cfg, seed: int = 0) -> PeerLM:
    return PeerLM(cfg, seed)


def make_train_step(model: PeerLM, lr: float = 1e-3, weight_decay: float = 0.1, betas=(0.9, 0.95),
                    eps: float = 1e-8, grad_clip: float = 1.0, compile: bool = False) -> Callable:
    """``step(input_ids, labels) -> loss (float)``: forward, backward, global-norm clip, AdamW.

    Decay groups as naohai's ``make_optimizer``: norm gains/shifts and biases do not decay.
    With ``compile`` the forward+backward function is ``torch.compile``'d (inductor).
    """
    decay = [p for n, p in model.named_parameters() if not (n.endswith(("gamma", "beta")) or "bias" in n)]
    plain = [p for n, p in model.named_parameters() if n.endswith(("gamma", "beta")) or "bias" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": plain, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)
    params = list(model.parameters())
    model.train()
    forward = torch.compile(model) if compile else model

    def step(input_ids, labels) -> float:
        opt.zero_grad(set_to_none=True)
        loss = forward(input_ids, labels)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        return float(loss.detach())

    return step
