"""Every malformed number, key or flag the planner reads: exit 2, one paragraph naming file, key and rule.

Strategy files, recipes, device profiles and command-line flags go through `naohai plan`
end to end; none may be accepted and none may end in a traceback.
"""
import pytest

from naohai.cli import main

GOOD_STRATEGY = "name: s\nmodel: tiny\nmesh: {data: 2, model: 1, pipeline: 1}\n"
GOOD_RECIPE = "name: r\nmodel: {preset: tiny}\ntrain: {global_batch_size: 16, micro_batch_size: 8}\n"

# (id, strategy text, text the error must contain)
STRATEGIES = [
    ("mesh-inf", "mesh: {data: .inf}", "mesh.data"),
    ("mesh-nan", "mesh: {data: .nan}", "mesh.data"),
    ("mesh-neg-inf", "mesh: {data: 2, model: -.inf}", "mesh.model"),
    ("mesh-huge", "mesh: {data: 1.0e+21}", "mesh.data"),
    ("mesh-string-1e21", "mesh: {data: 1e21}", "mesh.data"),
    ("mesh-fraction", "mesh: {data: 2.5}", "mesh.data"),
    ("mesh-bool", "mesh: {data: true}", "mesh.data"),
    ("mesh-zero", "mesh: {data: 2, pipeline: 0}", "mesh.pipeline"),
    ("mesh-negative", "mesh: {data: -2}", "mesh.data"),
    ("mesh-product-huge", "mesh: {data: 1000, model: 1000, pipeline: 2}", "mesh"),
    ("mesh-list", "mesh: [2, 2]", "mesh"),
    ("micro-batches-huge", "mesh: {data: 2}\nmicro_batches: 1.0e+21", "micro_batches"),
    ("micro-batches-inf", "mesh: {data: 2}\nmicro_batches: .inf", "micro_batches"),
    ("micro-batches-nan", "mesh: {data: 2}\nmicro_batches: .nan", "micro_batches"),
    ("devices-nan", "mesh: {data: 2}\ndevices: .nan", "devices"),
    ("devices-negative", "mesh: {data: 2}\ndevices: -8", "devices"),
    ("devices-huge", "mesh: {data: 2}\ndevices: 1.0e+30", "devices"),
    ("duplicate-layer-range", 'mesh: {data: 2}\nlayers:\n  "0-1": {recompute: full}\n  "0-1": {recompute: none}',
     "duplicate key '0-1'"),
    ("duplicate-top-key", "mesh: {data: 2}\nmesh: {data: 1}", "duplicate key 'mesh'"),
    ("duplicate-mesh-axis", "mesh: {data: 2, data: 1}", "duplicate key 'data'"),
    ("virtual-chunks-inf", "mesh: {data: 2}\npipeline: {scheduler: interleaved, virtual_chunks: .inf}",
     "pipeline.virtual_chunks"),
    ("layers-per-stage-nan", "mesh: {data: 2, pipeline: 2}\nmicro_batches: 2\npipeline: {layers_per_stage: [2, .nan]}",
     "pipeline.layers_per_stage[1]"),
    ("embedding-cost-nan", "mesh: {data: 2}\npipeline: {embedding_cost: .nan}", "pipeline.embedding_cost"),
    ("head-cost-inf", "mesh: {data: 2}\npipeline: {head_cost: .inf}", "pipeline.head_cost"),
    ("embedding-cost-negative", "mesh: {data: 2}\npipeline: {embedding_cost: -1}", "pipeline.embedding_cost"),
    ("threshold-inf", "mesh: {data: 2}\noptimizer_parallel: {threshold_kb: .inf}", "optimizer_parallel.threshold_kb"),
    ("shard-size-nan", "mesh: {data: 2}\noptimizer_parallel: {shard_size: .nan}", "optimizer_parallel.shard_size"),
    ("shard-size-zero", "mesh: {data: 2}\noptimizer_parallel: {shard_size: 0}", "optimizer_parallel.shard_size"),
    ("op-tuple-inf", "mesh: {data: 2}\nops: {layers.0.attention.q: [[.inf, 1], [1, 1]]}",
     "ops.layers.0.attention.q[0][0]"),
    ("op-tuple-huge", "mesh: {data: 2}\nops: {layers.0.attention.q: [[1.0e+21, 1], [1, 1]]}",
     "ops.layers.0.attention.q[0][0]"),
    ("sequence-parallel-string", "mesh: {data: 2}\nsequence_parallel: 'yes'", "sequence_parallel"),
    ("global-batch-nan", "mesh: {data: 2}\nglobal_batch: .nan", "global_batch"),
    ("global-batch-zero", "mesh: {data: 2}\nglobal_batch: 0", "global_batch"),
    ("global-batch-indivisible", "mesh: {data: 2}\nglobal_batch: 3", "mesh.data"),
    ("micro-batch-size-negative", "mesh: {data: 2}\nmicro_batch_size: -1", "micro_batch_size"),
    ("layer-range-float", 'mesh: {data: 2}\nlayers:\n  "0-1e3": {recompute: full}', 'layers."0-1e3"'),
    ("recompute-comm-int", 'mesh: {data: 2}\nlayers:\n  all: {recompute: {mode: full, comm: 1}}', "comm"),
    ("select-nan", 'mesh: {data: 2}\nlayers:\n  all: {recompute: {select: [.nan]}}', "select[0]"),
    ("name-list", "mesh: {data: 2}\nname: [a, b]", "key 'name'"),          # str() of the list was the name
    ("comment-mapping", "mesh: {data: 2}\ncomment: {a: 1}", "key 'comment'"),
    ("yaml-syntax", "mesh: {data: 2", "not valid YAML"),
    ("top-level-list", "- mesh", "mapping"),
]

