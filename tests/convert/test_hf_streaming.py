"""Import and export of a Hugging Face folder hold one tensor at a time, not the model, and write the files
MindSpore's and safetensors' own writers would (checked with their readers; memory with ``tracemalloc``,
which counts numpy's buffers)."""
import json
import os
import shutil
import tracemalloc

import numpy as np
import pytest

import hf_models
from naohai.cli import main

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny llama of 8 layers: the whole model is many times its largest tensor."""
    out = str(tmp_path_factory.mktemp("deep") / "llama8")
    model = hf_models.build("llama", out, num_hidden_layers=8)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    return out, state


def _peak(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_import_streams_into_the_file_mindspore_writes(deep, tmp_path):
    import mindspore as ms
    from naohai.convert.hf.convert import read_hf, stream_hf
    from naohai.convert.model_dir import write_hf_model_dir
    src, state = deep
    total, largest = sum(v.nbytes for v in state.values()), max(v.nbytes for v in state.values())
    assert total > 16 * largest
    out = str(tmp_path / "imported")

    def run():
        cfg, tensors = stream_hf(src)
        write_hf_model_dir(out, cfg, tensors, src)
    peak = _peak(run)
    assert peak < 4 * largest, (peak, largest, total)      # the old import held every tensor: peak > total

    # the streamed file is mindspore.save_checkpoint's, byte for byte, and read-only as it leaves it
    _, weights = read_hf(src)
    theirs = str(tmp_path / "theirs.ckpt")
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()], theirs)
    with open(os.path.join(out, "model.ckpt"), "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
    assert oct(os.stat(os.path.join(out, "model.ckpt")).st_mode & 0o777) == oct(os.stat(theirs).st_mode & 0o777)
    assert not [f for f in os.listdir(out) if f.endswith(".partial")]


@pytest.mark.parametrize("shard", [None, "300KB"])
def test_export_streams_tensors_safetensors_reads_back(deep, tmp_path, shard):
    from safetensors import safe_open
    from naohai.convert.hf.convert import write_hf
    from naohai.convert.model_dir import hf_export_sources
    src, state = deep
    largest = max(v.nbytes for v in state.values())
    imported = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", imported]) == 0
    out = str(tmp_path / "exported")
    recipe, weights, tokenizer_dir, base = hf_export_sources(imported)
    shard_bytes = 300_000 if shard else 5 * 1024 ** 3
    peak = _peak(lambda: write_hf(out, recipe.model, weights, where=imported, tokenizer_dir=tokenizer_dir,
                                  base_config=base, shard_bytes=shard_bytes))
    assert peak < 4 * largest, (peak, largest)

    # safetensors' own reader: every tensor of transformers' state dict, its dtype, shape and values;
    # its metadata; each shard within the size asked, the index naming every tensor's shard
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert (len(files) > 1) == bool(shard)
    found = {}
    for name in files:
        with safe_open(os.path.join(out, name), "np") as fh:
            assert fh.metadata() == {"format": "pt"}
            for key in fh.keys():
                found[key] = (name, fh.get_tensor(key))
        if shard:
            assert sum(v.nbytes for f, v in found.values() if f == name) <= shard_bytes
    assert set(found) == set(state)
    for key, (_, value) in found.items():
        assert value.dtype == np.float32 and np.array_equal(value, state[key]), key
    if shard:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        assert index["weight_map"] == {k: f for k, (f, _) in found.items()}
        assert index["metadata"]["total_size"] == sum(v.nbytes for v in state.values())

    # and the whole folder through a trained checkpoint's (in-memory) path gives the same tensors
    from safetensors.numpy import load_file
    again = str(tmp_path / "again")
    write_hf(again, recipe.model, dict(weights.items()), where=imported, shard_bytes=10 ** 12)
    assert {k: v.tobytes() for k, v in load_file(os.path.join(again, "model.safetensors")).items()} == \
        {k: v.tobytes() for k, (_, v) in found.items()}


def test_a_failure_half_way_leaves_no_partial_folder(deep, tmp_path, capsys):
    """A tensor of the wrong shape found while streaming (after others were written) exits 2 and removes
    what the import wrote: a new --out is gone, an empty one is empty again."""
    src, _ = deep
    bad = str(tmp_path / "bad")
    shutil.copytree(src, bad)
    config = json.load(open(os.path.join(bad, "config.json")))
    config["intermediate_size"] = 201                  # the MLP tensors come after the embedding and attention
    json.dump(config, open(os.path.join(bad, "config.json"), "w"))
    out = str(tmp_path / "new")
    assert main(["ckpt", "import", bad, "--from", "hf", "--out", out]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "mlp.gate_proj.weight" in err and "(201, 144)" in err and "Traceback" not in err
    assert not os.path.exists(out)
    # the library also takes an empty folder (the CLI refuses any existing --out): emptied again
    from naohai.convert.hf.convert import stream_hf
    from naohai.convert.model_dir import write_hf_model_dir
    from naohai.errors import UserError
    empty = str(tmp_path / "empty")
    os.makedirs(empty)
    cfg, tensors = stream_hf(bad)
    with pytest.raises(UserError, match="mlp.gate_proj.weight"):
        write_hf_model_dir(empty, cfg, tensors, bad)
    assert os.listdir(empty) == []


def test_export_of_a_folder_missing_a_tensor_exits_2(deep, tmp_path, capsys):
    import mindspore as ms
    src, _ = deep
    imported = str(tmp_path / "imported")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", imported]) == 0
    ckpt = os.path.join(imported, "model.ckpt")
    kept = {k: v for k, v in ms.load_checkpoint(ckpt).items() if k != "layers.5.mlp.down_weight"}
    os.chmod(ckpt, 0o600)
    ms.save_checkpoint([{"name": k, "data": v} for k, v in kept.items()], ckpt)
    capsys.readouterr()
    out = str(tmp_path / "x")
    assert main(["ckpt", "export", imported, "--to", "hf", "--out", out]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.ckpt" in err and "has no tensor" in err and "Traceback" not in err
    assert not os.path.exists(out)


def test_an_index_with_a_name_written_twice_exits_2(deep, tmp_path, capsys):
    src, _ = deep
    imported, sharded = str(tmp_path / "imported"), str(tmp_path / "sharded")
    assert main(["ckpt", "import", src, "--from", "hf", "--out", imported]) == 0
    assert main(["ckpt", "export", imported, "--to", "hf", "--out", sharded, "--shard-size", "300KB"]) == 0
    index = os.path.join(sharded, "model.safetensors.index.json")
    text = open(index).read()
    first = json.loads(text)["weight_map"]
    name, shard = next(iter(first.items()))
    other = next(f for f in first.values() if f != shard)
    open(index, "w").write(text.replace('"weight_map": {', f'"weight_map": {{"{name}": "{other}", ', 1))
    capsys.readouterr()
    assert main(["ckpt", "import", sharded, "--from", "hf", "--out", str(tmp_path / "again")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "model.safetensors.index.json" in err and "written twice" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "again")


def test_a_weight_that_is_not_finite_or_not_float_exits_2(deep, tmp_path, capsys):
    """A NaN in one layer's weight (met after earlier tensors were written) or a weight stored as integers
    exits 2 naming the file and tensor; nothing is left behind."""
    import struct
    src, _ = deep
    name = "model.layers.3.mlp.up_proj.weight"

    def variant(tag, edit):
        folder = str(tmp_path / tag)
        shutil.copytree(src, folder)
        path = os.path.join(folder, "model.safetensors")
        data = open(path, "rb").read()
        size = struct.unpack("<Q", data[:8])[0]
        header, body = json.loads(data[8:8 + size]), bytearray(data[8 + size:])
        edit(header[name], body)
        text = json.dumps(header).encode()
        open(path, "wb").write(struct.pack("<Q", len(text)) + text + bytes(body))
        return folder

    def nan(entry, body):
        body[entry["data_offsets"][0]:entry["data_offsets"][0] + 4] = np.float32(np.nan).tobytes()

    def ints(entry, _body):
        entry["dtype"] = "I32"
    for tag, edit, needle in (("nan", nan, "1 of its 28800 values NaN or infinite"),
                              ("ints", ints, "as int32; a weight is floating point")):
        out = str(tmp_path / f"{tag}-out")
        capsys.readouterr()
        assert main(["ckpt", "import", variant(tag, edit), "--from", "hf", "--out", out]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "model.safetensors" in err and name in err and needle in err and "Traceback" not in err, err
        assert not os.path.exists(out)


def test_a_folder_given_directly_is_read_a_stored_tensor_at_a_time(deep, tmp_path, monkeypatch):
    """``generate`` / ``eval`` / ``train.init_from`` of a Hugging Face folder fill the model holding one stored
    tensor, not the model read whole; the values are the import's, in any order of access."""
    from naohai.checkpoint.weights import find_weights, load_bytes, LOAD_BYTES_PER_PARAM
    from naohai.convert.hf.convert import read_hf
    from naohai.convert.weights import assign_weights
    from naohai.model.transformer import NaohaiLM
    src, state = deep
    largest = max(v.nbytes for v in state.values())
    found = find_weights(src)
    assert not found.reads_whole
    params = sum(v.size for v in state.values())
    assert load_bytes(found) == LOAD_BYTES_PER_PARAM * params + largest      # the model and one tensor
    model = NaohaiLM(found.recipe.model, seed=1)
    tensors = found.tensors()                        # reads the headers (and imports what it needs) only
    peak = _peak(lambda: assign_weights(model, tensors, where=src))
    assert peak < 4 * largest, (peak, largest)       # read whole, the peak was the model's float32 bytes
    _, whole = read_hf(src)
    for p in model.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), whole[p.name])
    for name in reversed(list(tensors)):
        np.testing.assert_array_equal(tensors[name], whole[name])


def test_a_fused_stored_tensor_is_read_once_for_its_parts(tmp_path, monkeypatch):
    """BLOOM stores query, key and value as one tensor per layer; a model filled in its parameters' order
    reads every stored tensor once."""
    from naohai.checkpoint.weights import load_model
    from naohai.convert.hf import folder
    src = str(tmp_path / "bloom")
    model = hf_models.build("bloom", src)
    fused = [k for k in model.state_dict() if "query_key_value.weight" in k]
    assert fused
    reads = []
    original = folder.StoredTensor.read
    monkeypatch.setattr(folder.StoredTensor, "read", lambda self: reads.append(self.name) or original(self))
    _, net = load_model(src)
    assert sorted(reads) == sorted(set(reads)), [n for n in set(reads) if reads.count(n) > 1]
    assert {n.split("transformer.", 1)[-1] for n in fused} <= {n.split("transformer.", 1)[-1] for n in reads}
    assert len({p.name for p in net.get_parameters()}) > len(reads)      # some reads filled several parameters
