"""LoRA adapters in Hugging Face PEFT's folder format: ``adapter_config.json`` + ``adapter_model.safetensors``.

For a model whose family has a Hugging Face architecture (:mod:`naohai.convert.hf`), the adapter
of op ``layers.<i>.<part>.<op>`` (:mod:`naohai.model.lora`) belongs to the module that holds its
base weight: the architecture's link of ``layers.<i>.<part>.<op>_weight`` names the tensor
(e.g. ``model.layers.0.self_attn.q_proj.weight``), the module is that name without ``.weight``.
PEFT stores ``base_model.model.<module>.lora_A.weight`` ([rank, in], naohai's ``A``) and
``...lora_B.weight`` ([out, rank], ``B``) and scales by ``lora_alpha / r``, as naohai does
(PEFT's ``tuners/lora/layer.py``, ``use_rslora`` off).  Only architectures that store the weight
as naohai does (one tensor, [out, in]) are written; a fused or transposed one is refused.

:func:`write_peft` / :func:`read_peft` also carry the other methods PEFT implements
(:mod:`naohai.model.finetune`): prefix tuning (``PREFIX_TUNING``) and prompt tuning
(``PROMPT_TUNING``) as the one ``prompt_embeddings`` tensor, LLaMA-Adapter (``ADAPTION_PROMPT``, the
llama family's module names) as ``adaption_prompt`` / ``adaption_gate`` per adapted layer.

An imported folder is user input: every number naohai reads from ``adapter_config.json`` (``r``,
``lora_alpha``, ``lora_dropout``, ``num_virtual_tokens``, ``adapter_len``, ``adapter_layers``,
``num_transformer_submodules``) goes through :mod:`naohai.validate` (no booleans, strings, NaN,
Infinity, fractions for integers, or values out of range), ``lora_alpha / r`` keeps the recipe's
bound (:data:`naohai.config.MAX_LORA_SCALE`), and the safetensors' tensors must be floating point
(F32, F16 or BF16, as PEFT saves a half-precision model's adapter; each read exactly as float32) with finite
values in float32; else exit 2 naming the file, the key and the rule.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from naohai import validate
from naohai.config import MAX_LORA_SCALE
from naohai.convert.hf.folder import read_safetensors
from naohai.errors import UserError
from naohai.model.config import ModelConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _modules(cfg: ModelConfig, where: str) -> Dict[str, str]:
    """naohai weight name -> Hugging Face module name, for weights stored one to one."""
    from naohai.convert.hf.arch import same
    from naohai.convert.hf.registry import for_family

    arch = for_family(cfg, where)
    return {link.ours[0]: link.ref[:-len(".weight")] for link in arch.links(cfg)
            if len(link.ours) == 1 and link.to_ref is same and link.ref.endswith(".weight")}


def write_peft_lora(out: str, cfg: ModelConfig, adapters: Dict[str, np.ndarray], *, rank: int, alpha: float,
                    dropout: float = 0.0, base_model: str = "", where: str = "adapter") -> List[str]:
    """Write the LoRA ``adapters`` (``<op>.lora_a`` / ``<op>.lora_b`` -> arrays) as a PEFT folder ``out``
    (a new path); returns the files written."""
    from safetensors.numpy import save_file

    if os.path.exists(out):
        raise UserError("already exists; exporting never overwrites (choose a new folder)", where=out, key="--out")
    modules = _modules(cfg, where)
    tensors, targets = {}, []
    for name in sorted(n for n in adapters if n.endswith(".lora_a")):
        op = name[:-len(".lora_a")]
        module = modules.get(f"{op}_weight")
        if module is None:
            raise UserError(f"the adapter of {op} has no Hugging Face module one to one with its weight in this "
                            f"family ({cfg.family}); PEFT export is not available for it", where=where,
                            key="finetune.targets")
        a = np.asarray(adapters[name], np.float32)
        b = np.asarray(adapters[f"{op}.lora_b"], np.float32)
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{op}: A {a.shape} and B {b.shape} are not of rank {rank}")
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b)
        targets.append(module)
    if not targets:
        raise UserError("holds no LoRA adapter to export", where=where, key="finetune")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "r": int(rank), "lora_alpha": float(alpha), "lora_dropout": float(dropout), "bias": "none",
              "target_modules": targets, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
              "inference_mode": True, "init_lora_weights": True, "modules_to_save": None}
    os.makedirs(out)
    with open(os.path.join(out, CONFIG), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    save_file(tensors, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
    return [CONFIG, WEIGHTS]


#: adapter_config.json keys whose non-default values change the computation; naohai has none of them
_UNSUPPORTED = {"use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False,
                "layer_replication": None}


def _read_config(folder: str):
    """(config path, weights path, adapter_config.json's object) of a PEFT folder; exit 2 naming the file."""
    config_path, weights_path = os.path.join(folder, CONFIG), os.path.join(folder, WEIGHTS)
    if not os.path.isdir(folder) or not os.path.isfile(config_path):
        raise UserError(f"is not a PEFT adapter folder: it needs {CONFIG} and {WEIGHTS}", where=folder)
    return config_path, weights_path, validate.read_json_object(config_path)


def _read_weights(weights_path: str) -> Dict[str, np.ndarray]:
    """The tensors of a PEFT folder's ``adapter_model.safetensors``; a missing or unreadable file exits 2."""
    if not os.path.isfile(weights_path):
        raise UserError(f"is missing ({WEIGHTS}: naohai reads safetensors, not adapter_model.bin)",
                        where=weights_path)
    tensors = read_safetensors(weights_path)       # BF16 and F16 adapters as float32, as PEFT's upcast does
    out = {}
    for name, value in tensors.items():
        if value.dtype.kind != "f":
            raise UserError(f"holds {name!r} as {value.dtype}; an adapter's tensors are floating point (read as "
                            f"float32, they would be its numbers silently)", where=weights_path, key=name,
                            rule="floating-point tensors")
        bad = int(value.size - np.count_nonzero(np.isfinite(value)))
        if bad:
            raise UserError(f"holds {name!r} with {bad} of its {value.size} values NaN or infinite (in float32, "
                            f"naohai's type); the adapted model's outputs would be NaN", where=weights_path, key=name,
                            rule="finite values")
        out[name] = value
    return out


def read_peft_lora(folder: str, cfg: ModelConfig, where_base: str = "--base"):
    """``(adapters by naohai name, rank, alpha, dropout)`` of the PEFT LoRA folder ``folder`` for a base of
    model ``cfg``.  Anything naohai would compute otherwise is refused: exit 2 naming the file and key."""
    from naohai.model.lora import lora_ops

    config_path, weights_path, config = _read_config(folder)
    if config.get("peft_type") != "LORA":
        raise UserError(f"is {config.get('peft_type')!r}; naohai imports LoRA adapters ('LORA')", where=config_path,
                        key="peft_type")
    for key, plain in _UNSUPPORTED.items():
        value = config.get(key, plain)
        if value != plain and not (plain in ({}, None) and not value):
            raise UserError(f"is {value!r}; naohai's LoRA has no such variant (it needs {plain!r})",
                            where=config_path, key=key)
    rank, alpha, dropout = _lora_numbers(config, config_path)
    tensors = _read_weights(weights_path)
    ops = {module: name[:-len("_weight")] for name, module in _modules(cfg, where_base).items()}
    dims = lora_ops(cfg)
    factors = []
    for key, value in sorted(tensors.items()):
        prefix, suffix = "base_model.model.", None
        for end, ab in ((".lora_A.weight", "a"), (".lora_B.weight", "b")):
            if key.startswith(prefix) and key.endswith(end):
                suffix = ab
                module = key[len(prefix):-len(end)]
        if suffix is None:
            raise UserError(f"holds {key!r}, which is not a LoRA factor (base_model.model.<module>.lora_A/B.weight)",
                            where=weights_path)
        op = ops.get(module)
        if op is None or op not in dims:
            raise UserError(f"base mismatch: {module} (tensor {key!r}) is not a linear layer LoRA adapts in the base "
                            f"model ({cfg.family}, {cfg.num_layers} layers)", where=weights_path, key="target_modules")
        factors.append((key, value, op, suffix))
    if factors:       # the rank against the adapted weights before their shapes (r = 1e30 is this rule's)
        smallest = min(min(dims[op]) for _, _, op, _ in factors)
        if rank > smallest:
            raise UserError(f"is {rank}, more than {smallest}, the smallest dimension of the adapted weights",
                            where=config_path, key="r",
                            rule="r <= the smallest dimension of each adapted weight")
    adapters: Dict[str, np.ndarray] = {}
    for key, value, op, suffix in factors:
        out, inn = dims[op]
        want = (rank, inn) if suffix == "a" else (out, rank)
        if tuple(value.shape) != want:
            raise UserError(f"base mismatch: {key} has shape {tuple(value.shape)}; rank {rank} over the base's "
                            f"{op} ([{out}, {inn}]) needs {want}", where=weights_path, key="r")
        adapters[f"{op}.lora_{suffix}"] = value
    pairs = {n[:-len(".lora_a")] for n in adapters if n.endswith(".lora_a")}
    lone = sorted({n.rsplit(".", 1)[0] for n in adapters} - pairs) + sorted(
        p for p in pairs if f"{p}.lora_b" not in adapters)
    if not adapters or lone:
        raise UserError(f"holds {'no LoRA factors' if not adapters else f'A without B or B without A for {lone[:3]}'}",
                        where=weights_path)
    return adapters, rank, alpha, dropout


def _lora_numbers(config: dict, where: str):
    """``(r, lora_alpha, lora_dropout)`` of a LoRA adapter_config.json, each checked as the recipe's
    ``finetune`` keys are (:class:`naohai.config.FinetuneConfig`): exit 2 naming the file, the key, the rule."""
    rank = validate.integer(config.get("r"), where, "r", minimum=1)
    alpha = validate.number(config.get("lora_alpha"), where, "lora_alpha", above=0)
    if alpha / rank > MAX_LORA_SCALE:
        # the scale is a tensor of the compute dtype: inf times B is inf or NaN in every adapted layer
        raise UserError(f"lora_alpha / r = {alpha:g} / {rank} = {alpha / rank:g} scales the adapter's output; above "
                        f"{MAX_LORA_SCALE:g}, float16's largest value, it is inf in float16 (and at 3.4e38 in "
                        f"float32), and the adapted layers would give inf or NaN", where=where, key="lora_alpha",
                        rule=f"0 < lora_alpha / r <= {MAX_LORA_SCALE:g}")
    dropout = config.get("lora_dropout")
    dropout = 0.0 if dropout is None else validate.number(dropout, where, "lora_dropout", minimum=0, below=1)
    return rank, alpha, dropout


# --------------------------------------------------------------------------- prefix, prompt, adaption prompt
#: naohai method -> PEFT's peft_type
PEFT_TYPES = {"lora": "LORA", "prefix": "PREFIX_TUNING", "prompt": "PROMPT_TUNING", "llama_adapter": "ADAPTION_PROMPT"}
_EMBEDDINGS = "prompt_embeddings"


def _adaption_key(i: int, what: str) -> str:
    return f"base_model.model.model.layers.{i}.self_attn.adaption_{what}"


def _need_llama(cfg: ModelConfig, where: str, key: str) -> None:
    if cfg.family != "llama":
        raise UserError(f"PEFT's adaption prompt knows the llama family's module names; this model is "
                        f"{cfg.family!r}, so it is not exported / imported", where=where, key=key)


def write_peft(out: str, cfg: ModelConfig, ft, tensors: Dict[str, np.ndarray], base_model: str = "",
               where: str = "adapter") -> List[str]:
    """Write the trained tensors of any PEFT-known method (``ft``: the recipe's ``finetune``) as a PEFT
    folder ``out`` (a new path).  prefix: ``prompt_embeddings`` = naohai's ``prefix.embedding`` (the same
    layout, ``prefix_projection: false``); prompt: ``prompt_embeddings`` = ``prompt.embedding``;
    llama_adapter: ``...layers.<i>.self_attn.adaption_prompt`` [1, L, hidden] and ``adaption_gate`` [1]."""
    from safetensors.numpy import save_file

    method = ft.method
    if method == "lora":
        return write_peft_lora(out, cfg, tensors, rank=int(ft.rank), alpha=float(ft.alpha),
                               dropout=float(ft.dropout), base_model=base_model, where=where)
    if method not in PEFT_TYPES:
        raise UserError(f"is {method!r}; Hugging Face PEFT has no such method (it knows "
                        f"{', '.join(PEFT_TYPES)}), so it has no PEFT folder", where=where, key="finetune.method")
    if os.path.exists(out):
        raise UserError("already exists; exporting never overwrites (choose a new folder)", where=out, key="--out")
    n = int(ft.num_virtual_tokens)
    common = {"peft_type": PEFT_TYPES[method], "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
              "inference_mode": True}
    if method in ("prefix", "prompt"):
        name = f"{method}.embedding"
        saved = {_EMBEDDINGS: np.ascontiguousarray(np.asarray(tensors[name], np.float32))}
        config = dict(common, num_virtual_tokens=n, num_layers=cfg.num_layers, num_transformer_submodules=1)
        if method == "prefix":
            token_dim = cfg.kv_heads * cfg.head_dim
            config.update(token_dim=token_dim, num_attention_heads=cfg.kv_heads, encoder_hidden_size=token_dim,
                          prefix_projection=False)
        else:
            config.update(token_dim=cfg.hidden_size, num_attention_heads=cfg.num_heads, prompt_tuning_init="RANDOM")
    else:
        _need_llama(cfg, where, "finetune.method")
        layers = range(cfg.num_layers - int(ft.adapter_layers), cfg.num_layers)
        saved = {}
        for i in layers:
            saved[_adaption_key(i, "prompt")] = np.ascontiguousarray(
                np.asarray(tensors[f"layers.{i}.attention.adaption_prompt"], np.float32)[None])
            saved[_adaption_key(i, "gate")] = np.asarray(tensors[f"layers.{i}.attention.adaption_gate"], np.float32)
        config = dict(common, adapter_len=n, adapter_layers=int(ft.adapter_layers), target_modules="self_attn")
    os.makedirs(out)
    with open(os.path.join(out, CONFIG), "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=2)
    save_file(saved, os.path.join(out, WEIGHTS), metadata={"format": "pt"})
    return [CONFIG, WEIGHTS]


def _positive(config: dict, key: str, where: str) -> int:
    return validate.integer(config.get(key), where, key, minimum=1)


def read_peft(folder: str, cfg: ModelConfig, where_base: str = "--base"):
    """``(finetune fields, tensors by naohai name)`` of the PEFT folder ``folder`` (LoRA, prefix tuning,
    prompt tuning or adaption prompt) for a base of model ``cfg``; exit 2 naming file and key otherwise."""
    config_path, weights_path, config = _read_config(folder)
    kind = config.get("peft_type")
    if not isinstance(kind, str):
        raise UserError(f"must name the method as a string ({', '.join(sorted(PEFT_TYPES.values()))}), got "
                        f"{kind!r}", where=config_path, key="peft_type", rule="type: string")
    if kind == "LORA":
        adapters, rank, alpha, dropout = read_peft_lora(folder, cfg, where_base)
        import re
        ops = sorted({n.rsplit(".", 1)[0] for n in adapters})
        return ({"method": "lora", "rank": rank, "alpha": alpha, "dropout": dropout,
                 "targets": "^(?:" + "|".join(re.escape(o) for o in ops) + ")$"}, adapters)
    methods = {v: k for k, v in PEFT_TYPES.items()}
    if kind not in methods:
        raise UserError(f"is {kind!r}; naohai imports {', '.join(sorted(methods))}", where=config_path,
                        key="peft_type")
    method = methods[kind]
    if config.get("task_type") not in (None, "CAUSAL_LM"):
        raise UserError(f"is {config.get('task_type')!r}; naohai's models are causal LMs ('CAUSAL_LM')",
                        where=config_path, key="task_type")
    submodules = config.get("num_transformer_submodules")
    if submodules is not None and validate.integer(submodules, config_path, "num_transformer_submodules",
                                                   minimum=1) != 1:
        raise UserError(f"is {submodules}; it must be 1 (a decoder-only model)", where=config_path,
                        key="num_transformer_submodules", rule="num_transformer_submodules == 1")
    tensors = _read_weights(weights_path)

    def shaped(key: str, want) -> np.ndarray:
        if key not in tensors:
            raise UserError(f"has no tensor {key!r}", where=weights_path)
        value = tensors[key]
        if tuple(value.shape) != tuple(want):
            raise UserError(f"base mismatch: {key} has shape {tuple(value.shape)}; this base model "
                            f"({cfg.family}, {cfg.num_layers} layers, hidden {cfg.hidden_size}) needs {tuple(want)}",
                            where=weights_path, key=key)
        return value

    if method in ("prefix", "prompt"):
        n = _positive(config, "num_virtual_tokens", config_path)
        if n + cfg.seq_length > cfg.positions:      # FinetuneConfig.fits's rule, before the tensor's shape
            raise UserError(f"is {n}: the virtual tokens come before the base model's "
                            f"{cfg.seq_length} tokens, and together they exceed the {cfg.positions} positions it "
                            f"numbers (its model.max_positions)", where=config_path, key="num_virtual_tokens",
                            rule="num_virtual_tokens + the base's seq_length <= its max_positions")
        width = cfg.num_layers * 2 * cfg.kv_heads * cfg.head_dim if method == "prefix" else cfg.hidden_size
        out = {f"{method}.embedding": shaped(_EMBEDDINGS, (n, width))}
        return {"method": method, "num_virtual_tokens": n}, out
    _need_llama(cfg, config_path, "peft_type")
    length = _positive(config, "adapter_len", config_path)
    layers = _positive(config, "adapter_layers", config_path)
    if layers > cfg.num_layers:
        raise UserError(f"is {layers}, more than the base model's {cfg.num_layers} layers", where=config_path,
                        key="adapter_layers", rule="1 <= adapter_layers <= the base's num_layers")
    out = {}
    for i in range(cfg.num_layers - layers, cfg.num_layers):
        out[f"layers.{i}.attention.adaption_prompt"] = shaped(_adaption_key(i, "prompt"),
                                                              (1, length, cfg.hidden_size))[0]
        out[f"layers.{i}.attention.adaption_gate"] = shaped(_adaption_key(i, "gate"), (1,))
    extra = sorted(set(tensors) - {_adaption_key(int(k.split(".")[1]), k.rsplit("_", 1)[1]) for k in out})
    if extra:
        raise UserError(f"holds {extra[0]!r}, which adapter_layers {layers} does not place", where=weights_path)
    return {"method": method, "num_virtual_tokens": length, "adapter_layers": layers}, out
