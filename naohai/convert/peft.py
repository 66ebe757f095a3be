"""LoRA adapters in Hugging Face PEFT's folder format: ``adapter_config.json`` + ``adapter_model.safetensors``.

For a model whose family has a Hugging Face architecture (:mod:`naohai.convert.hf`), the adapter
of op ``layers.<i>.<part>.<op>`` (:mod:`naohai.model.lora`) belongs to the module that holds its
base weight: the architecture's link of ``layers.<i>.<part>.<op>_weight`` names the tensor
(e.g. ``model.layers.0.self_attn.q_proj.weight``), the module is that name without ``.weight``.
PEFT stores ``base_model.model.<module>.lora_A.weight`` ([rank, in], naohai's ``A``) and
``...lora_B.weight`` ([out, rank], ``B``) and scales by ``lora_alpha / r``, as naohai does
(PEFT's ``tuners/lora/layer.py``, ``use_rslora`` off).  Only architectures that store the weight
as naohai does (one tensor, [out, in]) are written; a fused or transposed one is refused.
"""
from __future__ import annotations

import json
import os
from typing import Dict, List

import numpy as np

from naohai.errors import UserError
from naohai.model.config import ModelConfig

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def _modules(cfg: ModelConfig, where: str) -> Dict[str, str]:
    """naohai weight name -> Hugging Face module name, for weights stored one to one."""
    from naohai.convert.hf.arch import for_family, same

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
