"""naohai's .ckpt writer and table-of-contents reader against MindSpore's own save_checkpoint / load_checkpoint."""
import os

import mindspore as ms
import numpy as np
import pytest
from mindspore.train import serialization

from naohai import ckpt_format

RNG = np.random.default_rng(0)


def _tensors():
    return [("layers.0.w", ms.Parameter(ms.Tensor(RNG.standard_normal((3, 5)).astype(np.float32)), name="p")),
            ("scale", ms.Tensor(np.float32(2.5))),
            ("step", ms.Tensor(np.array([7], np.int32))),
            ("ids", ms.Tensor(np.arange(7, dtype=np.int64))),
            ("flags", ms.Tensor(np.array([True, False, True]))),
            ("half", ms.Tensor(RNG.standard_normal((2, 2, 2)).astype(np.float16))),
            ("brain", ms.Tensor(RNG.standard_normal((4, 3)).astype(np.float32)).astype(ms.bfloat16)),
            ("emb", ms.Tensor(RNG.standard_normal((40, 30)).astype(np.float32)))]


def test_the_writer_writes_mindspores_file_byte_for_byte(tmp_path):
    ours, theirs = str(tmp_path / "ours.ckpt"), str(tmp_path / "theirs.ckpt")
    tensors = _tensors()
    ckpt_format.write(ours, tensors)
    ms.save_checkpoint([{"name": n, "data": t} for n, t in tensors], theirs)
    with open(ours, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()


def test_a_sliced_tensor_loads_back_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_format, "SLICE_BYTES", 1000)      # 40 x 30 float32 = 4800 bytes: 5 values
    path = str(tmp_path / "s.ckpt")
    tensors = _tensors()
    written = ckpt_format.write(path, tensors)
    loaded = ms.load_checkpoint(path)
    assert list(loaded) == [n for n, _ in tensors]
    for name, t in tensors:
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        a, b = loaded[name].asnumpy(), t.asnumpy()
        assert a.tobytes() == b.tobytes(), name
    assert [(e.name, e.dims, e.nbytes) for e in written] == \
        [(n, tuple(t.shape), t.asnumpy().nbytes) for n, t in tensors]


def test_the_table_of_contents_is_what_load_checkpoint_reads(tmp_path, monkeypatch):
    # files written by MindSpore itself, with its slicing of large tensors forced (SLICE_SIZE is in KB)
    monkeypatch.setattr(serialization, "SLICE_SIZE", 2)
    path = str(tmp_path / "ms.ckpt")
    tensors = _tensors()
    ms.save_checkpoint([{"name": n, "data": t} for n, t in tensors], path)
    loaded = ms.load_checkpoint(path)
    got = ckpt_format.entries(path)
    assert [(e.name, e.dims, e.dtype, e.nbytes) for e in got] == \
        [(k, tuple(v.shape), str(v.dtype), v.asnumpy().nbytes) for k, v in loaded.items()]


def test_numpy_arrays_write_mindspores_file_and_read_back_by_the_table(tmp_path, monkeypatch):
    """numpy arrays written give save_checkpoint's file of the same Tensors; read() of each entry of a file
    MindSpore sliced (its SLICE_SIZE forced down) is what load_checkpoint reads."""
    arrays = [(n, t.asnumpy()) for n, t in _tensors() if t.dtype != ms.bfloat16]
    ours, theirs = str(tmp_path / "ours.ckpt"), str(tmp_path / "theirs.ckpt")
    ckpt_format.write(ours, iter(arrays))
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(a)} for n, a in arrays], theirs)
    with open(ours, "rb") as a, open(theirs, "rb") as b:
        assert a.read() == b.read()
    monkeypatch.setattr(serialization, "SLICE_SIZE", 2)
    sliced = str(tmp_path / "sliced.ckpt")
    ms.save_checkpoint([{"name": n, "data": ms.Tensor(a)} for n, a in arrays], sliced)
    loaded = ms.load_checkpoint(sliced)
    table = ckpt_format.entries(sliced)
    assert max(len(e.parts) for e in table) > 1
    for entry in table:
        got, want = ckpt_format.read(sliced, entry), loaded[entry.name].asnumpy()
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="has no MindSpore checkpoint type"):
        ckpt_format.write(str(tmp_path / "c.ckpt"), [("c", np.zeros(2, np.complex64))])
    brain = str(tmp_path / "bf16.ckpt")
    ckpt_format.write(brain, [(n, t) for n, t in _tensors() if t.dtype == ms.bfloat16])
    with pytest.raises(ckpt_format.MalformedCheckpoint, match="BFloat16"):
        ckpt_format.read(brain, ckpt_format.entries(brain)[0])
    os.truncate(sliced, os.path.getsize(sliced) - 3)
    last = table[-1]
    with pytest.raises(ckpt_format.MalformedCheckpoint, match="cut short"):
        ckpt_format.read(sliced, last)


