"""Tiny random Hugging Face models of every family naohai reads, built locally with transformers
(no download), for the import / export oracles.

Odd shapes on purpose: grouped queries with ratio 3 (6 heads, 2 kv heads), head dim 24 (hidden 144 /
6 heads), untied heads where the family allows them, partial rotary.  Norm weights and biases start
at 1 / 0 in transformers, so every 1-D parameter is perturbed: a norm or bias in the wrong place then
changes the logits.
"""
from __future__ import annotations

import os

import numpy as np

VOCAB = 300
SEQ = 64


def configs():
    """model_type -> transformers config (float32, tiny, odd shapes)."""
    from transformers import (BloomConfig, FalconConfig, GlmConfig, GPT2Config, GPTNeoXConfig, LlamaConfig,
                              MistralConfig, OlmoConfig, Qwen2Config)
    ids = dict(bos_token_id=3, eos_token_id=1, pad_token_id=0)           # the byte BPE's <s>, <eod>, <pad>
    common = dict(vocab_size=VOCAB, max_position_embeddings=SEQ, **ids)
    llama_like = dict(common, hidden_size=144, intermediate_size=200, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2)
    return {
        "llama": LlamaConfig(**llama_like, tie_word_embeddings=False, rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
        # Llama 3.1 / 3.2's frequency bands (original context 16 here: all three bands hold frequencies)
        "llama3": LlamaConfig(**llama_like, tie_word_embeddings=True, rms_norm_eps=1e-5,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 16}),
        "llama-linear": LlamaConfig(**llama_like, tie_word_embeddings=False,
                                    rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0}),
        "qwen2": Qwen2Config(**llama_like, tie_word_embeddings=True, rms_norm_eps=1e-5,
                             rope_parameters={"rope_type": "default", "rope_theta": 20000.0}),
        "mistral": MistralConfig(**llama_like, head_dim=24, tie_word_embeddings=False, rms_norm_eps=1e-5,
                                 sliding_window=None),
        "olmo": OlmoConfig(**llama_like, tie_word_embeddings=False, attention_bias=True),
        "glm": GlmConfig(**llama_like, head_dim=24, tie_word_embeddings=False, attention_bias=True,
                         rms_norm_eps=1e-5),
        "bloom": BloomConfig(vocab_size=VOCAB, hidden_size=120, n_layer=2, n_head=5, **ids),
        "falcon": FalconConfig(**dict(common, hidden_size=144, num_hidden_layers=2, num_attention_heads=6),
                               num_kv_heads=2, new_decoder_architecture=True, parallel_attn=True, bias=True,
                               ffn_hidden_size=200, tie_word_embeddings=False),
        "falcon-mq": FalconConfig(**dict(common, hidden_size=144, num_hidden_layers=2, num_attention_heads=6),
                                  multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                                  bias=False),
        "gpt_neox": GPTNeoXConfig(**dict(common, hidden_size=144, intermediate_size=200, num_hidden_layers=2,
                                         num_attention_heads=6), rotary_pct=0.5, use_parallel_residual=True,
                                  tie_word_embeddings=False),
        "gpt2": GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=144, n_layer=2, n_head=6, n_inner=200,
                           resid_pdrop=0.0, embd_pdrop=0.0, **ids,
                           attn_pdrop=0.0),
    }


def build(name: str, out: str, seed: int = 0, **changes):
    """Build, perturb and ``save_pretrained`` the tiny model ``name`` (its config with ``changes``) into
    ``out``; returns the model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = configs()[name]
    for key, value in changes.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
            else:   # larger weights than the 0.02 init, so that every layer moves the logits
                p.mul_(4.0)
    model.eval()
    model.save_pretrained(out)
    tokenizer(out)
    return model


TEXT = ("The for statement iterates over a sequence. 深度学习模型在实验室训练。 def f(x): return x + 1  🚀 "
        "while True: pass")


def tokenizer(out: str):
    """A byte-level BPE of VOCAB tokens (naohai's trainer) saved into the model folder."""
    from naohai.data.hf_tokenizer import train_byte_bpe
    return train_byte_bpe([TEXT] * 4, VOCAB, os.path.join(out, "tokenizer.json"))


def hf_greedy(model, ids, new: int = 32, stop: bool = True):
    """transformers' greedy continuation of one prompt: up to (not including) the first EOS, or with
    ``stop`` false all ``new`` tokens (EOS generated like any token)."""
    import torch
    eos = model.generation_config.eos_token_id
    ends = set(eos if isinstance(eos, list) else [eos])     # generation_config.json may list several
    kwargs = {} if stop else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(torch.as_tensor([list(ids)]), do_sample=False, max_new_tokens=new, min_new_tokens=0,
                             attention_mask=torch.ones((1, len(ids)), dtype=torch.long), **kwargs)
    out = out[0, len(ids):].tolist()
    cut = next((i for i, t in enumerate(out) if t in ends), len(out)) if stop else len(out)
    return out[:cut]


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    import torch
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids, np.int64))).logits.float().numpy()


def hf_mean_nll(model, windows: np.ndarray) -> float:
    """transformers' own mean token NLL over [n, seq + 1] windows (labels = the shifted window)."""
    import torch
    total, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            x = torch.as_tensor(np.asarray(w[None, :-1], np.int64))
            y = torch.as_tensor(np.asarray(w[None, 1:], np.int64))
            logp = torch.log_softmax(model(x).logits.double(), -1)
            total += float(-logp.gather(-1, y[..., None]).sum())
            count += y.numel()
    return total / count


def windows(n: int = 3, seed: int = 5) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=(n, SEQ + 1)).astype(np.int64)