RECIPES = [
    ("hidden-inf", "model: {preset: tiny, hidden_size: .inf}", "model.hidden_size"),
    ("layers-nan", "model: {preset: tiny, num_layers: .nan}", "model.num_layers"),
    ("norm-eps-nan", "model: {preset: tiny, norm_eps: .nan}", "model.norm_eps"),
    ("rope-base-inf", "model: {preset: tiny, rope_base: .inf}", "model.rope_base"),
    ("dropout-inf", "model: {preset: tiny, dropout: .inf}", "model.dropout"),
    ("vocab-negative", "model: {preset: tiny, vocab_size: -5}", "model.vocab_size"),
    # found by a probe: 2^31 - 1 layers was a MemoryError traceback in `plan`; the others were accepted
    ("layers-huge", "model: {preset: tiny, num_layers: 2147483647}", "model.num_layers"),
    ("norm-eps-zero", "model: {preset: tiny, norm_eps: 0}", "model.norm_eps"),
    ("rope-base-negative", "model: {preset: tiny, rope_base: -10000}", "model.rope_base"),
    ("init-std-huge", "model: {preset: tiny, init_std: 1.0e+300}", "model.init_std"),
    ("kv-heads-zero", "model: {preset: tiny, num_kv_heads: 0}", "model.num_kv_heads"),
    ("preset-list", "model: {preset: [tiny]}", "model.preset"),
    # read at the first logged step on Ascend and GPU, after data and model: refused when the run is planned
    ("device-profile-unknown", "model: {preset: tiny}\ntrain: {device_profile: ascend-910c}", "train.device_profile"),
    ("device-profile-missing-file", "model: {preset: tiny}\ntrain: {device_profile: /nowhere/p.yaml}",
     "train.device_profile"),
    ("global-batch-huge", "model: {preset: tiny}\ntrain: {global_batch_size: 1.0e+21}", "train.global_batch_size"),
    ("micro-batch-nan", "model: {preset: tiny}\ntrain: {micro_batch_size: .nan}", "train.micro_batch_size"),
    ("micro-batch-zero", "model: {preset: tiny}\ntrain: {micro_batch_size: 0}", "train.micro_batch_size"),
    ("lr-nan", "model: {preset: tiny}\ntrain: {lr: .nan}", "train.lr"),
    ("duplicate-model-key", "model: {preset: tiny}\ntrain: {lr: 1.0e-3, lr: 2.0e-3}", "duplicate key 'lr'"),
    ("batch-disagrees-with-strategy", "model: {preset: tiny}\ntrain: {global_batch_size: 32, micro_batch_size: 8}",
     "global_batch"),
    ("micro-batch-disagrees-with-strategy", "model: {preset: tiny}\ntrain: {micro_batch_size: 4}", "micro_batch_size"),
    ("both-stated-micro-batch-disagrees", "model: {preset: tiny}\ntrain: {global_batch_size: 16, micro_batch_size: 16}",
     "micro_batch_size"),
]

PROFILE_BASE = "base: ascend-910a-32g\n"
PROFILES_BAD = [
    ("matmul-efficiency-zero", "matmul_efficiency: 0", "matmul_efficiency"),
    ("matmul-efficiency-nan", "matmul_efficiency: .nan", "matmul_efficiency"),
    ("link-bandwidth-zero", "links: [{name: hccs, group: 4, gbs: 0}, {name: roce, gbs: 12.5}]", "links[0].gbs"),
    ("link-bandwidth-inf", "links: [{name: roce, gbs: .inf}]", "links[0].gbs"),
    ("memory-nan", "memory_gb: .nan", "memory_gb"),
    ("memory-inf", "memory_gb: .inf", "memory_gb"),
    ("reserve-above-memory", "memory_gb: 8\nreserve_gb: 9", "reserve_gb"),
    ("peak-zero", "peak_tflops_16: 0", "peak_tflops_16"),
    ("peak-string", "peak_tflops_32: fast", "peak_tflops_32"),
    ("overlap-above-one", "dp_overlap: 1.5", "dp_overlap"),
    ("devices-per-node-zero", "devices_per_node: 0", "devices_per_node"),
    ("links-empty", "links: []", "links"),
    ("links-groups-shrink", "links: [{name: a, group: 8, gbs: 90}, {name: b, group: 4, gbs: 10}, {name: c, gbs: 1}]",
     "links[1].group"),
    ("links-inner-without-group", "links: [{name: a, gbs: 90}, {name: b, gbs: 10}]", "links[0].group"),
    ("unknown-key", "memory_gbs: 8", "memory_gbs"),
    ("unknown-base", "base: ascend-911", "base"),
    ("duplicate-key", "memory_gb: 8\nmemory_gb: 16", "duplicate key 'memory_gb'"),
    # found by a probe: the planner divides FLOPs by peak x efficiency, which underflowed to 0 (ZeroDivisionError)
    ("peak-underflow", "peak_tflops_32: 1.0e-300\npeak_tflops_16: 1.0e-300", "peak_tflops_16"),
    ("matmul-efficiency-underflow", "matmul_efficiency: 1.0e-300", "matmul_efficiency"),
]

