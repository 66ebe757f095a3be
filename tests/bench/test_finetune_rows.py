"""`naohai bench`'s fine-tuning rows (naohai.bench.finetune) on a micro model, one round of 2 steps: the rows'
structure, and the optimizer state each variant's AdamWeightDecay holds against the bytes computed here from
the parameter shapes (fp32 moments, two per trained tensor): LoRA's = 2 x 4 x the adapter factors' size
(rank x (in + out) of every targeted base weight), full SFT's = 2 x 4 x every parameter.  No timing asserted."""
import json
import os
import re

import numpy as np

from naohai.bench.finetune import LORA, bench_finetune, write_random_sft
from naohai.bench.models import BenchModel, _tiny_family
from naohai.bench.report import render_markdown
from naohai.data.sft import SFTLoader, load_sft

MICRO = BenchModel("micro", _tiny_family(hidden_size=32, num_layers=2, num_heads=4, ffn_hidden_size=48,
                                         seq_length=32, vocab_size=256), 4)


def _base_shapes():
    """Every parameter of the plain model by name: shape (MindSpore's own, no fine-tuning applied)."""
    from naohai.model.transformer import NaohaiLM
    model = NaohaiLM(MICRO.model, seed=0)
    return {p.name: tuple(p.shape) for p in model.get_parameters()}


def test_random_sft_folder_reads_back_with_prompts_unlearned(tmp_path):
    path = write_random_sft(str(tmp_path / "sft"), 256, 32, train_windows=10)
    prep = load_sft(path)
    batch = SFTLoader(prep, "train", 4).next_batch()
    tokens, mask = batch.tokens, batch.mask
    assert tokens.shape == mask.shape == (4, 33) and batch.learned == int(mask[:, 1:].sum())
    assert (mask[:, 0] == 0).all() and 0.2 < mask[:, 1:].mean() < 0.8
    meta = json.load(open(os.path.join(path, "meta.json")))
    assert meta["splits"]["train"]["learned_tokens"] == int(np.asarray(prep.mask("train")).sum())


def test_full_sft_and_lora_rows_hold_the_optimizer_state_of_their_trained_parameters(tmp_path):
    ft = bench_finetune(MICRO, rounds=1, steps=2, workdir=str(tmp_path), peak=1.0, log=lambda *_: None)
    shapes = _base_shapes()
    size = lambda shape: int(np.prod(shape))
    every = sum(size(s) for s in shapes.values())
    pattern = re.compile(LORA["targets"])
    adapters, targeted = 0, 0
    for name, shape in shapes.items():        # a base op's weight: layers.<i>.<op>_weight, shape [out, in]
        m = re.match(r"layers\.\d+\.(.+)_weight$", name)
        if m and pattern.search(m.group(1)):
            out_dim, in_dim = shape
            adapters += LORA["rank"] * (in_dim + out_dim)
            targeted += 1
    assert adapters > 0
    full, lora = ft["rows"]["full"], ft["rows"]["lora"]
    assert full["trainable_params"] == every and lora["trainable_params"] == adapters
    assert full["optimizer_state_bytes"] == 2 * 4 * every
    assert lora["optimizer_state_bytes"] == 2 * 4 * adapters
    assert lora["optimizer_state_tensors"] == 2 * 2 * targeted            # two moments of A and of B per op
    assert full["optimizer_state_tensors"] == 2 * len(shapes)
    assert all(dtype == "Float32" for _, _, dtype in lora["optimizer_state_shapes"])
    assert ft["params"] == every and ft["model"] == "micro" and ft["batch"] == 4 and ft["seq"] == 32
    assert 0 < ft["learned_fraction"] < 1
    for row in (full, lora):
        assert row["tokens_per_s"] > 0 and len(row["rounds_tokens_per_s"]) == 1
        assert abs(row["learned_tokens_per_s"] - row["tokens_per_s"] * ft["learned_fraction"]) < 1e-6
        assert row["peak_rss"] > 0
    assert ft["ratios"]["lora_over_full_optimizer_state"] == lora["optimizer_state_bytes"] / full["optimizer_state_bytes"]
    results = {"environment": {"date": "d", "machine": "m", "cpus": 2, "mindspore": "2.10", "load_before": "0",
                               "load_after": "0"}, "rounds": 1,
               "peak": {"n": 8, "repeats": 1, "tflops": 1.0, "sources": {}}, "finetune": ft}
    md = render_markdown(results)
    assert "## Fine-tuning: full SFT against LoRA" in md
    assert f"| full SFT (every parameter) | {every:,} | {2 * 4 * every / 2 ** 20:,.1f} MiB |" in md
    assert f"| LoRA (base frozen) | {adapters:,} | " in md
