"""Published presets of the Hugging Face families: their parameter counts equal the published figures
and transformers' own count of the same architecture (built on the meta device from the config.json
naohai's exporter writes for the preset: no weights allocated)."""
import pytest

from naohai.config import preset_recipe
from naohai.convert.hf.registry import for_family
from naohai.convert.hf.convert import hf_config
from naohai.model.params import count_params

#: preset -> parameters as the model cards / transformers' num_parameters() give them
PUBLISHED = {
    "llama-7b": 6_738_415_616,       # huggyllama/llama-7b
    "qwen2.5-0.5b": 494_032_768,     # Qwen/Qwen2.5-0.5B (model card: 0.49B)
    "qwen2.5-7b": 7_615_616_512,     # Qwen/Qwen2.5-7B (model card: 7.61B)
    "mistral-7b": 7_241_732_096,     # mistralai/Mistral-7B-v0.1
    "olmo-7b": 6_888_095_744,        # allenai/OLMo-7B-hf
    "glm-4-9b": 9_399_951_360,       # THUDM/glm-4-9b-hf
    "falcon-7b": 6_921_720_704,      # tiiuae/falcon-7b
    "bloom-560m": 559_214_592,       # bigscience/bloom-560m
    "bloom-7b1": 7_069_016_064,      # bigscience/bloom-7b1
    "pythia-6.9b": 6_857_302_016,    # EleutherAI/pythia-6.9b (model card table)
    "gpt2": 124_439_808,             # openai-community/gpt2
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_preset_parameter_counts(preset):
    cfg = preset_recipe(preset).model
    assert count_params(cfg) == PUBLISHED[preset]
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM
    config = hf_config(cfg, for_family(cfg, preset))
    kind = config.pop("model_type")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **config))
    assert model.num_parameters() == PUBLISHED[preset]