# (id, extra argv for `plan ...`, text the error must contain)
FLAGS = [
    ("micro-batch-size-zero", ["tiny", "--devices", "4", "--search", "--micro-batch-size", "0"], "--micro-batch-size"),
    ("global-batch-zero", ["tiny", "--devices", "4", "--search", "--global-batch", "0"], "--global-batch"),
    ("devices-negative", ["tiny", "--devices", "-8", "--search"], "--devices"),
    ("devices-zero", ["tiny", "--devices", "0", "--search"], "--devices"),
    ("devices-float", ["tiny", "--devices", "1e21", "--search"], "--devices"),
    ("top-negative", ["tiny", "--devices", "4", "--search", "--top", "-1"], "--top"),
    ("top-zero", ["tiny", "--devices", "4", "--search", "--top", "0"], "--top"),
    ("micro-batch-size-nan", ["tiny", "--devices", "4", "--search", "--micro-batch-size", "nan"],
     "--micro-batch-size"),
    ("global-batch-indivisible", ["tiny", "--devices", "4", "--search", "--global-batch", "3",
                                  "--micro-batch-size", "2"], "--global-batch"),
    ("search-without-devices", ["tiny", "--search"], "--devices"),
    ("unknown-profile", ["tiny", "--devices", "4", "--search", "--profile", "ascend-910c"], "--profile"),
]


def _one_paragraph(code, err):
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("naohai: error:"), err
    assert "\n\n" not in err.strip(), err


def _run(capsys, argv):
    code = main(["plan", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text,needle", [c[1:] for c in STRATEGIES], ids=[c[0] for c in STRATEGIES])
def test_malformed_strategy(capsys, tmp_path, text, needle):
    path = tmp_path / "bad-strategy.yaml"
    path.write_text(text + "\n")
    code, err = _run(capsys, ["tiny", str(path)])
    _one_paragraph(code, err)
    assert "bad-strategy.yaml" in err and needle in err, err


@pytest.mark.parametrize("text,needle", [c[1:] for c in RECIPES], ids=[c[0] for c in RECIPES])
def test_malformed_recipe(capsys, tmp_path, text, needle):
    recipe = tmp_path / "bad-recipe.yaml"
    recipe.write_text("name: r\n" + text + "\n")
    strategy = tmp_path / "s.yaml"
    strategy.write_text(GOOD_STRATEGY + "global_batch: 16\nmicro_batch_size: 8\n")
    code, err = _run(capsys, [str(recipe), str(strategy)])
    _one_paragraph(code, err)
    assert ("bad-recipe.yaml" in err or "s.yaml" in err) and needle in err, err


@pytest.mark.parametrize("text,needle", [c[1:] for c in PROFILES_BAD], ids=[c[0] for c in PROFILES_BAD])
def test_malformed_profile(capsys, tmp_path, text, needle):
    profile = tmp_path / "bad-profile.yaml"
    profile.write_text(text + "\n" if text.startswith("base:") else PROFILE_BASE + text + "\n")
    strategy = tmp_path / "s.yaml"
    strategy.write_text(GOOD_STRATEGY)
    code, err = _run(capsys, ["tiny", str(strategy), "--profile", str(profile)])
    _one_paragraph(code, err)
    assert "bad-profile.yaml" in err and needle in err, err


@pytest.mark.parametrize("argv,needle", [c[1:] for c in FLAGS], ids=[c[0] for c in FLAGS])
def test_malformed_flag(capsys, argv, needle):
    code, err = _run(capsys, argv)
    _one_paragraph(code, err)
    assert needle in err, err


def test_corpus_is_at_least_sixty_cases():
    assert len(STRATEGIES) + len(RECIPES) + len(PROFILES_BAD) + len(FLAGS) >= 60


def test_good_inputs_pass(capsys, tmp_path):
    """The same harness accepts the well-formed versions (so the cases above fail for their own reason)."""
    strategy = tmp_path / "s.yaml"
    strategy.write_text(GOOD_STRATEGY)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GOOD_RECIPE)
    profile = tmp_path / "p.yaml"
    profile.write_text(PROFILE_BASE + "links: [{name: hccs, group: 4, gbs: 90}, {name: roce, gbs: 12.5}]\n")
    assert main(["plan", "tiny", str(strategy), "--profile", str(profile)]) == 0
    assert main(["plan", str(recipe), str(strategy)]) == 0
    assert main(["plan", "tiny", "--devices", "4", "--search", "--micro-batch-size", "2", "--top", "2"]) == 0
