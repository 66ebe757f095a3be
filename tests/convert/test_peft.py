"""LoRA adapters exported in PEFT's format, against peft.PeftModel over the transformers model: a tiny
llama built locally, imported into naohai, adapted (random B so the adapter matters), exported; PEFT
loads the folder over the original transformers model and its logits equal naohai's."""
import json
import os

import numpy as np
import pytest

import hf_models
from naohai.cli import main
from naohai.config import FinetuneConfig
from naohai.convert.peft import CONFIG, write_peft_lora
from naohai.errors import UserError
from naohai.model.lora import adapter_params, apply_lora

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = r"attention\.(q|k|v|out)$|mlp\.(gate|up|down)$"


def test_lora_adapter_loads_in_peft_with_equal_logits(tmp_path):
    from mindspore import Tensor
    from transformers import AutoModelForCausalLM
    from naohai.checkpoint.weights import load_model

    src = str(tmp_path / "llama")
    hf_models.build("llama", src)
    out = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", out, f"model.seq_length={hf_models.SEQ}"]) == 0
    found, model = load_model(out)
    recipe = found.recipe
    ft = FinetuneConfig(rank=4, alpha=8.0, targets=TARGETS)
    names = apply_lora(model, ft, seed=0)
    assert len(names) == 2 * 7
    rng = np.random.default_rng(1)
    for p in adapter_params(model):
        if p.name.endswith("lora_b"):
            p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
    model.set_train(False)
    ids = hf_models.windows()[:2, :-1]
    ours = model.logits(Tensor(ids.astype(np.int32))).asnumpy()

    adapter = str(tmp_path / "adapter")
    write_peft_lora(adapter, recipe.model, {p.name: p.asnumpy() for p in adapter_params(model)}, rank=4, alpha=8.0,
                    base_model=src)
    config = json.load(open(os.path.join(adapter, CONFIG)))
    assert config["r"] == 4 and len(config["target_modules"]) == 14
    base = AutoModelForCausalLM.from_pretrained(src)
    plain = hf_models.hf_logits(base.eval(), ids)
    theirs = hf_models.hf_logits(peft.PeftModel.from_pretrained(base, adapter).eval(), ids)
    assert np.abs(theirs - plain).max() > 1e-2                     # the adapter changes the logits ...
    assert np.abs(ours - theirs).max() <= 1e-4, np.abs(ours - theirs).max()   # ... as naohai's does
    with pytest.raises(UserError, match="already exists"):
        write_peft_lora(adapter, recipe.model, {}, rank=4, alpha=8.0)
