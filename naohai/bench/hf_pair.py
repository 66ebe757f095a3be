"""One model in two forms for the inference benchmarks: a Hugging Face folder and the naohai model folder
imported from it.

:func:`build_model` makes the ``tiny-llama`` preset (LLaMA layout, so it has a Hugging Face form) with
random weights from naohai's initialiser and a byte-level BPE trained on the pydoc topics, writes it as a
Hugging Face folder (:func:`naohai.convert.hf.convert.write_hf`) and imports that folder back the way
``naohai ckpt import --from hf`` does, so a naohai row and its transformers peer read the same weights and
the same ``tokenizer.json``.
"""
from __future__ import annotations

import os
from typing import Any, Dict


def build_model(workdir: str) -> Dict[str, Any]:
    """``{"hf": folder, "naohai": folder, "seq_length": n, "loss_pad_id": id or None}`` of one random tiny-llama with a pydoc BPE."""
    import mindspore as ms

    from naohai.config import recipe_from_dict
    from naohai.convert.hf.convert import read_hf, write_hf
    from naohai.convert.model_dir import write_hf_model_dir
    from naohai.data.corpus import pydoc_documents
    from naohai.data.hf_tokenizer import train_byte_bpe
    from naohai.model.transformer import NaohaiLM

    ms.set_device("CPU")
    tok_dir = os.path.join(workdir, "tokenizer")
    train_byte_bpe(list(pydoc_documents()), 2048, os.path.join(tok_dir, "tokenizer.json"))
    recipe = recipe_from_dict({"name": "bench-llama", "model": {"family": "llama", "preset": "tiny-llama"}},
                              where="bench")
    model = NaohaiLM(recipe.model, seed=0)
    weights = {p.name: p.asnumpy() for p in model.get_parameters()}
    hf = os.path.join(workdir, "hf")
    write_hf(hf, recipe.model, weights, where="bench", tokenizer_dir=tok_dir)
    nao = os.path.join(workdir, "naohai")
    cfg, imported = read_hf(hf, {"seq_length": recipe.model.seq_length})     # what `naohai ckpt import --from hf` does
    write_hf_model_dir(nao, cfg, imported, hf)
    return {"hf": hf, "naohai": nao, "seq_length": recipe.model.seq_length, "loss_pad_id": recipe.model.loss_pad_id}