def test_every_cut_of_a_file_is_malformed_or_reads_as_less(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt_format, "SLICE_BYTES", 1000)
    path = str(tmp_path / "whole.ckpt")
    whole = [(e.name, e.dims, e.nbytes) for e in ckpt_format.write(path, _tensors())]
    with open(path, "rb") as fh:
        data = fh.read()
    cut = str(tmp_path / "cut.ckpt")
    malformed = 0
    for n in range(len(data)):
        with open(cut, "wb") as fh:
            fh.write(data[:n])
        try:
            table = [(e.name, e.dims, e.nbytes) for e in ckpt_format.entries(cut)]
        except ckpt_format.MalformedCheckpoint:
            malformed += 1
            continue
        assert table != whole, n
    assert malformed > len(data) * 0.9


@pytest.mark.parametrize("junk", [b"\x12\x03abc", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0a\x05\x0a\x01a"])
def test_other_bytes_are_not_a_checkpoint(tmp_path, junk):
    path = str(tmp_path / "junk.ckpt")
    with open(path, "wb") as fh:
        fh.write(junk)
    with pytest.raises(ckpt_format.MalformedCheckpoint):
        ckpt_format.entries(path)


def test_a_save_whose_file_comes_back_short_fails_and_publishes_nothing(tmp_path, monkeypatch):
    from naohai.checkpoint import store
    real = ckpt_format.write

    def short(path, tensors):        # the disk took all but the last 100 bytes
        written = real(path, tensors)
        os.truncate(path, os.path.getsize(path) - 100)
        return written
    st = store.CheckpointStore(str(tmp_path / "run"))
    params = [ms.Parameter(ms.Tensor(RNG.standard_normal((16, 16)).astype(np.float32)), name=f"w{i}")
              for i in range(3)]
    assert st.save(1, params, {"recipe": {}}).path is not None
    monkeypatch.setattr(ckpt_format, "write", short)
    outcome = st.save(2, params, {"recipe": {}})
    assert outcome.path is None and "not a whole checkpoint" in outcome.error
    assert store.list_checkpoints(str(tmp_path / "run")) == [store.step_dir(str(tmp_path / "run"), 1)]


def test_a_background_save_writes_the_values_of_its_step(tmp_path):
    from naohai.checkpoint import store
    st = store.CheckpointStore(str(tmp_path / "run"))
    p = ms.Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="w")
    pending = st.save_async(1, [p], {"recipe": {}}, background=True)
    ms.ops.assign(p, ms.Tensor(np.zeros((3, 4), np.float32)))     # the next step changes the weight in place
    path = pending.finish().path
    loaded = ms.load_checkpoint(os.path.join(path, store.rank_file(0)))
    assert np.array_equal(loaded["w"].asnumpy(), np.arange(12, dtype=np.float32).reshape(3, 4))


def test_a_stacked_parameter_is_saved_per_layer_holding_one_stacks_copy_at_a_time(tmp_path):
    # two stacks of the layer loop, written through the file view: the files hold every layer's values under
    # its per-layer name, and a stack's host copy is let go once its last layer has been written
    from naohai.checkpoint import entries
    from tests.conftest import micro_recipe
    cfg = micro_recipe(str(tmp_path), str(tmp_path), str(tmp_path)).model
    layers = cfg.num_layers
    stacks = [ms.Parameter(ms.Tensor(RNG.standard_normal((layers, 4, 3)).astype(np.float32)),
                           name=f"stack.layer.attention.{w}_weight") for w in ("q", "k")]
    view = entries.file_view(cfg, stacks)
    held = []

    class Probe:                    # what the writer sees, and how many stack copies are alive as it reads
        def __init__(self, entry):
            self.entry, self.shape, self.dtype = entry, entry.shape, entry.dtype

        def asnumpy(self):
            value = self.entry.asnumpy()
            held.append(len({id(e.stack) for e in view if e.stack.buffer is not None}))
            return value
    path = str(tmp_path / "s.ckpt")
    ckpt_format.write(path, [(e.name, Probe(e)) for e in view])
    loaded = ms.load_checkpoint(path)
    for p, w in zip(stacks, ("q", "k")):
        for i in range(layers):
            assert np.array_equal(loaded[f"layers.{i}.attention.{w}_weight"].asnumpy(), p.asnumpy()[i])
    assert held == [1] * (layers - 1) + [0] + [1] * (layers - 1) + [0]
